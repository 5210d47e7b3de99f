//! Retention on the consumer (issue 16), over gRPC with real processes on the selected
//! backend: applied inbox rows compacted to tombstones (`--compact-once`, the background
//! loop at `--retention 0`) keep every Receive answer exact (DUPLICATE with its position,
//! ID_CONFLICT, SEQUENCE_CONFLICT), GetFlow shows them as compacted with the body's digest,
//! pending and blocked rows are never compacted, `--retention` parse errors exit 2 before
//! anything is created, and a crash at either compaction crash point leaves every row whole
//! or a tombstone.

use std::collections::BTreeMap;
use std::time::Duration;

use harness::db;
use harness::proc::{START_DEADLINE, run_to_exit};
use harness::{Consumer, Target, Workdir, envelope, reference_envelopes};
use proto::crash::CrashPoint;
use proto::pb::{self, ReceiveOutcome};

/// How long a `--compact-once` run may take.
const ONCE_DEADLINE: Duration = Duration::from_secs(60);

fn outcomes(results: &[pb::ReceiveResult]) -> Vec<ReceiveOutcome> {
    results.iter().map(|r| r.outcome()).collect()
}

/// Runs `consumer --compact-once --retention R` on `db` with `env`; returns the finished run.
fn compact_once(db: &Target, retention: &str, env: &[(&str, &str)]) -> harness::proc::Finished {
    let db = db.arg();
    run_to_exit("consumer", &["--db", &db, "--compact-once", "--retention", retention], env, ONCE_DEADLINE)
}

