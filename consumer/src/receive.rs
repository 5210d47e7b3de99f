//! Group commit of `Receive`: one writer thread owns consumer.db's inbox writes and takes
//! every envelope queued by all streams at once into ONE `BEGIN IMMEDIATE` transaction, one
//! `SAVEPOINT` per envelope (a failing envelope rolls back alone), and answers each only
//! after the commit. In auto-apply mode it then applies the flows the batch touched.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use proto::body::Event;
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, StepFailure, storage_status};
use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::apply::{self, ApplyOptions};
use crate::request::DEFAULT_MAX_STEPS;
use crate::storage::StorageWatch;
use crate::store::{self, ReceiveOutcome};

/// Default cap of envelopes per Receive transaction (`--max-batch`).
pub const DEFAULT_MAX_BATCH: usize = 256;

/// What one `Receive` stream shares with the writer: once one of its envelopes failed, the
/// stream ends with that error, so the writer stores none of its later envelopes (every
/// envelope it committed has been answered before the error).
#[derive(Debug, Default)]
pub struct StreamState {
    failed: AtomicBool,
}

impl StreamState {
    /// Marks the stream as ended by an error.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// True once an envelope of the stream failed (or its client went away).
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

/// What the writer decided for one envelope, and where the event sits in this database's
/// history (its inbox position; 0 when nothing is stored under its id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// The decision.
    pub outcome: ReceiveOutcome,
    /// The event's inbox position (0 when nothing is stored under its id).
    pub position: u64,
}

/// One envelope that passed the transport limits, queued for the writer.
pub struct ReceiveJob {
    /// The envelope's event.
    pub event: Event,
    /// The stream it came on (the writer skips envelopes of a failed stream).
    pub stream: Arc<StreamState>,
    /// Gets the decision after the commit that holds it (or the failure).
    pub reply: oneshot::Sender<Result<Received, Status>>,
}

/// How the writer runs.
#[derive(Clone, Copy, Debug)]
pub struct WriterOptions {
    /// Envelopes per transaction; 1 commits each alone.
    pub max_batch: usize,
    /// Apply the flows each committed batch touched.
    pub auto_apply: bool,
    /// How auto-apply applies.
    pub apply: ApplyOptions,
    /// The backlog cap (`--max-pending`).
    pub admission: store::Admission,
}

impl WriterOptions {
    fn storage(&self) -> Option<&'static StorageWatch> {
        self.apply.storage
    }
}

/// Envelopes per Receive batch (one transaction each), logged at shutdown.
static RECEIVE_BATCHES: runtime::batches::BatchSizes = runtime::batches::BatchSizes::new("receive");

/// Starts the writer thread. In auto-apply mode it first applies whatever earlier runs left
/// accepted but unapplied (a crash between a Receive commit and its apply, say).
pub fn spawn(conn: Arc<Mutex<Connection>>, opts: WriterOptions) -> std::io::Result<mpsc::Sender<ReceiveJob>> {
    let queue = opts.max_batch.saturating_mul(4).clamp(64, 1 << 16);
    if opts.auto_apply {
        let conn = Arc::clone(&conn);
        std::thread::Builder::new()
            .name("auto-apply-sweep".into())
            .spawn(move || sweep(&conn, opts.apply))?;
    }
    runtime::group::spawn_writer("receive-writer", opts.max_batch, queue, move |jobs: Vec<ReceiveJob>| {
        let started = std::time::Instant::now();
        let results = receive_batch(
            &mut runtime::blocking::lock(&conn),
            &jobs,
            &opts.apply.crash,
            opts.admission,
            opts.storage(),
        );
        let committed = started.elapsed();
        let batch_len = jobs.len();
        RECEIVE_BATCHES.record_timed(batch_len, started);
        let mut touched = BTreeSet::new();
        for (job, result) in jobs.into_iter().zip(results) {
            if matches!(&result, Ok(r) if matches!(r.outcome, ReceiveOutcome::Accepted | ReceiveOutcome::Duplicate))
            {
                touched.insert(job.event.flow_id);
            }
            // The stream may have ended meanwhile (client gone); its answer is moot.
            let _ = job.reply.send(result);
        }
        let flows = touched.len();
        if opts.auto_apply && flows > 0 {
            auto_apply(&conn, touched.into_iter().collect(), opts.apply);
        }
        tracing::debug!(
            envelopes = batch_len,
            receive_us = committed.as_micros() as u64,
            auto_apply_flows = if opts.auto_apply { flows } else { 0 },
            total_us = started.elapsed().as_micros() as u64,
            "receive batch"
        );
    })
}

