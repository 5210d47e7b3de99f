//! Retention on the producer (issue 16), over gRPC with real processes, on the selected
//! backend: `Advance` retries and conflicts against compacted outbox rows stay exact,
//! `GetFlow` shows tombstones, `--compact-once` and the background pass, `--retention` parse
//! errors, the two compaction crash points, and a relay that finds a consumer lost history
//! the producer already compacted stops loudly instead of re-sending part of it.

use std::time::Duration;

use harness::background::wait_for;
use harness::db;
use harness::proc::{Finished, arming, run_to_exit};
use harness::{Consumer, Producer, Target, Workdir, advance, relay};
use proto::crash::{self, CrashPoint};
use proto::pb::{self, AdvanceOutcome};

const DEADLINE: Duration = Duration::from_secs(60);

fn outcome(r: &pb::AdvanceResponse) -> AdvanceOutcome {
    AdvanceOutcome::try_from(r.outcome).expect("known outcome")
}

fn sha256_hex(body: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(body.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// `producer --db DB --retention R --compact-once` run to its exit, with `env`.
fn compact_once(db: &Target, retention: &str, env: &[(&str, &str)]) -> Finished {
    let db = db.arg();
    run_to_exit("producer", &["--db", &db, "--retention", retention, "--compact-once"], env, DEADLINE)
}

/// The JSON line of a successful `--compact-once`.
fn compact_line(done: &Finished) -> serde_json::Value {
    assert_eq!(done.code, Some(0), "{done:?}");
    let line = done.stdout.lines().next().unwrap_or_else(|| panic!("no stdout line: {done:?}"));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
}

/// A producer that never compacts by itself (the test decides when), with a consumer.
fn pipeline(work: &Workdir) -> (Producer, Consumer) {
    let producer = Producer::start_with(work, &["--retention", "off"]);
    let consumer = Consumer::start(work, true, &[]);
    (producer, consumer)
}

async fn get_flow(producer: &Producer, flow: &str) -> pb::ProducerFlow {
    let mut client = producer.client().await;
    client.get_flow(pb::GetFlowRequest { flow_id: flow.into() }).await.expect("GetFlow").into_inner()
}

/// Commits `flow` steps 1..=`steps` (ids `<flow><seq>`, schema 1) and checks each.
async fn commit(producer: &Producer, flow: &str, steps: usize) -> Vec<pb::AdvanceResponse> {
    let answers = producer.advance_steps(flow, 0, &vec![1; steps]).await;
    for r in &answers {
        assert_eq!(outcome(r), AdvanceOutcome::Committed, "{r:?}");
    }
    answers
}

/// Retries and conflicts against compacted rows answer exactly as before compaction;
/// unaccepted rows are never compacted; GetFlow shows tombstones with their digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advance_answers_stay_exact_against_compacted_rows() {
    let Some(work) = Workdir::for_test() else { return };
    let (producer, consumer) = pipeline(&work);
    commit(&producer, "A", 3).await;
    let b = producer.advance(advance("B", "B1", 0, "reserved", 2)).await;
    assert_eq!(outcome(&b), AdvanceOutcome::Committed);
    let sent = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(sent.code, Some(0), "{sent:?}");
    // C1 is committed after the relay ran: unaccepted, it must keep its body.
    commit(&producer, "C", 1).await;

    // The answers before compaction, to compare with.
    let retries = [advance("A", "A1", 0, "reserved", 1), advance("A", "A3", 2, "released", 1)];
    let mut before = Vec::new();
    for r in &retries {
        let answer = producer.advance(r.clone()).await;
        assert_eq!(outcome(&answer), AdvanceOutcome::Existing);
        before.push(answer);
    }
    let bodies: Vec<(String, String)> =
        db::outbox(&producer.db).into_iter().map(|r| (r.event_id, r.body)).collect();
    let body_of = |id: &str| bodies.iter().find(|(e, _)| e == id).expect("row").1.clone();
    let accepted_bytes: usize = bodies.iter().filter(|(id, _)| id != "C1").map(|(_, body)| body.len()).sum();

    let line = compact_line(&compact_once(&producer.db, "0", &[]));
    assert_eq!(line["compacted"], 4, "{line}");
    assert_eq!(line["body_bytes"], accepted_bytes, "{line}");
    assert_eq!(line["retention"], "0", "{line}");
    let rows = db::outbox(&producer.db);
    for row in &rows {
        assert_eq!(row.compacted, row.event_id != "C1", "{row:?}");
        assert_eq!(row.body.is_empty(), row.compacted, "{row:?}");
    }
    // Nothing left to do: a second pass compacts nothing.
    assert_eq!(compact_line(&compact_once(&producer.db, "0", &[]))["compacted"], 0);

    // EXISTING: byte for byte the answer given before compaction (body rebuilt, same digest).
    for (req, earlier) in retries.iter().zip(&before) {
        let again = producer.advance(req.clone()).await;
        assert_eq!(&again, earlier, "{req:?}");
        assert!(!again.event.as_ref().expect("event").compacted);
    }
    // CONFLICT: the tombstone, no body, its digest.
    let changes = [
        pb::AdvanceRequest { amount: 4, ..advance("A", "A1", 0, "reserved", 1) },
        advance("A", "A1", 0, "reserved", 2),
        advance("Z", "A1", 0, "reserved", 1),
        advance("B", "B1", 0, "reserved", 1),
    ];
    for req in changes {
        let answer = producer.advance(req.clone()).await;
        assert_eq!(outcome(&answer), AdvanceOutcome::Conflict, "{req:?}: {answer:?}");
        let event = answer.event.expect("the stored event");
        assert!(event.compacted, "{event:?}");
        assert!(event.body.is_empty(), "{event:?}");
        assert_eq!(event.body_sha256, sha256_hex(&body_of(&req.event_id)), "{req:?}");
        assert_eq!(event.event_id, req.event_id);
        assert!(answer.detail.contains("compacted"), "{}", answer.detail);
    }
    // A new id at a compacted step is STALE, as before; the flow moves on normally.
    assert_eq!(outcome(&producer.advance(advance("A", "A9", 0, "reserved", 1)).await), AdvanceOutcome::Stale);
    let next = producer.advance(advance("B", "B2", 1, "confirmed", 2)).await;
    assert_eq!(outcome(&next), AdvanceOutcome::Committed, "{next:?}");

    // GetFlow shows the tombstones: accepted, no body, the digest of the body they had.
    let flow = get_flow(&producer, "A").await;
    assert_eq!(flow.outbox.len(), 3);
    for row in &flow.outbox {
        assert!(row.compacted && row.accepted && row.body.is_empty(), "{row:?}");
        assert_eq!(row.body_sha256, sha256_hex(&body_of(&row.event_id)));
    }
    let c = get_flow(&producer, "C").await;
    assert!(!c.outbox[0].compacted && c.outbox[0].body_sha256.is_empty(), "{:?}", c.outbox[0]);
    assert_eq!(c.outbox[0].body, body_of("C1"));
    // The rows not compacted still travel.
    let rest = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(rest.code, Some(0), "{rest:?}");
    assert_eq!(rest.outcomes(), ["ACCEPTED", "ACCEPTED"]);
    let inbox = db::inbox(&consumer.db);
    assert_eq!(inbox.iter().find(|r| r.event_id == "C1").expect("C1 delivered").body, body_of("C1"));
}

/// `--retention 0` on the server: the background pass compacts accepted rows by itself within
/// about a second, logs what it did, and leaves unaccepted rows whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_pass_compacts_accepted_rows_at_retention_0() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start_with(&work, &["--retention", "0"]);
    let consumer = Consumer::start(&work, true, &[]);
    let on_postgres = matches!(producer.db, Target::Postgres(_));
    if on_postgres {
        // At 0 the producer's first pass asks relays to compact as they mark.
        wait_for(
            DEADLINE,
            || producer.process.log_text().contains("relays compact each outbox row").then_some(()),
            || producer.process.log_text(),
        );
    }
    commit(&producer, "A", 3).await;
    let sent = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(sent.code, Some(0), "{sent:?}");
    if on_postgres {
        let compacted = db::outbox(&producer.db).iter().filter(|r| r.compacted).count();
        assert_eq!(compacted, 3, "compacted by the relay's marks: {:?}", db::outbox(&producer.db));
    }
    commit(&producer, "U", 1).await;
    wait_for(
        DEADLINE,
        || db::outbox(&producer.db).iter().filter(|r| r.compacted).count().eq(&3).then_some(()),
        || format!("{:?}", db::outbox(&producer.db)),
    );
    let unaccepted = db::outbox(&producer.db).into_iter().find(|r| r.event_id == "U1").expect("U1");
    assert!(!unaccepted.compacted && !unaccepted.accepted, "{unaccepted:?}");
    wait_for(
        DEADLINE,
        || {
            producer
                .process
                .log_text()
                .contains("compaction pass: finished rows compacted to tombstones table=outbox")
                .then_some(())
        },
        || producer.process.log_text(),
    );
    let log = producer.process.log_text();
    assert!(
        log.contains("compaction of finished rows older than the retention table=outbox retention=0"),
        "{log}"
    );
    if on_postgres {
        // A pass may have taken some of the marks' rows while the relay still ran: the
        // passes' lines add up to the three.
        wait_for(
            DEADLINE,
            || (harness::when_finished(&producer.process.log_text()) >= 3).then_some(()),
            || producer.process.log_text(),
        );
        let log = producer.process.log_text();
        assert_eq!(harness::when_finished(&log), 3, "the passes report the relay's, once: {log}");
    }
    assert_eq!(
        outcome(&producer.advance(advance("A", "A2", 1, "confirmed", 1)).await),
        AdvanceOutcome::Existing
    );
}