/// The JSON line of a successful `--compact-once`.
fn compact_report(db: &Target, retention: &str) -> serde_json::Value {
    let run = compact_once(db, retention, &[]);
    assert_eq!(run.code, Some(0), "compact-once failed: {}", run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one JSON line on stdout: {:?}", run.stdout);
    serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {:?}", lines[0]))
}

/// (event_id, state, compacted, body empty, body_sha256) per inbox row of `flow` as GetFlow
/// shows it.
fn shown(flow: &pb::ConsumerFlow) -> Vec<(String, String, bool, bool, String)> {
    flow.inbox
        .iter()
        .map(|r| (r.event_id.clone(), r.state.clone(), r.compacted, r.body.is_empty(), r.body_sha256.clone()))
        .collect()
}

/// Every inbox row on disk is whole (a body, no digest) or a tombstone (an applied row with a
/// 64-hex-digit digest and no body), never neither.
fn assert_whole_or_tombstone(target: &Target, context: &str) -> (usize, usize) {
    let (mut whole, mut tombstones) = (0, 0);
    for row in db::inbox(target) {
        match (&row.body_sha256, row.body.is_empty()) {
            (None, false) => whole += 1,
            (Some(d), true) if row.state == "applied" && d.len() == 64 => tombstones += 1,
            _ => panic!("{context}: inbox row {row:?} is neither whole nor a tombstone"),
        }
    }
    (whole, tombstones)
}

/// A: three events applied; B: seq 1 applied, seq 2 received after that apply (pending); C:
/// a schema 2 event a consumer without the v2 decoder keeps blocked.
async fn fill(consumer: &Consumer) {
    let mut envelopes = reference_envelopes("A");
    envelopes.push(reference_envelopes("B")[0].clone());
    envelopes.push(envelope("C", 1, "reserved", 2, r#"{"units":3}"#));
    let answers = consumer.receive(envelopes).await;
    assert!(outcomes(&answers).iter().all(|o| *o == ReceiveOutcome::Accepted), "{answers:?}");
    assert_eq!(consumer.apply("A").await.applied, 3);
    assert_eq!(consumer.apply("B").await.applied, 1);
    assert_eq!(consumer.apply("C").await.applied, 0, "C1 is blocked (schema 2, no v2 decoder)");
    let b2 = consumer.receive(vec![reference_envelopes("B")[1].clone()]).await;
    assert_eq!(outcomes(&b2), [ReceiveOutcome::Accepted]);
}

/// Compaction by `--compact-once --retention 0` while the database is not served: applied
/// rows become tombstones with the digest GetFlow showed before, pending and blocked rows
/// stay whole, every redelivery answer stays exact, the position a duplicate reports and the
/// highest inbox position do not move, and Apply goes on past a compacted row.
#[tokio::test]
async fn compacted_rows_answer_redelivery_exactly() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(&work, &["--retention", "off"]);
    fill(&consumer).await;
    let mut before = BTreeMap::new();
    for f in ["A", "B", "C"] {
        before.insert(f, consumer.get_flow(f).await);
    }
    let duplicate_positions: Vec<u64> =
        consumer.receive(reference_envelopes("A")).await.iter().map(|r| r.inbox_position).collect();
    let high_water = db::inbox_high_water(&db::open_ro(&consumer.db)).unwrap();
    drop(consumer);

    // Retention 7d and off compact nothing: every row is younger than a week.
    for retention in ["7d", "off"] {
        assert_eq!(compact_report(&work.consumer_db(), retention)["compacted"], 0, "{retention}");
    }
    let report = compact_report(&work.consumer_db(), "0");
    assert_eq!(report["compacted"], 4, "A1..A3 and B1 (applied); B2 pending, C1 blocked: {report}");
    assert!(report["body_bytes"].as_u64().is_some_and(|b| b > 4 * 60), "{report}");
    assert_eq!(assert_whole_or_tombstone(&work.consumer_db(), "after the pass"), (2, 4));

    let consumer = Consumer::start_with(&work, &["--retention", "off"]);
    for f in ["A", "B", "C"] {
        let after = consumer.get_flow(f).await;
        let was = &before[f];
        assert_eq!(after.effects, was.effects, "{f}: effects are never compacted");
        assert_eq!(after.projection, was.projection, "{f}: projections are never compacted");
        let expected: Vec<(String, String, bool, bool, String)> = shown(was)
            .into_iter()
            .map(|(id, state, _, _, digest)| {
                let compacted = state == "applied";
                (id, state, compacted, compacted, digest)
            })
            .collect();
        assert_eq!(shown(&after), expected, "{f}: tombstones keep the digest GetFlow showed");
        assert!(was.inbox.iter().all(|r| r.body_sha256.len() == 64 && !r.compacted), "{f}: {was:?}");
    }
    assert_eq!(db::inbox_high_water(&db::open_ro(&consumer.db)).unwrap(), high_water, "positions never move");

    // Redelivery of compacted events: DUPLICATE, with the same positions as before.
    let again = consumer.receive(reference_envelopes("A")).await;
    assert_eq!(outcomes(&again), [ReceiveOutcome::Duplicate; 3], "{again:?}");
    assert_eq!(again.iter().map(|r| r.inbox_position).collect::<Vec<_>>(), duplicate_positions);
    // The same id with another body, another id at a compacted (flow, seq), and both in one
    // stream after a duplicate (the batched path decides them together).
    let changed = envelope("A", 1, "reserved", 1, r#"{"amount":4}"#);
    let mut other_id = reference_envelopes("A")[1].clone();
    other_id.event_id = "X-at-A2".into();
    let mixed =
        consumer.receive(vec![reference_envelopes("B")[0].clone(), changed.clone(), other_id.clone()]).await;
    assert_eq!(
        outcomes(&mixed),
        [ReceiveOutcome::Duplicate, ReceiveOutcome::IdConflict, ReceiveOutcome::SequenceConflict],
        "{mixed:?}"
    );
    assert!(mixed[2].detail.contains("A2"), "the conflict names the holder: {:?}", mixed[2]);
    // Alone (one envelope per stream) as well.
    for (env, expected) in [
        (changed, ReceiveOutcome::IdConflict),
        (other_id, ReceiveOutcome::SequenceConflict),
        (reference_envelopes("A")[2].clone(), ReceiveOutcome::Duplicate),
    ] {
        assert_eq!(outcomes(&consumer.receive(vec![env.clone()]).await), [expected], "{}", env.event_id);
    }
    // Apply goes on past the compacted B1; the blocked C1 stays blocked and listed.
    let b = consumer.apply("B").await;
    assert_eq!(b.applied, 1, "{b:?}");
    let stuck = consumer.list_stuck(0).await;
    assert!(format!("{stuck:?}").contains("\"C\""), "{stuck:?}");
    drop(consumer);
    let report = compact_report(&work.consumer_db(), "0");
    assert_eq!(report["compacted"], 1, "B2, applied since: {report}");
    assert_eq!(assert_whole_or_tombstone(&work.consumer_db(), "after the second pass"), (1, 5));
}

/// The background loop at `--retention 0` compacts applied rows within seconds of their
/// apply, logs what it did, counts them in the metrics, and Receive stays exact meanwhile.
#[tokio::test]
async fn the_background_pass_compacts_applied_rows() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer =
        Consumer::start_with(&work, &["--retention", "0", "--auto-apply", "--metrics-listen", "127.0.0.1:0"]);
    assert!(
        consumer
            .process
            .log_text()
            .contains("compaction of finished rows older than the retention table=inbox"),
        "the loop says it runs"
    );
    let metrics = harness::background::wait_for(
        Duration::from_secs(30),
        || harness::scrape::metrics_addr(&consumer.process.log_text()),
        || consumer.process.log_text(),
    );
    let answers = consumer.receive(reference_envelopes("A")).await;
    assert_eq!(outcomes(&answers), [ReceiveOutcome::Accepted; 3]);
    let compacted = harness::background::poll_async(Duration::from_secs(30), async || {
        let flow = consumer.get_flow("A").await;
        (flow.inbox.len() == 3 && flow.inbox.iter().all(|r| r.compacted)).then_some(flow)
    })
    .await;
    let Some(last) = compacted else {
        panic!("not compacted within 30 s; last GetFlow: {:?}", consumer.get_flow("A").await)
    };
    assert!(last.inbox.iter().all(|r| r.body.is_empty() && r.body_sha256.len() == 64), "{last:?}");
    assert_eq!(last.effects.len(), 3);
    let again = consumer.receive(reference_envelopes("A")).await;
    assert_eq!(outcomes(&again), [ReceiveOutcome::Duplicate; 3], "{again:?}");
    // The pass that compacted them, or (PostgreSQL, where Apply compacts at retention 0)
    // the pass after the apply, reports them.
    let reported = "compaction pass: finished rows compacted to tombstones table=inbox";
    let on_postgres = matches!(work.consumer_db(), Target::Postgres(_));
    let log = harness::background::wait_for(
        Duration::from_secs(30),
        || {
            let log = consumer.process.log_text();
            // On PostgreSQL the applies' rows may reach more than one pass's line.
            let all = !on_postgres || harness::when_finished(&log) >= 3;
            (log.contains(reported) && all).then_some(log)
        },
        || consumer.process.log_text(),
    );
    if on_postgres {
        assert_eq!(harness::when_finished(&log), 3, "compacted by Apply itself, counted once:\n{log}");
    }
    // The metrics count each of the three rows once (a pass adds its rows right after its
    // commit, so the last one may still be on its way), and the body bytes dropped.
    let rows = |m: &harness::scrape::Metrics| {
        m.get("ordered_events_consumer_compacted_rows_total", &[("table", "inbox")])
    };
    let counted = harness::background::poll_async(Duration::from_secs(30), async || {
        let m = harness::scrape::Metrics::scrape(&metrics).await;
        (rows(&m) >= 3.0).then_some(m)
    })
    .await;
    let m = match counted {
        Some(m) => m,
        None => harness::scrape::Metrics::scrape(&metrics).await,
    };
    assert_eq!(rows(&m), 3.0, "each compacted row counted once");
    let bytes = m.get("ordered_events_consumer_compacted_body_bytes_total", &[("table", "inbox")]);
    assert!(bytes >= 3.0 * 50.0, "three canonical bodies of at least 50 bytes each: {bytes}");
}

/// `--compact-once` while a consumer serves the same database: the pass goes through the
/// same locks as every writer, and the serving consumer sees the tombstones at once (GetFlow)
/// and answers redeliveries against them.
#[tokio::test]
async fn compact_once_beside_a_serving_consumer() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(&work, &["--retention", "off"]);
    let answers = consumer.receive(reference_envelopes("A")).await;
    assert_eq!(outcomes(&answers), [ReceiveOutcome::Accepted; 3]);
    assert_eq!(consumer.apply("A").await.applied, 3);
    let report = compact_report(&work.consumer_db(), "0");
    assert_eq!(report["compacted"], 3, "{report}");
    let flow = consumer.get_flow("A").await;
    assert!(flow.inbox.iter().all(|r| r.compacted && r.body.is_empty()), "{flow:?}");
    let again = consumer.receive(reference_envelopes("A")).await;
    assert_eq!(outcomes(&again), [ReceiveOutcome::Duplicate; 3], "{again:?}");
    let b = consumer.receive(reference_envelopes("B")).await;
    assert_eq!(outcomes(&b), [ReceiveOutcome::Accepted; 3], "new events still go in");
}

/// `--retention` that is not a duration: exit 2 with a message naming the flag (flag and
/// environment twin alike), before anything is opened or created.
#[test]
fn a_bad_retention_is_refused_before_anything_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.db");
    let db = path.to_str().unwrap();
    for (args, env) in [
        (vec!["--db", db, "--listen", "127.0.0.1:0", "--retention", "7w"], vec![]),
        (vec!["--db", db, "--compact-once", "--retention=-1d"], vec![]),
        (vec!["--db", db, "--compact-once", "--retention", "1.5h"], vec![]),
        (vec!["--db", db, "--listen", "127.0.0.1:0"], vec![("ORDERED_EVENTS_RETENTION", "soon")]),
    ] {
        let run = run_to_exit("consumer", &args, &env, START_DEADLINE);
        assert_eq!(run.code, Some(2), "{args:?} {env:?}: {}", run.stderr);
        assert!(run.stderr.contains("--retention"), "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains("not a duration"), "{args:?}: {}", run.stderr);
        assert!(run.stdout.is_empty(), "{args:?}: {}", run.stdout);
        assert!(!path.exists(), "{args:?}: the database was created");
    }
}

/// A crash inside a compaction pass (after a batch is rewritten, before its commit; and
/// after its commit) leaves every row whole or a tombstone; a restarted consumer answers
/// redeliveries exactly and the next pass finishes the job.
#[tokio::test]
async fn compaction_crash_points() {
    for (point, committed) in
        [(CrashPoint::ConsumerCompactAfterBatch, false), (CrashPoint::ConsumerCompactAfterCommit, true)]
    {
        let Some(work) = Workdir::for_test() else { return };
        let consumer = Consumer::start_with(&work, &["--retention", "off"]);
        fill(&consumer).await;
        drop(consumer);
        let crashed = compact_once(&work.consumer_db(), "0", &[(proto::crash::ENV, point.name())]);
        assert_eq!(crashed.code, Some(proto::crash::EXIT_CODE), "{point}: {}", crashed.stderr);
        assert!(crashed.stderr.contains(&point.marker()), "{point}: marker missing: {}", crashed.stderr);
        assert!(crashed.stdout.is_empty(), "{point}: no report from a crashed pass");
        let expected = if committed { (2, 4) } else { (6, 0) };
        assert_eq!(assert_whole_or_tombstone(&work.consumer_db(), point.name()), expected, "{point}");

        let consumer = Consumer::start_with(&work, &["--retention", "off"]);
        let again = consumer.receive(reference_envelopes("A")).await;
        assert_eq!(outcomes(&again), [ReceiveOutcome::Duplicate; 3], "{point}: {again:?}");
        let changed = envelope("A", 2, "confirmed", 1, r#"{"amount":5}"#);
        assert_eq!(outcomes(&consumer.receive(vec![changed]).await), [ReceiveOutcome::IdConflict], "{point}");
        drop(consumer);
        let report = compact_report(&work.consumer_db(), "0");
        assert_eq!(report["compacted"], if committed { 0 } else { 4 }, "{point}: {report}");
        assert_eq!(assert_whole_or_tombstone(&work.consumer_db(), "after recovery"), (2, 4), "{point}");
    }
}

/// SQLite: a pass gives the bodies' pages back (the file is created with incremental
/// auto-vacuum), and the database's size after it is below the size before.
#[tokio::test]
async fn compaction_gives_pages_back_on_sqlite() {
    harness::sqlite_only!("pages and file sizes are SQLite's");
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(&work, &["--retention", "off"]);
    let flows: Vec<String> = (0..400).map(|k| format!("flow-with-a-longer-name-{k:05}")).collect();
    let envelopes: Vec<pb::EventEnvelope> = flows.iter().flat_map(|f| reference_envelopes(f)).collect();
    let answers = consumer.receive(envelopes).await;
    assert!(outcomes(&answers).iter().all(|o| *o == ReceiveOutcome::Accepted));
    let all = consumer.apply_all(0).await;
    assert_eq!(all.results.iter().map(|f| f.applied).sum::<u32>(), 1200, "{:?}", all.results.first());
    drop(consumer);
    let report = compact_report(&work.consumer_db(), "0");
    assert_eq!(report["compacted"], 1200, "{report}");
    assert!(report["batches"].as_u64().is_some_and(|b| b >= 3), "at most 500 rows a batch: {report}");
    let (before, after) =
        (report["file_bytes_before"].as_u64().unwrap(), report["file_bytes_after"].as_u64().unwrap());
    assert!(report["pages_freed"].as_u64().is_some_and(|p| p > 0), "{report}");
    assert!(after < before, "{report}");
}

/// PostgreSQL: passes of several instances on one database at once compact every row
/// exactly once between them (SKIP LOCKED), and their counts add up to the rows.
#[tokio::test]
async fn concurrent_passes_on_postgres_never_double_count() {
    harness::postgres_only!("several instances share one database only on PostgreSQL");
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(&work, &["--retention", "off"]);
    let flows: Vec<String> = (0..1500).map(|k| format!("P{k:05}")).collect();
    let envelopes: Vec<pb::EventEnvelope> = flows.iter().flat_map(|f| reference_envelopes(f)).collect();
    let answers = consumer.receive(envelopes).await;
    assert!(outcomes(&answers).iter().all(|o| *o == ReceiveOutcome::Accepted));
    let all = consumer.apply_all(0).await;
    assert_eq!(all.results.iter().map(|f| f.applied).sum::<u32>(), 4500);
    let target = work.consumer_db();
    let runs: Vec<std::thread::JoinHandle<serde_json::Value>> = (0..3)
        .map(|_| {
            let target = target.clone();
            std::thread::spawn(move || compact_report(&target, "0"))
        })
        .collect();
    let total: u64 = runs.into_iter().map(|r| r.join().unwrap()["compacted"].as_u64().unwrap()).sum();
    assert_eq!(total, 4500, "every row compacted once between the three passes");
    assert_eq!(assert_whole_or_tombstone(&target, "after the passes"), (0, 4500));
    let again = consumer.receive(reference_envelopes("P00007")).await;
    assert_eq!(outcomes(&again), [ReceiveOutcome::Duplicate; 3]);
}

/// A measurement, not a timed test (run it with `--ignored --nocapture`, on either backend):
/// how much the consumer's storage grows per event over 100k events (33 334 flows × 3 steps
/// through Receive and ApplyAll), without compaction and with a pass at retention 0 after
/// each 100k. SQLite: the file's size (pages × page size). PostgreSQL: the inbox relation's
/// total size (heap, TOAST, indexes) and the whole schema's, after autovacuum has visited the
/// inbox (waited for up to 3 minutes; a manual VACUUM otherwise, and it says so). Prints the
/// figures the README quotes and checks that compaction makes the growth smaller.
#[tokio::test]
#[ignore = "a measurement (200k events), run by hand"]
async fn measure_growth_per_event() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start_with(&work, &["--retention", "off", "--max-pending", "0"]);
    let target = work.consumer_db();
    let flows = 33_334;
    let mut sizes = Vec::new();
    for round in 0..2 {
        let envelopes: Vec<pb::EventEnvelope> = (0..flows)
            .flat_map(|k| {
                let flow = format!("r{round}-{k:07}");
                reference_envelopes(&flow).into_iter().map(move |mut e| {
                    e.event_id = format!("{flow}-{}", e.seq);
                    e
                })
            })
            .collect();
        for chunk in envelopes.chunks(20_000) {
            let answers = consumer.receive(chunk.to_vec()).await;
            assert!(outcomes(&answers).iter().all(|o| *o == ReceiveOutcome::Accepted));
        }
        let mut applied = 0;
        loop {
            let all = consumer.apply_all(0).await;
            let n: u32 = all.results.iter().map(|f| f.applied).sum();
            applied += n;
            if n == 0 {
                break;
            }
        }
        assert_eq!(applied, flows * 3);
        let plain = storage_size(&target, None);
        let visits = autovacuum_visits(&target);
        let compacted = compact_report(&target, "0");
        assert_eq!(compacted["compacted"].as_u64(), Some(u64::from(flows) * 3), "{compacted}");
        let after = storage_size(&target, Some(visits));
        println!("round {round}: before the pass {plain:?}, pass {compacted}, after it {after:?}");
        sizes.push((plain, after));
    }
    let events = f64::from(flows * 3);
    let without = sizes[0].0.0 as f64 / events;
    let with = (sizes[1].1.0 - sizes[0].1.0) as f64 / events;
    println!(
        "growth per event: {without:.0} B without compaction, {with:.0} B with a pass per 100k: {sizes:?}"
    );
    assert!(with < without, "{sizes:?}");
}

/// PostgreSQL: how often autovacuum has visited the inbox (0 on SQLite).
fn autovacuum_visits(target: &Target) -> i64 {
    let Target::Postgres(url) = target else { return 0 };
    let pg = db::PgSession::connect(url, false).unwrap();
    pg.run(|c| {
        c.query_one(
            "SELECT coalesce(sum(autovacuum_count), 0)::bigint FROM pg_stat_user_tables
             WHERE schemaname = 'ordered_events_consumer' AND relname = 'inbox'",
            &[],
        )
        .unwrap()
        .get(0)
    })
    .unwrap()
}

/// SQLite: (file bytes, 0). PostgreSQL: (inbox total bytes, schema total bytes), once
/// autovacuum visited the inbox more often than `after_visits` when that is given.
fn storage_size(target: &Target, after_visits: Option<i64>) -> (u64, u64) {
    match target {
        Target::Sqlite(_) => {
            let report = compact_report(target, "7d");
            (report["file_bytes_after"].as_u64().unwrap(), 0)
        }
        Target::Postgres(url) => {
            let pg = db::PgSession::connect(url, false).unwrap();
            let q = |sql: &'static str| -> i64 {
                pg.run(move |c| c.query_one(sql, &[]).unwrap().get(0)).unwrap()
            };
            let autovacuum: String = pg.run(|c| c.query_one("SHOW autovacuum", &[]).unwrap().get(0)).unwrap();
            if after_visits.is_some() && autovacuum != "on" {
                println!("autovacuum is {autovacuum} on this server: VACUUM by hand (what it would run)");
                pg.run(|c| c.batch_execute("VACUUM ordered_events_consumer.inbox").unwrap()).unwrap();
            } else if let Some(before) = after_visits {
                let visited = harness::background::poll(Duration::from_secs(180), || {
                    (autovacuum_visits(target) > before).then_some(())
                });
                if visited.is_none() {
                    println!("autovacuum did not visit the inbox within 3 minutes: VACUUM by hand");
                    pg.run(|c| c.batch_execute("VACUUM ordered_events_consumer.inbox").unwrap()).unwrap();
                }
            }
            let inbox = q("SELECT pg_total_relation_size('ordered_events_consumer.inbox')");
            let schema = q("SELECT sum(pg_total_relation_size(c.oid))::bigint FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = 'ordered_events_consumer' AND c.relkind IN ('r', 'm')");
            (inbox as u64, schema as u64)
        }
    }
}

