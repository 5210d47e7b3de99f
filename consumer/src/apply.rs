//! The `Apply` loop (SPEC §7): per flow, exactly the next seq, decided by `rules` and then
//! blocked or applied through `store`, each write its own `BEGIN IMMEDIATE` that re-reads
//! the projection first, so racing appliers (threads or processes) leave one effect per seq.

use std::sync::{Mutex, MutexGuard};

use proto::body::Event;
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db;
use rusqlite::Connection;

use crate::rules::{BlockReason, Decision, Projection, decide_next};
use crate::store::{self, InboxState, Next, StepOutcome, StoreError};

/// How this consumer applies: whether the v2 decoder is enabled, and its crash point.
#[derive(Clone, Copy, Debug, Default)]
pub struct ApplyOptions {
    pub support_v2: bool,
    pub crash: CrashSwitch,
}

/// Why an `Apply` stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Nothing more is stored for the flow.
    Idle,
    /// The next seq is missing while a larger one is stored.
    Gap { waiting_for_seq: u64 },
    /// The next row cannot be applied; it is stored as `blocked` with `reason`.
    Blocked { event_id: String, reason: BlockReason, detail: String },
    /// The step limit was reached while a next row exists.
    Limit,
}

/// What one `Apply` did: the events this call applied (in order), why it stopped, and the
/// projection it stopped at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApplyReport {
    pub flow_id: String,
    pub applied: Vec<String>,
    pub stop: Stop,
    pub projection: Projection,
}

/// A storage failure during `Apply`. The steps in `applied` were committed before it and
/// stay committed; the failing step was rolled back whole.
#[derive(Debug, thiserror::Error)]
#[error("{source} (this call applied and committed {} step(s) before the failure)", applied.len())]
pub struct ApplyFailure {
    pub applied: Vec<String>,
    #[source]
    pub source: StoreError,
}

/// One step of the loop.
enum Progress {
    Applied(String),
    /// Another applier moved the projection between our read and our write: look again.
    Raced,
    Stopped(Stop, Projection),
}

/// Locks the shared connection. A panic while holding the lock rolled its transaction back
/// on unwind; the connection itself is still usable.
pub fn lock(conn: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    conn.lock().unwrap_or_else(|p| p.into_inner())
}

/// Applies `flow_id`'s exact next seqs, up to `max_steps`, taking the lock once per step so
/// `Receive` interleaves with a long `Apply`. Blocking: call it on a blocking thread.
pub fn apply_flow(
    shared: &Mutex<Connection>,
    flow_id: &str,
    max_steps: u32,
    opts: ApplyOptions,
) -> Result<ApplyReport, ApplyFailure> {
    let mut applied = Vec::new();
    loop {
        let budget_left = applied.len() < max_steps as usize;
        let progress = step_once(&mut lock(shared), flow_id, budget_left, opts);
        match progress {
            Ok(Progress::Applied(event_id)) => applied.push(event_id),
            Ok(Progress::Raced) => {}
            Ok(Progress::Stopped(stop, projection)) => {
                return Ok(ApplyReport { flow_id: flow_id.to_owned(), applied, stop, projection });
            }
            Err(source) => return Err(ApplyFailure { applied, source }),
        }
    }
}

