//! The consumer's store boundary: the domain types every backend shares, the one error enum
//! ([`StoreError`]) and [`ConsumerStore`], the store the service, the Receive writer, the
//! applier and the storage watch talk to. Each backend (`sqlite`, `pg`) owns all of its SQL;
//! no rusqlite or PostgreSQL type crosses this module. The invariants both keep: a stored
//! body never changes, and a flow's effects are a contiguous prefix of its seqs, each applied
//! once (a compare-and-set on the projection decides every step).
//!
//! An enum over the two backends rather than a trait object: the call sites stay plain
//! `store.apply_flows(..).await`, there is no `async fn` in a `dyn` trait to box, and a
//! third backend is one more arm the compiler points at everywhere.

pub mod pg;
pub mod sqlite;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use proto::body::Event;
use proto::crash::CrashSwitch;
use proto::target::DbTarget;
use runtime::OpenError;
pub use runtime::retention::CompactReport;

use crate::apply::{ApplyOptions, FlowResult};
use crate::receive::StreamState;
use crate::rules::{BlockReason, Projection};
use crate::storage::StorageWatch;

/// Why a store call failed, whatever the backend. The variants say what a caller can do:
/// retry (`Busy`, `Unavailable`), or report a failure (the others).
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// Contention: the database is locked by another writer (SQLite busy), or PostgreSQL
    /// gave up on a serialization failure or deadlock the store could not retry. Retryable.
    #[error("{0}")]
    Busy(String),
    /// PostgreSQL aborted the transaction to break a deadlock or a serialization failure.
    /// Retryable, but never inside the same transaction: a savepoint keeps every lock taken
    /// before it, so the same wait (and the same deadlock) would come back. The whole
    /// transaction is run again.
    #[error("{0}")]
    Aborted(String),
    /// The database server cannot be reached or dropped the connection. Retryable, and a
    /// storage failure (health goes `NOT_SERVING` until a probe commits again).
    #[error("{0}")]
    Unavailable(String),
    /// A constraint or a trigger refused one write; the storage itself is fine.
    #[error("{0}")]
    Refused(String),
    /// The storage failed (I/O error, disk full, any other database error).
    #[error("{0}")]
    Failed(String),
    /// The database holds something this store never writes (edited by hand, or a bug).
    #[error("the consumer database is inconsistent: {0}")]
    Inconsistent(String),
    /// The file at the database's path is no longer the one this process has open.
    #[error("{0}")]
    FileReplaced(String),
}

impl StoreError {
    /// Whether the caller may simply try again later (`UNAVAILABLE` on the wire).
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Busy(_) | StoreError::Aborted(_) | StoreError::Unavailable(_))
    }

    /// Whether the failure ends the transaction it happened in (the server is gone, or it
    /// aborted the transaction): no savepoint can undo it, and the caller drops the
    /// transaction instead of going on with it.
    pub fn loses_transaction(&self) -> bool {
        matches!(self, StoreError::Aborted(_) | StoreError::Unavailable(_))
    }

    /// Whether the error means storage cannot commit (health `NOT_SERVING`), as opposed to
    /// contention or one refused or bad row.
    pub fn is_storage_failure(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Failed(_) | StoreError::FileReplaced(_))
    }

    /// The gRPC status for this failure of `what`: the one mapping in the consumer.
    /// Busy and unreachable storage are `UNAVAILABLE` (retryable); everything else
    /// `INTERNAL`. The call changed nothing that was not committed.
    pub fn status(&self, what: &str) -> tonic::Status {
        match self {
            StoreError::Busy(e) | StoreError::Aborted(e) => {
                tonic::Status::unavailable(format!("{what}: database is busy, retry: {e}"))
            }
            StoreError::Unavailable(e) => {
                tonic::Status::unavailable(format!("{what}: database unavailable, retry: {e}"))
            }
            StoreError::Refused(e) | StoreError::Failed(e) => {
                tonic::Status::internal(format!("{what}: storage failure: {e}"))
            }
            StoreError::Inconsistent(_) => tonic::Status::internal(format!("{what}: {self}")),
            StoreError::FileReplaced(e) => tonic::Status::internal(format!("{what}: storage failure: {e}")),
        }
    }
}

impl From<StoreError> for tonic::Status {
    fn from(e: StoreError) -> tonic::Status {
        e.status("storage")
    }
}

