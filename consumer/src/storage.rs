//! Whether consumer.db can still commit, and what the process does about it: every commit is
//! preceded by [`StorageWatch::before_commit`] (the file at the path is still the one this
//! process opened: a deleted or replaced database is never written through an unlinked
//! inode), every commit outcome is reported to the watch (a change of state is logged once,
//! with its cause, and flips gRPC health between `SERVING` and `NOT_SERVING`), and while
//! storage fails a recovery thread probes it and, in auto-apply mode, applies what the
//! failure left unapplied, so recovery needs no operator call.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::watch;

use crate::apply::{self, ApplyOptions};
use crate::store::{self, StoreError};

/// Test hook, armed only through the environment like crash points: while the file this
/// variable names exists, every consumer.db commit fails as a full disk does. Used where the
/// machine cannot mount a small filesystem to fill for real.
pub const FAULT_ENV: &str = "ORDERED_EVENTS_FAULT_COMMIT_FAILS_WHILE";

/// The first pause between recovery attempts, and its cap.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_CAP: Duration = Duration::from_secs(5);

/// One file's identity on disk (device, inode).
type FileId = (u64, u64);

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The storage state of one consumer.db, shared by the writer, the appliers, the recovery
/// thread and the health service.
#[derive(Debug)]
pub struct StorageWatch {
    path: PathBuf,
    /// The database file and its WAL as this process opened them.
    opened: [(PathBuf, Option<FileId>); 2],
    fault: Option<PathBuf>,
    /// The cause of the current failure, `None` while commits succeed.
    failing: Mutex<Option<String>>,
    /// Set when auto-apply must run again over every flow (a failure may have left rows).
    apply_owed: std::sync::atomic::AtomicBool,
    serving: watch::Sender<bool>,
    wake: Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

impl StorageWatch {
    /// Records the identity of `path` and its `-wal` as opened now (call right after the
    /// connection is open), and reads the fault hook from the environment.
    pub fn new(path: &Path) -> StorageWatch {
        let fault = std::env::var_os(FAULT_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(fault) = &fault {
            tracing::warn!(
                env = FAULT_ENV,
                while_exists = %fault.display(),
                "FAULT INJECTION ARMED: consumer.db commits fail while this file exists"
            );
        }
        let db = path.to_owned();
        let wal = sidecar(path, "-wal");
        StorageWatch {
            path: path.to_owned(),
            opened: [(db.clone(), file_id(&db)), (wal.clone(), file_id(&wal))],
            fault,
            failing: Mutex::new(None),
            apply_owed: std::sync::atomic::AtomicBool::new(false),
            serving: watch::channel(true).0,
            wake: Mutex::new(None),
        }
    }

    /// A watch kept for the process's life: the options that carry it stay `Copy`.
    pub fn leak(self) -> &'static StorageWatch {
        Box::leak(Box::new(self))
    }

    /// Inside an open write transaction, just before its commit: refuses (the caller rolls
    /// back) when the database or its WAL at the path is no longer the file this process
    /// opened (deleted, or replaced by another file), or when the fault hook is armed.
    pub fn before_commit(&self) -> Result<(), StoreError> {
        for (path, opened) in &self.opened {
            let now = file_id(path);
            // A WAL that did not exist at open is adopted when first seen.
            if opened.is_some() && now != *opened {
                let what = if now.is_none() { "was deleted" } else { "was replaced by another file" };
                return Err(StoreError::FileReplaced(format!(
                    "{} {what} under this running consumer; refusing to write to the file it had open \
                     (restart the consumer: it reopens what is at the path, and a relay re-sends what \
                     a new database lacks)",
                    path.display()
                )));
            }
        }
        if let Some(fault) = &self.fault
            && fault.exists()
        {
            return Err(StoreError::Sqlite(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
                Some(format!("database or disk is full (injected: {} exists)", fault.display())),
            )));
        }
        Ok(())
    }

