//! gRPC health that follows storage, shared by both services: the cause of the current
//! failure (each user logs it, in its own words, when it changes), the health it drives, and
//! the wake-up of the task that probes until commits work again.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// The first pause between probes of storage that fails.
pub const PROBE_FIRST: Duration = Duration::from_millis(100);
/// The longest pause between probes (each failed probe doubles the pause up to it).
pub const PROBE_CAP: Duration = Duration::from_secs(5);

/// Whether storage takes commits: `SERVING` until a failure is reported, `NOT_SERVING` until a
/// success is.
#[derive(Debug)]
pub struct StorageHealth {
    /// The cause of the current failure, `None` while commits succeed.
    failing: Mutex<Option<String>>,
    serving: watch::Sender<bool>,
    wake: Notify,
}

impl Default for StorageHealth {
    fn default() -> Self {
        StorageHealth { failing: Mutex::new(None), serving: watch::Sender::new(true), wake: Notify::new() }
    }
}

impl StorageHealth {
    /// Storage failed with `cause`: health `NOT_SERVING`, and the prober woken. True when the
    /// cause is new (the caller logs it then).
    pub fn failed(&self, cause: &str) -> bool {
        let changed = {
            let mut failing = crate::blocking::lock(&self.failing);
            let changed = failing.as_deref() != Some(cause);
            if changed {
                *failing = Some(cause.to_owned());
            }
            changed
        };
        self.serving.send_if_modified(|s| std::mem::replace(s, false));
        self.wake.notify_one();
        changed
    }

    /// A commit (or a probe) worked: health `SERVING`. The cause of the failure it ends, if
    /// one did (the caller logs it then).
    pub fn succeeded(&self) -> Option<String> {
        let ended = crate::blocking::lock(&self.failing).take();
        if ended.is_some() {
            self.serving.send_replace(true);
        }
        ended
    }

    /// True while the last report was a failure.
    pub fn is_failing(&self) -> bool {
        crate::blocking::lock(&self.failing).is_some()
    }

    /// `true` while storage commits (`SERVING`), `false` while it fails.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.serving.subscribe()
    }

    /// Completes at the next failure reported (at once if one was since the last wait).
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Runs for ever (spawn it): while `owed()` (storage fails, or the caller owes work after
    /// a failure), runs `probe` every [`PROBE_FIRST`], doubling the pause up to [`PROBE_CAP`]
    /// (a failure reported meanwhile starts the pause over); otherwise waits for the next
    /// failure.
    pub async fn keep_probing<F>(&self, owed: impl Fn() -> bool, mut probe: impl FnMut() -> F)
    where
        F: std::future::Future<Output = ()>,
    {
        let mut pause = PROBE_FIRST;
        loop {
            if !owed() {
                pause = PROBE_FIRST;
                self.woken().await;
                continue;
            }
            if tokio::time::timeout(pause, self.woken()).await.is_ok() {
                continue;
            }
            pause = (pause * 2).min(PROBE_CAP);
            probe().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_new_once_and_a_success_ends_it() {
        let health = StorageHealth::default();
        let serving = health.serving();
        assert!(*serving.borrow() && !health.is_failing());
        assert_eq!(health.succeeded(), None, "nothing to end");
        assert!(health.failed("disk full"));
        assert!(!health.failed("disk full"), "the same cause again is not new");
        assert!(health.failed("connection refused"), "another cause is");
        assert!(!*serving.borrow() && health.is_failing());
        assert_eq!(health.succeeded(), Some("connection refused".to_owned()));
        assert!(*serving.borrow() && !health.is_failing());
    }
}