/// Result of a store call.
pub type Result<T> = std::result::Result<T, StoreError>;

/// An inbox row's state: accepted (`pending` or `blocked`) or `applied`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InboxState {
    /// Accepted, waiting for its turn.
    Pending,
    /// Accepted, and the applier found it cannot be applied (the row says why).
    Blocked,
    /// Applied: its effect is recorded.
    Applied,
}

impl InboxState {
    /// The lowercase name, exactly as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            InboxState::Pending => "pending",
            InboxState::Blocked => "blocked",
            InboxState::Applied => "applied",
        }
    }

    fn parse(s: &str) -> Option<InboxState> {
        match s {
            "pending" => Some(InboxState::Pending),
            "blocked" => Some(InboxState::Blocked),
            "applied" => Some(InboxState::Applied),
            _ => None,
        }
    }
}

/// One inbox row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxRecord {
    /// The event's id.
    pub event_id: String,
    /// Its flow.
    pub flow_id: String,
    /// Its seq in the flow.
    pub seq: u64,
    /// The step it makes, as sent.
    pub kind: String,
    /// Its payload schema.
    pub schema: u32,
    /// The canonical body, stored verbatim; empty once the row is compacted.
    pub body: String,
    /// The SHA-256 digest of the canonical body, exactly when the row is compacted (a
    /// tombstone: an applied row past the retention whose body is gone).
    pub compacted: Option<[u8; 32]>,
    /// Where it is: pending, blocked or applied.
    pub state: InboxState,
    /// Why it is blocked (only while blocked).
    pub reason: Option<BlockReason>,
    /// When the producer committed it (microseconds since the epoch), as its envelope said;
    /// `None` when the sender did not say. Kept beside the body, never part of it.
    pub committed_at_us: Option<i64>,
}

/// An inbox row as read, before its stored words are checked.
pub(crate) struct RawInbox {
    pub event_id: String,
    pub flow_id: String,
    pub seq: u64,
    pub kind: String,
    pub schema: u32,
    /// `None` once compacted.
    pub body: Option<String>,
    /// The digest a tombstone keeps (`None` while the body is stored).
    pub sha256: Option<Vec<u8>>,
    pub state: String,
    pub reason: Option<String>,
    pub committed_at_us: Option<i64>,
}

impl RawInbox {
    /// The row, or `Inconsistent` when a stored word is not one this store writes.
    pub(crate) fn check(self) -> Result<InboxRecord> {
        let RawInbox { event_id, flow_id, seq, kind, schema, body, sha256, state, reason, committed_at_us } =
            self;
        let state = InboxState::parse(&state)
            .ok_or_else(|| StoreError::Inconsistent(format!("inbox {event_id}: unknown state {state:?}")))?;
        let (body, compacted) = match (body, sha256) {
            (Some(body), _) => (body, None),
            (None, Some(digest)) if state == InboxState::Applied => {
                let digest: [u8; 32] = digest.try_into().map_err(|d: Vec<u8>| {
                    StoreError::Inconsistent(format!("inbox {event_id}: a digest of {} bytes", d.len()))
                })?;
                (String::new(), Some(digest))
            }
            (None, _) => {
                return Err(StoreError::Inconsistent(format!(
                    "inbox {event_id}: no body and no digest of one (state {})",
                    state.as_str()
                )));
            }
        };
        let reason = match reason {
            None => None,
            Some(r) => Some(BlockReason::parse(&r).ok_or_else(|| {
                StoreError::Inconsistent(format!("inbox {event_id}: unknown reason {r:?}"))
            })?),
        };
        Ok(InboxRecord {
            event_id,
            flow_id,
            seq,
            kind,
            schema,
            body,
            compacted,
            state,
            reason,
            committed_at_us,
        })
    }
}

/// What is stored under an event id, as a Receive compares it: the body, or a tombstone's
/// digest of it.
pub(crate) enum StoredBody {
    /// The canonical body, verbatim.
    Whole(String),
    /// The row is compacted: the SHA-256 digest of its canonical body.
    Digest(Vec<u8>),
}

impl StoredBody {
    /// From the two columns a read returns (body, digest); `None` when both are NULL.
    pub(crate) fn from_columns(body: Option<String>, sha256: Option<Vec<u8>>) -> Option<StoredBody> {
        match (body, sha256) {
            (Some(body), _) => Some(StoredBody::Whole(body)),
            (None, Some(digest)) => Some(StoredBody::Digest(digest)),
            (None, None) => None,
        }
    }

