//! `consumer --auto-apply`: the pipeline runs without anyone calling Apply. A relay in `run`
//! mode delivers, the consumer applies each committed Receive batch's flows; a flow stuck at
//! a gap or a block stays stuck (and reported) without holding other flows back; a restart
//! applies what an earlier run left accepted but unapplied. Also the batch-cap flags.

use std::time::Duration;

use harness::background::{RelayDaemon, wait_for};
use harness::db;
use harness::proc::ServerProcess;
use harness::{Consumer, Producer, Target, Workdir, advance, envelope, reference_envelopes, run_to_exit};
use proto::crash::CrashPoint;
use proto::pb::{AdvanceOutcome, ApplyStop, BlockReason, ReceiveOutcome};

use crate::consumer::{effect_rows, outcomes, reference_effects};

const DEADLINE: Duration = Duration::from_secs(30);

/// Starts `consumer --auto-apply` on the work dir's consumer.db, with extra flags and env.
fn auto_consumer(work: &Workdir, log: &str, extra: &[&str], env: &[(&str, &str)]) -> Consumer {
    let db = work.consumer_db();
    let mut args = vec!["--db".to_owned(), db.arg(), "--listen".into(), "127.0.0.1:0".into()];
    args.extend(["--auto-apply"].iter().chain(extra).map(|s| (*s).to_owned()));
    let process = ServerProcess::start("consumer", &args, env, work.path(log));
    assert!(process.log_text().contains("auto_apply=true"), "{}", process.log_text());
    Consumer { process, db }
}

/// Waits until `flow` has `n` effects, reporting the inbox if it never happens.
fn wait_for_effects(db_path: &Target, flow: &str, n: usize) {
    wait_for(
        DEADLINE,
        || (db::effects(db_path).iter().filter(|e| e.flow_id == flow).count() >= n).then_some(()),
        || format!("inbox {:?}", db::inbox(db_path)),
    );
}

fn inbox_of(db_path: &Target, flow: &str) -> Vec<(u64, String, Option<String>)> {
    db::inbox(db_path).into_iter().filter(|r| r.flow_id == flow).map(|r| (r.seq, r.state, r.reason)).collect()
}

/// Advance → relay run → Receive → auto-apply: three events of a flow end applied, in
/// order, with no Apply call, and the outbox rows end accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_run_and_auto_apply_deliver_and_apply_without_an_apply_call() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = auto_consumer(&work, "consumer.log", &[], &[]);
    let daemon = RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer.db,
        &consumer.process.url(),
        &["--poll-ms", "10"],
        &[],
    );
    for (i, kind) in ["reserved", "confirmed", "released"].iter().enumerate() {
        let r = producer.advance(advance("A", &format!("A{}", i + 1), i as u64, kind, 1)).await;
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
    }
    wait_for_effects(&consumer.db, "A", 3);
    assert_eq!(effect_rows(&consumer), reference_effects("A"));
    let projections = db::projections(&consumer.db);
    assert_eq!(
        (projections[0].last_seq, projections[0].state.as_str(), projections[0].held),
        (3, "released", 0)
    );
    wait_for(
        DEADLINE,
        || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(()),
        || format!("{:?}", db::outbox(&producer.db)),
    );
    let run = daemon.terminate(DEADLINE);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.outcomes(), ["ACCEPTED"; 3]);
    // Nothing is left for a manual Apply.
    let r = consumer.apply("A").await;
    assert_eq!((r.applied, ApplyStop::try_from(r.stop)), (0, Ok(ApplyStop::Idle)));
}

