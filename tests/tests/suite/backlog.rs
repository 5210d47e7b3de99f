//! Bounded backlogs over real processes: the consumer's `--max-pending` answers BACKLOG_FULL
//! in-band (nothing stored) but always admits the seq a waiting flow needs; the relay treats
//! it as "later" and redelivers until everything is applied in order, once; the producer's
//! `--max-unaccepted` refuses new steps with RESOURCE_EXHAUSTED until the relay caught up.

use harness::{Consumer, Producer, Workdir, advance, db, reference_envelopes, relay};
use proto::pb::{self, AdvanceOutcome, ReceiveOutcome};
use tonic::Code;

fn words(results: &[pb::ReceiveResult]) -> Vec<ReceiveOutcome> {
    results.iter().map(|r| ReceiveOutcome::try_from(r.outcome).expect("known outcome")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_consumer_backlog_refuses_new_work_but_admits_the_awaited_seq() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(&work, &["--max-pending", "3"]);
    let a = reference_envelopes("A");
    assert_eq!(words(&consumer.receive(vec![a[0].clone()]).await), [ReceiveOutcome::Accepted]);
    assert_eq!(consumer.apply("A").await.applied, 1);
    // A now waits for seq 2 behind seq 3; B1 and C1 fill the backlog to its cap.
    let fill = vec![a[2].clone(), reference_envelopes("B")[0].clone(), reference_envelopes("C")[0].clone()];
    assert_eq!(words(&consumer.receive(fill).await), [ReceiveOutcome::Accepted; 3]);
    let full = consumer
        .receive(vec![reference_envelopes("D")[0].clone(), reference_envelopes("B")[1].clone(), a[1].clone()])
        .await;
    assert_eq!(
        words(&full),
        [ReceiveOutcome::BacklogFull, ReceiveOutcome::BacklogFull, ReceiveOutcome::Accepted],
        "{full:?}"
    );
    assert!(full[0].detail.contains("backlog full"), "{}", full[0].detail);
    let inbox = db::inbox(&consumer.db);
    assert!(inbox.iter().all(|r| r.event_id != "D1" && r.event_id != "B2"), "a refused envelope was stored");
    assert_eq!(inbox.len(), 5);
    let applied = consumer.apply("A").await;
    assert_eq!(applied.applied, 2);
    assert_eq!(
        words(&consumer.receive(vec![reference_envelopes("D")[0].clone()]).await),
        [ReceiveOutcome::Accepted]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_redelivers_after_backlog_full_until_everything_is_applied_once() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start_with(&work, &["--max-pending", "5", "--auto-apply"]);
    for i in 0..20 {
        for r in producer.advance_steps(&format!("F{i:02}-"), 0, &[1, 1, 1]).await {
            assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed));
        }
    }
    let run = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let counts = &run.summary()["counts"];
    assert_eq!(counts["ACCEPTED"], 60, "{counts}");
    assert!(counts["BACKLOG_FULL"].as_u64().unwrap_or(0) > 0, "the cap was never reached: {counts}");
    assert!(db::outbox(&producer.db).iter().all(|r| r.accepted));
    // Auto-apply drains the backlog; every flow ends with effects 1, 2, 3 in order, once.
    let flow_ids: Vec<String> = (0..20).map(|i| format!("F{i:02}-")).collect();
    harness::background::wait_for(
        std::time::Duration::from_secs(30),
        || (db::effects(&consumer.db).len() == 60).then_some(()),
        || format!("{} effects", db::effects(&consumer.db).len()),
    );
    let effects = db::effects(&consumer.db);
    for flow in &flow_ids {
        let seqs: Vec<u64> = effects.iter().filter(|e| &e.flow_id == flow).map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3], "{flow}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_outbox_refuses_advance_with_resource_exhausted() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start_with(&work, &["--max-unaccepted", "2"]);
    let consumer = Consumer::start(&work, false, &[]);
    let mut client = producer.client().await;
    for r in producer.advance_steps("A", 0, &[1, 1]).await {
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed));
    }
    let full = client.advance(advance("A", "A3", 2, "released", 1)).await.expect_err("outbox full");
    assert_eq!(full.code(), Code::ResourceExhausted, "{full:?}");
    assert!(full.message().contains("outbox full"), "{}", full.message());
    assert_eq!(db::outbox(&producer.db).len(), 2);
    assert_eq!(db::flows(&producer.db)[0].seq, 2, "the refused step changed nothing");
    // A retry of a committed step is still answered.
    assert_eq!(
        AdvanceOutcome::try_from(producer.advance(advance("A", "A1", 0, "reserved", 1)).await.outcome),
        Ok(AdvanceOutcome::Existing)
    );
    let run = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let third = producer.advance(advance("A", "A3", 2, "released", 1)).await;
    assert_eq!(AdvanceOutcome::try_from(third.outcome), Ok(AdvanceOutcome::Committed));
}