    /// Whether `body` (an incoming event's canonical body) is the stored one: compared byte
    /// for byte while the body is stored, by SHA-256 digest once it is compacted. Only the
    /// duplicate and conflict paths call this, never a new event's insert.
    pub(crate) fn is(&self, body: &str) -> bool {
        match self {
            StoredBody::Whole(stored) => stored == body,
            StoredBody::Digest(digest) => {
                digest.as_slice() == runtime::retention::body_digest(body.as_bytes())
            }
        }
    }
}

/// A projection as read; `None` for a flow nothing was applied to.
pub(crate) fn checked_projection(flow_id: &str, row: Option<(u64, String, i64, i64)>) -> Result<Projection> {
    match row {
        None => Ok(Projection::NEW),
        Some((last_seq, state, held, amount)) => {
            let state = proto::flow::FlowState::parse(&state).ok_or_else(|| {
                StoreError::Inconsistent(format!("projection {flow_id}: unknown state {state:?}"))
            })?;
            Ok(Projection { last_seq, state, held, amount })
        }
    }
}

/// One effect row: the record an applied step leaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectRecord {
    /// The applied event.
    pub event_id: String,
    /// Its flow.
    pub flow_id: String,
    /// Its seq: a flow's effects are seqs 1..n, each once.
    pub seq: u64,
    /// The step it made.
    pub kind: String,
    /// Units held after it.
    pub held: i64,
}

/// What receiving one event decided (SPEC §6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiveOutcome {
    /// Inserted as pending; answered after the commit.
    Accepted,
    /// The same canonical body is stored under this event id; nothing written.
    Duplicate,
    /// This event id is stored with a different body; nothing written.
    IdConflict,
    /// Another event id holds this (flow_id, seq); nothing written.
    SequenceConflict {
        /// The event id stored at that seq.
        held_by: String,
    },
    /// The inbox holds `unapplied` rows, at or over the cap, and this event fills no gap;
    /// nothing written. The sender retries later.
    BacklogFull {
        /// Unapplied rows in the inbox.
        unapplied: u64,
    },
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

/// How many unapplied rows the inbox may hold before new events are refused for now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Admission {
    /// No cap.
    #[default]
    Unlimited,
    /// At most this many unapplied rows; an event that is exactly the next seq of a flow
    /// already waiting in the inbox is always admitted, so a full backlog never starves the
    /// event the stored rows wait for. A new flow's first event gets no such pass.
    Cap(u64),
}

/// This database's identity and how far its durable history reaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The random id created with the database.
    pub database_id: String,
    /// The highest inbox position; 0 for an empty inbox.
    pub highest_position: u64,
}

/// What is stored at a flow's next seq.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// The row at exactly the next seq (pending or blocked).
    Row(InboxRecord),
    /// Nothing at the next seq, but a later seq is stored.
    Gap,
    /// Nothing at or after the next seq.
    Idle,
}

/// What one applied step's guarded write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// Projection, effect and inbox mark written; the caller commits.
    Applied,
    /// The stored projection is not the one the decision was made
    /// on (another applier won): nothing written, decide again.
    Raced,
}

/// One flow that waits with accepted-but-unapplied rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backlog {
    /// The flow.
    pub flow_id: String,
    /// Its applied state.
    pub projection: Projection,
    /// Unapplied rows of the flow.
    pub waiting_rows: u64,
    /// The lowest unapplied row.
    pub lowest: InboxRecord,
}

/// One flow as `GetFlow` shows it, read in one snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowView {
    /// The applied state.
    pub projection: Projection,
    /// Every inbox row, in seq order.
    pub inbox: Vec<InboxRecord>,
    /// Every effect, in seq order.
    pub effects: Vec<EffectRecord>,
}

/// One envelope of a Receive batch, with the stream it came on: once an envelope of a stream
/// failed, the stream's later envelopes are not stored.
pub struct Incoming {
    /// The envelope's event (it passed the transport limits).
    pub event: Event,
    /// When the producer committed it, if the envelope said (stored beside the row when it
    /// is accepted; never compared).
    pub committed_at_us: Option<i64>,
    /// Its stream.
    pub stream: Arc<StreamState>,
}