    /// Reports a failed commit or write. Busy is contention, not a storage failure, and is
    /// not reported. The first failure (or a new cause) is logged once, health goes
    /// `NOT_SERVING`, and the recovery thread starts probing.
    pub fn commit_failed(&self, error: &StoreError) {
        if !is_storage_failure(error) {
            return;
        }
        let cause = error.to_string();
        let mut failing = runtime::blocking::lock(&self.failing);
        if failing.as_deref() != Some(cause.as_str()) {
            tracing::error!(
                db = %self.path.display(),
                error = %cause,
                "consumer.db cannot commit: health NOT_SERVING, nothing is accepted or applied until it can \
                 (retried with backoff)"
            );
            *failing = Some(cause);
        }
        drop(failing);
        self.apply_owed.store(true, std::sync::atomic::Ordering::Release);
        self.serving.send_if_modified(|s| std::mem::replace(s, false));
        if let Some(wake) = runtime::blocking::lock(&self.wake).as_ref() {
            let _ = wake.send(());
        }
    }

    /// Reports a successful commit: after a failure, logged once, and health goes `SERVING`.
    pub fn commit_succeeded(&self) {
        let mut failing = runtime::blocking::lock(&self.failing);
        if let Some(cause) = failing.take() {
            tracing::info!(db = %self.path.display(), after = %cause, "consumer.db commits again: health SERVING");
            self.serving.send_replace(true);
        }
    }

    /// True while the last commit failed.
    pub fn is_failing(&self) -> bool {
        runtime::blocking::lock(&self.failing).is_some()
    }

    /// `true` while storage commits (`SERVING`), `false` while it fails.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// Starts the recovery thread: while storage fails it probes with a real commit (backing
    /// off from 100 ms to 5 s); in auto-apply mode it then applies every flow with
    /// unapplied rows, until a whole pass succeeds.
    pub fn spawn_recovery(
        &'static self,
        conn: std::sync::Arc<Mutex<Connection>>,
        auto_apply: Option<ApplyOptions>,
    ) -> std::io::Result<()> {
        let (wake, woken) = std::sync::mpsc::channel::<()>();
        *runtime::blocking::lock(&self.wake) = Some(wake);
        std::thread::Builder::new().name("storage-recovery".into()).spawn(move || {
            let mut pause = RETRY_FIRST;
            loop {
                let owed = self.apply_owed.load(std::sync::atomic::Ordering::Acquire) && auto_apply.is_some();
                if !self.is_failing() && !owed {
                    pause = RETRY_FIRST;
                    if woken.recv().is_err() {
                        return;
                    }
                    continue;
                }
                match woken.recv_timeout(pause) {
                    Ok(()) => continue,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                }
                pause = (pause * 2).min(RETRY_CAP);
                if self.is_failing() {
                    match self.probe(&conn) {
                        Ok(()) => self.commit_succeeded(),
                        Err(e) => {
                            self.commit_failed(&e);
                            continue;
                        }
                    }
                }
                if let Some(opts) = auto_apply {
                    self.apply_owed.store(false, std::sync::atomic::Ordering::Release);
                    reapply(&conn, opts);
                }
            }
        })?;
        Ok(())
    }

    /// One real commit: a write to the identity row, checked like every other commit.
    fn probe(&self, conn: &Mutex<Connection>) -> Result<(), StoreError> {
        let mut conn = runtime::blocking::lock(conn);
        let tx = proto::db::begin_immediate(&mut conn)?;
        store::touch_probe(&tx, runtime::now_us())?;
        self.before_commit()?;
        tx.commit()?;
        Ok(())
    }
}

/// After a failure, in auto-apply mode: every flow with unapplied rows, as at start-up.
/// Failures are reported to the watch by the apply loop, which owes another pass then.
fn reapply(conn: &Mutex<Connection>, opts: ApplyOptions) {
    match apply::apply_all(conn, crate::request::DEFAULT_MAX_STEPS, opts) {
        Ok(results) => {
            let applied: usize =
                results.iter().filter_map(|r| r.outcome.as_ref().ok()).map(|r| r.applied.len()).sum();
            let failed = results.iter().filter(|r| r.outcome.is_err()).count();
            tracing::info!(flows = results.len(), applied, failed, "auto-apply after a storage failure");
        }
        Err(e) => {
            if let Some(watch) = opts.storage {
                watch.commit_failed(&e);
            }
        }
    }
}

/// Whether an error means storage cannot commit (as opposed to contention or a bad row).
pub fn is_storage_failure(error: &StoreError) -> bool {
    match error {
        // A constraint or a trigger refuses one row; the storage itself is fine.
        StoreError::Sqlite(e) => {
            !proto::db::is_busy(e) && e.sqlite_error_code() != Some(rusqlite::ErrorCode::ConstraintViolation)
        }
        StoreError::FileReplaced(_) => true,
        StoreError::Inconsistent(_) => false,
    }
}
