//! The `Apply` loop (SPEC §7), group-committed: per flow, exactly the next seq, decided by
//! `rules` and then blocked or applied through `store`. Consecutive steps of many flows share
//! one `BEGIN IMMEDIATE` transaction (up to `max_batch` steps), every decision is read inside
//! it, and each step (projection + effect + inbox mark) runs in its own `SAVEPOINT`, so a
//! failing step rolls back alone and racing appliers (threads or processes) leave one effect
//! per seq.

use std::sync::Mutex;

use proto::body::Event;
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, StepFailure};
use runtime::batches::BatchSizes;
use runtime::blocking::lock;
use rusqlite::{Connection, Transaction};

use crate::rules::{BlockReason, Decision, Projection, decide_next};
use crate::storage::StorageWatch;
use crate::store::{self, InboxState, Next, StepOutcome, StoreError};

/// Default cap of applied steps per transaction (`--apply-batch`).
pub const DEFAULT_APPLY_BATCH: usize = 256;

/// How this consumer applies: whether the v2 decoder is enabled, its crash point, and how
/// many steps one transaction may hold.
#[derive(Clone, Copy, Debug)]
pub struct ApplyOptions {
    /// Decode schema 2 (`{"units": n}`); without it such rows block as unsupported.
    pub support_v2: bool,
    /// The crash point this process is armed with, if any.
    pub crash: CrashSwitch,
    /// Steps (applied or blocked marks) per transaction; 1 commits each step alone.
    pub max_batch: usize,
    /// Checked before every commit and told every commit's outcome (none in unit tests).
    pub storage: Option<&'static StorageWatch>,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        ApplyOptions {
            support_v2: false,
            crash: CrashSwitch::default(),
            max_batch: DEFAULT_APPLY_BATCH,
            storage: None,
        }
    }
}

/// Why an `Apply` stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Nothing more is stored for the flow.
    Idle,
    /// The next seq is missing while a larger one is stored.
    Gap {
        /// The missing seq.
        waiting_for_seq: u64,
    },
    /// The next row cannot be applied; it is stored as `blocked` with `reason`.
    Blocked {
        /// The blocked row's event.
        event_id: String,
        /// Why it is blocked, as stored.
        reason: BlockReason,
        /// Why in words.
        detail: String,
    },
    /// The step limit was reached while a next row exists.
    Limit,
}

/// What one `Apply` did: the events this call applied (in order), why it stopped, and the
/// projection it stopped at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApplyReport {
    /// The flow.
    pub flow_id: String,
    /// The event ids this call applied, in seq order.
    pub applied: Vec<String>,
    /// Why it stopped.
    pub stop: Stop,
    /// The flow's projection where it stopped.
    pub projection: Projection,
}

/// A storage failure during `Apply`. The steps in `applied` were committed before it and
/// stay committed; the failing step was rolled back whole.
#[derive(Debug, thiserror::Error)]
#[error("{source} (this call applied and committed {} step(s) before the failure)", applied.len())]
pub struct ApplyFailure {
    /// The event ids committed before the failure, in seq order.
    pub applied: Vec<String>,
    /// The storage failure.
    #[source]
    pub source: StoreError,
}

/// Applies `flow_id`'s exact next seqs, up to `max_steps`, in transactions of up to
/// `opts.max_batch` steps (the lock is taken per transaction, so `Receive` interleaves with
/// a long `Apply`). Blocking: call it on a blocking thread.
pub fn apply_flow(
    shared: &Mutex<Connection>,
    flow_id: &str,
    max_steps: u32,
    opts: ApplyOptions,
) -> Result<ApplyReport, ApplyFailure> {
    let mut results = apply_flows(shared, vec![flow_id.to_owned()], max_steps, opts);
    match results.pop() {
        Some(result) => result.outcome,
        // apply_flows answers every flow it is given.
        None => Err(ApplyFailure {
            applied: Vec::new(),
            source: StoreError::Inconsistent("apply produced no result".into()),
        }),
    }
}

/// One flow's result in `apply_all` and `apply_flows`.
#[derive(Debug)]
pub struct FlowResult {
    /// The flow.
    pub flow_id: String,
    /// What applying it did, or how it failed.
    pub outcome: Result<ApplyReport, ApplyFailure>,
}

/// How many flow ids `apply_all` reads per page.
const FLOW_PAGE: usize = 256;