/// One envelope's answer from [`ConsumerStore::receive_batch`]: `None` when it was not
/// stored because an earlier envelope of its stream failed.
pub type BatchAnswer = Option<Result<Received>>;

/// The events one committed Receive batch holds, by their inbox position: its auto-apply
/// takes a step's event from here instead of reading the stored body back and parsing it
/// a second time (on SQLite the body's join and parse were ~3.5k instructions per event,
/// callgrind, bench). Exact for as long as the position exists: an accepted event's body
/// is its canonical body, a duplicate's stored body is the same, a stored body is never
/// edited, and a position is never reused (inbox rows are never deleted; compaction drops
/// the bodies of applied rows only, which no step reads again).
pub struct BatchEvents {
    batch: Arc<Vec<Incoming>>,
    /// (position, index in `batch`), sorted by position.
    at: Vec<(u64, usize)>,
}

impl BatchEvents {
    /// The batch's events that are stored (accepted or duplicate), from its answers.
    pub fn new(batch: Arc<Vec<Incoming>>, answers: &[BatchAnswer]) -> BatchEvents {
        let mut at: Vec<(u64, usize)> = answers
            .iter()
            .enumerate()
            .filter_map(|(i, answer)| match answer {
                Some(Ok(Received {
                    outcome: ReceiveOutcome::Accepted | ReceiveOutcome::Duplicate,
                    position,
                })) if *position > 0 => Some((*position, i)),
                _ => None,
            })
            .collect();
        at.sort_unstable();
        BatchEvents { batch, at }
    }

    /// The event stored at inbox `position`, if this batch holds it.
    pub fn event_at(&self, position: i64) -> Option<&Event> {
        let position = u64::try_from(position).ok()?;
        let i = self.at.binary_search_by_key(&position, |&(p, _)| p).ok()?;
        self.batch.get(self.at[i].1).map(|incoming| &incoming.event)
    }
}

/// How a Receive batch runs.
#[derive(Clone, Copy, Debug)]
pub struct ReceiveContext {
    /// The crash point this process is armed with, if any.
    pub crash: CrashSwitch,
    /// The backlog cap.
    pub admission: Admission,
    /// Checked before the commit and told its outcome (none in unit tests).
    pub storage: Option<&'static StorageWatch>,
    /// The batch is applied right after its commit (auto-apply): the store may keep what
    /// its transaction learnt of the flows for that apply.
    pub applied_next: bool,
}

/// The consumer's store: consumer.db on SQLite or the `ordered_events_consumer` schema on
/// PostgreSQL. Cheap to clone (a shared connection or a pool).
#[derive(Clone)]
pub enum ConsumerStore {
    /// A SQLite file, one connection used on blocking threads.
    Sqlite(sqlite::SqliteStore),
    /// A PostgreSQL schema, a pool of connections.
    Postgres(pg::PgStore),
}

impl ConsumerStore {
    /// Opens (creating if needed) the store `target` names and logs its settings.
    pub async fn open(target: &DbTarget) -> std::result::Result<ConsumerStore, OpenError> {
        Ok(match target {
            DbTarget::Sqlite(path) => {
                let path = path.clone();
                let store = tokio::task::spawn_blocking(move || sqlite::SqliteStore::open(&path))
                    .await
                    .map_err(|e| OpenError::Identity(format!("opening the consumer database: {e}")))??;
                ConsumerStore::Sqlite(store)
            }
            DbTarget::Postgres(url) => ConsumerStore::Postgres(pg::PgStore::open(url).await?),
        })
    }