/// A retention that is not a duration: exit 2, a message naming the flag and the value,
/// nothing created.
#[test]
fn a_bad_retention_is_refused_before_anything_is_created() {
    let Some(work) = Workdir::for_test() else { return };
    let db = work.producer_db();
    for bad in ["7w", "1.5h", "-1d", "forever"] {
        let flag = format!("--retention={bad}");
        let done = run_to_exit("producer", &["--db", &db.arg(), &flag], &[], DEADLINE);
        assert_eq!(done.code, Some(2), "{bad}: {done:?}");
        assert!(done.stderr.contains("--retention"), "{bad}: {}", done.stderr);
        assert!(done.stderr.contains(bad), "{bad}: {}", done.stderr);
        let env_done = run_to_exit(
            "producer",
            &["--db", &db.arg(), "--compact-once"],
            &[("ORDERED_EVENTS_RETENTION", bad)],
            DEADLINE,
        );
        assert_eq!(env_done.code, Some(2), "{bad} (env): {env_done:?}");
        assert!(env_done.stderr.contains("--retention"), "{bad} (env): {}", env_done.stderr);
    }
    match &db {
        Target::Sqlite(path) => assert!(!path.exists(), "{} was created", path.display()),
        Target::Postgres(url) => {
            let mut client = postgres::Client::connect(url, postgres::NoTls).expect("connect");
            let schemas: i64 = client
                .query_one(
                    "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'ordered_events_producer'",
                    &[],
                )
                .expect("count schemas")
                .get(0);
            assert_eq!(schemas, 0, "the producer schema was created");
        }
    }
    let help = run_to_exit("producer", &["--help"], &[], DEADLINE);
    assert!(
        help.stdout.contains("--retention <DURATION>") && help.stdout.contains("--compact-once"),
        "{}",
        help.stdout
    );
}

