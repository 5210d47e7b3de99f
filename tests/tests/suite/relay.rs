//! The relay between real producer and consumer processes: end to end, the head-of-line
//! row of §10, its two crash points, six racing relays, `run` mode, and its errors.

use std::time::Duration;

use harness::Target;
use harness::background::{RelayDaemon, wait_for};
use harness::db;
use harness::proc::{ServerProcess, relay_armed};
use harness::{Consumer, Producer, Workdir, advance, relay};
use proto::crash::CrashPoint;
use proto::pb::{self, AdvanceOutcome, ApplyStop, ReceiveOutcome};

/// Commits steps `done+1 ..= done+steps` of `flow` and checks each was COMMITTED.
async fn commit_flow_from(producer: &Producer, flow: &str, done: usize, steps: usize) {
    for r in producer.advance_steps(flow, done, &vec![1; steps]).await {
        assert_eq!(AdvanceOutcome::try_from(r.outcome), Ok(AdvanceOutcome::Committed), "{r:?}");
    }
}

async fn commit_flow(producer: &Producer, flow: &str, steps: usize) {
    commit_flow_from(producer, flow, 0, steps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_events_travel_from_advance_to_apply() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit_flow(&producer, "A", 3).await;
    let run = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.outcomes(), ["ACCEPTED"; 3]);
    assert_eq!(run.summary()["counts"]["ACCEPTED"], 3);
    assert!(db::outbox(&producer.db).iter().all(|r| r.accepted));
    // Accepted is not applied.
    assert!(db::inbox(&consumer.db).iter().all(|r| r.state == "pending"));
    assert!(db::effects(&consumer.db).is_empty());
    let applied = consumer.apply("A").await;
    assert_eq!(applied.applied, 3);
    assert_eq!(ApplyStop::try_from(applied.stop), Ok(ApplyStop::Idle));
    let kinds: Vec<_> = db::effects(&consumer.db).into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, ["reserved", "confirmed", "released"]);
    // Outbox bodies arrive byte for byte.
    let out: Vec<_> = db::outbox(&producer.db).into_iter().map(|r| r.body).collect();
    let inn: Vec<_> = db::inbox(&consumer.db).into_iter().map(|r| r.body).collect();
    assert_eq!(out, inn);
    // Nothing left: idle.
    let idle = relay(&producer.db, &consumer.process.url(), &["drain"], &[]);
    assert_eq!(idle.code, Some(0));
    assert_eq!(idle.summary()["idle"], true);
}