    /// `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        match self {
            ConsumerStore::Sqlite(_) => "sqlite",
            ConsumerStore::Postgres(_) => "postgres",
        }
    }

    /// The identity and the highest inbox position, read in one snapshot.
    pub async fn identity(&self) -> Result<Identity> {
        Ok(self.identify(Vec::new()).await?.0)
    }

    /// [`ConsumerStore::identity`] and, read in the same snapshot, for each probe
    /// `(position, event_id)` in order, whether the inbox row at that position holds that
    /// event (a row compacted to a tombstone does; a position holding another event or none
    /// does not). One read, however many probes (the caller bounds them).
    pub async fn identify(&self, probes: Vec<(u64, String)>) -> Result<(Identity, Vec<bool>)> {
        match self {
            ConsumerStore::Sqlite(s) => s.identify(probes).await,
            ConsumerStore::Postgres(p) => p.identify(probes).await,
        }
    }

    /// SPEC §6 for a batch of envelopes in ONE transaction, in order, each in its own
    /// savepoint (a failing envelope rolls back alone and fails its stream), so a later
    /// envelope sees an earlier one exactly as after that one's own commit. Commits only when
    /// something was inserted; every answer is returned after that commit. If the commit
    /// fails, every envelope gets the error. Crash points `consumer.receive.after_insert`
    /// (after each accepted insert) and `.after_commit` sit inside.
    pub async fn receive_batch(&self, batch: Arc<Vec<Incoming>>, ctx: ReceiveContext) -> Vec<BatchAnswer> {
        match self {
            ConsumerStore::Sqlite(s) => s.receive_batch(batch, ctx).await,
            ConsumerStore::Postgres(p) => p.receive_batch(&batch, ctx).await,
        }
    }

    /// Applies each of `flows` in turn (SPEC §7), up to `max_steps` each, consecutive steps
    /// of many flows sharing a transaction of up to `opts.max_batch` steps, each step
    /// (projection + effect + inbox mark) in its own savepoint; see [`crate::apply`].
    pub async fn apply_flows(
        &self,
        flows: Vec<String>,
        max_steps: u32,
        opts: ApplyOptions,
    ) -> Vec<FlowResult> {
        match self {
            ConsumerStore::Sqlite(s) => s.apply_flows(flows, max_steps, opts).await,
            ConsumerStore::Postgres(p) => p.apply_flows(flows, max_steps, opts).await,
        }
    }

    /// [`ConsumerStore::apply_flows`] right after the Receive batch that holds `events`
    /// (auto-apply). On SQLite a step whose row the batch stored takes its event from
    /// `events`, and a flow whose every unapplied row the batch's transaction stored reads
    /// nothing before its steps, when nothing was written since that commit.
    pub async fn apply_received(
        &self,
        flows: Vec<String>,
        events: BatchEvents,
        max_steps: u32,
        opts: ApplyOptions,
    ) -> Vec<FlowResult> {
        match self {
            ConsumerStore::Sqlite(s) => s.apply_received(flows, events, max_steps, opts).await,
            // PostgreSQL keeps a row's body in the row it reads anyway (not measured further).
            ConsumerStore::Postgres(p) => p.apply_flows(flows, max_steps, opts).await,
        }
    }

    /// Up to `limit` flows with unapplied rows whose id sorts after `after` (start with "").
    pub async fn flows_with_unapplied(&self, after: String, limit: usize) -> Result<Vec<String>> {
        match self {
            ConsumerStore::Sqlite(s) => s.flows_with_unapplied(after, limit).await,
            ConsumerStore::Postgres(p) => p.flows_with_unapplied(&after, limit).await,
        }
    }

    /// Up to `limit` flows after `after` (in flow_id order) with a row blocked for `reason`
    /// (read from the partial index of unapplied rows: the cost grows with the backlog, never
    /// with the history).
    pub async fn flows_blocked(
        &self,
        reason: BlockReason,
        after: String,
        limit: usize,
    ) -> Result<Vec<String>> {
        match self {
            ConsumerStore::Sqlite(s) => s.flows_blocked(reason, after, limit).await,
            ConsumerStore::Postgres(p) => p.flows_blocked(reason, &after, limit).await,
        }
    }

    /// The flow's projection, inbox rows and effects, in one snapshot.
    pub async fn flow(&self, flow_id: String) -> Result<FlowView> {
        match self {
            ConsumerStore::Sqlite(s) => s.flow(flow_id).await,
            ConsumerStore::Postgres(p) => p.flow(&flow_id).await,
        }
    }

    /// Up to `limit` flows with unapplied rows in flow_id order, each with its projection
    /// and lowest unapplied row, and the total of unapplied rows, in one snapshot.
    pub async fn backlog(&self, limit: usize) -> Result<(Vec<Backlog>, u64)> {
        match self {
            ConsumerStore::Sqlite(s) => s.backlog(limit).await,
            ConsumerStore::Postgres(p) => p.backlog(limit).await,
        }
    }

    /// The storage probe: one real commit (a write to a one-row table), checked by `watch`
    /// before it commits like every other commit.
    pub async fn probe(&self, watch: &'static StorageWatch) -> Result<()> {
        match self {
            ConsumerStore::Sqlite(s) => s.probe(watch).await,
            ConsumerStore::Postgres(p) => p.probe(watch).await,
        }
    }

    /// Unapplied (pending + blocked) inbox rows, from the counter kept in the same
    /// transactions as the rows.
    pub async fn unapplied_count(&self) -> Result<u64> {
        match self {
            ConsumerStore::Sqlite(s) => s.unapplied_count().await,
            ConsumerStore::Postgres(p) => p.unapplied_count().await,
        }
    }

    /// The backlog's counters, as the metrics scrape reads them (see [`BacklogReader`]).
    pub async fn backlog_counts(&self) -> Result<BacklogCounts> {
        match self {
            ConsumerStore::Sqlite(s) => s.backlog_counts().await,
            ConsumerStore::Postgres(p) => p.backlog_counts().await,
        }
    }

    /// A reader of the backlog counters for the metrics scrape, which
    /// runs on a blocking thread: on SQLite a read-only connection of its own (never the
    /// writer's lock), on PostgreSQL a pooled connection.
    pub fn backlog_reader(&self) -> BacklogReader {
        match self {
            ConsumerStore::Sqlite(s) => s.backlog_reader(),
            ConsumerStore::Postgres(p) => p.backlog_reader(),
        }
    }

    /// One compaction pass (issue 16): every applied inbox row applied before `cutoff_us`
    /// is reduced to a tombstone (event id, flow id, seq, kind, schema and the SHA-256 digest
    /// of its body; the body is dropped), in transactions of at most `COMPACT_BATCH` rows.
    /// Pending and blocked rows are never touched. Crash points `consumer.compact.after_batch`
    /// (a batch rewritten, not committed) and `.after_commit` sit inside. On SQLite the freed
    /// pages are then given back (`incremental_vacuum`, in bounded steps) when the file
    /// allows it. Several instances on one PostgreSQL database may run passes at once: each
    /// row is compacted (and counted) by exactly one of them.
    pub async fn compact(
        &self,
        cutoff_us: i64,
        crash: CrashSwitch,
        keep_free_pages: u64,
    ) -> Result<CompactReport> {
        match self {
            ConsumerStore::Sqlite(s) => s.compact(cutoff_us, crash, keep_free_pages).await,
            ConsumerStore::Postgres(p) => p.compact(cutoff_us, crash).await,
        }
    }

    /// The connection pool's state (PostgreSQL only).
    pub fn pool_status(&self) -> Option<runtime::metrics::PoolStatus> {
        match self {
            ConsumerStore::Sqlite(_) => None,
            ConsumerStore::Postgres(p) => Some(p.pool_status()),
        }
    }
}

