//! Blocking work beside the async runtime: SQLite calls run on blocking threads, never on the
//! runtime's, and a connection shared between threads survives a panic of one of its users.

use std::sync::{Arc, Mutex, MutexGuard};

/// Locks `shared`, recovering it if a thread panicked while holding it: a panic while
/// holding a connection rolled its open transaction back on unwind (rusqlite's drop), so the
/// connection itself is still usable, and refusing it would stop the service for good.
pub fn lock<T>(shared: &Mutex<T>) -> MutexGuard<'_, T> {
    shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A blocking task that panicked or was cancelled: its work may not have run.
#[derive(Debug, thiserror::Error)]
#[error("storage task failed: {0}")]
pub struct TaskFailed(#[from] tokio::task::JoinError);

impl From<TaskFailed> for tonic::Status {
    /// The work was storage work, so a lost task is `INTERNAL`.
    fn from(e: TaskFailed) -> tonic::Status {
        tonic::Status::internal(e.to_string())
    }
}

/// Runs `f` with `shared` locked for the whole call, on a blocking thread.
pub async fn with_locked<T, R, F>(shared: &Arc<Mutex<T>>, f: F) -> Result<R, TaskFailed>
where
    T: Send + 'static,
    R: Send + 'static,
    F: FnOnce(&mut T) -> R + Send + 'static,
{
    let shared = Arc::clone(shared);
    Ok(tokio::task::spawn_blocking(move || f(&mut lock(&shared))).await?)
}

/// Runs `f` with `shared` unlocked, on a blocking thread: for work that takes the lock per
/// step (with [`lock`]) so other users interleave with it.
pub async fn with_shared<T, R, F>(shared: &Arc<Mutex<T>>, f: F) -> Result<R, TaskFailed>
where
    T: Send + 'static,
    R: Send + 'static,
    F: FnOnce(&Mutex<T>) -> R + Send + 'static,
{
    let shared = Arc::clone(shared);
    Ok(tokio::task::spawn_blocking(move || f(&shared)).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_recovered() {
        let shared = Arc::new(Mutex::new(1));
        let poisoner = Arc::clone(&shared);
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().unwrap();
            panic!("poison the lock");
        })
        .join();
        assert!(shared.is_poisoned());
        *lock(&shared) += 1;
        assert_eq!(*lock(&shared), 2);
    }

    #[tokio::test]
    async fn blocking_calls_see_the_shared_value() {
        let shared = Arc::new(Mutex::new(vec![1]));
        with_locked(&shared, |v| v.push(2)).await.unwrap();
        let len = with_shared(&shared, |m| lock(m).len()).await.unwrap();
        assert_eq!(len, 2);
        let panicked = with_locked(&shared, |_| -> () { panic!("boom") }).await.unwrap_err();
        assert_eq!(tonic::Status::from(panicked).code(), tonic::Code::Internal);
        // The panic poisoned the lock; the value is still there.
        assert_eq!(*lock(&shared), [1, 2]);
    }
}