/// A crash inside a compaction batch (rewritten, not committed) or just after its commit:
/// every row is whole or a tombstone, never neither; after a restart the answers are exact
/// and the next pass finishes the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_during_compaction_leaves_every_row_whole_or_a_tombstone() {
    for (point, compacted_by_crash) in
        [(CrashPoint::ProducerCompactAfterBatch, 0), (CrashPoint::ProducerCompactAfterCommit, 6)]
    {
        let Some(work) = Workdir::for_test() else { return };
        let (producer, consumer) = pipeline(&work);
        commit(&producer, "A", 3).await;
        commit(&producer, "B", 3).await;
        let sent = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
        assert_eq!(sent.code, Some(0), "{sent:?}");
        let bodies: Vec<(String, String)> =
            db::outbox(&producer.db).into_iter().map(|r| (r.event_id, r.body)).collect();

        let crashed = compact_once(&producer.db, "0", &[arming(point)]);
        assert_eq!(crashed.code, Some(crash::EXIT_CODE), "{point}: {crashed:?}");
        assert!(crashed.stderr.contains(&point.marker()), "{point}: {}", crashed.stderr);
        let rows = db::outbox(&producer.db);
        assert_eq!(rows.len(), 6, "{point}");
        for row in &rows {
            let (_, body) = bodies.iter().find(|(id, _)| *id == row.event_id).expect("same rows");
            // Whole (the very body) or a tombstone (no body), never anything else.
            assert!(row.compacted != (row.body == *body), "{point}: {row:?}");
            assert!(row.accepted, "{point}: {row:?}");
        }
        assert_eq!(rows.iter().filter(|r| r.compacted).count(), compacted_by_crash, "{point}");

        // The running producer (another process) answers exactly meanwhile.
        let retry = producer.advance(advance("A", "A2", 1, "confirmed", 1)).await;
        assert_eq!(outcome(&retry), AdvanceOutcome::Existing, "{point}");
        assert_eq!(retry.event.expect("event").body, bodies[1].1, "{point}");
        let changed =
            producer.advance(pb::AdvanceRequest { amount: 5, ..advance("B", "B1", 0, "reserved", 1) }).await;
        assert_eq!(outcome(&changed), AdvanceOutcome::Conflict, "{point}");
        // The next pass finishes what the crash left.
        let line = compact_line(&compact_once(&producer.db, "0", &[]));
        assert_eq!(line["compacted"], 6 - compacted_by_crash, "{point}: {line}");
        assert!(db::outbox(&producer.db).iter().all(|r| r.compacted), "{point}");
        let retry = producer.advance(advance("B", "B3", 2, "released", 1)).await;
        assert_eq!(outcome(&retry), AdvanceOutcome::Existing, "{point}");
        assert_eq!(retry.event.expect("event").body, bodies[5].1, "{point}");
    }
}