/// What the metrics scrape reads about the backlog: counters kept exact in the same
/// transactions as the rows they count (never a count over the rows per scrape).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BacklogCounts {
    /// Unapplied (pending + blocked) rows.
    pub unapplied: u64,
    /// Blocked rows by reason, in [`BLOCK_REASONS`] order. A blocked row is always its
    /// flow's next seq, so this is also the number of flows blocked for each reason.
    pub blocked: [u64; 3],
    /// Flows with unapplied rows whose next seq (last applied + 1) is not stored.
    pub gap: u64,
    /// Flows whose next seq is stored and pending (an Apply would move them).
    pub ready: u64,
}

/// The block reasons in the order [`BacklogCounts::blocked`] keeps them.
pub const BLOCK_REASONS: [BlockReason; 3] =
    [BlockReason::UnsupportedSchema, BlockReason::InvalidPayload, BlockReason::InvalidTransition];

/// The index of `reason` in [`BLOCK_REASONS`].
pub(crate) fn reason_index(reason: BlockReason) -> usize {
    match reason {
        BlockReason::UnsupportedSchema => 0,
        BlockReason::InvalidPayload => 1,
        BlockReason::InvalidTransition => 2,
    }
}

/// Reads the backlog counts from a blocking thread.
pub type BacklogReader = Arc<dyn Fn() -> std::result::Result<BacklogCounts, String> + Send + Sync>;

/// The applied-at minus committed-at of one applied row, in microseconds, when the row
/// knows its committed time and the clocks agree on the order (a negative span, from clocks
/// that disagree, is not a latency and is not recorded).
pub(crate) fn commit_lag_us(committed_at_us: Option<i64>, applied_at_us: i64) -> Option<u64> {
    committed_at_us.and_then(|c| u64::try_from(applied_at_us.checked_sub(c)?).ok())
}

