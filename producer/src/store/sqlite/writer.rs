//! Group commit of `Advance` on SQLite: one writer thread owns producer.db's writes and runs every
//! call queued at once in ONE `BEGIN IMMEDIATE` transaction (a failing call, e.g. a trigger
//! raising, rolls back alone and gets its own error: see [`advance_batch`]), and answers
//! every call only after the commit that holds it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, OpenedFiles, StepFailure, Steps};
use runtime::health::StorageHealth;
use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot, watch};

use crate::request::AdvanceCommand;
use crate::store::{ADVANCE_BATCHES, AdvanceReply, StoreError};

/// One queued `Advance` and where its answer goes.
pub struct AdvanceJob {
    /// The validated call.
    pub cmd: AdvanceCommand,
    /// Gets the answer after the commit that holds the call (or its failure).
    pub reply: oneshot::Sender<Result<AdvanceReply, StoreError>>,
}

/// Whether producer.db takes the producer's commits, for gRPC health, checked and reported
/// around every `Advance` commit.
///
/// Before each commit: the path must still name the file this producer opened. Committed
/// into a deleted or replaced file, an event would be answered `COMMITTED` and be gone with
/// the process (nothing else can open that file; a restarted producer refuses the leftovers
/// of a deleted one). The first refusal is logged once and turns health `NOT_SERVING`, for
/// good: only a restart opens what is at the path.
///
/// A commit that fails for a reason of the storage's own (a full disk, an I/O error, a file
/// system remounted read-only) is logged once per cause and turns health `NOT_SERVING`; a
/// probe ([`spawn_prober`]) writes one row with backoff until a commit works, and that, or
/// the next committed batch, turns it back. Contention (`SQLITE_BUSY`) is not a failure.
#[derive(Debug)]
pub struct StorageWatch {
    files: OpenedFiles,
    /// The test hook that fails commits ([`db::COMMIT_FAULT_ENV`]).
    fault: db::CommitFault,
    /// Set once the file was found deleted or replaced: nothing succeeds after that.
    gone: AtomicBool,
    health: StorageHealth,
}

impl StorageWatch {
    /// Watches `path` as it is now (call right after opening it).
    pub fn new(path: &Path) -> StorageWatch {
        StorageWatch {
            files: OpenedFiles::of(path),
            fault: db::CommitFault::from_env("producer"),
            gone: AtomicBool::new(false),
            health: StorageHealth::default(),
        }
    }

    /// `false` while commits fail, and for good once the file was found gone (for health).
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.health.serving()
    }

    /// Inside the transaction, just before its commit: refuses (the caller rolls back) when
    /// the path no longer names the file opened, or while the test hook is armed.
    fn before_commit(&self) -> Result<(), StoreError> {
        self.files.check().map_err(|what| {
            self.gone.store(true, Ordering::Release);
            if self.health.failed(&what) {
                tracing::error!(
                    error = %what,
                    "PRODUCER DATABASE GONE under this running producer: no Advance commits any more (each is \
                     answered INTERNAL and nothing of it is written), health NOT_SERVING; restart the producer: \
                     it opens what is at the path, or refuses a deleted database's leftovers"
                );
            }
            StoreError::storage(
                "advance commit",
                format!(
                    "{what} under this running producer; refusing to commit to the file it had open \
                     (restart the producer)"
                ),
            )
        })?;
        // The test hook stands for a full disk.
        self.fault.check().map_err(|detail| StoreError::Storage {
            what: "advance commit",
            detail,
            outage: true,
        })
    }

    /// A transaction could not begin or commit. A storage failure (not contention, not a
    /// file already reported gone) is logged when its cause is new, and turns health
    /// `NOT_SERVING` until a commit works.
    fn commit_failed(&self, e: &StoreError) {
        if !matches!(e, StoreError::Storage { .. }) || self.gone.load(Ordering::Acquire) {
            return;
        }
        let cause = e.to_string();
        if self.health.failed(&cause) {
            tracing::error!(
                error = %cause,
                "producer database cannot commit: health NOT_SERVING, every Advance is answered INTERNAL \
                 and nothing of it is written until it can (probed with backoff)"
            );
        }
    }

    /// A transaction committed: after a failure, logged once, and health `SERVING`.
    fn committed(&self) {
        if self.gone.load(Ordering::Acquire) {
            return;
        }
        if let Some(cause) = self.health.succeeded() {
            tracing::info!(after = %cause, "producer database commits again: health SERVING");
        }
    }

    /// True while commits fail and a probe may end it (not once the file is gone).
    fn probe_owed(&self) -> bool {
        self.health.is_failing() && !self.gone.load(Ordering::Acquire)
    }
}

