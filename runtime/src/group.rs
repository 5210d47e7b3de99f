//! Group commit plumbing shared by the producer's and the consumer's writers: one blocking
//! thread owns the writes and takes every job already queued (up to a cap) into one
//! transaction, so many callers share one durable commit and each is answered after it.

use tokio::sync::{mpsc, oneshot};

/// The largest batch cap any `--max-batch`-style flag accepts.
pub const MAX_BATCH_CAP: usize = 65_536;

/// Starts the writer thread `name`: it waits for a job, takes every further job already
/// queued up to `max_batch` in all, and hands the batch to `each_batch`; it ends when every
/// sender is dropped. `queue` bounds the jobs waiting (callers then wait: back-pressure).
/// SQLite work belongs here, never on the async runtime.
pub fn spawn_writer<J, F>(
    name: &str,
    max_batch: usize,
    queue: usize,
    mut each_batch: F,
) -> std::io::Result<mpsc::Sender<J>>
where
    J: Send + 'static,
    F: FnMut(Vec<J>) + Send + 'static,
{
    let max_batch = max_batch.max(1);
    let (tx, mut rx) = mpsc::channel::<J>(queue.max(1));
    std::thread::Builder::new().name(name.to_owned()).spawn(move || {
        while let Some(first) = rx.blocking_recv() {
            let mut batch = Vec::with_capacity(max_batch.min(1024));
            batch.push(first);
            while batch.len() < max_batch {
                match rx.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            each_batch(batch);
        }
    })?;
    Ok(tx)
}

/// Answers a writer thread hands to its callers, a batch at a time. Each answer sent from
/// the writer thread straight to a caller's task wakes the runtime from another thread (a
/// remote schedule and, while the runtime sleeps, a `write` to its wake-up eventfd) and lets
/// each caller's response leave in a write of its own. Handed over as one batch, to a task
/// on the runtime that answers them there, a batch costs one wake-up, and its callers'
/// responses are ready in the same turn of the runtime, so a connection writes them together.
pub struct Answers<T> {
    /// To the answering task; `None` outside a runtime (answers go straight to the callers).
    batches: Option<mpsc::UnboundedSender<Answered<T>>>,
}

/// A batch's callers, each with its answer.
pub type Answered<T> = Vec<(oneshot::Sender<T>, T)>;

impl<T: Send + 'static> Answers<T> {
    /// Spawns the answering task on the current runtime, if any. The queue is bounded by the
    /// writer's: it holds the answers of the batches taken and not answered yet.
    pub fn new() -> Answers<T> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return Answers { batches: None } };
        let (batches, mut queued) = mpsc::unbounded_channel::<Answered<T>>();
        runtime.spawn(async move {
            while let Some(batch) = queued.recv().await {
                answer_all(batch);
            }
        });
        Answers { batches: Some(batches) }
    }

    /// Answers every caller of `batch`, in order (a caller that went away is skipped).
    pub fn send(&self, batch: Answered<T>) {
        match &self.batches {
            Some(batches) => {
                // The runtime is gone (shutting down): answer from here.
                if let Err(mpsc::error::SendError(batch)) = batches.send(batch) {
                    answer_all(batch);
                }
            }
            None => answer_all(batch),
        }
    }
}

impl<T: Send + 'static> Default for Answers<T> {
    fn default() -> Self {
        Answers::new()
    }
}

fn answer_all<T>(batch: Answered<T>) {
    for (caller, answer) in batch {
        // The caller may have gone away (deadline, disconnect); its answer is moot.
        let _ = caller.send(answer);
    }
}

/// Parses a batch cap flag: an integer from 1 to [`MAX_BATCH_CAP`].
pub fn parse_cap(value: &str) -> Result<usize, String> {
    let n: usize = value.parse().map_err(|e| format!("{value:?} is not a count: {e}"))?;
    if (1..=MAX_BATCH_CAP).contains(&n) {
        Ok(n)
    } else {
        Err(format!("must be 1 to {MAX_BATCH_CAP}, got {n}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_jobs_share_a_batch_up_to_the_cap() {
        let (seen_tx, seen_rx) = std::sync::mpsc::channel::<Vec<u32>>();
        let gate = std::sync::Arc::new(std::sync::Barrier::new(2));
        let writer_gate = std::sync::Arc::clone(&gate);
        let mut first = true;
        let tx = spawn_writer("test-writer", 3, 16, move |batch: Vec<u32>| {
            if first {
                // Hold the first batch until the test queued the rest.
                first = false;
                writer_gate.wait();
            }
            seen_tx.send(batch).unwrap();
        })
        .unwrap();
        tx.blocking_send(0).unwrap();
        for i in 1..=5 {
            tx.blocking_send(i).unwrap();
        }
        gate.wait();
        drop(tx);
        let batches: Vec<Vec<u32>> = seen_rx.iter().collect();
        // The first batch may or may not have caught some of the rest; every later one was
        // queued in full while the first was held, so it is as large as the cap allows.
        assert_eq!(batches.concat(), [0, 1, 2, 3, 4, 5], "{batches:?}");
        assert!(batches.iter().all(|b| !b.is_empty() && b.len() <= 3), "{batches:?}");
        let left_after_first = 6 - batches[0].len();
        assert_eq!(batches[1].len(), left_after_first.min(3), "{batches:?}");
    }

    /// On a runtime the answers travel as one batch and arrive in order; outside one they go
    /// straight to the callers.
    #[test]
    fn answers_reach_every_caller_with_or_without_a_runtime() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for inside in [true, false] {
            let answers: Answers<u32> =
                if inside { runtime.block_on(async { Answers::new() }) } else { Answers::new() };
            assert_eq!(answers.batches.is_some(), inside);
            let (callers, waits): (Vec<_>, Vec<_>) = (0..5).map(|_| oneshot::channel::<u32>()).unzip();
            // A caller gone before its answer is skipped; the others get theirs.
            let mut waits = waits;
            drop(waits.remove(2));
            std::thread::spawn(move || answers.send(callers.into_iter().zip(10..15).collect()))
                .join()
                .unwrap();
            let got: Vec<u32> = runtime.block_on(async {
                let mut got = Vec::new();
                for w in waits {
                    got.push(w.await.unwrap());
                }
                got
            });
            assert_eq!(got, [10, 11, 13, 14]);
        }
    }

    #[test]
    fn caps_are_checked() {
        assert_eq!(parse_cap("1"), Ok(1));
        assert!(parse_cap("0").is_err());
        assert!(parse_cap("x").is_err());
        assert!(parse_cap(&(MAX_BATCH_CAP + 1).to_string()).is_err());
    }
}
