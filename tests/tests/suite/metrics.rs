//! Prometheus metrics over real processes: a producer, a consumer and a `relay run`, each
//! with `--metrics-listen 127.0.0.1:0`, go through commits, retries and conflicts, a gap and
//! a block; their `/metrics` is scraped with an HTTP client, parsed as Prometheus text, and
//! the values are checked against the answers the test itself saw.

use std::collections::BTreeMap;
use std::time::Duration;

use harness::backend::Backend;
use harness::background::{RelayDaemon, wait_for};
use harness::proc::{ServerProcess, server_args};
use harness::scrape::{Metrics, get, metrics_addr};
use harness::{Consumer, Producer, Workdir, advance, db, envelope};
use proto::pb::{AdvanceOutcome, ApplyStop, ReceiveOutcome};

const DEADLINE: Duration = Duration::from_secs(30);
const METRICS: [&str; 2] = ["--metrics-listen", "127.0.0.1:0"];

fn addr_in(log: impl Fn() -> String) -> String {
    wait_for(DEADLINE, || metrics_addr(&log()), &log)
}

/// On PostgreSQL, the pool gauges of `pool`: its size as configured, and no more
/// connections in use or idle than it may open. On SQLite there is no pool and no gauge.
fn assert_pool(m: &Metrics, pool: &str, max: f64) {
    let max_seen = m.value("ordered_events_pg_pool_max_connections", &[("pool", pool)]);
    if Backend::current() == Backend::Postgres {
        assert_eq!(max_seen, Some(max), "{pool}");
        let in_use = m.get("ordered_events_pg_pool_connections", &[("pool", pool), ("state", "in_use")]);
        let idle = m.get("ordered_events_pg_pool_connections", &[("pool", pool), ("state", "idle")]);
        assert!(in_use + idle >= 1.0, "{pool}: the pool opened a connection at start-up");
        assert!(in_use + idle <= max, "{pool}: {in_use} in use + {idle} idle > {max}");
        assert_eq!(m.get("ordered_events_pg_pool_waiting", &[("pool", pool)]), 0.0, "{pool}");
    } else {
        assert_eq!(max_seen, None, "{pool}: no pool on SQLite");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_the_pipeline_answered() {
    let Some(work) = Workdir::for_test() else { return };
    let producer = Producer::start_with(&work, &METRICS);
    let consumer = Consumer::start_with(&work, &METRICS);
    let producer_metrics = addr_in(|| producer.process.log_text());
    let consumer_metrics = addr_in(|| consumer.process.log_text());

    // Only /metrics is served.
    assert_eq!(get(&producer_metrics, "/").await.0, 404);
    assert_eq!(get(&consumer_metrics, "/healthz").await.0, 404);

    // Producer: flow A (three steps), flow B (schema 1 then schema 2, which this consumer
    // cannot decode), a retry, a conflicting retry and a stale call. Tally what it answered.
    let mut answered: BTreeMap<&str, f64> = BTreeMap::new();
    let mut answers = producer.advance_steps("A", 0, &[1, 1, 1]).await;
    answers.extend(producer.advance_steps("B", 0, &[1, 2]).await);
    answers.push(producer.advance(advance("A", "A1", 0, "reserved", 1)).await);
    answers.push(producer.advance(advance("A", "A1", 0, "reserved", 2)).await);
    answers.push(producer.advance(advance("A", "A9", 1, "confirmed", 1)).await);
    for a in &answers {
        let label = match AdvanceOutcome::try_from(a.outcome) {
            Ok(AdvanceOutcome::Committed) => "committed",
            Ok(AdvanceOutcome::Existing) => "existing",
            Ok(AdvanceOutcome::Conflict) => "conflict",
            Ok(AdvanceOutcome::Stale) => "stale",
            Ok(AdvanceOutcome::InvalidTransition) => "invalid_transition",
            other => panic!("unexpected answer {other:?}"),
        };
        *answered.entry(label).or_default() += 1.0;
    }
    assert_eq!(answered.get("committed"), Some(&5.0), "{answered:?}");
    assert!(answered.len() >= 3, "the retries got no distinct answers: {answered:?}");
    let m = Metrics::scrape(&producer_metrics).await;
    for outcome in
        ["committed", "existing", "conflict", "stale", "invalid_transition", "outbox_full", "error"]
    {
        let expected = answered.get(outcome).copied().unwrap_or(0.0);
        assert_eq!(
            m.get("ordered_events_producer_advance_total", &[("outcome", outcome)]),
            expected,
            "{outcome}"
        );
    }
    assert_eq!(m.get("ordered_events_producer_advance_duration_seconds_count", &[]), answers.len() as f64);
    assert_eq!(m.get("ordered_events_producer_outbox_unaccepted", &[]), 5.0);
    assert!(m.get("ordered_events_producer_outbox_oldest_unaccepted_age_seconds", &[]) > 0.0);
    assert_eq!(m.get("ordered_events_producer_outbox_cap", &[]), 1_000_000.0);
    assert_eq!(m.get("ordered_events_producer_outbox_fill_ratio", &[]), 5.0 / 1_000_000.0);
    // Every call went through the writer in some transaction, counted with its size.
    assert_eq!(m.get("ordered_events_transaction_items_sum", &[("writer", "advance")]), answers.len() as f64);
    assert_pool(&m, "producer", 8.0);
    m.save("producer");

    // The relay delivers all five without a line per delivery; its progress line says so.
    let url = consumer.process.url();
    let relay_args = ["--summary-interval-ms", "100", METRICS[0], METRICS[1]];
    let mut args = vec!["run"];
    args.extend(relay_args);
    let relay = RelayDaemon::start_mode(work.dir.path(), "relay", &producer.db, &url, &args, &[]);
    let relay_metrics = addr_in(|| relay.log_text());
    wait_for(
        DEADLINE,
        || db::outbox(&producer.db).iter().all(|r| r.accepted).then_some(()),
        || format!("{:?}", db::outbox(&producer.db)),
    );
    let progress = wait_for(
        DEADLINE,
        || {
            let out = std::fs::read_to_string(&relay.stdout).unwrap_or_default();
            out.lines()
                .rev()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find(|v| v["type"] == "progress")
                .filter(|v| v["sent"] == 5)
        },
        || std::fs::read_to_string(&relay.stdout).unwrap_or_default(),
    );
    assert_eq!(progress["counts"]["ACCEPTED"], 5, "{progress}");
    let m = Metrics::scrape(&relay_metrics).await;
    assert_eq!(m.get("ordered_events_relay_deliveries_total", &[("answer", "accepted")]), 5.0);
    assert_eq!(m.get("ordered_events_relay_deliveries_total", &[("answer", "sequence_conflict")]), 0.0);
    assert_eq!(m.get("ordered_events_transaction_items_sum", &[("writer", "mark")]), 5.0);
    assert_pool(&m, "relay", 2.0);
    // Alone on a PostgreSQL outbox, the relay holds every partition's lease; on SQLite it
    // takes none and the gauge is absent.
    let held = m.value("ordered_events_relay_partitions_held", &[]);
    match work.backend() {
        harness::Backend::Postgres => assert_eq!(held, Some(64.0)),
        harness::Backend::Sqlite => assert_eq!(held, None),
    }
    m.save("relay");
    let run = relay.terminate(DEADLINE);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(run.deliveries().count(), 0, "run wrote delivery lines without --delivery-lines");
    let m = Metrics::scrape(&producer_metrics).await;
    assert_eq!(m.get("ordered_events_producer_outbox_unaccepted", &[]), 0.0);
    assert_eq!(m.get("ordered_events_producer_outbox_oldest_unaccepted_age_seconds", &[]), 0.0);

    // Consumer, directly (envelopes without a committed time, as grpcurl sends them): a gap
    // (G2 without G1), a flow ready but not applied (R1), an id conflict and a sequence conflict.
    let mut conflicting = envelope("A", 1, "reserved", 1, r#"{"amount":4}"#);
    conflicting.event_id = "A1".into();
    let mut squatter = envelope("A", 2, "confirmed", 1, r#"{"amount":3}"#);
    squatter.event_id = "Z2".into();
    let results = consumer
        .receive(vec![
            envelope("G", 2, "confirmed", 1, r#"{"amount":3}"#),
            envelope("R", 1, "reserved", 1, r#"{"amount":3}"#),
            conflicting,
            squatter,
        ])
        .await;
    let outcomes: Vec<_> = results.iter().map(|r| ReceiveOutcome::try_from(r.outcome)).collect();
    assert_eq!(
        outcomes,
        [
            Ok(ReceiveOutcome::Accepted),
            Ok(ReceiveOutcome::Accepted),
            Ok(ReceiveOutcome::IdConflict),
            Ok(ReceiveOutcome::SequenceConflict)
        ],
        "{results:?}"
    );
    let a = consumer.apply("A").await;
    let b = consumer.apply("B").await;
    let g = consumer.apply("G").await;
    assert_eq!((a.applied, a.stop), (3, ApplyStop::Idle as i32));
    assert_eq!((b.applied, b.stop), (1, ApplyStop::Blocked as i32));
    assert_eq!((g.applied, g.stop), (0, ApplyStop::Gap as i32));

    let m = Metrics::scrape(&consumer_metrics).await;
    let receive = |outcome| m.get("ordered_events_consumer_receive_total", &[("outcome", outcome)]);
    assert_eq!(receive("accepted"), 7.0);
    assert_eq!(receive("id_conflict"), 1.0);
    assert_eq!(receive("sequence_conflict"), 1.0);
    assert_eq!(receive("duplicate") + receive("rejected") + receive("backlog_full") + receive("error"), 0.0);
    let stops = |stop| m.get("ordered_events_consumer_apply_stops_total", &[("stop", stop)]);
    assert_eq!(stops("idle"), 1.0);
    assert_eq!(stops("gap"), 1.0);
    assert_eq!(stops("blocked_unsupported_schema"), 1.0);
    assert_eq!(stops("blocked_invalid_payload") + stops("limit") + stops("error"), 0.0);
    // B2 (blocked), G2 (behind the gap) and R1 (ready) wait.
    assert_eq!(m.get("ordered_events_consumer_inbox_unapplied", &[]), 3.0);
    assert_eq!(m.get("ordered_events_consumer_backlog_fill_ratio", &[]), 3.0 / 1_000_000.0);
    let waiting = |state| m.get("ordered_events_consumer_flows_waiting", &[("state", state)]);
    assert_eq!(waiting("gap"), 1.0);
    assert_eq!(waiting("ready"), 1.0);
    assert_eq!(waiting("blocked_unsupported_schema"), 1.0);
    assert_eq!(waiting("blocked_invalid_payload") + waiting("blocked_invalid_transition"), 0.0);
    assert_eq!(
        m.value("ordered_events_consumer_flows_waiting_walk_truncated", &[]),
        None,
        "no walk, no gauge"
    );
    // The four events the relay delivered and Apply applied (A1..A3, B1) carried their
    // committed time; each is one observation, from its Advance's commit to its Apply.
    let lag = |what: &str| m.get(&format!("ordered_events_consumer_commit_to_applied_seconds_{what}"), &[]);
    assert_eq!(lag("count"), 4.0);
    assert!(lag("sum") > 0.0, "{}", lag("sum"));
    assert_eq!(m.get("ordered_events_transaction_items_sum", &[("writer", "apply")]), 4.0);
    assert_eq!(m.get("ordered_events_transaction_items_sum", &[("writer", "receive")]), 9.0);
    assert_pool(&m, "consumer", 8.0);
    assert!(m.get("ordered_events_transaction_duration_seconds_count", &[("writer", "receive")]) >= 1.0);
    m.save("consumer");

    // A scraper that does not ask for OpenMetrics gets the classic text format.
    let (status, content_type, _) = get(&consumer_metrics, "/metrics").await;
    assert_eq!((status, content_type.as_str()), (200, "text/plain; version=0.0.4; charset=utf-8"));
}

/// A consumer with `--metrics-listen` (and `extra` flags) on the workdir's database.
fn metrics_consumer(work: &Workdir, log: &str, extra: &[&str]) -> (Consumer, String) {
    let db = work.consumer_db();
    let mut flags = METRICS.to_vec();
    flags.extend_from_slice(extra);
    let process = ServerProcess::start("consumer", &server_args(&db, &flags), &[], work.path(log));
    let consumer = Consumer { process, db };
    let addr = addr_in(|| consumer.process.log_text());
    (consumer, addr)
}

/// The waiting flows by state as scraped (gap, ready, blocked by reason in the order
/// unsupported_schema, invalid_payload, invalid_transition) and the unapplied rows.
async fn waiting(addr: &str) -> ([f64; 5], f64) {
    let m = Metrics::scrape(addr).await;
    let state = |s| m.get("ordered_events_consumer_flows_waiting", &[("state", s)]);
    let states = [
        state("gap"),
        state("ready"),
        state("blocked_unsupported_schema"),
        state("blocked_invalid_payload"),
        state("blocked_invalid_transition"),
    ];
    (states, m.get("ordered_events_consumer_inbox_unapplied", &[]))
}

/// The waiting-flow gauges are exact counts, not a sample: flows move gap → ready → applied,
/// ready → blocked, blocked → re-evaluated → applied by a `--support-v2` consumer started on
/// the same database (the counts survive the restart), and on PostgreSQL a second instance
/// receiving into the same database moves the first one's gauges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_flows_are_counted_exactly_through_every_state() {
    let Some(work) = Workdir::for_test() else { return };
    let (mut consumer, addr) = metrics_consumer(&work, "consumer-v1.log", &[]);
    let v1 = r#"{"amount":3}"#;
    let v2 = r#"{"units":3}"#;
    let accepted = |results: &[proto::pb::ReceiveResult]| {
        assert!(results.iter().all(|r| r.outcome == ReceiveOutcome::Accepted as i32), "{results:?}")
    };
    // G waits at a gap (G2, G3); R, B (schema 2), V (schema 1 then 2) and W (schema 2 with a
    // schema-1 payload) are ready: their first seq is stored, nothing applied yet.
    accepted(
        &consumer
            .receive(vec![
                envelope("G", 2, "confirmed", 1, v1),
                envelope("G", 3, "released", 1, v1),
                envelope("R", 1, "reserved", 1, v1),
                envelope("R", 2, "confirmed", 1, v1),
                envelope("B", 1, "reserved", 2, v2),
                envelope("V", 1, "reserved", 1, v1),
                envelope("V", 2, "confirmed", 2, v2),
                envelope("W", 1, "reserved", 2, v1),
            ])
            .await,
    );
    assert_eq!(waiting(&addr).await, ([1.0, 4.0, 0.0, 0.0, 0.0], 8.0));
    // A v1 consumer blocks B1, V2 (after applying V1) and W1: three ready flows now blocked.
    for flow in ["B", "V", "W"] {
        assert_eq!(consumer.apply(flow).await.stop, ApplyStop::Blocked as i32, "{flow}");
    }
    assert_eq!(waiting(&addr).await, ([1.0, 1.0, 3.0, 0.0, 0.0], 7.0));
    // G1 fills G's gap: ready. Then G and R apply to the end: idle.
    accepted(&consumer.receive(vec![envelope("G", 1, "reserved", 1, v1)]).await);
    assert_eq!(waiting(&addr).await, ([0.0, 2.0, 3.0, 0.0, 0.0], 8.0));
    assert_eq!(consumer.apply("G").await.applied, 3);
    assert_eq!(consumer.apply("R").await.applied, 2);
    assert_eq!(waiting(&addr).await, ([0.0, 0.0, 3.0, 0.0, 0.0], 3.0));
    // R3 arrives ready, G5 behind a new gap (G4 missing).
    accepted(
        &consumer
            .receive(vec![envelope("R", 3, "released", 1, v1), envelope("G", 5, "released", 1, v1)])
            .await,
    );
    assert_eq!(waiting(&addr).await, ([1.0, 1.0, 3.0, 0.0, 0.0], 5.0));

    // The same database under a --support-v2 consumer: the counts are as they were.
    let stopped = consumer.process.terminate(DEADLINE);
    assert!(stopped.success(), "{stopped:?}");
    let (v2_consumer, v2_addr) = metrics_consumer(&work, "consumer-v2.log", &["--support-v2"]);
    assert_eq!(waiting(&v2_addr).await, ([1.0, 1.0, 3.0, 0.0, 0.0], 5.0));
    // B1 and V2 apply; W1 is re-evaluated (no `units` in its payload): blocked for another reason.
    assert_eq!(v2_consumer.apply("B").await.applied, 1);
    assert_eq!(v2_consumer.apply("V").await.applied, 1);
    assert_eq!(v2_consumer.apply("W").await.stop, ApplyStop::Blocked as i32);
    assert_eq!(waiting(&v2_addr).await, ([1.0, 1.0, 0.0, 1.0, 0.0], 3.0));
    assert_eq!(v2_consumer.apply("R").await.applied, 1);
    assert_eq!(waiting(&v2_addr).await, ([1.0, 0.0, 0.0, 1.0, 0.0], 2.0));

    if work.backend() == harness::Backend::Postgres {
        // A second instance on the same database fills G's gap; the first one's gauges move.
        let (other, other_addr) = metrics_consumer(&work, "consumer-other.log", &[]);
        accepted(&other.receive(vec![envelope("G", 4, "confirmed", 1, v1)]).await);
        for addr in [&v2_addr, &other_addr] {
            assert_eq!(waiting(addr).await, ([0.0, 1.0, 0.0, 1.0, 0.0], 3.0), "{addr}");
        }
    }
}