/// While `files` reports failing commits, writes one row of producer.db (the backlog
/// counter, to the value it has) in a transaction of its own, with the backoff of
/// [`StorageHealth::keep_probing`], until one commits. Started on the current runtime, if any.
pub fn spawn_prober(conn: Arc<Mutex<Connection>>, files: Arc<StorageWatch>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    runtime.spawn(async move {
        let owed = || files.probe_owed();
        files
            .health
            .keep_probing(owed, || {
                let (conn, probing) = (Arc::clone(&conn), Arc::clone(&files));
                async move {
                    // A lost blocking task is tried again at the next pause.
                    let _ = runtime::blocking::with_locked(&conn, move |conn| probe(conn, &probing)).await;
                }
            })
            .await;
    });
}

/// One probe: the write an `Advance` batch's commit makes, without an event.
fn probe(conn: &mut Connection, files: &StorageWatch) {
    let tx = match db::begin_immediate(conn) {
        Ok(tx) => tx,
        Err(e) => return files.commit_failed(&StoreError::from(e).during("advance commit")),
    };
    let written = tx
        .execute("UPDATE backlog SET unaccepted = unaccepted WHERE id = 1", [])
        .map_err(StoreError::from)
        .and_then(|_| files.before_commit())
        .and_then(|()| tx.commit().map_err(StoreError::from));
    match written {
        Ok(()) => files.committed(),
        Err(e) => files.commit_failed(&e.during("advance commit")),
    }
}

/// Starts the writer thread; calls wait (back-pressure) when `4 × max_batch` are queued.
/// Every commit is preceded by `files`' check.
pub fn spawn(
    conn: Arc<Mutex<Connection>>,
    crash: CrashSwitch,
    max_batch: usize,
    max_unaccepted: Option<u64>,
    files: Arc<StorageWatch>,
) -> std::io::Result<mpsc::Sender<AdvanceJob>> {
    let answers = runtime::group::Answers::new();
    runtime::group::spawn_writer(
        "advance-writer",
        max_batch,
        queue_len(max_batch),
        move |jobs: Vec<AdvanceJob>| {
            let (cmds, replies): (Vec<_>, Vec<_>) = jobs.into_iter().map(|j| (j.cmd, j.reply)).unzip();
            let started = std::time::Instant::now();
            let results =
                { advance_batch(&mut runtime::blocking::lock(&conn), &cmds, &crash, max_unaccepted, &files) };
            ADVANCE_BATCHES.record_timed(cmds.len(), started);
            tracing::debug!(calls = cmds.len(), us = started.elapsed().as_micros() as u64, "advance batch");
            answers.send(replies.into_iter().zip(results).collect());
        },
    )
}

fn queue_len(max_batch: usize) -> usize {
    max_batch.saturating_mul(4).clamp(64, 1 << 16)
}