/// Runs the apply loop for every flow with unapplied rows, in flow_id order, a page of flows
/// per group of transactions; one flow's failure is its own result and the others go on.
/// Only failing to list the flows fails the call. Blocking: call it on a blocking thread.
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
        results.extend(apply_flows(shared, page, max_steps, opts));
    }
}

/// One flow's progress while a group runs.
struct FlowRun {
    flow_id: String,
    /// Applied and committed.
    committed: Vec<String>,
    /// Applied inside the open transaction.
    pending: Vec<String>,
    /// Wrote anything (a step or a blocked mark) inside the open transaction.
    wrote: bool,
    /// The projection this flow's last step wrote inside the open transaction (what a read
    /// would return now); `None` at the start of each transaction, so it is read again.
    known: Option<Projection>,
    end: Option<Result<(Stop, Projection), StoreError>>,
}

/// What one step inside the open transaction did.
enum Progress {
    Applied { event_id: String, after: Projection },
    Stopped { stop: Stop, projection: Projection, wrote: bool },
}

/// Steps per committed apply transaction, logged at shutdown.
static APPLY_BATCHES: BatchSizes = BatchSizes::new("apply");

/// Applies each of `flows` in turn, up to `max_steps` each, with consecutive steps of many
/// flows in one `BEGIN IMMEDIATE` transaction of up to `opts.max_batch` steps. Each step is
/// its own savepoint: a failing step rolls back alone and fails only its flow (the others'
/// steps in the same transaction commit); if the whole transaction is lost, every flow that
/// wrote in it fails and keeps only what was committed before. `consumer.apply.after_commit`
/// is reached after each commit that holds an applied step. Blocking: call it on a blocking
/// thread.
pub fn apply_flows(
    shared: &Mutex<Connection>,
    flows: Vec<String>,
    max_steps: u32,
    opts: ApplyOptions,
) -> Vec<FlowResult> {
    let mut runs: Vec<FlowRun> = flows
        .into_iter()
        .map(|flow_id| FlowRun {
            flow_id,
            committed: Vec::new(),
            pending: Vec::new(),
            wrote: false,
            known: None,
            end: None,
        })
        .collect();
    let max_batch = opts.max_batch.max(1);
    let mut next = 0;
    while next < runs.len() {
        let mut guard = lock(shared);
        let started = std::time::Instant::now();
        let tx = match db::begin_immediate(&mut guard) {
            Ok(tx) => tx,
            Err(e) => {
                if let Some(watch) = opts.storage {
                    watch.commit_failed(&StoreError::Sqlite(db::copy_error(&e)));
                }
                // No write lock (busy past the timeout, or worse): every flow not yet done fails.
                for run in &mut runs[next..] {
                    run.end = Some(Err(StoreError::Sqlite(db::copy_error(&e))));
                }
                break;
            }
        };
        let mut steps = 0;
        let mut lost = None;
        while next < runs.len() && steps < max_batch {
            let run = &mut runs[next];
            let budget_left = run.committed.len() + run.pending.len() < max_steps as usize;
            match step_in_tx(&tx, &run.flow_id, run.known, budget_left, &opts) {
                Ok(Progress::Applied { event_id, after }) => {
                    run.known = Some(after);
                    run.pending.push(event_id);
                    run.wrote = true;
                    steps += 1;
                }
                Ok(Progress::Stopped { stop, projection, wrote }) => {
                    run.wrote |= wrote;
                    steps += usize::from(wrote);
                    run.end = Some(Ok((stop, projection)));
                    next += 1;
                }
                Err(StepFailure::RolledBack(e)) => {
                    run.end = Some(Err(e));
                    next += 1;
                }
                Err(StepFailure::TransactionLost(e)) => {
                    lost = Some(copy_store_error(&e));
                    run.end = Some(Err(e));
                    run.pending.clear();
                    run.wrote = false;
                    next += 1;
                    break;
                }
            }
        }
        for run in &mut runs {
            run.known = None;
        }
        let applied_any = runs.iter().any(|r| !r.pending.is_empty());
        let wrote_any = runs.iter().any(|r| r.wrote);
        let finished = if let Some(e) = lost {
            drop(tx);
            Err(e)
        } else if wrote_any {
            match opts.storage.map_or(Ok(()), |watch| watch.before_commit()) {
                Ok(()) => tx.commit().map_err(StoreError::Sqlite),
                Err(refused) => {
                    drop(tx);
                    Err(refused)
                }
            }
        } else {
            // Nothing written: dropping the transaction releases the lock.
            drop(tx);
            Ok(())
        };
        drop(guard);
        if let Some(watch) = opts.storage {
            match &finished {
                Ok(()) if wrote_any => watch.commit_succeeded(),
                Ok(()) => {}
                Err(e) => watch.commit_failed(e),
            }
        }
        match finished {
            Ok(()) => {
                if applied_any {
                    APPLY_BATCHES.record_timed(runs.iter().map(|r| r.pending.len()).sum(), started);
                }
                for run in &mut runs {
                    let pending = std::mem::take(&mut run.pending);
                    run.committed.extend(pending);
                    run.wrote = false;
                }
                if applied_any {
                    opts.crash.reach(CrashPoint::ConsumerApplyAfterCommit);
                }
            }
            Err(e) => {
                for run in runs.iter_mut().filter(|r| r.wrote) {
                    run.pending.clear();
                    run.wrote = false;
                    run.end = Some(Err(copy_store_error(&e)));
                }
            }
        }
    }
    runs.into_iter()
        .map(|run| {
            let outcome = match run.end {
                Some(Ok((stop, projection))) => {
                    Ok(ApplyReport { flow_id: run.flow_id.clone(), applied: run.committed, stop, projection })
                }
                Some(Err(source)) => {
                    if let Some(watch) = opts.storage {
                        watch.commit_failed(&source);
                    }
                    Err(ApplyFailure { applied: run.committed, source })
                }
                None => Err(ApplyFailure {
                    applied: run.committed,
                    source: StoreError::Inconsistent("apply stopped before this flow was reached".into()),
                }),
            };
            crate::metrics::count_stop(outcome.as_ref().ok().map(|report| &report.stop));
            FlowResult { flow_id: run.flow_id, outcome }
        })
        .collect()
}

