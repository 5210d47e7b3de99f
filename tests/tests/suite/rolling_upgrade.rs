//! The upgrade with no downtime (issue 15, the design card's demonstration grown up): a
//! v1-only consumer and a `--support-v2` consumer serve one PostgreSQL database side by side,
//! both with auto-apply. The old one stores schema-2 events and reports them BLOCKED; the new
//! one applies them, in order, once (at its start, and within seconds for events that reach
//! only the old one); then the old one is stopped and nothing is lost or applied twice.

use std::collections::BTreeMap;
use std::time::Duration;

use harness::background::{RelayDaemon, wait_for};
use harness::proc::{ServerProcess, server_args};
use harness::{Consumer, Producer, Target, Workdir, db};
use proto::pb::{AdvanceOutcome, ApplyStop, BlockReason, ListStuckRequest};

const DEADLINE: Duration = Duration::from_secs(60);

fn start_consumer(work: &Workdir, name: &str, extra: &[&str]) -> Consumer {
    let db = work.consumer_db();
    let mut flags = vec!["--auto-apply"];
    flags.extend_from_slice(extra);
    let process =
        ServerProcess::start("consumer", &server_args(&db, &flags), &[], work.path(&format!("{name}.log")));
    Consumer { process, db }
}

/// Commits flows `<prefix>0..n`, each three steps in the given schemas.
async fn commit(producer: &Producer, prefix: &str, n: usize, schemas: &[u32]) {
    for i in 0..n {
        for r in producer.advance_steps(&format!("{prefix}{i}"), 0, schemas).await {
            assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
        }
    }
}

/// Waits until the consumer database holds `n` effects and every outbox row is accepted,
/// then checks each flow's effects are seqs 1, 2, 3 in apply order, each event once.
fn wait_applied(producer_db: &Target, consumer_db: &Target, n: usize, logs: &dyn Fn() -> String) {
    wait_for(
        DEADLINE,
        || {
            (db::effects(consumer_db).len() >= n && db::outbox(producer_db).iter().all(|r| r.accepted))
                .then_some(())
        },
        || format!("{} effects of {n}; logs:\n{}", db::effects(consumer_db).len(), logs()),
    );
    let effects = db::effects(consumer_db);
    assert_eq!(effects.len(), n, "each event applied once");
    let mut per_flow: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for e in &effects {
        per_flow.entry(e.flow_id.as_str()).or_default().push(e.seq);
    }
    for (flow, seqs) in per_flow {
        assert_eq!(seqs, [1, 2, 3], "{flow}: applied out of order or twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_v1_and_a_v2_consumer_on_one_database_upgrade_with_no_downtime() {
    harness::postgres_only!("two consumer instances on one database need PostgreSQL");
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let mut old = start_consumer(&work, "consumer-v1", &[]);
    let daemon = RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer.db,
        &old.process.url(),
        &["--poll-ms", "10"],
        &[],
    );
    let consumer_db = old.db.clone();

    // Before the upgrade: schema-2 steps are stored and blocked by the v1-only instance.
    commit(&producer, "before", 10, &[1, 2, 2]).await;
    wait_for(
        DEADLINE,
        || {
            let inbox = db::inbox(&consumer_db);
            let blocked = inbox
                .iter()
                .filter(|r| {
                    r.seq == 2 && r.state == "blocked" && r.reason.as_deref() == Some("unsupported_schema")
                })
                .count();
            (inbox.len() == 30 && blocked == 10 && db::effects(&consumer_db).len() == 10).then_some(())
        },
        || format!("inbox {:?}\nlog:\n{}", db::inbox(&consumer_db), old.process.log_text()),
    );
    let said = old.apply("before0").await;
    assert_eq!(ApplyStop::try_from(said.stop), Ok(ApplyStop::Blocked), "{said:?}");
    assert_eq!(BlockReason::try_from(said.reason), Ok(BlockReason::UnsupportedSchema), "{said:?}");
    assert_eq!(said.applied, 0);

    // ListStuck says which instance answered: this one cannot read schema 2.
    let stuck =
        old.client().await.list_stuck(ListStuckRequest { limit: 0 }).await.expect("ListStuck").into_inner();
    assert_eq!(stuck.flows.len(), 10, "{stuck:?}");
    let by = stuck.answered_by.expect("answered_by");
    assert!(by.instance_id.starts_with("consumer-") && !by.support_v2 && by.auto_apply, "{by:?}");
    assert!(old.process.log_text().contains(&by.instance_id), "the instance id is logged at start-up");

    // The new instance starts beside the old one and applies what it left blocked.
    let new = start_consumer(&work, "consumer-v2", &["--support-v2"]);
    let read = |name: &str| std::fs::read_to_string(work.path(name)).unwrap_or_default();
    let logs = || format!("old:\n{}\nnew:\n{}", read("consumer-v1.log"), read("consumer-v2.log"));
    wait_applied(&producer.db, &consumer_db, 30, &logs);

    // Both serve: events that reach only the old instance are stored there, reported
    // blocked, and applied by the new one within its unblock interval.
    commit(&producer, "during", 10, &[2, 2, 2]).await;
    wait_applied(&producer.db, &consumer_db, 60, &logs);
    assert!(new.process.log_text().contains("auto-apply: applied flows left blocked"), "{}", logs());
    let said = old.apply("during0").await;
    assert_eq!((said.applied, ApplyStop::try_from(said.stop)), (0, Ok(ApplyStop::Idle)), "{said:?}");
    let said = new.apply("during0").await;
    assert_eq!((said.applied, ApplyStop::try_from(said.stop)), (0, Ok(ApplyStop::Idle)), "{said:?}");
    let stuck =
        new.client().await.list_stuck(ListStuckRequest { limit: 0 }).await.expect("ListStuck").into_inner();
    assert!(stuck.flows.is_empty(), "{stuck:?}");
    let new_by = stuck.answered_by.expect("answered_by");
    assert!(new_by.support_v2 && new_by.instance_id != by.instance_id, "{new_by:?}");

    // The old instance stops; the new one takes the deliveries and nothing is lost.
    assert_eq!(old.process.terminate(DEADLINE).code(), Some(0));
    let run = daemon.terminate(DEADLINE);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    commit(&producer, "after", 5, &[1, 2, 2]).await;
    let drained = harness::relay(&producer.db, &new.process.url(), &["drain"], &[]);
    assert_eq!(drained.code, Some(0), "{}", drained.stderr);
    wait_applied(&producer.db, &consumer_db, 75, &logs);
    for p in db::projections(&consumer_db) {
        assert_eq!((p.last_seq, p.state.as_str()), (3, "released"), "{p:?}");
    }
}
