//! Group commit of `Receive`: one writer task takes every envelope queued by all streams at
//! once into ONE transaction of the store (`ConsumerStore::receive_batch`: a savepoint per
//! envelope, so a failing envelope rolls back alone), and answers each only after the
//! commit. In auto-apply mode it then applies the flows the batch touched.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use proto::body::Event;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::apply::{self, ApplyOptions};
use crate::request::DEFAULT_MAX_STEPS;
use crate::storage::StorageWatch;
use crate::store::{self, BatchEvents, ConsumerStore, Incoming, ReceiveContext, ReceiveOutcome};

pub use crate::store::Received;

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

/// One envelope that passed the transport limits, queued for the writer.
pub struct ReceiveJob {
    /// The envelope's event.
    pub event: Event,
    /// When the producer committed it, if the envelope said.
    pub committed_at_us: Option<i64>,
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

/// Starts the writer task (on the current runtime). In auto-apply mode it first applies
/// whatever earlier runs left accepted but unapplied (a crash between a Receive commit and
/// its apply, say).
pub fn spawn(store: ConsumerStore, opts: WriterOptions) -> mpsc::Sender<ReceiveJob> {
    let queue = opts.max_batch.saturating_mul(4).clamp(64, 1 << 16);
    let max_batch = opts.max_batch.max(1);
    let (tx, mut rx) = mpsc::channel::<ReceiveJob>(queue);
    if opts.auto_apply {
        let store = store.clone();
        tokio::spawn(async move { sweep(&store, opts.apply).await });
    }
    if opts.auto_apply && opts.apply.support_v2 {
        let store = store.clone();
        tokio::spawn(async move { unblock_loop(&store, opts.apply).await });
    }
    tokio::spawn(async move {
        while let Some(first) = rx.recv().await {
            let mut jobs = Vec::with_capacity(max_batch.min(1024));
            jobs.push(first);
            while jobs.len() < max_batch {
                match rx.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
            write_batch(&store, jobs, opts).await;
        }
    });
    tx
}

/// One batch: stored in one transaction, every envelope answered after its commit, then (in
/// auto-apply mode) the flows it touched applied.
async fn write_batch(store: &ConsumerStore, jobs: Vec<ReceiveJob>, opts: WriterOptions) {
    let started = std::time::Instant::now();
    let batch_len = jobs.len();
    let mut replies = Vec::with_capacity(batch_len);
    let mut incoming = Vec::with_capacity(batch_len);
    for job in jobs {
        replies.push(job.reply);
        incoming.push(Incoming {
            event: job.event,
            committed_at_us: job.committed_at_us,
            stream: job.stream,
        });
    }
    let incoming = Arc::new(incoming);
    let ctx = ReceiveContext {
        crash: opts.apply.crash,
        admission: opts.admission,
        storage: opts.storage(),
        applied_next: opts.auto_apply,
    };
    let answers = store.receive_batch(Arc::clone(&incoming), ctx).await;
    let committed = started.elapsed();
    RECEIVE_BATCHES.record_timed(batch_len, started);
    let events = opts.auto_apply.then(|| BatchEvents::new(Arc::clone(&incoming), &answers));
    let mut touched = BTreeSet::new();
    for ((reply, envelope), answer) in replies.into_iter().zip(incoming.iter()).zip(answers) {
        let answer = match answer {
            None => Err(Status::aborted("receive: an earlier envelope of this stream failed")),
            Some(Ok(received)) => {
                if matches!(received.outcome, ReceiveOutcome::Accepted | ReceiveOutcome::Duplicate) {
                    touched.insert(envelope.event.flow_id.clone());
                }
                Ok(received)
            }
            Some(Err(e)) => Err(e.status("receive")),
        };
        // The stream may have ended meanwhile (client gone); its answer is moot.
        let _ = reply.send(answer);
    }
    let flows = touched.len();
    if let Some(events) = events.filter(|_| flows > 0) {
        auto_apply(store, touched.into_iter().collect(), events, opts.apply).await;
    }
    tracing::debug!(
        envelopes = batch_len,
        receive_us = committed.as_micros() as u64,
        auto_apply_flows = if opts.auto_apply { flows } else { 0 },
        total_us = started.elapsed().as_micros() as u64,
        "receive batch"
    );
}

/// Auto-apply at start-up: every flow with unapplied rows.
async fn sweep(store: &ConsumerStore, opts: ApplyOptions) {
    match apply::apply_all(store, DEFAULT_MAX_STEPS, opts).await {
        Ok(results) => {
            let applied: usize =
                results.iter().filter_map(|r| r.outcome.as_ref().ok()).map(|r| r.applied.len()).sum();
            log_failures(&results);
            tracing::info!(flows = results.len(), applied, "auto-apply: applied what earlier runs left");
        }
        Err(e) => tracing::warn!(error = %e, "auto-apply: cannot list flows with unapplied rows"),
    }
}

/// How often a `--support-v2 --auto-apply` consumer looks for flows blocked on a schema
/// it can read.
const UNBLOCK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Flows per read of the blocked ones.
const UNBLOCK_PAGE: usize = 1000;

/// In auto-apply mode with the v2 decoder: applies, every [`UNBLOCK_EVERY`], the flows whose
/// rows another instance (one without `--support-v2`, on the same database, during a rolling
/// upgrade) or an earlier run of this one left blocked as `unsupported_schema`. Auto-apply
/// otherwise applies only the flows a Receive batch touched, so without this such a flow would
/// wait for its next event or an operator's `Apply`. Reads the partial index of unapplied rows
/// only; a failure is logged and retried next time.
async fn unblock_loop(store: &ConsumerStore, opts: ApplyOptions) {
    let mut every = tokio::time::interval(UNBLOCK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The last listing failure, so an outage is logged once per cause, not every tick.
    let mut failing: Option<String> = None;
    loop {
        every.tick().await;
        let mut after = String::new();
        loop {
            let flows = match store
                .flows_blocked(crate::rules::BlockReason::UnsupportedSchema, after.clone(), UNBLOCK_PAGE)
                .await
            {
                Ok(flows) => {
                    if failing.take().is_some() {
                        tracing::info!(
                            "auto-apply: flows blocked on an unsupported schema can be listed again"
                        );
                    }
                    flows
                }
                Err(e) => {
                    let cause = e.to_string();
                    if failing.as_deref() == Some(cause.as_str()) {
                        tracing::debug!(error = %cause, "auto-apply: still cannot list blocked flows");
                    } else {
                        tracing::warn!(error = %cause, "auto-apply: cannot list flows blocked on an unsupported schema; retried every 2 s");
                        failing = Some(cause);
                    }
                    break;
                }
            };
            let Some(last) = flows.last().cloned() else { break };
            let full = flows.len() == UNBLOCK_PAGE;
            let results = store.apply_flows(flows, DEFAULT_MAX_STEPS, opts).await;
            log_failures(&results);
            let applied: usize =
                results.iter().filter_map(|r| r.outcome.as_ref().ok()).map(|r| r.applied.len()).sum();
            if applied > 0 {
                tracing::info!(
                    flows = results.len(),
                    applied,
                    "auto-apply: applied flows left blocked on a schema this consumer reads (--support-v2)"
                );
            }
            if !full {
                break;
            }
            after = last;
        }
    }
}

/// Auto-apply after a committed batch: the flows it touched, group-committed, each step of a
/// row the batch stored taking its event from `events`. A flow that stops at a gap or a
/// block simply waits (as with a manual Apply); a failing flow is logged and retried when its
/// next event arrives.
async fn auto_apply(store: &ConsumerStore, flows: Vec<String>, events: BatchEvents, opts: ApplyOptions) {
    let results = store.apply_received(flows, events, DEFAULT_MAX_STEPS, opts).await;
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