/// Reads the projection and the row at its next seq, decides, and writes the decision in
/// its own `BEGIN IMMEDIATE` transaction (re-checked inside it).
fn step_once(
    conn: &mut Connection,
    flow_id: &str,
    budget_left: bool,
    opts: ApplyOptions,
) -> Result<Progress, StoreError> {
    let (from, next) = {
        // One snapshot for the projection and the row; released before any write.
        let read = conn.transaction()?;
        let from = store::projection(&read, flow_id)?;
        let next = store::next_to_apply(&read, flow_id, from.next_seq())?;
        (from, next)
    };
    let row = match next {
        Next::Idle => return Ok(Progress::Stopped(Stop::Idle, from)),
        Next::Gap => return Ok(Progress::Stopped(Stop::Gap { waiting_for_seq: from.next_seq() }, from)),
        Next::Row(row) => row,
    };
    if !budget_left {
        return Ok(Progress::Stopped(Stop::Limit, from));
    }
    let event = Event::from_canonical_body(&row.body)
        .map_err(|e| StoreError::Inconsistent(format!("inbox {}: {e}", row.event_id)))?;
    match decide_next(&from, &event, opts.support_v2) {
        Decision::Block { reason, detail } => {
            if row.state != InboxState::Blocked || row.reason != Some(reason) {
                let tx = db::begin_immediate(conn)?;
                if store::projection(&tx, flow_id)? != from {
                    return Ok(Progress::Raced);
                }
                if store::mark_blocked(&tx, &row.event_id, reason)? {
                    tracing::warn!(
                        flow_id,
                        event_id = %row.event_id,
                        seq = row.seq,
                        reason = reason.as_str(),
                        %detail,
                        "event blocked: kept stored, re-evaluated on every Apply"
                    );
                }
                tx.commit()?;
            }
            let stop = Stop::Blocked { event_id: row.event_id, reason, detail };
            Ok(Progress::Stopped(stop, from))
        }
        Decision::Apply { kind, after } => {
            let tx = db::begin_immediate(conn)?;
            match store::apply_step(&tx, &row, &from, kind, &after, &opts.crash, crate::now_us())? {
                StepOutcome::Raced => Ok(Progress::Raced),
                StepOutcome::Applied => {
                    tx.commit()?;
                    opts.crash.reach(CrashPoint::ConsumerApplyAfterCommit);
                    tracing::debug!(flow_id, event_id = %row.event_id, seq = row.seq, "applied");
                    Ok(Progress::Applied(row.event_id))
                }
            }
        }
    }
}

/// One flow's result in `apply_all`.
#[derive(Debug)]
pub struct FlowResult {
    pub flow_id: String,
    pub outcome: Result<ApplyReport, ApplyFailure>,
}

/// How many flow ids `apply_all` reads per page.
const FLOW_PAGE: usize = 256;

