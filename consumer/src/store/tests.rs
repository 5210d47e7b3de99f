//! The store's behaviour through [`ConsumerStore`], run on BOTH backends: a fresh SQLite file
//! and a fresh PostgreSQL database per test (skipped loudly when no server is reachable,
//! failing instead when `ORDERED_EVENTS_REQUIRE_PG=1`).

use std::sync::Arc;

use proto::flow::FlowState;
use proto::pb;
use proto::pg::testing::{TestDb, most_rows_a_scan_read};
use proto::target::DbTarget;

use super::*;
use crate::apply::{self, ApplyOptions, Stop};
use crate::receive::StreamState;

/// What keeps a test's database alive (dropped at the end of the test: the file is removed,
/// the PostgreSQL database dropped).
enum Keep {
    Sqlite(#[allow(dead_code)] tempfile::TempDir),
    Pg(#[allow(dead_code)] TestDb),
}

/// A store per backend, each on a fresh database.
async fn stores(label: &str) -> Vec<(ConsumerStore, Keep)> {
    let mut out = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    let target = DbTarget::Sqlite(dir.path().join("c.db"));
    out.push((ConsumerStore::open(&target).await.unwrap(), Keep::Sqlite(dir)));
    if let Some(db) = TestDb::create(label) {
        let target: DbTarget = db.url().parse().unwrap();
        out.push((ConsumerStore::open(&target).await.unwrap(), Keep::Pg(db)));
    }
    out
}

impl ConsumerStore {
    /// Runs backend-specific SQL (triggers, hand edits).
    async fn exec(&self, sqlite: &str, pg: &str) {
        match self {
            ConsumerStore::Sqlite(s) => s.execute_batch(sqlite),
            ConsumerStore::Postgres(p) => p.execute_batch(pg).await,
        }
    }
}

/// A PL/pgSQL trigger function raising `message` for the rows `when` names (a condition on
/// `NEW`; subqueries allowed, as a trigger's own WHEN does not), and its trigger.
fn pg_reject(table: &str, when: &str, message: &str) -> String {
    format!(
        "CREATE FUNCTION reject_{table}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF {when} THEN RAISE EXCEPTION '{message}'; END IF; RETURN NEW; END $$;
         CREATE TRIGGER reject_{table} BEFORE INSERT ON {table} FOR EACH ROW
         EXECUTE FUNCTION reject_{table}();"
    )
}

fn sqlite_reject(table: &str, when: &str, message: &str) -> String {
    format!(
        "CREATE TRIGGER reject_{table} BEFORE INSERT ON {table} WHEN {when}
         BEGIN SELECT RAISE(ABORT, '{message}'); END;"
    )
}

fn event(id: &str, flow: &str, seq: u64, kind: &str, schema: u32, payload: &str) -> Event {
    let env = pb::EventEnvelope {
        event_id: id.into(),
        flow_id: flow.into(),
        seq,
        kind: kind.into(),
        schema,
        payload_json: payload.into(),
        committed_at_us: None,
    };
    proto::limits::check_envelope(&env).unwrap()
}

const V1: &str = r#"{"amount":3}"#;

fn reference(flow: &str, seq: u64) -> Event {
    let kind = ["reserved", "confirmed", "released"][seq as usize - 1];
    event(&format!("{flow}{seq}"), flow, seq, kind, 1, V1)
}

fn ctx(admission: Admission) -> ReceiveContext {
    ReceiveContext { crash: CrashSwitch::default(), admission, storage: None, applied_next: false }
}

/// One batch of events on one stream each (or `stream` for all when given).
async fn batch(
    store: &ConsumerStore,
    events: Vec<(Event, Arc<StreamState>)>,
    admission: Admission,
) -> Vec<String> {
    let incoming =
        events.into_iter().map(|(event, stream)| Incoming { event, committed_at_us: None, stream }).collect();
    store
        .receive_batch(Arc::new(incoming), ctx(admission))
        .await
        .into_iter()
        .map(|a| match a {
            None => "Skipped".to_owned(),
            Some(Ok(r)) => format!("{:?}", r.outcome),
            Some(Err(e)) => format!("{:?}: {e}", e.status("receive").code()),
        })
        .collect()
}

async fn receive_one(store: &ConsumerStore, e: Event, admission: Admission) -> Received {
    let incoming =
        vec![Incoming { event: e, committed_at_us: None, stream: Arc::new(StreamState::default()) }];
    let mut answers = store.receive_batch(Arc::new(incoming), ctx(admission)).await;
    answers.pop().flatten().unwrap().unwrap()
}

async fn receive(store: &ConsumerStore, e: Event) -> ReceiveOutcome {
    receive_one(store, e, Admission::Unlimited).await.outcome
}

async fn receive_capped(store: &ConsumerStore, e: Event, cap: u64) -> ReceiveOutcome {
    receive_one(store, e, Admission::Cap(cap)).await.outcome
}

#[tokio::test(flavor = "multi_thread")]
async fn receive_outcomes_and_positions() {
    for (store, _keep) in stores("c_receive_outcomes").await {
        let b = store.backend();
        assert_eq!(store.identity().await.unwrap().highest_position, 0, "{b}");
        let first = receive_one(&store, reference("A", 1), Admission::Unlimited).await;
        assert_eq!(first.outcome, ReceiveOutcome::Accepted, "{b}");
        assert!(first.position >= 1, "{b}");
        let again = receive_one(&store, reference("A", 1), Admission::Unlimited).await;
        assert_eq!((again.outcome, again.position), (ReceiveOutcome::Duplicate, first.position), "{b}");
        let changed = event("A1", "A", 1, "reserved", 1, r#"{"amount":4}"#);
        assert_eq!(receive(&store, changed).await, ReceiveOutcome::IdConflict, "{b}");
        let other_id = Event { event_id: "X".into(), ..reference("A", 1) };
        assert_eq!(
            receive(&store, other_id).await,
            ReceiveOutcome::SequenceConflict { held_by: "A1".into() },
            "{b}"
        );
        // A kind and schema this build does not know are stored, body byte for byte.
        let unknown = event("A2", "A", 2, "teleported", 77, r#"{"who":"knows"}"#);
        let second = receive_one(&store, unknown.clone(), Admission::Unlimited).await;
        assert_eq!(second.outcome, ReceiveOutcome::Accepted, "{b}");
        assert!(second.position > first.position, "{b}: arrival order");
        let view = store.flow("A".into()).await.unwrap();
        assert_eq!(view.inbox.len(), 2, "{b}");
        assert_eq!(view.inbox[1].body, unknown.canonical_body(), "{b}");
        assert!(view.inbox.iter().all(|r| r.state == InboxState::Pending && r.reason.is_none()), "{b}");
        let identity = store.identity().await.unwrap();
        assert_eq!(identity.highest_position, second.position, "{b}");
        assert!(!identity.database_id.is_empty(), "{b}");
        assert_eq!(store.identity().await.unwrap().database_id, identity.database_id, "{b}");
    }
}

/// Identify's probes: a position holding the probed event is held (a tombstone too); one
/// holding another event, or none, is not; answers come in the probes' order.
#[tokio::test(flavor = "multi_thread")]
async fn identify_answers_each_probe_by_position_and_event() {
    for (store, _keep) in stores("c_identify_probes").await {
        let b = store.backend();
        let (identity, held) = store.identify(Vec::new()).await.unwrap();
        assert!(held.is_empty(), "{b}");
        assert_eq!(identity.highest_position, 0, "{b}");
        let a1 = receive_one(&store, reference("A", 1), Admission::Unlimited).await.position;
        let b1 = receive_one(&store, reference("B", 1), Admission::Unlimited).await.position;
        // A1 applied and compacted to a tombstone; B1 pending with its body.
        assert_eq!(apply(&store, "A", 10, ApplyOptions::default()).await.applied.len(), 1, "{b}");
        let report = store.compact(runtime::now_us() + 1, CrashSwitch::default(), 0).await.unwrap();
        assert_eq!(report.compacted, 1, "{b}: {report:?}");
        assert!(store.flow("A".into()).await.unwrap().inbox[0].compacted.is_some(), "{b}: a tombstone");
        let probes = vec![
            (b1, "B1".to_owned()),
            (a1, "A1".to_owned()),
            // The position holds another event (a restored inbox gave it away).
            (b1, "X1".to_owned()),
            // No row at the position, and one past any BIGINT.
            (b1 + 100, "B1".to_owned()),
            (u64::MAX, "A1".to_owned()),
        ];
        let (identity, held) = store.identify(probes).await.unwrap();
        assert_eq!(held, [true, true, false, false, false], "{b}");
        assert_eq!(identity.highest_position, b1, "{b}");
        assert_eq!(identity, store.identity().await.unwrap(), "{b}");
    }
}

/// Duplicates inside one batch get exactly the answers one transaction each would give.
#[tokio::test(flavor = "multi_thread")]
async fn duplicates_within_a_batch_answer_as_if_sequential() {
    for (store, _keep) in stores("c_batch_duplicates").await {
        let s = Arc::new(StreamState::default());
        let events = vec![
            (event("A1", "A", 1, "reserved", 1, V1), Arc::clone(&s)),
            (event("A1", "A", 1, "reserved", 1, V1), Arc::clone(&s)),
            (event("A1", "A", 1, "reserved", 1, r#"{"amount":4}"#), Arc::clone(&s)),
            (event("X", "A", 1, "reserved", 1, V1), Arc::clone(&s)),
            (event("B1", "B", 1, "reserved", 1, V1), Arc::clone(&s)),
        ];
        assert_eq!(
            batch(&store, events, Admission::Unlimited).await,
            ["Accepted", "Duplicate", "IdConflict", "SequenceConflict { held_by: \"A1\" }", "Accepted"],
            "{}",
            store.backend()
        );
        assert_eq!(store.flow("A".into()).await.unwrap().inbox.len(), 1);
        assert_eq!(store.flow("B".into()).await.unwrap().inbox.len(), 1);
        assert!(!s.failed());
    }
}

/// An envelope whose insert a trigger rejects rolls back alone and fails its own stream:
/// that stream's later envelopes are not stored; other streams' envelopes commit.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_envelope_fails_only_its_stream() {
    for (store, _keep) in stores("c_failing_envelope").await {
        let b = store.backend();
        store
            .exec(
                &sqlite_reject("inbox", "NEW.flow_id = 'B'", "inbox insert rejected"),
                &pg_reject("inbox", "NEW.flow_id = 'B'", "inbox insert rejected"),
            )
            .await;
        let (one, two) = (Arc::new(StreamState::default()), Arc::new(StreamState::default()));
        let events = vec![
            (reference("A", 1), Arc::clone(&one)),
            (reference("B", 1), Arc::clone(&one)),
            (reference("C", 1), Arc::clone(&one)),
            (reference("D", 1), Arc::clone(&two)),
        ];
        let words = batch(&store, events, Admission::Unlimited).await;
        assert_eq!(words[0], "Accepted", "{b}");
        assert!(
            words[1].starts_with("Internal") && words[1].contains("inbox insert rejected"),
            "{b}: {words:?}"
        );
        assert_eq!(words[2..], ["Skipped", "Accepted"], "{b}");
        assert!(one.failed() && !two.failed(), "{b}");
        for (flow, rows) in [("A", 1), ("B", 0), ("C", 0), ("D", 1)] {
            assert_eq!(store.flow(flow.into()).await.unwrap().inbox.len(), rows, "{b} {flow}");
        }
        assert_eq!(store.unapplied_count().await.unwrap(), 2, "{b}");
    }
}

async fn apply(store: &ConsumerStore, flow: &str, max_steps: u32, opts: ApplyOptions) -> apply::ApplyReport {
    apply::apply_flow(store, flow, max_steps, opts).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn apply_takes_exactly_the_next_seq_gaps_limits_and_idle() {
    for (store, _keep) in stores("c_apply_order").await {
        let b = store.backend();
        let v1 = ApplyOptions::default();
        receive(&store, reference("A", 3)).await;
        let r = apply(&store, "A", 10, v1).await;
        assert_eq!((r.applied.len(), r.stop), (0, Stop::Gap { waiting_for_seq: 1 }), "{b}");
        receive(&store, reference("A", 1)).await;
        receive(&store, reference("A", 2)).await;
        let r = apply(&store, "A", 1, v1).await;
        assert_eq!((r.applied, r.stop), (vec!["A1".to_owned()], Stop::Limit), "{b}");
        let r = apply(&store, "A", 10, v1).await;
        assert_eq!((r.applied, r.stop), (vec!["A2".to_owned(), "A3".to_owned()], Stop::Idle), "{b}");
        assert_eq!(
            r.projection,
            Projection { last_seq: 3, state: FlowState::Released, held: 0, amount: 3 },
            "{b}"
        );
        let r = apply(&store, "A", 10, v1).await;
        assert_eq!((r.applied.len(), r.stop), (0, Stop::Idle), "{b}");
        let view = store.flow("A".into()).await.unwrap();
        assert_eq!(view.effects.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3], "{b}");
        assert!(view.inbox.iter().all(|r| r.state == InboxState::Applied), "{b}");
        assert_eq!(store.unapplied_count().await.unwrap(), 0, "{b}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn blocked_rows_wait_for_the_v2_decoder_and_keep_their_bodies() {
    for (store, _keep) in stores("c_apply_v2").await {
        let b = store.backend();
        receive(&store, reference("A", 1)).await;
        let v2_event = event("A2", "A", 2, "confirmed", 2, r#"{"units":3}"#);
        receive(&store, v2_event.clone()).await;
        let r = apply(&store, "A", 10, ApplyOptions::default()).await;
        assert_eq!(r.applied, ["A1"], "{b}");
        assert!(
            matches!(&r.stop, Stop::Blocked { event_id, reason: BlockReason::UnsupportedSchema, .. } if event_id == "A2"),
            "{b}: {:?}",
            r.stop
        );
        let rows = store.flow("A".into()).await.unwrap().inbox;
        assert_eq!(
            (rows[1].state, rows[1].reason),
            (InboxState::Blocked, Some(BlockReason::UnsupportedSchema))
        );
        let (stuck, total) = store.backlog(10).await.unwrap();
        assert_eq!((stuck.len(), total), (1, 1), "{b}");
        assert_eq!((stuck[0].lowest.seq, stuck[0].lowest.reason), (2, Some(BlockReason::UnsupportedSchema)));
        assert_eq!(stuck[0].projection.last_seq, 1, "{b}");
        let v2 = ApplyOptions { support_v2: true, ..ApplyOptions::default() };
        let r = apply(&store, "A", 10, v2).await;
        assert_eq!((r.applied, r.stop), (vec!["A2".to_owned()], Stop::Idle), "{b}");
        let rows = store.flow("A".into()).await.unwrap().inbox;
        assert_eq!((rows[1].state, rows[1].reason), (InboxState::Applied, None), "{b}");
        assert_eq!(rows[1].body, v2_event.canonical_body(), "{b}: the body is never edited");
        assert_eq!(store.backlog(10).await.unwrap().1, 0, "{b}");
    }
}

/// A committed time an hour ahead: kept beside the row, never measured at apply (the
/// commit→applied histogram is global, and a test that counts it runs beside these).
fn from_the_future() -> Option<i64> {
    Some(runtime::now_us() + 3_600_000_000)
}

/// One batch on one stream, received as auto-apply receives it (to be applied next), the
/// rows committed at `committed_at_us`: the outcomes (`None` for a failed envelope) and the
/// batch's events.
async fn receive_to_apply(
    store: &ConsumerStore,
    events: &[Event],
    committed_at_us: Option<i64>,
) -> (Vec<Option<ReceiveOutcome>>, BatchEvents) {
    let stream = Arc::new(StreamState::default());
    let incoming: Vec<Incoming> = events
        .iter()
        .map(|e| Incoming { event: e.clone(), committed_at_us, stream: Arc::clone(&stream) })
        .collect();
    let incoming = Arc::new(incoming);
    let applied_next = ReceiveContext { applied_next: true, ..ctx(Admission::Unlimited) };
    let answers = store.receive_batch(Arc::clone(&incoming), applied_next).await;
    let outcomes = answers.iter().map(|a| a.clone().and_then(Result::ok).map(|r| r.outcome)).collect();
    (outcomes, BatchEvents::new(incoming, &answers))
}

/// Auto-apply's path: the flows a batch touched, applied with the batch's events
/// ([`BatchEvents`]) and, on SQLite, with what the batch's transaction knew of them. Rows
/// the batch holds (accepted, and a duplicate of an earlier row), rows stored before it
/// (which the step reads), and flows whose every unapplied row is the batch's (new ones,
/// one applied before, one interleaved with others) end exactly as with a plain apply: in
/// seq order, blocked on a schema the consumer cannot read, stopped at a gap, counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_applied_with_its_events_ends_as_a_plain_apply() {
    for (store, _keep) in stores("c_apply_received").await {
        let b = store.backend();
        let v1 = ApplyOptions::default();
        // Stored before the batch: A1 (applied by the batch's run), B3 (past B's gap), C1,
        // and E1, applied.
        for e in [reference("A", 1), reference("B", 3), reference("C", 1), reference("E", 1)] {
            receive(&store, e).await;
        }
        assert_eq!(apply(&store, "E", 10, v1).await.applied, ["E1"], "{b}");
        let batch = [
            reference("A", 2),
            reference("D", 1),
            reference("A", 3),
            reference("C", 1),
            reference("D", 2),
            event("C2", "C", 2, "confirmed", 2, r#"{"units":3}"#),
            reference("E", 3),
            reference("B", 1),
            reference("E", 2),
            reference("D", 3),
        ];
        let committed_at_us = from_the_future();
        let (outcomes, events) = receive_to_apply(&store, &batch, committed_at_us).await;
        let mut expected = vec![Some(ReceiveOutcome::Accepted); batch.len()];
        expected[3] = Some(ReceiveOutcome::Duplicate);
        assert_eq!(outcomes, expected, "{b}");
        let flows = ["A", "B", "C", "D", "E"].map(str::to_owned).to_vec();
        let results = store.apply_received(flows, events, 1000, v1).await;
        let reports: Vec<_> = results.into_iter().map(|r| r.outcome.unwrap()).collect();
        let ids = |ids: &[&str]| ids.iter().map(|id| id.to_string()).collect::<Vec<_>>();
        assert_eq!((&reports[0].applied, &reports[0].stop), (&ids(&["A1", "A2", "A3"]), &Stop::Idle), "{b}");
        assert_eq!(reports[0].projection.state, FlowState::Released, "{b}");
        assert_eq!(
            (&reports[1].applied, &reports[1].stop),
            (&ids(&["B1"]), &Stop::Gap { waiting_for_seq: 2 }),
            "{b}"
        );
        assert_eq!(reports[2].applied, ["C1"], "{b}");
        assert!(
            matches!(&reports[2].stop, Stop::Blocked { event_id, reason: BlockReason::UnsupportedSchema, .. } if event_id == "C2"),
            "{b}: {:?}",
            reports[2].stop
        );
        assert_eq!((&reports[3].applied, &reports[3].stop), (&ids(&["D1", "D2", "D3"]), &Stop::Idle), "{b}");
        assert_eq!((&reports[4].applied, &reports[4].stop), (&ids(&["E2", "E3"]), &Stop::Idle), "{b}");
        for flow in ["A", "D", "E"] {
            let view = store.flow(flow.into()).await.unwrap();
            assert_eq!(view.effects.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3], "{b} {flow}");
            assert_eq!(view.projection.state, FlowState::Released, "{b} {flow}");
            assert_eq!(view.inbox[1].body, reference(flow, 2).canonical_body(), "{b} {flow}");
        }
        let d2 = &store.flow("D".into()).await.unwrap().inbox[1];
        assert_eq!((d2.state, d2.committed_at_us), (InboxState::Applied, committed_at_us), "{b}");
        // B3 and C2 wait: one flow at a gap, one blocked.
        assert_eq!(store.unapplied_count().await.unwrap(), 2, "{b}");
        assert_exact(&store, "after the batch's apply").await;
    }
}

/// What a Receive transaction knew is used only while nothing was written after it: here an
/// applier without the v2 decoder blocks the batch's row in between (through the same store,
/// then through another store on the same database, as a second process would), and the
/// batch's apply, with the decoder, applies it. Taken as known, the row would have been
/// pending: its blocked count would never come down, and the counts would drift.
#[tokio::test(flavor = "multi_thread")]
async fn what_a_batch_knew_is_not_taken_after_another_write() {
    for (store, _keep) in stores("c_apply_received_stale").await {
        let b = store.backend();
        let (v1, v2) =
            (ApplyOptions::default(), ApplyOptions { support_v2: true, ..ApplyOptions::default() });
        let other = match &store {
            ConsumerStore::Sqlite(s) => {
                ConsumerStore::open(&DbTarget::Sqlite(s.path().to_owned())).await.unwrap()
            }
            ConsumerStore::Postgres(_) => store.clone(),
        };
        for (flow, applier) in [("H", &store), ("K", &other)] {
            let v2_row = event(&format!("{flow}1"), flow, 1, "reserved", 2, r#"{"units":3}"#);
            let (outcomes, events) = receive_to_apply(&store, &[v2_row], None).await;
            assert_eq!(outcomes, [Some(ReceiveOutcome::Accepted)], "{b} {flow}");
            let blocked = apply(applier, flow, 10, v1).await;
            assert!(matches!(blocked.stop, Stop::Blocked { .. }), "{b} {flow}: {:?}", blocked.stop);
            assert_eq!(store.backlog_counts().await.unwrap().blocked[0], 1, "{b} {flow}");
            let results = store.apply_received(vec![flow.to_owned()], events, 1000, v2).await;
            let report = results[0].outcome.as_ref().unwrap();
            assert_eq!((report.applied.len(), &report.stop), (1, &Stop::Idle), "{b} {flow}");
            let counts = assert_exact(&store, &format!("after {flow}")).await;
            assert_eq!((counts.ready, counts.gap, counts.blocked), (0, 0, [0; 3]), "{b} {flow}");
        }
    }
}

/// A flow named twice in one call, with rows past its last valid step, and a flow with a
/// gap: each run of a flow finds what the one before left (the rows an apply transaction
/// reads ahead are not carried from one run to the next), whatever the batch size.
#[tokio::test(flavor = "multi_thread")]
async fn a_flow_named_twice_finds_what_its_first_run_left() {
    for max_batch in [1, 2, 256] {
        for (store, _keep) in stores(&format!("c_apply_twice_{max_batch}")).await {
            let b = store.backend();
            for seq in 1..=3 {
                receive(&store, reference("D", seq)).await;
            }
            receive(&store, event("D4", "D", 4, "released", 1, V1)).await;
            receive(&store, event("D5", "D", 5, "released", 1, V1)).await;
            receive(&store, reference("E", 1)).await;
            receive(&store, reference("E", 3)).await;
            let opts = ApplyOptions { max_batch, ..ApplyOptions::default() };
            let flows = ["D", "E", "D", "E"].map(str::to_owned).to_vec();
            let runs: Vec<String> = store
                .apply_flows(flows, 1000, opts)
                .await
                .into_iter()
                .map(|r| {
                    let report = r.outcome.unwrap();
                    format!("{} {:?} {:?}", r.flow_id, report.applied, report.stop)
                })
                .collect();
            let blocked_d4 = |run: &str| run.contains("D4") && run.contains("InvalidTransition");
            assert!(
                runs[0].starts_with(r#"D ["D1", "D2", "D3"] Blocked"#) && blocked_d4(&runs[0]),
                "{b}: {runs:?}"
            );
            assert_eq!(runs[1], r#"E ["E1"] Gap { waiting_for_seq: 2 }"#, "{b}: {runs:?}");
            assert!(runs[2].starts_with("D [] Blocked") && blocked_d4(&runs[2]), "{b}: {runs:?}");
            assert_eq!(runs[3], "E [] Gap { waiting_for_seq: 2 }", "{b}: {runs:?}");
            let d = store.flow("D".into()).await.unwrap();
            assert_eq!(d.projection.last_seq, 3, "{b}");
            let states: Vec<(u64, InboxState)> = d.inbox.iter().map(|r| (r.seq, r.state)).collect();
            assert_eq!(
                states,
                [
                    (1, InboxState::Applied),
                    (2, InboxState::Applied),
                    (3, InboxState::Applied),
                    (4, InboxState::Blocked),
                    (5, InboxState::Pending)
                ],
                "{b}"
            );
            assert_eq!(store.flow("E".into()).await.unwrap().projection.last_seq, 1, "{b}");
            // One step per run: each run stops at its limit with the flow's next row read.
            for seq in 1..=3 {
                receive(&store, reference("F", seq)).await;
            }
            let runs: Vec<String> = store
                .apply_flows(vec!["F".to_owned(); 4], 1, opts)
                .await
                .into_iter()
                .map(|r| format!("{:?}", r.outcome.unwrap().applied))
                .collect();
            assert_eq!(runs, [r#"["F1"]"#, r#"["F2"]"#, r#"["F3"]"#, "[]"], "{b}");
        }
    }
}

/// A trigger that rejects the effect insert leaves no partial state: the projection write
/// of the same step rolls back with it, and the call reports the storage failure.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_effect_insert_leaves_no_partial_state() {
    for (store, _keep) in stores("c_effect_trigger").await {
        let b = store.backend();
        for seq in 1..=2 {
            receive(&store, reference("A", seq)).await;
        }
        store
            .exec(
                &sqlite_reject(
                    "effect_log",
                    "(SELECT seq FROM inbox WHERE rowid = NEW.position) = 2",
                    "effects frozen",
                ),
                &pg_reject(
                    "effect_log",
                    "(SELECT seq FROM inbox WHERE position = NEW.position) = 2",
                    "effects frozen",
                ),
            )
            .await;
        let failure = apply::apply_flow(&store, "A", 10, ApplyOptions::default()).await.unwrap_err();
        assert_eq!(failure.applied, ["A1"], "{b}: the step before stays committed");
        let status = failure.source.status("apply A");
        assert_eq!(status.code(), tonic::Code::Internal, "{b}");
        assert!(status.message().contains("effects frozen"), "{b}: {status:?}");
        let view = store.flow("A".into()).await.unwrap();
        assert_eq!(view.projection.last_seq, 1, "{b}");
        assert_eq!(view.projection.state, FlowState::Reserved, "{b}");
        assert_eq!(view.effects.len(), 1, "{b}");
        assert_eq!(view.inbox[1].state, InboxState::Pending, "{b}");
        assert_eq!(store.unapplied_count().await.unwrap(), 1, "{b}");
    }
}

/// A step whose projection write fails fails alone, also where a direct run holds a flow's
/// projection write back to its last step (SQLite): the steps before it and the other flows
/// of the group stay applied.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_projection_write_fails_only_its_step() {
    for (store, _keep) in stores("c_projection_trigger").await {
        let b = store.backend();
        for flow in ["A", "B", "C"] {
            for seq in 1..=3 {
                receive(&store, reference(flow, seq)).await;
            }
        }
        store
            .exec(
                "CREATE TRIGGER frozen_insert BEFORE INSERT ON projection
                     WHEN NEW.flow_id = 'B' AND NEW.last_seq = 3
                 BEGIN SELECT RAISE(ABORT, 'projection frozen'); END;
                 CREATE TRIGGER frozen_update BEFORE UPDATE ON projection
                     WHEN NEW.flow_id = 'B' AND NEW.last_seq = 3
                 BEGIN SELECT RAISE(ABORT, 'projection frozen'); END;",
                "CREATE FUNCTION frozen() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN RAISE EXCEPTION 'projection frozen'; END $$;
                 CREATE TRIGGER frozen BEFORE INSERT OR UPDATE ON projection FOR EACH ROW
                     WHEN (NEW.flow_id = 'B' AND NEW.last_seq = 3) EXECUTE FUNCTION frozen();",
            )
            .await;
        let flows = ["A", "B", "C"].map(str::to_owned).to_vec();
        let results = store.apply_flows(flows, 1000, ApplyOptions::default()).await;
        let applied: Vec<_> = results
            .iter()
            .map(|r| match &r.outcome {
                Ok(report) => (report.applied.clone(), None),
                Err(f) => (f.applied.clone(), Some(f.source.to_string().contains("projection frozen"))),
            })
            .collect();
        let ids = |ids: &[&str]| ids.iter().map(|id| id.to_string()).collect::<Vec<_>>();
        assert_eq!(
            applied,
            [
                (ids(&["A1", "A2", "A3"]), None),
                (ids(&["B1", "B2"]), Some(true)),
                (ids(&["C1", "C2", "C3"]), None)
            ],
            "{b}"
        );
        for (flow, last_seq, effects) in [("A", 3, 3), ("B", 2, 2), ("C", 3, 3)] {
            let view = store.flow(flow.into()).await.unwrap();
            assert_eq!(view.projection.last_seq, last_seq, "{b} {flow}");
            assert_eq!(view.effects.len(), effects, "{b} {flow}");
            let states: Vec<_> = view.inbox.iter().map(|r| r.state).collect();
            let expected: Vec<_> = (1..=3)
                .map(|seq| if seq <= last_seq { InboxState::Applied } else { InboxState::Pending })
                .collect();
            assert_eq!(states, expected, "{b} {flow}");
        }
        assert_eq!(store.unapplied_count().await.unwrap(), 1, "{b}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_backlog_refuses_new_work_but_admits_the_awaited_seq() {
    for (store, _keep) in stores("c_backlog_cap").await {
        let b = store.backend();
        assert_eq!(receive_capped(&store, reference("A", 1), 3).await, ReceiveOutcome::Accepted);
        apply(&store, "A", 1, ApplyOptions::default()).await;
        // A waits for seq 2 behind seq 3; B and C fill the backlog to its cap of 3.
        for e in [reference("A", 3), reference("B", 1), reference("C", 1)] {
            assert_eq!(receive_capped(&store, e, 3).await, ReceiveOutcome::Accepted, "{b}");
        }
        assert_eq!(store.unapplied_count().await.unwrap(), 3, "{b}");
        // A new flow's first event and a non-next seq are refused; nothing is stored.
        assert_eq!(
            receive_capped(&store, reference("D", 1), 3).await,
            ReceiveOutcome::BacklogFull { unapplied: 3 }
        );
        assert_eq!(
            receive_capped(&store, reference("B", 2), 3).await,
            ReceiveOutcome::BacklogFull { unapplied: 3 }
        );
        // Duplicates are still told apart when full.
        assert_eq!(receive_capped(&store, reference("B", 1), 3).await, ReceiveOutcome::Duplicate, "{b}");
        // The seq A waits for is admitted over the cap, and the backlog drains as it applies.
        assert_eq!(receive_capped(&store, reference("A", 2), 3).await, ReceiveOutcome::Accepted, "{b}");
        assert_eq!(store.unapplied_count().await.unwrap(), 4, "{b}");
        apply(&store, "A", 10, ApplyOptions::default()).await;
        assert_eq!(store.unapplied_count().await.unwrap(), 2, "{b}");
        let (_, rows) = store.backlog(10).await.unwrap();
        assert_eq!(rows, 2, "{b}: the counter matches the rows");
        assert_eq!(receive_capped(&store, reference("D", 1), 3).await, ReceiveOutcome::Accepted, "{b}");
    }
}

/// Many flows share transactions of any size and end exactly as one transaction per step
/// would; a failing step (a bad stored body) fails its flow only.
#[tokio::test(flavor = "multi_thread")]
async fn apply_all_isolates_flows_and_failures() {
    for (store, _keep) in stores("c_apply_all").await {
        let b = store.backend();
        for (flow, seqs) in [("A", &[1, 3][..]), ("B", &[1, 2, 3][..])] {
            for &seq in seqs {
                receive(&store, reference(flow, seq)).await;
            }
        }
        receive(&store, reference("C", 1)).await;
        store
            .exec(
                "UPDATE inbox_body SET body = 'garbage'
                 WHERE position = (SELECT rowid FROM inbox WHERE event_id = 'C1')",
                "UPDATE inbox SET body = 'garbage' WHERE event_id = 'C1'",
            )
            .await;
        let opts = ApplyOptions { max_batch: 2, ..ApplyOptions::default() };
        let results = apply::apply_all(&store, 1000, opts).await.unwrap();
        let ids: Vec<&str> = results.iter().map(|r| r.flow_id.as_str()).collect();
        assert_eq!(ids, ["A", "B", "C"], "{b}");
        let a = results[0].outcome.as_ref().unwrap();
        assert_eq!(
            (a.projection.state, a.projection.held, &a.stop),
            (FlowState::Reserved, 3, &Stop::Gap { waiting_for_seq: 2 })
        );
        let bb = results[1].outcome.as_ref().unwrap();
        assert_eq!((bb.projection.state, bb.applied.len()), (FlowState::Released, 3), "{b}");
        let c = results[2].outcome.as_ref().unwrap_err();
        assert!(c.to_string().contains("inconsistent"), "{b}: {c}");
        assert_eq!(store.flows_with_unapplied(String::new(), 10).await.unwrap(), ["A", "C"], "{b}");
    }
}

/// Two stores on `db` (two pools: as two consumer instances would have) and 20 reference
/// flows received through the first, none applied.
async fn two_appliers_over_20_flows(db: &TestDb) -> (ConsumerStore, ConsumerStore, Vec<String>) {
    let target: DbTarget = db.url().parse().unwrap();
    let one = ConsumerStore::open(&target).await.unwrap();
    let two = ConsumerStore::open(&target).await.unwrap();
    let flows: Vec<String> = (0..20).map(|i| format!("F{i}")).collect();
    for flow in &flows {
        for seq in 1..=3 {
            receive(&one, reference(flow, seq)).await;
        }
    }
    (one, two, flows)
}

/// Two appliers (two pools: as two consumer instances would) racing over the same flows
/// leave exactly one effect per seq, in order.
#[tokio::test(flavor = "multi_thread")]
async fn racing_appliers_apply_each_step_once() {
    let Some(db) = TestDb::create("c_apply_race") else { return };
    let (one, two, flows) = two_appliers_over_20_flows(&db).await;
    // One step per transaction (the step-by-step path), then whole groups (PostgreSQL's
    // group fast path, whose compare-and-sets must see the other applier's moves).
    let (one_step, grouped) =
        (ApplyOptions { max_batch: 1, ..ApplyOptions::default() }, ApplyOptions::default());
    let (a, b) = tokio::join!(
        one.apply_flows(flows.clone(), 1000, one_step),
        two.apply_flows(flows.clone(), 1000, grouped)
    );
    let mut applied = 0;
    for r in a.iter().chain(b.iter()) {
        let report = r.outcome.as_ref().unwrap_or_else(|e| panic!("{}: {e}", r.flow_id));
        applied += report.applied.len();
        assert_eq!(report.projection.last_seq, 3);
    }
    assert_eq!(applied, 60, "each step applied by exactly one of the two");
    for flow in &flows {
        let view = one.flow(flow.clone()).await.unwrap();
        assert_eq!(view.effects.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3], "{flow}");
    }
    assert_eq!(one.unapplied_count().await.unwrap(), 0);
}

/// PostgreSQL at retention 0: Apply compacts each row it applies in the statement that marks
/// it (the step-by-step path and the group path, racing), keeping the digest of its body, and
/// the next pass reports every row once, with its body's bytes.
#[tokio::test(flavor = "multi_thread")]
async fn pg_applies_at_retention_0_compact_what_they_apply_and_passes_count_it_once() {
    let Some(db) = TestDb::create("c_pg_compact_applied") else { return };
    let (one, two, flows) = two_appliers_over_20_flows(&db).await;
    let mut digests = std::collections::BTreeMap::new();
    let mut bytes = 0;
    for flow in &flows {
        for row in one.flow(flow.clone()).await.unwrap().inbox {
            bytes += row.body.len() as u64;
            digests.insert(row.event_id.clone(), runtime::retention::body_digest(row.body.as_bytes()));
        }
    }
    let one_step = ApplyOptions { max_batch: 1, compact_applied: true, ..ApplyOptions::default() };
    let grouped = ApplyOptions { compact_applied: true, ..ApplyOptions::default() };
    let (a, b) = tokio::join!(
        one.apply_flows(flows.clone(), 1000, one_step),
        two.apply_flows(flows.clone(), 1000, grouped)
    );
    let applied: usize = a.iter().chain(b.iter()).map(|r| r.outcome.as_ref().unwrap().applied.len()).sum();
    assert_eq!(applied, 60, "each step applied by exactly one of the two");
    for flow in &flows {
        for row in one.flow(flow.clone()).await.unwrap().inbox {
            assert!(row.body.is_empty(), "{flow}: {row:?}");
            assert_eq!(row.compacted.as_ref(), digests.get(&row.event_id), "{flow}: {row:?}");
        }
    }
    let report = one.compact(0, CrashSwitch::default(), 0).await.unwrap();
    assert_eq!((report.compacted, report.when_finished, report.body_bytes), (60, 60, bytes));
    assert_eq!(two.compact(0, CrashSwitch::default(), 0).await.unwrap().compacted, 0, "counted once");
    // Redelivered, they are duplicates at their positions.
    let again = receive_one(&one, reference("F0", 1), Admission::Unlimited).await;
    assert_eq!((again.outcome, again.position), (ReceiveOutcome::Duplicate, 1));
}

/// Two grouped appliers racing over many flows, one walking them in reverse (so their row
/// locks cross): whatever each group's compare-and-sets find, every step is applied once.
#[tokio::test(flavor = "multi_thread")]
async fn racing_group_appliers_apply_each_step_once() {
    let Some(db) = TestDb::create("c_group_race") else { return };
    let target: DbTarget = db.url().parse().unwrap();
    let one = ConsumerStore::open(&target).await.unwrap();
    let two = ConsumerStore::open(&target).await.unwrap();
    let flows: Vec<String> = (0..200).map(|i| format!("G{i:03}")).collect();
    let s = Arc::new(StreamState::default());
    let events = flows.iter().flat_map(|f| (1..=3).map(|seq| (reference(f, seq), Arc::clone(&s)))).collect();
    assert!(batch(&one, events, Admission::Unlimited).await.iter().all(|w| w == "Accepted"));
    let reversed: Vec<String> = flows.iter().rev().cloned().collect();
    let opts = ApplyOptions { max_batch: 64, ..ApplyOptions::default() };
    let (a, b) =
        tokio::join!(one.apply_flows(flows.clone(), 1000, opts), two.apply_flows(reversed, 1000, opts));
    let mut applied = 0;
    for r in a.iter().chain(b.iter()) {
        // A flow may fail only as contention (the other applier kept moving it); then the
        // other applier finished it.
        match &r.outcome {
            Ok(report) => applied += report.applied.len(),
            Err(failure) => {
                assert!(failure.source.is_retryable(), "{}: {}", r.flow_id, failure.source);
                applied += failure.applied.len();
            }
        }
    }
    assert_eq!(applied, 600, "each step applied by exactly one of the two");
    for flow in &flows {
        let view = one.flow(flow.clone()).await.unwrap();
        assert_eq!(view.effects.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3], "{flow}");
        assert_eq!(view.projection.last_seq, 3, "{flow}");
    }
    assert_eq!(one.unapplied_count().await.unwrap(), 0);
}

/// PostgreSQL: opening again finds the schema made by the first open and keeps its identity.
#[tokio::test(flavor = "multi_thread")]
async fn pg_open_is_idempotent_and_keeps_the_identity() {
    let Some(db) = TestDb::create("c_pg_open") else { return };
    let target: DbTarget = db.url().parse().unwrap();
    let first = ConsumerStore::open(&target).await.unwrap();
    let id = first.identity().await.unwrap().database_id;
    let second = ConsumerStore::open(&target).await.unwrap();
    assert_eq!(second.identity().await.unwrap().database_id, id);
    assert_eq!(second.backend(), "postgres");
}

/// A batch larger than any small-join shortcut, with a failing envelope in the middle and a
/// duplicate of an earlier one at the end: every answer is the one-by-one answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_large_batch_answers_each_envelope_in_order() {
    for (store, _keep) in stores("c_large_batch").await {
        let b = store.backend();
        store
            .exec(
                &sqlite_reject("inbox", "NEW.flow_id = 'P20'", "inbox insert rejected"),
                &pg_reject("inbox", "NEW.flow_id = 'P20'", "inbox insert rejected"),
            )
            .await;
        let mut events: Vec<(Event, Arc<StreamState>)> =
            (0..40).map(|i| (reference(&format!("P{i}"), 1), Arc::new(StreamState::default()))).collect();
        events.push((reference("P5", 1), Arc::new(StreamState::default())));
        events.push((reference("P20", 1), Arc::new(StreamState::default())));
        let words = batch(&store, events, Admission::Unlimited).await;
        for (i, word) in words.iter().enumerate() {
            let expected = match i {
                20 | 41 => "Internal",
                40 => "Duplicate",
                _ => "Accepted",
            };
            assert!(word.starts_with(expected), "{b}: envelope {i}: {word}");
        }
        assert_eq!(store.unapplied_count().await.unwrap(), 39, "{b}");
        for i in [0, 19, 21, 39] {
            assert_eq!(store.flow(format!("P{i}")).await.unwrap().inbox.len(), 1, "{b}: P{i}");
        }
        assert!(store.flow("P20".into()).await.unwrap().inbox.is_empty(), "{b}");
    }
}

/// Many flows share apply transactions of any size and end exactly as one transaction per
/// step would: a step whose effect insert a trigger rejects rolls back alone (its flow fails,
/// keeping the steps committed before), a gap and a block stop only their own flow.
#[tokio::test(flavor = "multi_thread")]
async fn a_group_of_flows_ends_like_one_step_per_transaction() {
    let mut views: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
    for max_batch in [1, 2, 4, 256] {
        for (store, _keep) in stores(&format!("c_group_{max_batch}")).await {
            for flow in ["A", "B", "C"] {
                for seq in 1..=3 {
                    receive(&store, reference(flow, seq)).await;
                }
            }
            receive(&store, reference("G", 2)).await;
            receive(&store, event("V1", "V", 1, "reserved", 2, r#"{"units":3}"#)).await;
            store
                .exec(
                    &sqlite_reject(
                        "effect_log",
                        "(SELECT event_id FROM inbox WHERE rowid = NEW.position) = 'B2'",
                        "effect B2 rejected",
                    ),
                    &pg_reject(
                        "effect_log",
                        "(SELECT event_id FROM inbox WHERE position = NEW.position) = 'B2'",
                        "effect B2 rejected",
                    ),
                )
                .await;
            let opts = ApplyOptions { max_batch, ..ApplyOptions::default() };
            let flows = ["A", "B", "C", "G", "V"].map(str::to_owned).to_vec();
            let view: Vec<String> = store
                .apply_flows(flows, 1000, opts)
                .await
                .iter()
                .map(|r| match &r.outcome {
                    Ok(report) => {
                        format!(
                            "{} {:?} {:?} {:?}",
                            r.flow_id, report.applied, report.stop, report.projection
                        )
                    }
                    // The failure's text is the backend's own; its kind and what it kept are not.
                    Err(f) => format!(
                        "{} failed after {:?}: {:?} {}",
                        r.flow_id,
                        f.applied,
                        f.source.status("apply").code(),
                        f.source.to_string().contains("effect B2 rejected")
                    ),
                })
                .collect();
            let b = store.backend();
            assert_eq!(view[1], "B failed after [\"B1\"]: Internal true", "{b} {max_batch}: {view:?}");
            assert!(view[3].contains("Gap { waiting_for_seq: 1 }"), "{b}: {view:?}");
            assert!(view[4].contains("UnsupportedSchema"), "{b}: {view:?}");
            let mut records = Vec::new();
            for flow in ["A", "B", "C", "G", "V"] {
                let v = store.flow(flow.into()).await.unwrap();
                records.push(format!(
                    "{:?} {:?} {:?}",
                    v.projection,
                    v.inbox.iter().map(|r| (r.seq, r.state, r.reason)).collect::<Vec<_>>(),
                    v.effects
                ));
            }
            views.push((format!("{b} batch {max_batch}"), view, records));
        }
    }
    for other in &views[1..] {
        assert_eq!((&other.1, &other.2), (&views[0].1, &views[0].2), "{} vs {}", other.0, views[0].0);
    }
}

/// Receives `e` alone, with the committed time its envelope carried.
async fn receive_at(
    store: &ConsumerStore,
    e: Event,
    committed_at_us: Option<i64>,
    admission: Admission,
) -> ReceiveOutcome {
    let incoming = vec![Incoming { event: e, committed_at_us, stream: Arc::new(StreamState::default()) }];
    let mut answers = store.receive_batch(Arc::new(incoming), ctx(admission)).await;
    answers.pop().flatten().unwrap().unwrap().outcome
}

/// The committed time rides beside the row: stored once, never part of the body and never
/// compared (a resend with another value or none is still a duplicate), and each applied
/// row that knows it is recorded once in the commit→applied histogram when its apply
/// commits; a committed time after the apply (clocks that disagree) is not a latency.
#[tokio::test(flavor = "multi_thread")]
async fn the_committed_time_is_kept_beside_the_row_and_measured_at_apply() {
    let histogram = &crate::metrics::COMMIT_TO_APPLIED;
    for (store, _keep) in stores("c_committed_at").await {
        let b = store.backend();
        let now = runtime::now_us();
        let a1 = reference("A", 1);
        assert_eq!(
            receive_at(&store, a1.clone(), Some(now - 2_000_000), Admission::Unlimited).await,
            ReceiveOutcome::Accepted
        );
        for again in [Some(now), None] {
            assert_eq!(
                receive_at(&store, a1.clone(), again, Admission::Unlimited).await,
                ReceiveOutcome::Duplicate,
                "{b}"
            );
        }
        // The capped path (one envelope at a time) stores it too; so does a sender without it.
        assert_eq!(
            receive_at(&store, reference("A", 2), Some(now - 1_000_000), Admission::Cap(100)).await,
            ReceiveOutcome::Accepted
        );
        assert_eq!(
            receive_at(&store, reference("A", 3), None, Admission::Unlimited).await,
            ReceiveOutcome::Accepted
        );
        assert_eq!(
            receive_at(&store, reference("F", 1), Some(now + 3_600_000_000), Admission::Unlimited).await,
            ReceiveOutcome::Accepted
        );
        let rows = store.flow("A".into()).await.unwrap().inbox;
        let stamps: Vec<Option<i64>> = rows.iter().map(|r| r.committed_at_us).collect();
        assert_eq!(
            stamps,
            [Some(now - 2_000_000), Some(now - 1_000_000), None],
            "{b}: the first stamp stays"
        );
        assert_eq!(rows[0].body, a1.canonical_body(), "{b}: the body does not carry it");
        let before = histogram.count();
        let r = apply(&store, "A", 10, ApplyOptions::default()).await;
        assert_eq!(r.applied.len(), 3, "{b}");
        let f = apply(&store, "F", 10, ApplyOptions::default()).await;
        assert_eq!(f.applied.len(), 1, "{b}");
        // Other tests apply rows without a committed time, which are never recorded.
        assert_eq!(
            histogram.count() - before,
            2,
            "{b}: A1 and A2; not A3 (unknown) nor F1 (from the future)"
        );
    }
}

/// The scrape's backlog counts: blocked rows by reason kept exact through blocking,
/// re-evaluation to another reason and applying, and the gap and ready flows through a gap
/// filled, a ready flow applied and a blocked one unblocked.
#[tokio::test(flavor = "multi_thread")]
async fn backlog_counts_tell_gap_blocked_and_ready() {
    for (store, _keep) in stores("c_backlog_counts").await {
        let b = store.backend();
        receive(&store, reference("A", 1)).await; // applied below: not waiting
        receive(&store, reference("G", 2)).await; // a gap at G1
        receive(&store, event("B1", "B", 1, "reserved", 2, r#"{"amount":3}"#)).await; // schema 2
        receive(&store, event("C1", "C", 1, "reserved", 2, r#"{"units":3}"#)).await; // schema 2
        receive(&store, event("P1", "P", 1, "reserved", 1, r#"{"units":3}"#)).await; // invalid payload
        receive(&store, reference("R", 1)).await; // ready: not applied yet
        receive(&store, reference("R", 2)).await;
        for flow in ["A", "B", "C", "G", "P"] {
            apply(&store, flow, 10, ApplyOptions::default()).await;
        }
        let counts = store.backlog_counts().await.unwrap();
        let expected = BacklogCounts { unapplied: 6, blocked: [2, 1, 0], gap: 1, ready: 1 };
        assert_eq!(truth(&store).await, (1, 1), "{b}");
        assert_eq!(counts, expected, "{b}");
        // Applying again with the same decoder changes nothing.
        apply(&store, "B", 10, ApplyOptions::default()).await;
        assert_eq!(store.backlog_counts().await.unwrap(), expected, "{b}");
        // With the v2 decoder, B1 is re-evaluated to another reason (no `units`) and C1 applies.
        let v2 = ApplyOptions { support_v2: true, ..ApplyOptions::default() };
        let r = apply(&store, "B", 10, v2).await;
        assert!(matches!(r.stop, Stop::Blocked { reason: BlockReason::InvalidPayload, .. }), "{b}: {r:?}");
        assert_eq!(apply(&store, "C", 10, v2).await.applied, ["C1"], "{b}");
        // R applies; G waits for G1, which arrives and makes it ready.
        apply(&store, "R", 10, ApplyOptions::default()).await;
        receive(&store, reference("G", 1)).await;
        let counts = store.backlog_counts().await.unwrap();
        assert_eq!(counts, BacklogCounts { unapplied: 4, blocked: [0, 2, 0], gap: 0, ready: 1 }, "{b}");
        assert_eq!(counts.unapplied, store.unapplied_count().await.unwrap(), "{b}");
        assert_eq!(truth(&store).await, (0, 1), "{b}");
    }
}

/// The gap and ready flows read off the rows themselves (each waiting flow's lowest unapplied
/// row against its projection), to check the counters against.
async fn truth(store: &ConsumerStore) -> (u64, u64) {
    let (flows, _) = store.backlog(100_000).await.unwrap();
    let gap = flows.iter().filter(|f| f.lowest.seq > f.projection.next_seq()).count();
    let ready = flows
        .iter()
        .filter(|f| f.lowest.seq == f.projection.next_seq() && f.lowest.state == InboxState::Pending)
        .count();
    (gap as u64, ready as u64)
}

/// Asserts the counters equal the rows' truth, and that the states add up to the waiting flows.
async fn assert_exact(store: &ConsumerStore, what: &str) -> BacklogCounts {
    let counts = store.backlog_counts().await.unwrap();
    let (flows, _) = store.backlog(100_000).await.unwrap();
    assert_eq!((counts.gap, counts.ready), truth(store).await, "{} {what}: {counts:?}", store.backend());
    assert_eq!(
        counts.gap + counts.ready + counts.blocked.iter().sum::<u64>(),
        flows.len() as u64,
        "{} {what}: every waiting flow in exactly one state",
        store.backend()
    );
    counts
}

/// Gap and ready stay exact through multi-row batches (the fast paths on PostgreSQL) and
/// grouped applies that move many flows at once: a flow of each shape (ready, gap, ready with
/// a gap behind it, gap filled in the same batch), then applied, then the missing seqs.
#[tokio::test(flavor = "multi_thread")]
async fn gap_and_ready_stay_exact_through_batches_and_groups() {
    for (store, _keep) in stores("c_gap_ready").await {
        let s = Arc::new(StreamState::default());
        let flows: Vec<String> = (0..120).map(|i| format!("F{i:03}")).collect();
        let shape = |i: usize| -> &'static [u64] {
            match i % 5 {
                0 => &[1],
                1 => &[2],
                2 => &[1, 3],
                3 => &[3, 1, 2],
                _ => &[2, 3],
            }
        };
        let events = flows
            .iter()
            .enumerate()
            .flat_map(|(i, f)| shape(i).iter().map(|&seq| (reference(f, seq), Arc::clone(&s))))
            .collect();
        assert!(batch(&store, events, Admission::Unlimited).await.iter().all(|w| w == "Accepted"));
        let counts = assert_exact(&store, "after the first batch").await;
        assert_eq!((counts.gap, counts.ready), (48, 72), "{}", store.backend());
        // One envelope at a time too (the step-by-step receive).
        receive(&store, reference("Z", 2)).await;
        receive(&store, reference("Z", 3)).await;
        assert_exact(&store, "a gap flow").await;
        receive(&store, reference("Z", 1)).await;
        assert_exact(&store, "its gap filled").await;
        let opts = ApplyOptions { max_batch: 7, ..ApplyOptions::default() };
        store.apply_flows(flows.clone(), 1, opts).await;
        assert_exact(&store, "one step each").await;
        store.apply_flows(flows.clone(), 100, opts).await;
        let counts = assert_exact(&store, "applied").await;
        assert_eq!((counts.gap, counts.ready), (72, 1), "{}", store.backend());
        let missing = flows
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(i % 5, 1 | 2 | 4))
            .map(|(i, f)| (reference(f, if i % 5 == 2 { 2 } else { 1 }), Arc::clone(&s)))
            .collect();
        assert!(batch(&store, missing, Admission::Unlimited).await.iter().all(|w| w == "Accepted"));
        let counts = assert_exact(&store, "gaps filled").await;
        assert_eq!((counts.gap, counts.ready), (0, 73), "{}", store.backend());
        store.apply_flows(flows.iter().chain([&"Z".to_owned()]).cloned().collect(), 100, opts).await;
        assert_eq!(assert_exact(&store, "all applied").await, BacklogCounts::default());
    }
}

/// PostgreSQL: two stores on one database (two instances) receiving and applying the same
/// flows at once keep gap and ready exact.
#[tokio::test(flavor = "multi_thread")]
async fn pg_instances_racing_keep_gap_and_ready_exact() {
    let Some(db) = TestDb::create("c_gap_ready_race") else { return };
    let target: DbTarget = db.url().parse().unwrap();
    let one = ConsumerStore::open(&target).await.unwrap();
    let two = ConsumerStore::open(&target).await.unwrap();
    let flows: Vec<String> = (0..60).map(|i| format!("R{i:02}")).collect();
    let opts = ApplyOptions { max_batch: 16, ..ApplyOptions::default() };
    let reversed: Vec<String> = flows.iter().rev().cloned().collect();
    let s = Arc::new(StreamState::default());
    let part = |seq: u64| flows.iter().map(|f| (reference(f, seq), Arc::clone(&s))).collect::<Vec<_>>();
    // Seq 2 on one instance and seq 1 on the other while both apply.
    let (a, b, _, _) = tokio::join!(
        batch(&one, part(2), Admission::Unlimited),
        batch(&two, part(1), Admission::Unlimited),
        one.apply_flows(flows.clone(), 100, opts),
        two.apply_flows(reversed.clone(), 100, opts),
    );
    assert!(a.iter().chain(&b).all(|w| w == "Accepted"), "{a:?} {b:?}");
    assert_exact(&one, "receiving and applying at once").await;
    let (a, _, _) = tokio::join!(
        batch(&one, part(3), Admission::Unlimited),
        one.apply_flows(flows.clone(), 100, opts),
        two.apply_flows(reversed.clone(), 100, opts),
    );
    assert!(a.iter().all(|w| w == "Accepted"), "{a:?}");
    assert_exact(&two, "the last seqs").await;
    tokio::join!(one.apply_flows(flows.clone(), 100, opts), two.apply_flows(reversed, 100, opts));
    assert_eq!(assert_exact(&one, "all applied").await, BacklogCounts::default());
}

/// PostgreSQL: a version 2 schema with rows a version 2 build wrote (one pending, one blocked)
/// is upgraded in place to version 3: the committed-time column is there (NULL for the old
/// rows), the blocked count starts from the blocked row, and the triggers keep every counter
/// from then on.
#[tokio::test(flavor = "multi_thread")]
async fn pg_a_version_2_schema_is_upgraded_and_keeps_its_counts() {
    let Some(db) = TestDb::create("c_pg_v2_upgrade") else { return };
    let target: DbTarget = db.url().parse().unwrap();
    let DbTarget::Postgres(url) = &target else { panic!("a postgres URL") };
    let v2 = proto::pg::PgKind { version: 2, ddl: pg::DDL_V2, upgrades: &pg::KIND.upgrades[..1], ..pg::KIND };
    let old = proto::pg::open(url, &v2, proto::db::OpenMode::Create, 2).await.unwrap();
    let client = old.pool.get().await.unwrap();
    let (a1, b1) = (reference("A", 1), event("B1", "B", 1, "reserved", 2, r#"{"units":3}"#));
    client
        .execute(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, reason, received_at_us)
             VALUES ('A1', 'A', 1, 'reserved', 1, $1, 'pending', NULL, 1),
                    ('B1', 'B', 1, 'reserved', 2, $2, 'blocked', 'unsupported_schema', 1)",
            &[&a1.canonical_body(), &b1.canonical_body()],
        )
        .await
        .unwrap();
    // An applied step with its effect, as a version 2 build kept it.
    let c1 = event("C1", "C", 1, "reserved", 1, r#"{"amount":4}"#);
    client
        .batch_execute(&format!(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, reason, received_at_us,
                               applied_at_us)
             VALUES ('C1', 'C', 1, 'reserved', 1, '{}', 'applied', NULL, 1, 2);
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES ('C', 1, 'reserved', 4, 4);
             INSERT INTO effect(event_id, flow_id, seq, kind, held, applied_at_us)
             VALUES ('C1', 'C', 1, 'reserved', 4, 2);",
            c1.canonical_body()
        ))
        .await
        .unwrap();
    let columns: i64 = client
        .query_one(
            "SELECT count(*) FROM information_schema.columns WHERE column_name = 'committed_at_us'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(columns, 0, "version 2 has no committed time");
    drop(client);
    drop(old);

    let store = ConsumerStore::open(&target).await.unwrap();
    let counts = store.backlog_counts().await.unwrap();
    assert_eq!(counts, BacklogCounts { unapplied: 2, blocked: [1, 0, 0], gap: 0, ready: 1 });
    assert_eq!(store.flow("A".into()).await.unwrap().inbox[0].committed_at_us, None);
    // Version 7 keeps the effect by its inbox row's position; GetFlow shows it as before.
    let c = store.flow("C".into()).await.unwrap();
    let kept: Vec<_> =
        c.effects.iter().map(|e| (e.event_id.as_str(), e.flow_id.as_str(), e.seq, e.held)).collect();
    assert_eq!(kept, [("C1", "C", 1, 4)]);
    let now = runtime::now_us();
    assert_eq!(
        receive_at(&store, reference("A", 2), Some(now), Admission::Unlimited).await,
        ReceiveOutcome::Accepted
    );
    assert_eq!(apply(&store, "A", 10, ApplyOptions::default()).await.applied, ["A1", "A2"]);
    let v2_decoder = ApplyOptions { support_v2: true, ..ApplyOptions::default() };
    assert_eq!(apply(&store, "B", 10, v2_decoder).await.applied, ["B1"]);
    assert_eq!(store.backlog_counts().await.unwrap(), BacklogCounts::default());
    // Apply order goes on after the copied effect's.
    let check = proto::pg::open(url, &pg::KIND, proto::db::OpenMode::Existing, 1).await.unwrap();
    let order: String = check
        .pool
        .get()
        .await
        .unwrap()
        .query_one("SELECT string_agg(position || ':' || event_id, ' ' ORDER BY position) FROM effect", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(order, "1:C1 2:A1 3:A2 4:B1");
    // A new schema is the upgraded one: the same columns and functions.
    let fresh = TestDb::create("c_pg_v3_fresh").expect("the server answered a moment ago");
    let fresh_store = ConsumerStore::open(&fresh.url().parse().unwrap()).await.unwrap();
    let (ConsumerStore::Postgres(fresh), ConsumerStore::Postgres(upgraded)) = (&fresh_store, &store) else {
        panic!("postgres")
    };
    assert_eq!(fresh.schema_definition().await, upgraded.schema_definition().await);
}

/// PostgreSQL: a compaction batch reads the rows it compacts and no others, with most of the
/// history compacted already and the statistics saying so, under either plan the server may
/// cache for the prepared statement (left to choose, a generic plan built a bitmap of every
/// row still to compact for each batch).
#[tokio::test(flavor = "multi_thread")]
async fn pg_a_compaction_batch_reads_only_the_rows_it_compacts() {
    let Some(db) = TestDb::create("c_pg_compact_reads") else { return };
    let target: DbTarget = db.url().parse().unwrap();
    let DbTarget::Postgres(url) = &target else { panic!("a postgres URL") };
    drop(ConsumerStore::open(&target).await.unwrap());
    let opened = proto::pg::open(url, &pg::KIND, proto::db::OpenMode::Existing, 1).await.unwrap();
    let client = opened.pool.get().await.unwrap();
    client
        .batch_execute(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us,
                               applied_at_us)
             SELECT f || '-' || s, f, s, 'reserved', 1,
                    '{\"amount\":1,\"flow_id\":\"' || f || '\",\"seq\":' || s || '}', 'applied', g,
                    g * 3 + s
             FROM generate_series(1, 2000) g, generate_series(1, 3) s,
                  LATERAL (SELECT 'flow' || lpad(g::text, 7, '0') AS f) n;
             UPDATE inbox SET body_sha256 = sha256(convert_to(body, 'UTF8')), body = NULL
             WHERE position < 4000;",
        )
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE inbox").await.unwrap();
    for plan in ["force_custom_plan", "force_generic_plan"] {
        let read = most_rows_a_scan_read(&client, pg::COMPACT_SQL, "(9000000000, 100)", plan).await;
        assert!(read <= 100, "{plan}: one scan read {read} rows for a batch of 100");
    }
}