fn copy_store_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Sqlite(e) => StoreError::Sqlite(db::copy_error(e)),
        StoreError::Inconsistent(msg) => StoreError::Inconsistent(msg.clone()),
        StoreError::FileReplaced(msg) => StoreError::FileReplaced(msg.clone()),
    }
}

/// A failure outside a savepoint (a read): the transaction survives unless SQLite dropped it.
fn classify(tx: &Transaction<'_>, e: StoreError) -> StepFailure<StoreError> {
    if tx.is_autocommit() { StepFailure::TransactionLost(e) } else { StepFailure::RolledBack(e) }
}

/// Reads the projection (unless this transaction's previous step of the flow just wrote it:
/// `known`) and the row at its next seq inside the open transaction, decides, and writes the
/// decision in its own savepoint.
fn step_in_tx(
    tx: &Transaction<'_>,
    flow_id: &str,
    known: Option<Projection>,
    budget_left: bool,
    opts: &ApplyOptions,
) -> Result<Progress, StepFailure<StoreError>> {
    let from = match known {
        Some(projection) => projection,
        None => store::projection(tx, flow_id).map_err(|e| classify(tx, e))?,
    };
    let next = store::next_to_apply(tx, flow_id, from.next_seq()).map_err(|e| classify(tx, e))?;
    let row = match next {
        Next::Idle => return Ok(Progress::Stopped { stop: Stop::Idle, projection: from, wrote: false }),
        Next::Gap => {
            let stop = Stop::Gap { waiting_for_seq: from.next_seq() };
            return Ok(Progress::Stopped { stop, projection: from, wrote: false });
        }
        Next::Row(row) => row,
    };
    if !budget_left {
        return Ok(Progress::Stopped { stop: Stop::Limit, projection: from, wrote: false });
    }
    let event = Event::from_canonical_body(&row.body).map_err(|e| {
        StepFailure::RolledBack(StoreError::Inconsistent(format!("inbox {}: {e}", row.event_id)))
    })?;
    match decide_next(&from, &event, opts.support_v2) {
        Decision::Block { reason, detail } => {
            let mut wrote = false;
            if row.state != InboxState::Blocked || row.reason != Some(reason) {
                wrote = db::in_savepoint(tx, |tx| store::mark_blocked(tx, &row.event_id, reason))?;
                if wrote {
                    tracing::warn!(
                        flow_id,
                        event_id = %row.event_id,
                        seq = row.seq,
                        reason = reason.as_str(),
                        %detail,
                        "event blocked: kept stored, re-evaluated on every Apply"
                    );
                }
            }
            let stop = Stop::Blocked { event_id: row.event_id, reason, detail };
            Ok(Progress::Stopped { stop, projection: from, wrote })
        }
        Decision::Apply { kind, after } => {
            let now = runtime::now_us();
            match db::in_savepoint(tx, |tx| {
                store::apply_step(tx, &row, &from, kind, &after, &opts.crash, now)
            })? {
                StepOutcome::Applied => {
                    tracing::debug!(flow_id, event_id = %row.event_id, seq = row.seq, "applied");
                    Ok(Progress::Applied { event_id: row.event_id, after })
                }
                // The projection was read inside this same transaction: it cannot have moved.
                StepOutcome::Raced => Err(StepFailure::RolledBack(StoreError::Inconsistent(format!(
                    "projection of {flow_id} moved inside the apply transaction"
                )))),
            }
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

    fn reference(conn: &Mutex<Connection>, flow: &str) {
        for (seq, kind) in [(1, "reserved"), (2, "confirmed"), (3, "released")] {
            receive(conn, flow, seq, kind, 1, V1);
        }
    }

    /// Many flows share transactions of any size and end exactly as one transaction per step
    /// would: a step whose effect insert a trigger rejects rolls back alone (its flow fails,
    /// keeping the steps committed before), a gap and a block stop only their own flow.
    #[test]
    fn a_group_of_flows_ends_like_one_step_per_transaction() {
        let mut views = Vec::new();
        for max_batch in [1, 2, 4, 256] {
            let dir = tempfile::tempdir().unwrap();
            let conn = shared(&dir);
            for flow in ["A", "B", "C"] {
                reference(&conn, flow);
            }
            receive(&conn, "G", 2, "confirmed", 1, V1);
            receive(&conn, "V", 1, "reserved", 2, r#"{"units":3}"#);
            lock(&conn)
                .execute_batch(
                    "CREATE TRIGGER reject_b2 BEFORE INSERT ON effect WHEN NEW.event_id = 'B2'
                     BEGIN SELECT RAISE(ABORT, 'effect B2 rejected'); END;",
                )
                .unwrap();
            let opts = ApplyOptions { max_batch, ..ApplyOptions::default() };
            let flows = ["A", "B", "C", "G", "V"].map(str::to_owned).to_vec();
            let results = apply_flows(&conn, flows, 1000, opts);
            let view: Vec<String> = results
                .iter()
                .map(|r| match &r.outcome {
                    Ok(report) => format!(
                        "{} {:?} {:?} {:?}",
                        r.flow_id, report.applied, report.stop, report.projection
                    ),
                    Err(f) => format!("{} failed after {:?}: {}", r.flow_id, f.applied, f.source),
                })
                .collect();
            assert!(
                view[1].starts_with("B failed after [\"B1\"]") && view[1].contains("effect B2 rejected"),
                "{view:?}"
            );
            assert!(view[3].contains("Gap { waiting_for_seq: 1 }"), "{view:?}");
            assert!(view[4].contains("UnsupportedSchema"), "{view:?}");
            let records = {
                let conn = lock(&conn);
                let mut records = Vec::new();
                for flow in ["A", "B", "C", "G", "V"] {
                    records.push(format!(
                        "{:?} {:?} {:?}",
                        store::projection(&conn, flow).unwrap(),
                        store::flow_inbox(&conn, flow)
                            .unwrap()
                            .iter()
                            .map(|r| (r.seq, r.state, r.reason))
                            .collect::<Vec<_>>(),
                        store::flow_effects(&conn, flow).unwrap()
                    ));
                }
                records
            };
            views.push((view, records));
        }
        for other in &views[1..] {
            assert_eq!(other, &views[0]);
        }
    }

    /// A step limit smaller than the batch, and a batch smaller than the flow, both hold.
    #[test]
    fn limits_and_batches_split_a_flow() {
        let dir = tempfile::tempdir().unwrap();
        let conn = shared(&dir);
        reference(&conn, "A");
        let opts = ApplyOptions { max_batch: 2, ..ApplyOptions::default() };
        let r = apply_flow(&conn, "A", 2, opts).unwrap();
        assert_eq!((r.applied, r.stop), (vec!["A1".to_owned(), "A2".to_owned()], Stop::Limit));
        let r = apply_flow(&conn, "A", 10, ApplyOptions { max_batch: 1, ..opts }).unwrap();
        assert_eq!((r.applied, r.stop), (vec!["A3".to_owned()], Stop::Idle));
    }
}