#[cfg(test)]
#[test]
fn a_commit_lag_needs_a_stamp_and_clocks_in_order() {
    assert_eq!(commit_lag_us(Some(1_000), 1_500), Some(500));
    assert_eq!(commit_lag_us(Some(1_500), 1_500), Some(0));
    assert_eq!(commit_lag_us(Some(2_000), 1_500), None, "a negative span is not a latency");
    assert_eq!(commit_lag_us(None, 1_500), None);
    assert_eq!(commit_lag_us(Some(i64::MIN), i64::MAX), None, "no overflow");
}

/// One flow's progress while a group of flows is applied, in either backend.
pub(crate) struct FlowRun {
    pub(crate) flow_id: String,
    /// Applied and committed.
    pub(crate) committed: Vec<String>,
    /// Applied inside the open transaction.
    pub(crate) pending: Vec<String>,
    /// The commit→applied latencies (µs) of the pending steps that know it, recorded once
    /// their transaction commits.
    pub(crate) pending_lags: Vec<u64>,
    /// Wrote anything (a step or a blocked mark) inside the open transaction.
    pub(crate) wrote: bool,
    pub(crate) end: Option<std::result::Result<(crate::apply::Stop, Projection), StoreError>>,
}

impl FlowRun {
    /// Every flow of a group, none started.
    pub(crate) fn all(flows: Vec<String>) -> Vec<FlowRun> {
        flows
            .into_iter()
            .map(|flow_id| FlowRun {
                flow_id,
                committed: Vec::new(),
                pending: Vec::new(),
                pending_lags: Vec::new(),
                wrote: false,
                end: None,
            })
            .collect()
    }

    /// One step applied inside the open transaction, with its commit→applied latency if known.
    pub(crate) fn applied(&mut self, event_id: String, lag_us: Option<u64>) {
        self.pending.push(event_id);
        self.pending_lags.extend(lag_us);
    }

    /// Forgets the steps of a transaction that did not commit.
    pub(crate) fn forget_pending(&mut self) {
        self.pending.clear();
        self.pending_lags.clear();
    }
}

/// After one group transaction ended (`finished`: committed, or why not), the same for both
/// backends: the storage watch hears of a commit that wrote or of the failure; on success
/// every pending step counts as committed and `consumer.apply.after_commit` is reached if
/// any step was applied; on failure every flow that wrote in it fails and keeps only what
/// was committed before.
pub(crate) fn settle(
    runs: &mut [FlowRun],
    finished: Result<()>,
    started: std::time::Instant,
    opts: &ApplyOptions,
) {
    let applied_any = runs.iter().any(|r| !r.pending.is_empty());
    let wrote_any = runs.iter().any(|r| r.wrote);
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
                crate::apply::APPLY_BATCHES.record_timed(runs.iter().map(|r| r.pending.len()).sum(), started);
            }
            for run in runs.iter_mut() {
                let pending = std::mem::take(&mut run.pending);
                run.committed.extend(pending);
                for lag in run.pending_lags.drain(..) {
                    crate::metrics::COMMIT_TO_APPLIED.observe(lag);
                }
                run.wrote = false;
            }
            if applied_any {
                opts.crash.reach(proto::crash::CrashPoint::ConsumerApplyAfterCommit);
            }
        }
        Err(e) => {
            for run in runs.iter_mut().filter(|r| r.wrote) {
                run.forget_pending();
                run.wrote = false;
                run.end = Some(Err(e.clone()));
            }
        }
    }
}

/// Each flow's answer once its group is done.
pub(crate) fn reports(runs: Vec<FlowRun>, opts: &ApplyOptions) -> Vec<FlowResult> {
    use crate::apply::{ApplyFailure, ApplyReport};
    runs.into_iter()
        .map(|run| {
            let outcome = match run.end {
                Some(Ok((stop, projection))) => {
                    Ok(ApplyReport { flow_id: run.flow_id.clone(), applied: run.committed, stop, projection })
                }
                Some(Err(source)) => Err(ApplyFailure { applied: run.committed, source }),
                None => Err(ApplyFailure {
                    applied: run.committed,
                    source: StoreError::Inconsistent("apply stopped before this flow was reached".into()),
                }),
            };
            crate::apply::finish(run.flow_id, outcome, opts)
        })
        .collect()
}