/// A compaction pass that fails (here a test trigger refuses the tombstone's write) is
/// counted in `ordered_events_consumer_compaction_failures_total`, logged, and changes
/// nothing: the rows stay whole, the server goes on receiving and applying, and once the
/// cause is gone the next pass compacts them.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_compaction_pass_is_counted_and_loses_nothing() {
    let Some(work) = Workdir::for_test() else { return };
    let mut consumer = Consumer::start(&work, false, &[]);
    consumer.process.terminate(Duration::from_secs(30));
    let target = work.consumer_db();
    let message = "compaction refused by the test trigger";
    let (install, remove) = match &target {
        Target::Sqlite(_) => (
            format!(
                "CREATE TRIGGER no_tombstone BEFORE INSERT ON inbox_digest
                 BEGIN SELECT RAISE(ABORT, '{message}'); END;"
            ),
            "DROP TRIGGER no_tombstone;".to_owned(),
        ),
        Target::Postgres(_) => {
            let schema = db::Store::Consumer.pg_schema();
            (
                format!(
                    "CREATE FUNCTION {schema}.no_tombstone() RETURNS trigger LANGUAGE plpgsql AS $body$
                     BEGIN RAISE EXCEPTION '{message}'; END $body$;
                     CREATE TRIGGER no_tombstone BEFORE UPDATE OF body_sha256 ON {schema}.inbox
                         FOR EACH ROW EXECUTE FUNCTION {schema}.no_tombstone();"
                ),
                format!(
                    "DROP TRIGGER no_tombstone ON {schema}.inbox; DROP FUNCTION {schema}.no_tombstone();"
                ),
            )
        }
    };
    db::execute(&target, &install);

    // Not 0: on PostgreSQL Apply itself compacts at 0, and the trigger would refuse the apply.
    let args = ["--retention", "1s", "--auto-apply", "--metrics-listen", "127.0.0.1:0"];
    let mut consumer = Consumer::start_on_with(target.clone(), work.path("refused.log"), &args);
    let metrics = harness::background::wait_for(
        START_DEADLINE,
        || harness::scrape::metrics_addr(&consumer.process.log_text()),
        || consumer.process.log_text(),
    );
    let answers = consumer.receive(reference_envelopes("A")).await;
    assert_eq!(outcomes(&answers), [ReceiveOutcome::Accepted; 3], "{answers:?}");
    let failures = |m: &harness::scrape::Metrics| {
        m.get("ordered_events_consumer_compaction_failures_total", &[("table", "inbox")])
    };
    let failed = harness::background::poll_async(Duration::from_secs(30), async || {
        let flow = consumer.get_flow("A").await;
        let applied = flow.inbox.iter().filter(|r| r.state == "applied").count() == 3;
        let m = harness::scrape::Metrics::scrape(&metrics).await;
        (applied && failures(&m) >= 1.0).then_some(m)
    })
    .await;
    let log = consumer.process.log_text();
    let Some(m) = failed else { panic!("no failed pass counted within 30 s:\n{log}") };
    assert_eq!(m.get("ordered_events_consumer_compacted_rows_total", &[("table", "inbox")]), 0.0);
    assert!(log.contains("compaction pass failed") && log.contains(message), "{log}");
    let (whole, tombstones) = assert_whole_or_tombstone(&target, "refused pass");
    assert_eq!((whole, tombstones), (3, 0), "a refused pass changes nothing");
    // The server still serves: another flow is received and applied.
    let b = consumer.receive(reference_envelopes("B")).await;
    assert_eq!(outcomes(&b), [ReceiveOutcome::Accepted; 3], "{b:?}");
    consumer.process.terminate(Duration::from_secs(30));

    db::execute(&target, &remove);
    let consumer = Consumer::start_on_with(target.clone(), work.path("allowed.log"), &args);
    let compacted = harness::background::poll_async(Duration::from_secs(30), async || {
        let flows = [consumer.get_flow("A").await, consumer.get_flow("B").await];
        flows.iter().all(|f| f.inbox.len() == 3 && f.inbox.iter().all(|r| r.compacted)).then_some(())
    })
    .await;
    assert!(compacted.is_some(), "not compacted once the trigger is gone:\n{}", consumer.process.log_text());
    assert_eq!(assert_whole_or_tombstone(&target, "after"), (0, 6));
}
