//! Whether the consumer's database can still commit, and what the process does about it,
//! for either backend: every commit is preceded by [`StorageWatch::before_commit`] (on
//! SQLite, the file at the path is still the one this process opened: a deleted or replaced
//! database is never written through an unlinked inode), every commit outcome is reported
//! to the watch (a change of state is logged once, with its cause, and flips gRPC health
//! between `SERVING` and `NOT_SERVING`; on PostgreSQL a lost server counts as a failing
//! commit), and while storage fails a recovery task probes it and, in auto-apply mode,
//! applies what the failure left unapplied, so recovery needs no operator call.

use proto::db::{CommitFault, OpenedFiles};
use proto::target::DbTarget;
use runtime::health::StorageHealth;
use tokio::sync::watch;

use crate::apply::{self, ApplyOptions};
use crate::store::{ConsumerStore, StoreError};

/// The storage state of one consumer database, shared by the writer, the appliers, the
/// recovery task and the health service.
#[derive(Debug)]
pub struct StorageWatch {
    /// The database, as logs show it (password hidden).
    shown: String,
    /// A SQLite database file and its WAL as this process opened them (none on PostgreSQL).
    opened: OpenedFiles,
    /// The test hook that fails commits ([`proto::db::COMMIT_FAULT_ENV`]).
    fault: CommitFault,
    /// Set when auto-apply must run again over every flow (a failure may have left rows).
    apply_owed: std::sync::atomic::AtomicBool,
    health: StorageHealth,
}

impl StorageWatch {
    /// For a SQLite target, records the identity of the file and its `-wal` as opened now
    /// (call right after the connection is open); reads the fault hook from the environment.
    pub fn new(target: &DbTarget) -> StorageWatch {
        let fault = CommitFault::from_env("consumer");
        let opened = match target {
            DbTarget::Sqlite(path) => OpenedFiles::of(path),
            DbTarget::Postgres(_) => OpenedFiles::default(),
        };
        StorageWatch {
            shown: target.to_string(),
            opened,
            fault,
            apply_owed: std::sync::atomic::AtomicBool::new(false),
            health: StorageHealth::default(),
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
        self.opened.check().map_err(|what| {
            StoreError::FileReplaced(format!(
                "{what} under this running consumer; refusing to write to the file it had open \
                 (restart the consumer: it reopens what is at the path, and a relay re-sends what \
                 a new database lacks)"
            ))
        })?;
        self.fault.check().map_err(StoreError::Failed)
    }

    /// Reports a failed commit or write. Busy is contention, not a storage failure, and is
    /// not reported. The first failure (or a new cause) is logged once, health goes
    /// `NOT_SERVING`, and the recovery thread starts probing.
    pub fn commit_failed(&self, error: &StoreError) {
        if !error.is_storage_failure() {
            return;
        }
        let cause = error.to_string();
        self.apply_owed.store(true, std::sync::atomic::Ordering::Release);
        if self.health.failed(&cause) {
            tracing::error!(
                db = %self.shown,
                error = %cause,
                "consumer database cannot commit: health NOT_SERVING, nothing is accepted or applied until it can \
                 (retried with backoff)"
            );
        }
    }

    /// Reports a successful commit: after a failure, logged once, and health goes `SERVING`.
    pub fn commit_succeeded(&self) {
        if let Some(cause) = self.health.succeeded() {
            tracing::info!(db = %self.shown, after = %cause, "consumer database commits again: health SERVING");
        }
    }

    /// True while the last commit failed.
    pub fn is_failing(&self) -> bool {
        self.health.is_failing()
    }

    /// `true` while storage commits (`SERVING`), `false` while it fails.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.health.serving()
    }

    /// Starts the recovery task (on the current runtime): while storage fails it probes
    /// with a real commit (backing off from 100 ms to 5 s); in auto-apply mode it then
    /// applies every flow with unapplied rows, until a whole pass succeeds.
    pub fn spawn_recovery(&'static self, store: ConsumerStore, auto_apply: Option<ApplyOptions>) {
        let owed = move || {
            self.is_failing()
                || (auto_apply.is_some() && self.apply_owed.load(std::sync::atomic::Ordering::Acquire))
        };
        tokio::spawn(self.health.keep_probing(owed, move || {
            let store = store.clone();
            async move {
                if self.is_failing() {
                    match store.probe(self).await {
                        Ok(()) => self.commit_succeeded(),
                        Err(e) => return self.commit_failed(&e),
                    }
                }
                if let Some(opts) = auto_apply {
                    self.apply_owed.store(false, std::sync::atomic::Ordering::Release);
                    reapply(&store, opts).await;
                }
            }
        }));
    }
}

/// After a failure, in auto-apply mode: every flow with unapplied rows, as at start-up.
/// Failures are reported to the watch by the apply loop, which owes another pass then.
async fn reapply(store: &ConsumerStore, opts: ApplyOptions) {
    match apply::apply_all(store, crate::request::DEFAULT_MAX_STEPS, opts).await {
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