/// Auto-apply at start-up: every flow with unapplied rows.
fn sweep(conn: &Mutex<Connection>, opts: ApplyOptions) {
    match apply::apply_all(conn, DEFAULT_MAX_STEPS, opts) {
        Ok(results) => {
            let applied: usize =
                results.iter().filter_map(|r| r.outcome.as_ref().ok()).map(|r| r.applied.len()).sum();
            log_failures(&results);
            tracing::info!(flows = results.len(), applied, "auto-apply: applied what earlier runs left");
        }
        Err(e) => tracing::warn!(error = %e, "auto-apply: cannot list flows with unapplied rows"),
    }
}

/// Auto-apply after a committed batch: the flows it touched, group-committed. A flow that
/// stops at a gap or a block simply waits (as with a manual Apply); a failing flow is logged
/// and retried when its next event arrives.
fn auto_apply(conn: &Mutex<Connection>, flows: Vec<String>, opts: ApplyOptions) {
    let results = apply::apply_flows(conn, flows, DEFAULT_MAX_STEPS, opts);
    log_failures(&results);
}

fn log_failures(results: &[apply::FlowResult]) {
    for r in results {
        if let Err(failure) = &r.outcome {
            tracing::warn!(
                flow_id = %r.flow_id, error = %failure,
                "auto-apply: flow failed; retried with its next event, or once storage commits again"
            );
        }
    }
}

