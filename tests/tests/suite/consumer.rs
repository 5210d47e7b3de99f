//! The consumer over gRPC: the §10 scenarios (out of order, accepted is not applied, schema
//! v2 blocking and unblocking, flow isolation), Receive's answers, every arrival order,
//! request limits and ListStuck, and the binary's own contract (flags, errors, shutdown).

use std::time::Duration;

use harness::db;
use harness::{Consumer, Target, Workdir, envelope, reference_envelopes, run_to_exit};
use proto::pb::{self, ApplyStop, BlockReason, ReceiveOutcome};

pub(crate) fn outcomes(results: &[pb::ReceiveResult]) -> Vec<ReceiveOutcome> {
    results.iter().map(|r| ReceiveOutcome::try_from(r.outcome).expect("known outcome")).collect()
}

pub(crate) fn stop(r: &pb::ApplyResult) -> ApplyStop {
    ApplyStop::try_from(r.stop).expect("known stop")
}

pub(crate) fn projection(r: &pb::ApplyResult) -> (u64, String, i64) {
    let p = r.projection.as_ref().expect("projection");
    (p.last_seq, p.state.clone(), p.held)
}

/// (event_id, seq, kind, held) of every effect row, in apply order.
pub(crate) fn effect_rows(consumer: &Consumer) -> Vec<(String, u64, String, i64)> {
    db::effects(&consumer.db).into_iter().map(|e| (e.event_id, e.seq, e.kind, e.held)).collect()
}

pub(crate) fn reference_effects(flow: &str) -> Vec<(String, u64, String, i64)> {
    [(1, "reserved", 3), (2, "confirmed", 3), (3, "released", 0)]
        .into_iter()
        .map(|(seq, kind, held)| (format!("{flow}{seq}"), seq, kind.to_owned(), held))
        .collect()
}

async fn accept(consumer: &Consumer, envelopes: Vec<pb::EventEnvelope>) {
    let n = envelopes.len();
    let answers = consumer.receive(envelopes).await;
    assert_eq!(outcomes(&answers), vec![ReceiveOutcome::Accepted; n], "{answers:?}");
}

/// Arrival 3, then 1, then 2, applying after each: GAP at 1, GAP at 2, then all three.
#[tokio::test]
async fn out_of_order_3_1_2() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let [a1, a2, a3] = <[_; 3]>::try_from(reference_envelopes("A")).expect("three");

    accept(&consumer, vec![a3]).await;
    let r = consumer.apply("A").await;
    assert_eq!((r.applied, stop(&r), r.waiting_for_seq), (0, ApplyStop::Gap, 1), "{r:?}");
    assert_eq!(projection(&r), (0, "new".into(), 0));
    assert!(db::effects(&consumer.db).is_empty());

    accept(&consumer, vec![a1]).await;
    let r = consumer.apply("A").await;
    assert_eq!((r.applied, stop(&r), r.waiting_for_seq), (1, ApplyStop::Gap, 2), "{r:?}");
    assert_eq!(r.applied_event_ids, ["A1"]);
    assert_eq!(projection(&r), (1, "reserved".into(), 3));

    accept(&consumer, vec![a2]).await;
    let r = consumer.apply("A").await;
    assert_eq!((r.applied, stop(&r)), (2, ApplyStop::Idle), "{r:?}");
    assert_eq!(r.applied_event_ids, ["A2", "A3"]);
    assert_eq!(projection(&r), (3, "released".into(), 0));

    assert_eq!(effect_rows(&consumer), reference_effects("A"));
    let p = db::projections(&consumer.db);
    assert_eq!(
        p.iter().map(|p| (p.flow_id.as_str(), p.last_seq, p.state.as_str(), p.held)).collect::<Vec<_>>(),
        [("A", 3, "released", 0)]
    );
    let inbox = db::inbox(&consumer.db);
    assert!(inbox.iter().all(|r| r.state == "applied" && r.reason.is_none()), "{inbox:?}");
    let flow = consumer.get_flow("A").await;
    assert_eq!(
        flow.inbox.iter().map(|r| (r.seq, r.state.as_str(), r.reason.as_str())).collect::<Vec<_>>(),
        [(1, "applied", ""), (2, "applied", ""), (3, "applied", "")]
    );
    assert_eq!(
        flow.effects.iter().map(|e| (e.seq, e.kind.as_str(), e.held)).collect::<Vec<_>>(),
        [(1, "reserved", 3), (2, "confirmed", 3), (3, "released", 0)]
    );
}