/// A flow waiting at a gap and a flow blocked by a schema this consumer cannot read stay
/// stuck and are reported; flows received with and after them apply. The missing seq
/// arriving later unblocks its flow; a restart with the v2 decoder applies the blocked one.
// Multi-threaded so client connections keep running while `terminate` waits for the exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_flow_stays_stuck_without_holding_others_back() {
    let Some(work) = Workdir::for_test() else { return };
    let mut consumer = auto_consumer(&work, "consumer.log", &[], &[]);
    let gap = reference_envelopes("G")[1..].to_vec();
    let blocked = vec![
        envelope("V", 1, "reserved", 1, r#"{"amount":3}"#),
        envelope("V", 2, "confirmed", 2, r#"{"units":3}"#),
        envelope("V", 3, "released", 1, r#"{"amount":3}"#),
    ];
    let mut first = gap.clone();
    first.extend(blocked);
    first.extend(reference_envelopes("B"));
    assert_eq!(outcomes(&consumer.receive(first).await), vec![ReceiveOutcome::Accepted; 8]);
    wait_for_effects(&consumer.db, "B", 3);
    wait_for_effects(&consumer.db, "V", 1);
    wait_for(
        DEADLINE,
        || (inbox_of(&consumer.db, "V")[1].1 == "blocked").then_some(()),
        || format!("{:?}", inbox_of(&consumer.db, "V")),
    );
    // Later flows are not held back either.
    assert_eq!(
        outcomes(&consumer.receive(reference_envelopes("C")).await),
        vec![ReceiveOutcome::Accepted; 3]
    );
    wait_for_effects(&consumer.db, "C", 3);

    assert_eq!(inbox_of(&consumer.db, "G"), [(2, "pending".into(), None), (3, "pending".into(), None)]);
    assert_eq!(
        inbox_of(&consumer.db, "V"),
        [
            (1, "applied".into(), None),
            (2, "blocked".into(), Some("unsupported_schema".into())),
            (3, "pending".into(), None)
        ]
    );
    let stuck = consumer.list_stuck(0).await;
    let why: Vec<(String, ApplyStop, u64, BlockReason)> = stuck
        .flows
        .iter()
        .map(|f| {
            (
                f.flow_id.clone(),
                ApplyStop::try_from(f.why).expect("stop"),
                f.waiting_for_seq,
                BlockReason::try_from(f.reason).expect("reason"),
            )
        })
        .collect();
    assert_eq!(
        why,
        [
            ("G".into(), ApplyStop::Gap, 1, BlockReason::Unspecified),
            ("V".into(), ApplyStop::Blocked, 0, BlockReason::UnsupportedSchema),
        ]
    );

    // The missing seq arrives: the gap closes and the whole flow applies.
    assert_eq!(
        outcomes(&consumer.receive(reference_envelopes("G")[..1].to_vec()).await),
        [ReceiveOutcome::Accepted]
    );
    wait_for_effects(&consumer.db, "G", 3);
    assert_eq!(effect_rows(&consumer).iter().filter(|e| e.0.starts_with('G')).count(), 3);

    // A restart with the v2 decoder applies the blocked flow at start-up, with no new event.
    consumer.process.terminate(DEADLINE);
    let consumer = auto_consumer(&work, "consumer-v2.log", &["--support-v2"], &[]);
    wait_for_effects(&consumer.db, "V", 3);
    assert!(db::inbox(&consumer.db).iter().all(|r| r.state == "applied"), "{:?}", db::inbox(&consumer.db));
    assert!(consumer.list_stuck(0).await.flows.is_empty());
}

/// A crash after the Receive commit and before its answer (and its auto-apply) leaves the
/// event accepted; the restarted consumer applies it at start-up, and the redelivery is a
/// DUPLICATE that applies nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_auto_apply_is_recovered_at_start_up() {
    let Some(work) = Workdir::for_test() else { return };
    let point = CrashPoint::ConsumerReceiveAfterCommit;
    let mut crashing = auto_consumer(&work, "crash.log", &[], &[(proto::crash::ENV, point.name())]);
    let a1 = reference_envelopes("A")[0].clone();
    let mut client = crashing.client().await;
    if let Ok(response) = client.receive(tokio_stream::iter(vec![a1.clone()])).await {
        assert!(response.into_inner().message().await.is_err(), "the dying consumer answered");
    }
    let status = crashing.process.wait_exit(DEADLINE);
    assert_eq!(status.code(), Some(proto::crash::EXIT_CODE), "{}", crashing.process.log_text());
    assert!(crashing.process.log_text().contains(&point.marker()));
    assert_eq!(inbox_of(&crashing.db, "A"), [(1, "pending".into(), None)]);
    assert!(db::effects(&crashing.db).is_empty());

    let consumer = auto_consumer(&work, "recovered.log", &[], &[]);
    wait_for_effects(&consumer.db, "A", 1);
    assert_eq!(outcomes(&consumer.receive(vec![a1]).await), [ReceiveOutcome::Duplicate]);
    assert_eq!(effect_rows(&consumer), reference_effects("A")[..1]);
}

/// Every batch cap is a flag with an environment twin; a cap of 0 is refused at start-up.
#[test]
fn batch_cap_flags_and_their_environment_twins() {
    let Some(work) = Workdir::for_test() else { return };
    let db = work.consumer_db().arg();
    let pdb = work.producer_db().arg();
    let cases: [(&str, Vec<&str>, &str); 4] = [
        ("consumer", vec!["--db", &db, "--max-batch", "0"], "--max-batch"),
        ("consumer", vec!["--db", &db, "--apply-batch", "0"], "--apply-batch"),
        ("producer", vec!["--db", &pdb, "--max-batch", "0"], "--max-batch"),
        (
            "relay",
            vec!["--producer-db", &pdb, "--consumer", "http://127.0.0.1:1", "--mark-batch", "0", "drain"],
            "--mark-batch",
        ),
    ];
    for (bin, args, flag) in cases {
        let refused = run_to_exit(bin, &args, &[], DEADLINE);
        assert_eq!(refused.code, Some(2), "{bin} {args:?}: {refused:?}");
        assert!(
            refused.stderr.contains(flag) && refused.stderr.contains("must be 1 to"),
            "{}",
            refused.stderr
        );
    }
    for (bin, var) in [
        ("consumer", "ORDERED_EVENTS_CONSUMER_MAX_BATCH"),
        ("consumer", "ORDERED_EVENTS_APPLY_MAX_BATCH"),
        ("consumer", "ORDERED_EVENTS_AUTO_APPLY"),
        ("producer", "ORDERED_EVENTS_PRODUCER_MAX_BATCH"),
        ("relay", "ORDERED_EVENTS_RELAY_MARK_BATCH"),
        ("relay", "ORDERED_EVENTS_RELAY_MARK_DELAY_MS"),
    ] {
        let help = run_to_exit(bin, &["--help"], &[], DEADLINE);
        assert!(help.stdout.contains(var), "{bin} --help does not name {var}:\n{}", help.stdout);
    }
    // The twins are read: a batch-1 consumer configured only through the environment.
    let consumer = Consumer::start(
        &work,
        false,
        &[
            ("ORDERED_EVENTS_CONSUMER_MAX_BATCH", "1"),
            ("ORDERED_EVENTS_APPLY_MAX_BATCH", "1"),
            ("ORDERED_EVENTS_AUTO_APPLY", "true"),
        ],
    );
    let log = consumer.process.log_text();
    assert!(log.contains("max_batch=1 apply_batch=1 auto_apply=true"), "{log}");
}