/// SPEC §6 for a batch of envelopes in ONE `BEGIN IMMEDIATE` transaction, in queue order,
/// each in its own savepoint, so a later envelope sees an earlier one exactly as it would
/// after that one's own commit (the same event twice is `DUPLICATE`, two ids for one
/// (flow, seq) is `SEQUENCE_CONFLICT`). Commits only when something was inserted: a batch of
/// `DUPLICATE`/conflict answers writes nothing and reaches no crash point. If the commit
/// fails, every envelope of the batch gets the error. An envelope whose stream already failed
/// is not stored (its stream has ended). Every failed envelope fails its stream.
pub fn receive_batch(
    conn: &mut Connection,
    jobs: &[ReceiveJob],
    crash: &CrashSwitch,
    admission: store::Admission,
    storage: Option<&StorageWatch>,
) -> Vec<Result<Received, Status>> {
    let report = |e: &store::StoreError| {
        if let Some(watch) = storage {
            watch.commit_failed(e);
        }
    };
    let fail_all = |status: Status| -> Vec<Result<Received, Status>> {
        jobs.iter()
            .map(|job| {
                job.stream.fail();
                Err(status.clone())
            })
            .collect()
    };
    let tx = match db::begin_immediate(conn) {
        Ok(tx) => tx,
        Err(e) => {
            let status = storage_status("receive", &e);
            report(&store::StoreError::Sqlite(e));
            return fail_all(status);
        }
    };
    let mut results = Vec::with_capacity(jobs.len());
    let mut inserted = false;
    for job in jobs {
        if job.stream.failed() {
            results.push(Err(Status::aborted("receive: an earlier envelope of this stream failed")));
            continue;
        }
        let now = runtime::now_us();
        let decided = db::in_savepoint(&tx, |tx| {
            let outcome = store::insert_pending(tx, &job.event, now, admission)?;
            let position = match outcome {
                ReceiveOutcome::Accepted => u64::try_from(tx.last_insert_rowid()).unwrap_or(0),
                ReceiveOutcome::Duplicate => store::inbox_position(tx, &job.event.event_id)?.unwrap_or(0),
                _ => 0,
            };
            Ok::<_, store::StoreError>(Received { outcome, position })
        });
        match decided {
            Ok(received) => {
                if received.outcome == ReceiveOutcome::Accepted {
                    inserted = true;
                    crash.reach(CrashPoint::ConsumerReceiveAfterInsert);
                }
                results.push(Ok(received));
            }
            Err(StepFailure::RolledBack(e)) => {
                report(&e);
                job.stream.fail();
                results.push(Err(crate::service::store_status("receive", &e)));
            }
            Err(StepFailure::TransactionLost(e)) => {
                drop(tx);
                report(&e);
                return fail_all(crate::service::store_status("receive", &e));
            }
        }
    }
    if !inserted {
        // Nothing was written; dropping the transaction releases the lock.
        return results;
    }
    if let Some(refused) = storage.map_or(Ok(()), |watch| watch.before_commit()).err() {
        drop(tx);
        report(&refused);
        return fail_all(crate::service::store_status("receive commit", &refused));
    }
    if let Err(e) = tx.commit() {
        let status = storage_status("receive commit", &e);
        report(&store::StoreError::Sqlite(e));
        return fail_all(status);
    }
    if let Some(watch) = storage {
        watch.commit_succeeded();
    }
    crash.reach(CrashPoint::ConsumerReceiveAfterCommit);
    results
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::pb;

    fn event(id: &str, flow: &str, seq: u64, amount: i64) -> Event {
        let env = pb::EventEnvelope {
            event_id: id.into(),
            flow_id: flow.into(),
            seq,
            kind: "reserved".into(),
            schema: 1,
            payload_json: format!(r#"{{"amount":{amount}}}"#),
        };
        proto::limits::check_envelope(&env).unwrap()
    }

    fn jobs(events: Vec<(Event, &Arc<StreamState>)>) -> Vec<ReceiveJob> {
        events
            .into_iter()
            .map(|(event, stream)| ReceiveJob {
                event,
                stream: Arc::clone(stream),
                reply: oneshot::channel().0,
            })
            .collect()
    }

    fn words(results: &[Result<Received, Status>]) -> Vec<String> {
        results
            .iter()
            .map(|r| match r {
                Ok(o) => format!("{:?}", o.outcome),
                Err(s) => format!("{:?}", s.code()),
            })
            .collect()
    }

    /// Duplicates inside one batch get exactly the answers one transaction each would give.
    #[test]
    fn duplicates_within_a_batch_answer_as_if_sequential() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = store::open(&dir.path().join("c.db")).unwrap();
        let s = Arc::new(StreamState::default());
        let batch = jobs(vec![
            (event("A1", "A", 1, 3), &s),
            (event("A1", "A", 1, 3), &s),
            (event("A1", "A", 1, 4), &s),
            (event("X", "A", 1, 3), &s),
            (event("B1", "B", 1, 3), &s),
        ]);
        let results =
            receive_batch(&mut conn, &batch, &CrashSwitch::default(), store::Admission::Unlimited, None);
        assert_eq!(
            words(&results),
            ["Accepted", "Duplicate", "IdConflict", "SequenceConflict { held_by: \"A1\" }", "Accepted"]
        );
        assert_eq!(store::flow_inbox(&conn, "A").unwrap().len(), 1);
        assert_eq!(store::flow_inbox(&conn, "B").unwrap().len(), 1);
        assert!(!s.failed());
    }

    /// An envelope whose insert a trigger rejects rolls back alone and fails its own stream:
    /// that stream's later envelopes are not stored; other streams' envelopes commit.
    #[test]
    fn a_failing_envelope_fails_only_its_stream() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = store::open(&dir.path().join("c.db")).unwrap();
        conn.execute_batch(
            "CREATE TRIGGER reject_b BEFORE INSERT ON inbox WHEN NEW.flow_id = 'B'
             BEGIN SELECT RAISE(ABORT, 'inbox insert rejected'); END;",
        )
        .unwrap();
        let (one, two) = (Arc::new(StreamState::default()), Arc::new(StreamState::default()));
        let batch = jobs(vec![
            (event("A1", "A", 1, 3), &one),
            (event("B1", "B", 1, 3), &one),
            (event("C1", "C", 1, 3), &one),
            (event("D1", "D", 1, 3), &two),
        ]);
        let results =
            receive_batch(&mut conn, &batch, &CrashSwitch::default(), store::Admission::Unlimited, None);
        assert_eq!(words(&results), ["Accepted", "Internal", "Aborted", "Accepted"]);
        assert!(results[1].as_ref().unwrap_err().message().contains("inbox insert rejected"));
        assert!(one.failed() && !two.failed());
        for (flow, rows) in [("A", 1), ("B", 0), ("C", 0), ("D", 1)] {
            assert_eq!(store::flow_inbox(&conn, flow).unwrap().len(), rows, "{flow}");
        }
    }
}
