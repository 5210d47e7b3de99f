//! The `Apply` loop (SPEC §7), group-committed: per flow, exactly the next seq, decided by
//! `rules` and then blocked or applied by the store. Consecutive steps of many flows share
//! one transaction (up to `max_batch` steps), every decision is read inside it, and each step
//! (projection + effect + inbox mark) runs in its own savepoint, so a failing step rolls back
//! alone; every step is a compare-and-set on the flow's projection, so racing appliers
//! (threads, processes or instances) leave one effect per seq. The loops themselves live in
//! each backend (`store::sqlite`, `store::pg`); this module holds what they report.

use proto::crash::CrashSwitch;
use runtime::batches::BatchSizes;

use crate::rules::{BlockReason, Projection};
use crate::storage::StorageWatch;
use crate::store::{ConsumerStore, StoreError};

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
    /// `--retention 0`: on PostgreSQL an applied row loses its body (keeping its digest) in
    /// the statement that marks it applied, not in a later pass (one row version instead of
    /// two); the pass reports it. SQLite compacts in its passes either way.
    pub compact_applied: bool,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        ApplyOptions {
            support_v2: false,
            crash: CrashSwitch::default(),
            max_batch: DEFAULT_APPLY_BATCH,
            storage: None,
            compact_applied: false,
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
/// `opts.max_batch` steps (so `Receive` interleaves with a long `Apply`).
pub async fn apply_flow(
    store: &ConsumerStore,
    flow_id: &str,
    max_steps: u32,
    opts: ApplyOptions,
) -> Result<ApplyReport, ApplyFailure> {
    let mut results = store.apply_flows(vec![flow_id.to_owned()], max_steps, opts).await;
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
/// Only failing to list the flows fails the call.
pub async fn apply_all(
    store: &ConsumerStore,
    max_steps: u32,
    opts: ApplyOptions,
) -> Result<Vec<FlowResult>, StoreError> {
    let mut results = Vec::new();
    let mut after = String::new();
    loop {
        let page = store.flows_with_unapplied(after, FLOW_PAGE).await?;
        let Some(last) = page.last() else { return Ok(results) };
        after = last.clone();
        results.extend(store.apply_flows(page, max_steps, opts).await);
    }
}

/// Steps per committed apply transaction (either backend), logged at shutdown.
pub(crate) static APPLY_BATCHES: BatchSizes = BatchSizes::new("apply");

/// Counts one flow's result in the metrics and reports a storage failure to the watch; both
/// backends call it for every result they return.
pub(crate) fn finish(
    flow_id: String,
    outcome: Result<ApplyReport, ApplyFailure>,
    opts: &ApplyOptions,
) -> FlowResult {
    if let (Err(failure), Some(watch)) = (&outcome, opts.storage) {
        watch.commit_failed(&failure.source);
    }
    crate::metrics::count_stop(outcome.as_ref().ok().map(|report| &report.stop));
    FlowResult { flow_id, outcome }
}