/// Receiving stores; only Apply applies.
#[tokio::test]
async fn accepted_is_not_applied() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    accept(&consumer, reference_envelopes("A")).await;
    let inbox = db::inbox(&consumer.db);
    assert_eq!(inbox.len(), 3);
    assert!(inbox.iter().all(|r| r.state == "pending" && r.reason.is_none()), "{inbox:?}");
    assert!(db::projections(&consumer.db).is_empty());
    assert!(db::effects(&consumer.db).is_empty());
    let flow = consumer.get_flow("A").await;
    let p = flow.projection.expect("projection");
    assert_eq!((p.last_seq, p.state.as_str(), p.held), (0, "new", 0));
    assert!(flow.effects.is_empty());
    assert_eq!(flow.inbox.len(), 3);
}

fn v2_flow(flow: &str) -> Vec<pb::EventEnvelope> {
    vec![
        envelope(flow, 1, "reserved", 1, r#"{"amount":3}"#),
        envelope(flow, 2, "confirmed", 2, r#"{"units":3}"#),
        envelope(flow, 3, "released", 2, r#"{"units":3}"#),
    ]
}

/// Schema 2 blocks a consumer without the v2 decoder; the same file under a consumer
/// restarted with it applies the same rows, ids, seqs and bodies untouched.
#[tokio::test]
async fn schema_v2_blocks_then_unblocks_after_restart_with_v2() {
    let Some(work) = Workdir::for_test() else { return };
    let mut consumer = Consumer::start(&work, false, &[]);
    assert!(
        consumer.process.log_text().contains("v2_decoder=\"disabled\""),
        "{}",
        consumer.process.log_text()
    );
    accept(&consumer, v2_flow("A")).await;
    for round in 0..2 {
        // The second Apply re-evaluates the blocked row: same answer, nothing applied.
        let r = consumer.apply("A").await;
        assert_eq!(r.applied, if round == 0 { 1 } else { 0 }, "{r:?}");
        assert_eq!(stop(&r), ApplyStop::Blocked);
        assert_eq!(BlockReason::try_from(r.reason), Ok(BlockReason::UnsupportedSchema));
        assert_eq!(r.blocked_event_id, "A2");
        assert!(r.detail.contains("--support-v2"), "{}", r.detail);
        assert_eq!(projection(&r), (1, "reserved".into(), 3));
    }
    let before = db::inbox(&consumer.db);
    let states: Vec<_> = before.iter().map(|r| (r.seq, r.state.as_str(), r.reason.as_deref())).collect();
    assert_eq!(
        states,
        [(1, "applied", None), (2, "blocked", Some("unsupported_schema")), (3, "pending", None)]
    );
    assert_eq!(db::projections(&consumer.db)[0].last_seq, 1);

    consumer.process.kill();
    let consumer = Consumer::start_on(work.consumer_db(), work.path("consumer-v2.log"), true, &[]);
    assert!(
        consumer.process.log_text().contains("v2_decoder=\"enabled\""),
        "{}",
        consumer.process.log_text()
    );
    let r = consumer.apply("A").await;
    assert_eq!((r.applied, stop(&r)), (2, ApplyStop::Idle), "{r:?}");
    assert_eq!(r.applied_event_ids, ["A2", "A3"]);
    assert_eq!(projection(&r), (3, "released".into(), 0));
    let after = db::inbox(&consumer.db);
    let identity = |rows: &[db::InboxRow]| {
        rows.iter()
            .map(|r| (r.event_id.clone(), r.flow_id.clone(), r.seq, r.body.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(identity(&after), identity(&before), "ids, seqs and bodies are never edited");
    assert!(after.iter().all(|r| r.state == "applied" && r.reason.is_none()), "{after:?}");
    assert_eq!(effect_rows(&consumer), reference_effects("A"));
}

/// `ORDERED_EVENTS_SUPPORT_V2` is the flag's twin and takes the usual spellings.
#[tokio::test]
async fn support_v2_environment_twin() {
    for (value, enabled) in [("1", true), ("true", true), ("0", false), ("false", false)] {
        let Some(work) = Workdir::for_test() else { return };
        let consumer = Consumer::start(&work, false, &[("ORDERED_EVENTS_SUPPORT_V2", value)]);
        accept(&consumer, v2_flow("A")).await;
        let r = consumer.apply("A").await;
        let expected = if enabled { (3, ApplyStop::Idle) } else { (1, ApplyStop::Blocked) };
        assert_eq!((r.applied, stop(&r)), expected, "ORDERED_EVENTS_SUPPORT_V2={value}: {r:?}");
    }
}

/// A gap in flow A never stops flow B.
#[tokio::test]
async fn flow_isolation_with_apply_all() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let a = reference_envelopes("A");
    accept(&consumer, vec![a[0].clone(), a[2].clone()]).await;
    accept(&consumer, reference_envelopes("B")).await;
    let all = consumer.apply_all(0).await;
    let summary: Vec<_> = all
        .results
        .iter()
        .map(|r| (r.flow_id.as_str(), r.applied, stop(r), r.waiting_for_seq, projection(r), r.error.as_str()))
        .collect();
    assert_eq!(
        summary,
        [
            ("A", 1, ApplyStop::Gap, 2, (1, "reserved".into(), 3), ""),
            ("B", 3, ApplyStop::Idle, 0, (3, "released".into(), 0), "")
        ]
    );
    let p: Vec<_> =
        db::projections(&consumer.db).into_iter().map(|p| (p.flow_id, p.last_seq, p.state, p.held)).collect();
    assert_eq!(p, [("A".into(), 1, "reserved".into(), 3), ("B".into(), 3, "released".into(), 0)]);
    // Nothing left to do for B; A still waits for seq 2.
    let again = consumer.apply_all(0).await;
    assert_eq!(again.results.iter().map(|r| (r.flow_id.as_str(), r.applied)).collect::<Vec<_>>(), [("A", 0)]);
}

/// Conflicts are answers that store nothing; a re-formatted payload of the same event is a
/// duplicate because the canonical body is what is compared.
#[tokio::test]
async fn conflicts_and_duplicates() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let original = envelope("A", 1, "reserved", 1, r#"{"amount":3,"note":"x"}"#);
    let answers = consumer
        .receive(vec![
            original.clone(),
            pb::EventEnvelope {
                payload_json: "{ \"note\" : \"x\",\n\t\"amount\": 3 }".into(),
                ..original.clone()
            },
            pb::EventEnvelope { payload_json: r#"{"amount":4,"note":"x"}"#.into(), ..original.clone() },
            pb::EventEnvelope { flow_id: "B".into(), ..original.clone() },
            pb::EventEnvelope { event_id: "X1".into(), ..original.clone() },
            original.clone(),
        ])
        .await;
    assert_eq!(
        outcomes(&answers),
        [
            ReceiveOutcome::Accepted,
            ReceiveOutcome::Duplicate,
            ReceiveOutcome::IdConflict,
            ReceiveOutcome::IdConflict,
            ReceiveOutcome::SequenceConflict,
            ReceiveOutcome::Duplicate,
        ]
    );
    assert_eq!(
        answers.iter().map(|a| a.event_id.as_str()).collect::<Vec<_>>(),
        ["A1", "A1", "A1", "A1", "X1", "A1"]
    );
    assert!(answers[4].detail.contains("held by event A1"), "{:?}", answers[4]);
    assert!(!answers[2].detail.is_empty());
    let inbox = db::inbox(&consumer.db);
    assert_eq!(inbox.len(), 1, "{inbox:?}");
    assert_eq!(
        inbox[0].body,
        r#"{"event_id":"A1","flow_id":"A","kind":"reserved","payload":{"amount":3,"note":"x"},"schema":1,"seq":1}"#
    );
    assert_eq!(consumer.apply("A").await.applied, 1);
    assert_eq!(effect_rows(&consumer), reference_effects("A")[..1]);
}

fn permutations() -> Vec<[usize; 3]> {
    vec![[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]
}

/// Every arrival order of a flow's three events, with duplicates in the middle and at the
/// end, applied after each arrival: the applied prefix is always the contiguous received
/// prefix, and every flow ends with the same projection and effect sequence.
#[tokio::test]
async fn permutations_with_duplicates_converge() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    for (i, perm) in permutations().into_iter().enumerate() {
        let flow = format!("P{i}");
        let events = reference_envelopes(&flow);
        let arrivals = [perm[0], perm[1], perm[0], perm[2], perm[1]];
        let mut received = [false; 3];
        let mut applied = 0;
        for idx in arrivals {
            let answers = consumer.receive(vec![events[idx].clone()]).await;
            let expected = if received[idx] { ReceiveOutcome::Duplicate } else { ReceiveOutcome::Accepted };
            assert_eq!(outcomes(&answers), [expected], "{flow} arrival {idx}");
            received[idx] = true;
            let r = consumer.apply(&flow).await;
            applied += r.applied;
            let prefix = received.iter().take_while(|r| **r).count() as u64;
            assert_eq!(projection(&r).0, prefix, "{flow} {perm:?}: applied prefix after {received:?}");
        }
        assert_eq!(applied, 3, "{flow}");
        let got = consumer.get_flow(&flow).await;
        let p = got.projection.expect("projection");
        assert_eq!((p.last_seq, p.state.as_str(), p.held), (3, "released", 0), "{flow} {perm:?}");
        let effects: Vec<_> =
            got.effects.iter().map(|e| (e.event_id.clone(), e.seq, e.kind.clone(), e.held)).collect();
        assert_eq!(effects, reference_effects(&flow), "{flow} {perm:?}");
    }
    // The effect table in apply order: every flow's effects are seqs 1, 2, 3 in that order.
    let all = db::effects(&consumer.db);
    assert_eq!(all.len(), 18);
    for i in 0..6 {
        let flow = format!("P{i}");
        let seqs: Vec<u64> = all.iter().filter(|e| e.flow_id == flow).map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3], "{flow}");
    }
}

/// Transport-limit violations are answered REJECTED in-band, naming the field; the stream
/// goes on and nothing is stored for them.
#[tokio::test]
async fn rejected_envelopes_name_the_field_and_the_stream_goes_on() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let ok = |seq: u64| envelope("R", seq, "reserved", 1, r#"{"amount":3}"#);
    let cases = [
        ("event_id", pb::EventEnvelope { event_id: String::new(), ..ok(1) }),
        ("seq", pb::EventEnvelope { seq: 0, ..ok(2) }),
        ("payload_json.amount", pb::EventEnvelope { payload_json: r#"{"amount":3.0}"#.into(), ..ok(3) }),
        ("payload_json.amount", pb::EventEnvelope { payload_json: r#"{"amount":{"n":3}}"#.into(), ..ok(4) }),
        ("payload_json", pb::EventEnvelope { payload_json: r#"{"amount":3,"amount":3}"#.into(), ..ok(5) }),
        ("payload_json", pb::EventEnvelope { payload_json: "[3]".into(), ..ok(6) }),
        ("schema", pb::EventEnvelope { schema: 0, ..ok(7) }),
        ("flow_id", pb::EventEnvelope { flow_id: "has space".into(), ..ok(8) }),
    ];
    let mut stream: Vec<_> = cases.iter().map(|(_, e)| e.clone()).collect();
    stream.push(envelope("A", 1, "reserved", 1, r#"{"amount":3}"#));
    let answers = consumer.receive(stream).await;
    assert_eq!(answers.len(), cases.len() + 1);
    for ((field, sent), answer) in cases.iter().zip(&answers) {
        assert_eq!(ReceiveOutcome::try_from(answer.outcome), Ok(ReceiveOutcome::Rejected), "{field}");
        assert!(answer.detail.starts_with(&format!("{field}: ")), "{field}: {:?}", answer.detail);
        assert_eq!(answer.event_id, sent.event_id);
    }
    assert_eq!(outcomes(&answers[cases.len()..]), [ReceiveOutcome::Accepted]);
    let inbox = db::inbox(&consumer.db);
    assert_eq!(inbox.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>(), ["A1"]);
}

/// Unknown kinds and schemas are accepted and stored verbatim; Apply blocks them (and bad
/// payloads, and changed amounts) with the reason, and keeps re-evaluating.
#[tokio::test]
async fn apply_blocks_with_each_reason() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    accept(
        &consumer,
        vec![
            envelope("K", 1, "teleported", 1, r#"{"amount":3}"#),
            envelope("S", 1, "reserved", 9, r#"{"whatever":true}"#),
            envelope("P", 1, "reserved", 1, r#"{"amount":"3"}"#),
            envelope("M", 1, "reserved", 1, r#"{"amount":3}"#),
            envelope("M", 2, "confirmed", 1, r#"{"amount":4}"#),
        ],
    )
    .await;
    for (flow, reason, event_id, applied) in [
        ("K", BlockReason::InvalidTransition, "K1", 0),
        ("S", BlockReason::UnsupportedSchema, "S1", 0),
        ("P", BlockReason::InvalidPayload, "P1", 0),
        ("M", BlockReason::InvalidTransition, "M2", 1),
    ] {
        let r = consumer.apply(flow).await;
        assert_eq!(
            (r.applied, stop(&r), r.blocked_event_id.as_str()),
            (applied, ApplyStop::Blocked, event_id)
        );
        assert_eq!(BlockReason::try_from(r.reason), Ok(reason), "{flow}: {r:?}");
        assert!(!r.detail.is_empty(), "{flow}");
    }
    let stored = consumer.get_flow("S").await.inbox;
    assert_eq!(
        stored[0].body,
        r#"{"event_id":"S1","flow_id":"S","kind":"reserved","payload":{"whatever":true},"schema":9,"seq":1}"#
    );
    assert_eq!((stored[0].state.as_str(), stored[0].reason.as_str()), ("blocked", "unsupported_schema"));
    let reasons: Vec<_> = db::inbox(&consumer.db).into_iter().filter_map(|r| r.reason).collect();
    assert_eq!(
        reasons,
        ["invalid_transition", "invalid_transition", "invalid_payload", "unsupported_schema"]
    );
}

/// Request limits are INVALID_ARGUMENT naming the field; LIMIT stops after max_steps; the
/// operator's ListStuck names each waiting flow's reason and counts.
#[tokio::test]
async fn limits_and_list_stuck() {
    let Some(work) = Workdir::for_test() else { return };
    let consumer = Consumer::start(&work, false, &[]);
    let mut client = consumer.client().await;
    for (field, status) in [
        ("max_steps", client.apply(pb::ApplyRequest { flow_id: "L".into(), max_steps: 100_001 }).await),
        ("flow_id", client.apply(pb::ApplyRequest { flow_id: String::new(), max_steps: 0 }).await),
    ] {
        let status = status.expect_err(field);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    let status = client.apply_all(pb::ApplyAllRequest { max_steps: 100_001 }).await.expect_err("max_steps");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let status = client.list_stuck(pb::ListStuckRequest { limit: 10_001 }).await.expect_err("limit");
    assert!(status.message().starts_with("limit"), "{}", status.message());
    let status = client.get_flow(pb::GetFlowRequest { flow_id: String::new() }).await.expect_err("flow_id");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // B: blocked at 1; G: gap at 2; L: 3 ready rows, limited to 1 step; D: done.
    let g = reference_envelopes("G");
    accept(&consumer, vec![envelope("B", 1, "reserved", 2, r#"{"units":3}"#), g[0].clone(), g[2].clone()])
        .await;
    accept(&consumer, reference_envelopes("L")).await;
    accept(&consumer, reference_envelopes("D")).await;
    let r = client
        .apply(pb::ApplyRequest { flow_id: "L".into(), max_steps: 1 })
        .await
        .expect("Apply")
        .into_inner();
    assert_eq!((r.applied, stop(&r), projection(&r).0), (1, ApplyStop::Limit, 1), "{r:?}");
    for flow in ["B", "G", "D"] {
        consumer.apply(flow).await;
    }
    let stuck = consumer.list_stuck(0).await;
    assert_eq!(stuck.unapplied_rows, 4, "{stuck:?}");
    let view: Vec<_> = stuck
        .flows
        .iter()
        .map(|f| {
            (
                f.flow_id.as_str(),
                ApplyStop::try_from(f.why).expect("why"),
                f.last_seq,
                f.waiting_rows,
                f.waiting_for_seq,
                f.blocked_seq,
                f.blocked_event_id.as_str(),
                BlockReason::try_from(f.reason).expect("reason"),
            )
        })
        .collect();
    assert_eq!(
        view,
        [
            ("B", ApplyStop::Blocked, 0, 1, 0, 1, "B1", BlockReason::UnsupportedSchema),
            ("G", ApplyStop::Gap, 1, 1, 2, 0, "", BlockReason::Unspecified),
            ("L", ApplyStop::Limit, 1, 2, 0, 0, "", BlockReason::Unspecified),
        ]
    );
    let first = consumer.list_stuck(1).await;
    assert_eq!((first.flows.len(), first.unapplied_rows), (1, 4));
}

/// `--version`, `--help`, and one clear line for a file that is not a consumer database.
#[test]
fn binary_flags_and_startup_errors() {
    let deadline = Duration::from_secs(30);
    let version = run_to_exit("consumer", &["--version"], &[], deadline);
    assert_eq!(version.code, Some(0));
    assert!(version.stdout.starts_with("consumer "), "{version:?}");
    let help = run_to_exit("consumer", &["--help"], &[], deadline);
    for needle in ["--support-v2", "ORDERED_EVENTS_SUPPORT_V2", "ORDERED_EVENTS_CONSUMER_DB", "--listen"] {
        assert!(help.stdout.contains(needle), "{needle} missing from --help");
    }

    let Some(mut work) = Workdir::for_test() else { return };
    // A database that says it belongs to a producer.
    let other = work.other_db("other.db");
    let (setup, says) = match &other {
        Target::Sqlite(_) => (
            format!("PRAGMA application_id = {}; CREATE TABLE t(x);", proto::db::PRODUCER_APPLICATION_ID),
            "not a consumer database (it is a producer database)",
        ),
        Target::Postgres(_) => (
            "CREATE SCHEMA ordered_events_consumer;
             CREATE TABLE ordered_events_consumer.meta(id INTEGER PRIMARY KEY, kind TEXT NOT NULL,
                 schema_version INTEGER NOT NULL, database_id TEXT NOT NULL, created_at_us BIGINT NOT NULL);
             INSERT INTO ordered_events_consumer.meta VALUES (1, 'producer', 1, 'x', 0);"
                .to_owned(),
            "is not a consumer schema (it says it is a producer schema)",
        ),
    };
    db::execute(&other, &setup);
    let other = other.arg();
    let refused = run_to_exit("consumer", &["--db", &other, "--listen", "127.0.0.1:0"], &[], deadline);
    assert_eq!(refused.code, Some(1), "{refused:?}");
    assert!(refused.stdout.is_empty(), "{refused:?}");
    let lines: Vec<&str> = refused.stderr.lines().filter(|l| l.starts_with("consumer: error:")).collect();
    assert_eq!(lines.len(), 1, "{}", refused.stderr);
    assert!(lines[0].contains(says), "{}", lines[0]);
    assert!(!refused.stderr.contains("panicked"), "{}", refused.stderr);

    let armed = run_to_exit(
        "consumer",
        &["--db", &work.consumer_db().arg(), "--listen", "127.0.0.1:0"],
        &[("ORDERED_EVENTS_CRASH_AT", "consumer.nowhere")],
        deadline,
    );
    assert_eq!(armed.code, Some(1), "{armed:?}");
    assert!(armed.stderr.contains("is not a crash point"), "{}", armed.stderr);
}

/// Health reports SERVING; SIGTERM ends an open Receive stream after its answers and the
/// process exits 0. (Multi-threaded: the client's connection tasks must keep running while
/// the test thread waits for the exit, or the server would wait on a frozen client.)
#[tokio::test(flavor = "multi_thread")]
async fn health_and_clean_shutdown_with_an_open_stream() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let Some(work) = Workdir::for_test() else { return };
    let mut consumer = Consumer::start(&work, false, &[]);
    let mut health = HealthClient::new(harness::proc::connect(&consumer.process.url()).await);
    let status = health
        .check(HealthCheckRequest { service: "ordered_events.v1.Consumer".into() })
        .await
        .expect("health check")
        .into_inner();
    assert_eq!(status.status, ServingStatus::Serving as i32);

    let (sender, requests) = tokio::sync::mpsc::channel(4);
    let mut client = consumer.client().await;
    let mut answers = client
        .receive(tokio_stream::wrappers::ReceiverStream::new(requests))
        .await
        .expect("Receive call")
        .into_inner();
    sender.send(reference_envelopes("A")[0].clone()).await.expect("send");
    let first = answers.message().await.expect("answer").expect("one answer");
    assert_eq!(ReceiveOutcome::try_from(first.outcome), Ok(ReceiveOutcome::Accepted));
    // The client keeps its half open; shutdown must not wait for it.
    let status = consumer.process.terminate(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", consumer.process.log_text());
    assert!(!matches!(answers.message().await, Ok(Some(_))), "no answer without an envelope");
    drop(sender);
    assert_eq!(db::inbox(&consumer.db).len(), 1);
}
