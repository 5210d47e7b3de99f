//! Several service instances on one PostgreSQL database (issue 15): three producers racing
//! `Advance` for the same flows resolve exactly as one producer would (one COMMITTED per step,
//! the others EXISTING or STALE), and the outbox never holds two events for one (flow, seq).

use std::collections::BTreeMap;
use std::sync::Arc;

use harness::{Producer, Workdir, db};
use proto::pb::{AdvanceOutcome, producer_client::ProducerClient};
use tokio::sync::Barrier;

const FLOWS: usize = 40;
const KINDS: [&str; 3] = ["reserved", "confirmed", "released"];

/// One racer's answer to one step.
#[derive(Clone, Debug)]
struct Said {
    racer: usize,
    event_id: String,
    outcome: AdvanceOutcome,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_producers_racing_for_each_step_commit_it_once() {
    harness::postgres_only!("several producer instances on one database need PostgreSQL");
    let Some(work) = Workdir::for_test() else { return };
    let producers: Vec<Producer> = (0..3)
        .map(|i| Producer::start_on(work.producer_db(), work.path(&format!("producer-{i}.log")), &[]))
        .collect();
    // Racers 0 and 1 send the same event (id and body) to producers 0 and 1; racer 2 sends
    // another event for the same step to producer 2. Every step of every flow is released to
    // the three at once.
    let barrier = Arc::new(Barrier::new(3));
    let mut tasks = Vec::new();
    for (racer, producer) in producers.iter().enumerate() {
        let url = producer.process.url();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = ProducerClient::new(harness::proc::connect(&url).await);
            let mut said = Vec::new();
            for f in 0..FLOWS {
                let flow = format!("race{f}");
                for (seq, kind) in KINDS.iter().enumerate() {
                    let event_id =
                        if racer == 2 { format!("{flow}-other-{seq}") } else { format!("{flow}-{seq}") };
                    let req = harness::advance(&flow, &event_id, seq as u64, kind, 1);
                    barrier.wait().await;
                    let outcome = loop {
                        match client.advance(req.clone()).await {
                            Ok(answer) => break AdvanceOutcome::try_from(answer.into_inner().outcome),
                            // Contention between instances may be answered "retry".
                            Err(status) if status.code() == tonic::Code::Unavailable => continue,
                            Err(status) => panic!("racer {racer} {flow} seq {seq}: {status}"),
                        }
                    };
                    let outcome = outcome.unwrap_or_else(|e| panic!("racer {racer}: unknown outcome {e}"));
                    said.push((flow.clone(), seq, Said { racer, event_id, outcome }));
                    // All three see the step decided before the next one is raced.
                    barrier.wait().await;
                }
            }
            said
        }));
    }
    let mut steps: BTreeMap<(String, usize), Vec<Said>> = BTreeMap::new();
    for task in tasks {
        for (flow, seq, said) in task.await.expect("racer") {
            steps.entry((flow, seq)).or_default().push(said);
        }
    }

    let outbox = db::outbox(&producers[0].db);
    let mut stored: BTreeMap<(String, u64), Vec<String>> = BTreeMap::new();
    for row in &outbox {
        stored.entry((row.flow_id.clone(), row.seq)).or_default().push(row.event_id.clone());
    }
    assert_eq!(stored.len(), FLOWS * 3, "every step of every flow stored");
    let mut won_by_other = 0;
    for ((flow, seq), said) in &steps {
        let ids = &stored[&(flow.clone(), *seq as u64 + 1)];
        assert_eq!(ids.len(), 1, "{flow} seq {}: two events stored: {ids:?}", seq + 1);
        let winner = &ids[0];
        let committed: Vec<&Said> = said.iter().filter(|s| s.outcome == AdvanceOutcome::Committed).collect();
        assert_eq!(committed.len(), 1, "{flow} seq {}: {said:?}", seq + 1);
        assert_eq!(&committed[0].event_id, winner, "{said:?}");
        for s in said {
            let allowed: &[AdvanceOutcome] = if &s.event_id == winner {
                &[AdvanceOutcome::Committed, AdvanceOutcome::Existing]
            } else {
                // Its step was taken by the other event: the flow moved past expected_seq.
                &[AdvanceOutcome::Stale]
            };
            assert!(
                allowed.contains(&s.outcome),
                "{flow} seq {}: racer {} said {:?}",
                seq + 1,
                s.racer,
                s.outcome
            );
        }
        if winner.contains("-other-") {
            won_by_other += 1;
        }
    }
    // The race is real only if both kinds of event won some steps; the later steps of a
    // flow must then follow whichever event won the earlier one.
    eprintln!("{} steps raced; the other event won {won_by_other}", steps.len());
    assert_eq!(steps.len(), FLOWS * 3);
    for p in &producers {
        assert!(!p.process.log_text().contains("panicked"), "{}", p.process.log_text());
    }
}