/// SPEC §5 for a batch of calls in ONE `BEGIN IMMEDIATE` transaction, in queue order, so a
/// later call sees an earlier one's writes exactly as it would after that call's own commit.
/// The calls first run directly in the transaction; if one fails, that transaction is rolled
/// back unanswered and the batch runs again with each call in its own savepoint, so the
/// failing call (e.g. a trigger raising) rolls back alone and gets its own error (see
/// [`db::Steps`]). Commits only when some call wrote (`COMMITTED`); a batch of
/// `EXISTING`/`STALE`/… answers writes nothing and reaches no crash point. If the commit
/// fails, or `files` refuses it, every call of the batch gets the error (none of them is
/// committed).
pub fn advance_batch(
    conn: &mut Connection,
    cmds: &[AdvanceCommand],
    crash: &CrashSwitch,
    max_unaccepted: Option<u64>,
    files: &StorageWatch,
) -> Vec<Result<AdvanceReply, StoreError>> {
    match advance_in_tx(conn, cmds, crash, max_unaccepted, files, Steps::Direct) {
        Some(results) => results,
        None => advance_in_tx(conn, cmds, crash, max_unaccepted, files, Steps::Savepoint)
            // With savepoints every failure is answered; nothing asks for another run.
            .unwrap_or_default(),
    }
}