/// The consumer database is restored from an older copy after the producer compacted the
/// rows it lost: the relay cannot send them again, so it re-sends nothing, unmarks nothing,
/// says how many rows and which, and what to do, and exits 1 (`once` and `run` alike: `run`
/// must not spin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_refuses_to_resend_history_the_producer_compacted() {
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start_with(&work, &["--retention", "off"]);
    let consumer_db = work.other_db("consumer.db");
    let mut consumer = Consumer::start_on(consumer_db.clone(), work.path("consumer.log"), true, &[]);
    commit(&producer, "kept", 3).await;
    let sent = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(sent.code, Some(0), "{sent:?}");

    // The backup, taken while the consumer is stopped.
    assert_eq!(consumer.process.terminate(DEADLINE).code(), Some(0));
    let backup = work.other_db("backup.db");
    copy_database(&consumer_db, &backup);
    let consumer = Consumer::start_on(consumer_db.clone(), work.path("consumer-2.log"), true, &[]);
    commit(&producer, "lost", 3).await;
    let sent = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(sent.code, Some(0), "{sent:?}");

    // Every accepted row is compacted; then one more is accepted (it keeps its body), and the
    // consumer comes back from the older copy.
    assert_eq!(compact_line(&compact_once(&producer.db, "0", &[]))["compacted"], 6);
    commit(&producer, "late", 1).await;
    let sent = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(sent.code, Some(0), "{sent:?}");
    drop(consumer);
    let restored = Consumer::start_on(backup, work.path("consumer-3.log"), true, &[]);
    // A new row, so `once` has something to send (it checks the consumer only then).
    commit(&producer, "new", 1).await;
    let before = db::outbox(&producer.db);
    let stopped = relay(&producer.db, &restored.process.url(), &["once"], &[]);
    assert_eq!(stopped.code, Some(1), "{stopped:?}");
    let err = &stopped.stderr;
    assert!(err.contains("CONSUMER HISTORY LOST BEYOND RETENTION"), "{err}");
    assert!(err.contains("4 accepted rows are missing"), "{err}");
    assert!(err.contains("3 of them compacted"), "{err}");
    assert!(err.contains("lost1"), "{err}");
    assert!(err.contains("Restore a newer copy of the consumer database"), "{err}");
    let consumer_db_id = err
        .split("missing from consumer database ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .expect("the error names the consumer database")
        .to_owned();
    assert!(err.contains(&format!("relay accept-lost --consumer-database-id {consumer_db_id}")), "{err}");
    assert_eq!(stopped.deliveries().count(), 0, "nothing may be sent");
    assert_eq!(db::outbox(&producer.db), before, "nothing may be unmarked");
    assert!(db::inbox(&restored.db).iter().all(|r| r.flow_id == "kept"));
    // `run` stops too (exit 1), it does not spin. (Under PostgreSQL leases its first check
    // runs before it holds partitions, so it may deliver new1 first; the check that follows
    // finds the compacted rows either way.)
    let stopped = relay(&producer.db, &restored.process.url(), &["run", "--poll-ms", "100"], &[]);
    assert_eq!(stopped.code, Some(1), "{stopped:?}");
    assert!(stopped.stderr.contains("CONSUMER HISTORY LOST BEYOND RETENTION"), "{}", stopped.stderr);
    for row in db::outbox(&producer.db).iter().filter(|r| r.flow_id != "new" && r.flow_id != "late") {
        assert!(row.accepted && row.compacted, "a compacted row was unmarked: {row:?}");
    }

    // No newer copy exists: an operator accepts the loss. The database id is required, and
    // another database's id is refused without changing anything.
    let url = restored.process.url();
    let before = db::outbox(&producer.db);
    let missing = relay(&producer.db, &url, &["accept-lost"], &[]);
    assert_eq!(missing.code, Some(2), "{missing:?}");
    assert!(missing.stderr.contains("--consumer-database-id"), "{}", missing.stderr);
    let wrong = relay(&producer.db, &url, &["accept-lost", "--consumer-database-id", "another-db"], &[]);
    assert_eq!(wrong.code, Some(1), "{wrong:?}");
    assert!(wrong.stderr.contains("accept-lost refused"), "{}", wrong.stderr);
    assert!(wrong.stderr.contains("not another-db"), "{}", wrong.stderr);
    assert!(wrong.stderr.contains("nothing was changed"), "{}", wrong.stderr);
    assert_eq!(db::outbox(&producer.db), before, "a refused accept-lost changed the outbox");

    let accepted =
        relay(&producer.db, &url, &["accept-lost", "--consumer-database-id", &consumer_db_id], &[]);
    assert_eq!(accepted.code, Some(0), "{accepted:?}");
    assert!(accepted.stderr.contains("CONSUMER HISTORY LOSS ACCEPTED BY AN OPERATOR"), "{}", accepted.stderr);
    assert_eq!(accepted.lines.len(), 1, "one line: {:?}", accepted.lines);
    let line = &accepted.lines[0];
    assert_eq!(line["type"], "accept_lost", "{line}");
    assert_eq!(line["consumer_database_id"], consumer_db_id.as_str(), "{line}");
    assert_eq!(
        (line["lost"].as_u64(), line["loss_accepted"].as_u64(), line["unmarked"].as_u64()),
        (Some(4), Some(3), Some(1)),
        "{line}"
    );
    assert_eq!(line["first"], serde_json::json!(["lost1", "lost2", "lost3"]), "{line}");
    assert_eq!(accepted.deliveries().count(), 0, "accept-lost sends nothing");

    // The relay runs again: the row that kept its body is sent again; the compacted ones
    // stay accepted (LOST_ACCEPTED) and are never sent; their flow waits at a gap.
    let resent = relay(&producer.db, &url, &["drain"], &[]);
    assert_eq!(resent.code, Some(0), "{resent:?}");
    assert!(resent.deliveries().any(|d| d["event_id"] == "late1"), "{:?}", resent.lines);
    assert!(!resent.stderr.contains("CONSUMER HISTORY LOST"), "{}", resent.stderr);
    for row in db::outbox(&producer.db) {
        assert!(row.accepted, "{row:?}");
        let expected = if row.flow_id == "lost" { "LOST_ACCEPTED" } else { "ACCEPTED" };
        assert_eq!(row.last_outcome.as_deref(), Some(expected), "{row:?}");
    }
    let inbox: Vec<String> = db::inbox(&restored.db).into_iter().map(|r| r.event_id).collect();
    assert!(inbox.contains(&"late1".to_owned()) && inbox.contains(&"new1".to_owned()), "{inbox:?}");
    assert!(!inbox.iter().any(|id| id.starts_with("lost")), "{inbox:?}");
}

/// Copies a stopped consumer's database: its file (SQLite, WAL checkpointed on clean exit),
/// or a PostgreSQL database made from it as a template.
fn copy_database(from: &Target, to: &Target) {
    match (from, to) {
        (Target::Sqlite(from), Target::Sqlite(to)) => {
            for suffix in ["", "-wal", "-shm"] {
                let (mut src, mut dst) = (from.as_os_str().to_owned(), to.as_os_str().to_owned());
                src.push(suffix);
                dst.push(suffix);
                if std::path::Path::new(&src).exists() {
                    std::fs::copy(&src, &dst).expect("copy the consumer database");
                }
            }
        }
        (Target::Postgres(from), Target::Postgres(to)) => {
            let name =
                |url: &str| url.split('?').next().unwrap_or(url).rsplit('/').next().unwrap_or("").to_owned();
            let admin = Target::Postgres(proto::pg::testing::with_database(from, "postgres"));
            db::execute(&admin, &format!("DROP DATABASE {} WITH (FORCE)", name(to)));
            db::execute(&admin, &format!("CREATE DATABASE {} TEMPLATE {}", name(to), name(from)));
        }
        _ => panic!("{from} and {to} are on different backends"),
    }
}