/// Runs [`apply_flow`] for every flow with unapplied rows, in flow_id order; one flow's
/// failure is its own result and the others go on. Only failing to list the flows fails
/// the call. Blocking: call it on a blocking thread.
pub fn apply_all(
    shared: &Mutex<Connection>,
    max_steps: u32,
    opts: ApplyOptions,
) -> Result<Vec<FlowResult>, StoreError> {
    let mut results = Vec::new();
    let mut after = String::new();
    loop {
        let page = store::flows_with_unapplied(&lock(shared), &after, FLOW_PAGE)?;
        let Some(last) = page.last() else { return Ok(results) };
        after = last.clone();
        for flow_id in page {
            let outcome = apply_flow(shared, &flow_id, max_steps, opts);
            results.push(FlowResult { flow_id, outcome });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::flow::FlowState;
    use proto::pb;

    fn shared(dir: &tempfile::TempDir) -> Mutex<Connection> {
        Mutex::new(store::open(&dir.path().join("c.db")).unwrap())
    }

    fn receive(conn: &Mutex<Connection>, flow: &str, seq: u64, kind: &str, schema: u32, payload: &str) {
        let env = pb::EventEnvelope {
            event_id: format!("{flow}{seq}"),
            flow_id: flow.into(),
            seq,
            kind: kind.into(),
            schema,
            payload_json: payload.into(),
        };
        let event = proto::limits::check_envelope(&env).unwrap();
        let mut conn = lock(conn);
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert_eq!(
            store::insert_pending(&tx, &event, 1, store::Admission::Unlimited).unwrap(),
            store::ReceiveOutcome::Accepted
        );
        tx.commit().unwrap();
    }

    const V1: &str = r#"{"amount":3}"#;

    #[test]
    fn gaps_limits_and_idle() {
        let dir = tempfile::tempdir().unwrap();
        let conn = shared(&dir);
        let v1 = ApplyOptions::default();
        receive(&conn, "A", 3, "released", 1, V1);
        let r = apply_flow(&conn, "A", 10, v1).unwrap();
        assert_eq!((r.applied.len(), r.stop), (0, Stop::Gap { waiting_for_seq: 1 }));
        receive(&conn, "A", 1, "reserved", 1, V1);
        receive(&conn, "A", 2, "confirmed", 1, V1);
        let r = apply_flow(&conn, "A", 1, v1).unwrap();
        assert_eq!((r.applied, r.stop), (vec!["A1".to_owned()], Stop::Limit));
        let r = apply_flow(&conn, "A", 10, v1).unwrap();
        assert_eq!((r.applied, r.stop), (vec!["A2".to_owned(), "A3".to_owned()], Stop::Idle));
        assert_eq!(r.projection, Projection { last_seq: 3, state: FlowState::Released, held: 0, amount: 3 });
        let r = apply_flow(&conn, "A", 10, v1).unwrap();
        assert_eq!((r.applied.len(), r.stop), (0, Stop::Idle));
    }

    #[test]
    fn blocked_rows_wait_for_the_v2_decoder() {
        let dir = tempfile::tempdir().unwrap();
        let conn = shared(&dir);
        receive(&conn, "A", 1, "reserved", 1, V1);
        receive(&conn, "A", 2, "confirmed", 2, r#"{"units":3}"#);
        let r = apply_flow(&conn, "A", 10, ApplyOptions::default()).unwrap();
        assert_eq!(r.applied, ["A1"]);
        assert!(matches!(
            &r.stop,
            Stop::Blocked { event_id, reason: BlockReason::UnsupportedSchema, .. } if event_id == "A2"
        ));
        let rows = store::flow_inbox(&lock(&conn), "A").unwrap();
        assert_eq!(
            (rows[1].state, rows[1].reason),
            (InboxState::Blocked, Some(BlockReason::UnsupportedSchema))
        );
        let v2 = ApplyOptions { support_v2: true, ..ApplyOptions::default() };
        let r = apply_flow(&conn, "A", 10, v2).unwrap();
        assert_eq!((r.applied, r.stop), (vec!["A2".to_owned()], Stop::Idle));
        let rows = store::flow_inbox(&lock(&conn), "A").unwrap();
        assert_eq!((rows[1].state, rows[1].reason), (InboxState::Applied, None));
    }

    #[test]
    fn apply_all_isolates_flows_and_failures() {
        let dir = tempfile::tempdir().unwrap();
        let conn = shared(&dir);
        for (flow, seqs) in [("A", &[1, 3][..]), ("B", &[1, 2, 3][..])] {
            for &seq in seqs {
                let kind = ["reserved", "confirmed", "released"][seq as usize - 1];
                receive(&conn, flow, seq, kind, 1, V1);
            }
        }
        // A bad body in flow C (edited by hand) fails C only.
        receive(&conn, "C", 1, "reserved", 1, V1);
        lock(&conn).execute("UPDATE inbox SET body = 'garbage' WHERE event_id = 'C1'", []).unwrap();
        let results = apply_all(&conn, 1000, ApplyOptions::default()).unwrap();
        let ids: Vec<&str> = results.iter().map(|r| r.flow_id.as_str()).collect();
        assert_eq!(ids, ["A", "B", "C"]);
        let a = results[0].outcome.as_ref().unwrap();
        assert_eq!((a.projection.state, a.projection.held), (FlowState::Reserved, 3));
        assert_eq!(a.stop, Stop::Gap { waiting_for_seq: 2 });
        let b = results[1].outcome.as_ref().unwrap();
        assert_eq!((b.projection.state, b.projection.held, b.applied.len()), (FlowState::Released, 0, 3));
        let c = results[2].outcome.as_ref().unwrap_err();
        assert!(c.to_string().contains("inconsistent"), "{c}");
    }
}