/// One run of [`advance_batch`]; `None` when a call failed in a `Direct` run (the
/// transaction is rolled back, nothing is answered).
fn advance_in_tx(
    conn: &mut Connection,
    cmds: &[AdvanceCommand],
    crash: &CrashSwitch,
    max_unaccepted: Option<u64>,
    files: &StorageWatch,
    steps: Steps,
) -> Option<Vec<Result<AdvanceReply, StoreError>>> {
    let fail_all = |e: StoreError| Some(cmds.iter().map(|_| Err(e.clone())).collect());
    let tx = match db::begin_immediate(conn) {
        Ok(tx) => tx,
        Err(e) => {
            let e = StoreError::from(e).during("advance");
            files.commit_failed(&e);
            return fail_all(e);
        }
    };
    let mut unaccepted = super::Unaccepted::new(max_unaccepted);
    let mut held = db::Held::new(&tx);
    let mut results = Vec::with_capacity(cmds.len());
    for (i, cmd) in cmds.iter().enumerate() {
        let step = db::in_step(&tx, steps, |tx| {
            super::advance(tx, &mut held, cmd, crash, runtime::now_us(), &mut unaccepted, steps)
        });
        match step {
            Ok(reply) => results.push(Ok(reply)),
            Err(_) if steps == Steps::Direct => return None,
            Err(StepFailure::RolledBack(e)) => results.push(Err(e.during("advance"))),
            Err(StepFailure::TransactionLost(e)) => {
                // Nothing of this transaction can commit: every call fails, none is half done.
                tracing::warn!(error = %e, lost = i, "advance batch rolled back whole");
                let e = e.during("advance");
                files.commit_failed(&e);
                return fail_all(e);
            }
        }
    }
    drop(held);
    if unaccepted.added() == 0 {
        // Nothing was written; dropping the transaction releases the lock.
        return Some(results);
    }
    let committed = unaccepted
        .write(&tx)
        .and_then(|()| files.before_commit())
        .and_then(|()| tx.commit().map_err(StoreError::from));
    if let Err(e) = committed {
        let e = e.during("advance commit");
        files.commit_failed(&e);
        return fail_all(e);
    }
    files.committed();
    crash.reach(CrashPoint::ProducerAfterCommit);
    Some(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::AdvanceOutcome;
    use crate::store::sqlite as store;
    use crate::store::sqlite::tests::step_of as cmd;
    use proto::db::OpenMode;

    /// [`advance_batch`] on `dir`'s `p.db`, without crash points or an outbox cap.
    fn run(
        conn: &mut Connection,
        dir: &tempfile::TempDir,
        batch: &[AdvanceCommand],
    ) -> Vec<Result<AdvanceReply, StoreError>> {
        advance_batch(
            conn,
            batch,
            &CrashSwitch::default(),
            None,
            &StorageWatch::new(&dir.path().join("p.db")),
        )
    }

    fn outcome(r: &Result<AdvanceReply, StoreError>) -> Result<AdvanceOutcome, bool> {
        r.as_ref().map(|r| r.outcome.clone()).map_err(StoreError::is_retryable)
    }

    /// One batch gives exactly the answers the same calls would get one transaction each.
    #[test]
    fn a_batch_answers_like_sequential_calls() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = store::open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        let batch = [
            cmd("A", "A1", 0, "reserved"),
            cmd("A", "A1", 0, "reserved"),
            cmd("A", "X1", 0, "reserved"),
            cmd("A", "A2", 1, "confirmed"),
            cmd("B", "A2", 0, "reserved"),
            cmd("B", "B1", 0, "released"),
        ];
        let results = run(&mut conn, &dir, &batch);
        let got: Vec<_> = results.iter().map(outcome).collect();
        assert!(matches!(got[5], Ok(AdvanceOutcome::InvalidTransition(_))), "{got:?}");
        assert_eq!(
            got[..5],
            [
                Ok(AdvanceOutcome::Committed),
                Ok(AdvanceOutcome::Existing),
                Ok(AdvanceOutcome::Stale),
                Ok(AdvanceOutcome::Committed),
                Ok(AdvanceOutcome::Conflict),
            ]
        );
        assert_eq!(store::flow_record(&conn, "A").unwrap().seq, 2);
        assert_eq!(store::flow_outbox(&conn, "A").unwrap().len(), 2);
        assert!(store::flow_outbox(&conn, "B").unwrap().is_empty());
    }

    /// A direct run does not look up the id of a call at its flow's expected seq; a taken id
    /// is still answered by its history first, whether the step would write (the insert
    /// fails, the batch runs again with savepoints) or not (an illegal step reads it).
    #[test]
    fn a_taken_id_at_the_expected_seq_is_answered_by_its_history() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = store::open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        run(&mut conn, &dir, &[cmd("A", "A1", 0, "reserved")]);
        let batch = [
            cmd("B", "B1", 0, "reserved"),
            cmd("C", "A1", 0, "reserved"),
            cmd("D", "A1", 0, "released"),
            cmd("E", "E1", 0, "released"),
            cmd("B", "B2", 1, "confirmed"),
        ];
        let results = run(&mut conn, &dir, &batch);
        let got: Vec<_> = results.iter().map(outcome).collect();
        assert_eq!(
            got[..3],
            [Ok(AdvanceOutcome::Committed), Ok(AdvanceOutcome::Conflict), Ok(AdvanceOutcome::Conflict)]
        );
        assert!(matches!(got[3], Ok(AdvanceOutcome::InvalidTransition(_))), "{got:?}");
        assert_eq!(got[4], Ok(AdvanceOutcome::Committed));
        assert_eq!(store::flow_record(&conn, "B").unwrap().seq, 2);
        for flow in ["C", "D", "E"] {
            assert_eq!(store::flow_record(&conn, flow).unwrap().seq, 0, "{flow} moved");
            assert!(store::flow_outbox(&conn, flow).unwrap().is_empty());
        }
    }

    /// A batch with nothing to write leaves the file untouched (no commit at all).
    #[test]
    fn a_batch_without_writes_commits_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = store::open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        run(&mut conn, &dir, &[cmd("A", "A1", 0, "reserved")]);
        let wal = dir.path().join("p.db-wal");
        let before = std::fs::metadata(&wal).unwrap().len();
        let results = run(&mut conn, &dir, &[cmd("A", "A1", 0, "reserved"), cmd("A", "Z", 0, "reserved")]);
        assert_eq!(outcome(&results[0]), Ok(AdvanceOutcome::Existing));
        assert_eq!(outcome(&results[1]), Ok(AdvanceOutcome::Stale));
        assert_eq!(std::fs::metadata(&wal).unwrap().len(), before, "a batch without writes wrote the WAL");
        let other = store::open(&dir.path().join("p.db"), OpenMode::Existing).unwrap();
        assert_eq!(store::outbox_counts(&other).unwrap(), (1, 1));
    }
}