/// §10: A1 conflicts at the consumer, B1 is pending. The default relay starves B; an
/// explicit send delivers it; drain skips A and delivers B's later rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_of_line_default_relay_and_the_ways_around_it() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit_flow(&producer, "A", 1).await;
    commit_flow(&producer, "B", 1).await;
    let conflicting = harness::envelope("A", 1, "reserved", 1, r#"{"amount":4}"#);
    let answers = consumer.receive(vec![conflicting]).await;
    assert_eq!(ReceiveOutcome::try_from(answers[0].outcome), Ok(ReceiveOutcome::Accepted));
    let url = consumer.process.url();
    for _ in 0..3 {
        let run = relay(&producer.db, &url, &["once"], &[]);
        assert_eq!(run.code, Some(3), "{run:?}");
        assert_eq!(run.outcomes(), ["ID_CONFLICT"]);
        assert_eq!(run.deliveries().next().expect("one delivery")["event_id"], "A1");
    }
    assert!(db::inbox(&consumer.db).iter().all(|r| r.event_id != "B1"), "B1 must not be delivered by once");
    let row = |id: &str| db::outbox(&producer.db).into_iter().find(|r| r.event_id == id).expect("row");
    assert!(!row("A1").accepted);
    // The operator sees the stuck conflict from the producer side.
    let mut client = producer.client().await;
    let flow =
        client.get_flow(pb::GetFlowRequest { flow_id: "A".into() }).await.expect("GetFlow").into_inner();
    assert_eq!((flow.outbox[0].attempts, flow.outbox[0].last_outcome.as_str()), (3, "ID_CONFLICT"));

    let send = relay(&producer.db, &url, &["send", "--event-id", "B1"], &[]);
    assert_eq!(send.code, Some(0), "{send:?}");
    assert_eq!(send.outcomes(), ["ACCEPTED"]);
    assert!(row("B1").accepted);
    assert_eq!(consumer.apply("B").await.applied, 1);

    // Later rows: drain delivers B2, B3 and holds A back (A2 is never sent).
    producer.advance(advance("A", "A2", 1, "confirmed", 1)).await;
    producer.advance(advance("B", "B2", 1, "confirmed", 1)).await;
    producer.advance(advance("B", "B3", 2, "released", 1)).await;
    // A window of one makes "A2 was never sent" deterministic; with a wider window A2 may
    // already be in flight when A1's conflict comes back, and is then marked by its own answer.
    let drain = relay(&producer.db, &url, &["drain", "--window", "1"], &[]);
    assert_eq!(drain.code, Some(3), "{drain:?}");
    let sent: Vec<_> =
        drain.deliveries().map(|d| d["event_id"].as_str().unwrap_or_default().to_owned()).collect();
    assert_eq!(sent, ["A1", "B2", "B3"]);
    assert_eq!(drain.summary()["skipped_flows"], serde_json::json!(["A"]));
    assert!(!row("A1").accepted && !row("A2").accepted);
    assert!(row("B2").accepted && row("B3").accepted);
    assert!(db::inbox(&consumer.db).iter().all(|r| r.event_id != "A2"));
    let b = consumer.apply("B").await;
    assert_eq!((b.applied, b.projection.expect("projection").state.as_str()), (2, "released"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_mark_redelivers_as_duplicate() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit_flow(&producer, "A", 1).await;
    let url = consumer.process.url();
    let crashed = relay_armed(&producer.db, &url, &["once"], CrashPoint::RelayAfterMark);
    assert!(crashed.crashed_at(CrashPoint::RelayAfterMark), "{crashed:?}");
    // Visible before recovery: the inbox holds A1, the outbox still says unaccepted.
    assert!(!db::outbox(&producer.db)[0].accepted);
    assert_eq!(db::inbox(&consumer.db).len(), 1);
    let again = relay(&producer.db, &url, &["once"], &[]);
    assert_eq!((again.code, again.outcomes()), (Some(0), vec!["DUPLICATE".to_owned()]));
    assert!(db::outbox(&producer.db)[0].accepted);
    assert_eq!(consumer.apply("A").await.applied, 1);
    assert_eq!(db::effects(&consumer.db).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_mark_commit_leaves_nothing_to_do() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    commit_flow(&producer, "A", 1).await;
    let url = consumer.process.url();
    let crashed = relay_armed(&producer.db, &url, &["once"], CrashPoint::RelayAfterMarkCommit);
    assert!(crashed.crashed_at(CrashPoint::RelayAfterMarkCommit), "{crashed:?}");
    assert!(db::outbox(&producer.db)[0].accepted);
    assert_eq!(db::inbox(&consumer.db)[0].state, "pending");
    let again = relay(&producer.db, &url, &["once"], &[]);
    assert_eq!(again.code, Some(0));
    assert_eq!(again.summary()["idle"], true);
    assert_eq!(consumer.apply("A").await.applied, 1);
    assert_eq!(db::effects(&consumer.db).len(), 1);
}

/// Six relay processes drain the same rows at once: transport work is wasted, but every
/// event has exactly one inbox row and every answer is ACCEPTED or DUPLICATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_relays_racing_drain() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let consumer = Consumer::start(&work, false, &[]);
    for i in 0..20 {
        commit_flow(&producer, &format!("F{i:02}-"), 3).await;
    }
    let url = consumer.process.url();
    let db_path = producer.db.clone();
    let runs: Vec<_> = (0..6)
        .map(|_| {
            let (db_path, url) = (db_path.clone(), url.clone());
            std::thread::spawn(move || relay(&db_path, &url, &["drain", "--window", "4"], &[]))
        })
        .collect();
    let runs: Vec<_> = runs.into_iter().map(|h| h.join().expect("relay thread")).collect();
    let mut accepted = 0;
    for run in &runs {
        assert_eq!(run.code, Some(0), "{run:?}");
        for outcome in run.outcomes() {
            assert!(outcome == "ACCEPTED" || outcome == "DUPLICATE", "{outcome}");
            accepted += u64::from(outcome == "ACCEPTED");
        }
    }
    assert_eq!(accepted, 60, "each event is accepted exactly once");
    let inbox = db::inbox(&consumer.db);
    assert_eq!(inbox.len(), 60);
    let mut ids: Vec<_> = inbox.iter().map(|r| r.event_id.clone()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 60);
    assert!(db::outbox(&producer.db).iter().all(|r| r.accepted));
}

/// `run` picks up rows committed after it started, survives a consumer restart on the same
/// address, holds no read transaction while idle, and exits 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_mode_follows_new_rows_and_survives_a_consumer_restart() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let mut consumer = Consumer::start(&work, false, &[]);
    let url = consumer.process.url();
    let daemon = RelayDaemon::start(
        work.dir.path(),
        "relay-run",
        &producer.db,
        &url,
        &["--poll-ms", "20", "--max-backoff-ms", "200"],
        &[],
    );
    commit_flow(&producer, "A", 2).await;
    let inbox_has = |path: &Target, n: usize| (db::inbox(path).len() >= n).then_some(());
    wait_for(
        Duration::from_secs(30),
        || inbox_has(&consumer.db, 2),
        || format!("{:?}", db::inbox(&consumer.db)),
    );

    // While the relay idles it holds no read transaction open between polls.
    match &producer.db {
        // A checkpoint can truncate the WAL.
        Target::Sqlite(path) => {
            let conn = rusqlite::Connection::open(path).expect("open producer.db");
            let busy: i64 =
                conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0)).expect("checkpoint");
            assert_eq!(busy, 0, "a reader blocked the checkpoint");
        }
        // Every transaction open now (a poll's, at most) ends soon after.
        Target::Postgres(_) => {
            let open = db::open_transactions(&producer.db);
            wait_for(
                Duration::from_secs(30),
                || {
                    let now = db::open_transactions(&producer.db);
                    open.iter().all(|t| !now.contains(t)).then_some(())
                },
                || format!("still open: {:?}", db::open_transactions(&producer.db)),
            );
        }
    }

    // Restart the consumer on the same address while rows keep coming.
    consumer.process.kill();
    let addr = consumer.process.addr.clone();
    let args = ["--db".to_owned(), consumer.db.arg(), "--listen".to_owned(), addr];
    commit_flow_from(&producer, "A", 2, 1).await;
    let restarted = Consumer {
        process: ServerProcess::start("consumer", &args, &[], work.path("consumer2.log")),
        db: consumer.db.clone(),
    };
    commit_flow(&producer, "B", 1).await;
    wait_for(
        Duration::from_secs(30),
        || inbox_has(&restarted.db, 4),
        || format!("{:?}", db::inbox(&restarted.db)),
    );
    let run = daemon.terminate(Duration::from_secs(30));
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.outcomes().iter().all(|o| o == "ACCEPTED" || o == "DUPLICATE"), "{:?}", run.outcomes());
    assert_eq!(run.summary()["mode"], "run");
    assert!(db::outbox(&producer.db).iter().all(|r| r.accepted));
    assert_eq!(restarted.apply("A").await.applied, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operational_errors_exit_1_with_one_line() {
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    commit_flow(&producer, "A", 1).await;
    // Nothing listens on this port (a server bound and released it).
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let run = relay(&producer.db, &format!("http://{closed}"), &["drain"], &[]);
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(
        run.stderr.lines().any(|l| l.starts_with("relay: error: consumer unreachable")),
        "{}",
        run.stderr
    );
    assert!(!db::outbox(&producer.db)[0].accepted);

    let empty = work.other_db("empty.db");
    if let Some(file) = empty.sqlite_path() {
        std::fs::write(file, b"").expect("write");
    }
    let run = relay(&empty, "http://127.0.0.1:1", &["drain"], &[]);
    assert_eq!(run.code, Some(1));
    assert!(run.stderr.contains("has not been created by the producer"), "{}", run.stderr);

    let unknown = relay(&producer.db, "http://127.0.0.1:1", &["send", "--event-id", "nope"], &[]);
    assert_eq!(unknown.code, Some(1));
    assert!(unknown.stderr.contains("no outbox row has event_id \"nope\""), "{}", unknown.stderr);

    let usage = relay(&producer.db, "http://127.0.0.1:1", &["teleport"], &[]);
    assert_eq!(usage.code, Some(2));
}
