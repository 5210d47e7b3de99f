//! The producer's store boundary: the outbox's domain types, the one [`StoreError`], the pure
//! SPEC §5 decision both backends make ([`decide`]), and [`ProducerStore`], the one handle the
//! service, the metrics and the relay hold. `sqlite` owns every rusqlite statement, `pg` every
//! PostgreSQL statement; nothing above this module names either client.
//!
//! The handle is an enum over the two backends rather than a trait object: there are exactly
//! two, the methods are async (no boxed futures needed), and a `match` per method keeps the
//! call sites plain.

mod pg;
mod sqlite;

use proto::crash::CrashSwitch;
use proto::db::OpenMode;
use proto::flow::{FlowState, TransitionError, check_step};
use proto::target::DbTarget;
use runtime::OpenError;
pub use runtime::retention::CompactReport;

use crate::request::AdvanceCommand;

pub use pg::KIND as PG_KIND;
pub use sqlite::{KIND as SQLITE_KIND, UNACCEPTED_PAGE_SQL};

/// Calls per `Advance` batch (one transaction each), logged at shutdown.
pub(crate) static ADVANCE_BATCHES: runtime::batches::BatchSizes =
    runtime::batches::BatchSizes::new("advance");
/// Answers per recorded-answers (mark) transaction, logged at shutdown.
pub(crate) static MARK_BATCHES: runtime::batches::BatchSizes = runtime::batches::BatchSizes::new("mark");

/// A flow's committed state as the producer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowRecord {
    /// The seq of the flow's last committed step (0: new).
    pub seq: u64,
    /// The state that step led to.
    pub state: FlowState,
    /// The amount fixed by `reserved` (0: new).
    pub amount: i64,
}

impl FlowRecord {
    /// A flow with no row yet.
    pub const NEW: FlowRecord = FlowRecord { seq: 0, state: FlowState::New, amount: 0 };
}

/// One outbox row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The event's id.
    pub event_id: String,
    /// Its flow.
    pub flow_id: String,
    /// Its seq in the flow.
    pub seq: u64,
    /// The step it makes.
    pub kind: String,
    /// Its payload schema.
    pub schema: u32,
    /// The canonical body, exactly as committed and sent; empty once compacted (see
    /// `compacted`), except in an `EXISTING` answer, which rebuilds it from the request.
    pub body: String,
    /// Compaction dropped the body (retention): only the tombstone is kept, with its digest.
    pub compacted: bool,
    /// The SHA-256 digest of the canonical body, where the store keeps one (always for a
    /// compacted row; otherwise as the backend stored it, possibly `None`).
    pub body_sha256: Option<[u8; 32]>,
    /// The consumer durably holds it (answered `ACCEPTED` or `DUPLICATE`).
    pub accepted: bool,
    /// Answers the relay recorded for it.
    pub attempts: u64,
    /// The last answer's word, e.g. `BACKLOG_FULL` (none before the first answer).
    pub last_outcome: Option<String>,
    /// When its transaction stamped it (microseconds since the epoch), as read from the
    /// outbox: sent with the envelope so the consumer can measure commit→applied. `None` in
    /// the copy [`decide`] builds for a new row (the stamp is taken when it is written), so
    /// a `COMMITTED` answer carries none; nothing compares it.
    pub committed_at_us: Option<i64>,
    /// The row's key in the SQLite outbox (`outbox.id`, never renumbered), with which a relay
    /// marks it without searching the event id's index; `None` on PostgreSQL and in the copy
    /// [`decide`] builds.
    pub row_id: Option<i64>,
}

/// What `advance` decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdvanceOutcome {
    /// The step and its outbox event are written (committed with the transaction).
    Committed,
    /// The event id is already committed with the same body: a retry, nothing written.
    Existing,
    /// The event id is already committed with another body; nothing written.
    Conflict,
    /// The flow is not at `expected_seq`; nothing written.
    Stale,
    /// The step is not legal from the flow's state; nothing written.
    InvalidTransition(TransitionError),
    /// The step is legal, but `unaccepted` outbox rows already wait for the relay, at or
    /// over the cap; nothing changed. Retry after the relay caught up.
    OutboxFull {
        /// Outbox rows not yet accepted by the consumer.
        unaccepted: u64,
    },
}

/// The answer to one `Advance`: the outcome, the flow as it now stands, and the stored event
/// for `Committed`, `Existing` and `Conflict`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdvanceReply {
    /// What was decided.
    pub outcome: AdvanceOutcome,
    /// The flow after the call.
    pub flow: FlowRecord,
    /// The stored event of `event_id`, where one is.
    pub event: Option<OutboxRecord>,
}

/// What SPEC §5 says to do with one call, decided on what the call's transaction read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Answer without writing anything.
    Answer(AdvanceReply),
    /// Write the flow as `flow` (from `expected_seq`) and insert `event`, then answer
    /// `COMMITTED` with both.
    Write {
        /// The flow after the step.
        flow: FlowRecord,
        /// The outbox row to insert (unaccepted, never sent).
        event: OutboxRecord,
    },
}

impl Decision {
    /// The reply this decision gives once its writes (if any) are done.
    pub fn into_reply(self) -> AdvanceReply {
        match self {
            Decision::Answer(reply) => reply,
            Decision::Write { flow, event } => {
                AdvanceReply { outcome: AdvanceOutcome::Committed, flow, event: Some(event) }
            }
        }
    }
}

/// SPEC §5, pure, shared by both backends, in order: event-id history (EXISTING/CONFLICT,
/// `stored` is the outbox row of the call's event id), expected seq (STALE), legal step
/// (INVALID_TRANSITION), then the outbox cap (`backlog`: unaccepted rows and the cap, when
/// capped), else the write. `flow` is the flow as the transaction read it.
pub fn decide(
    flow: &FlowRecord,
    stored: Option<&OutboxRecord>,
    cmd: &AdvanceCommand,
    backlog: Option<(u64, u64)>,
) -> Decision {
    let answer = |outcome, event| Decision::Answer(AdvanceReply { outcome, flow: flow.clone(), event });
    if let Some(stored) = stored {
        let body = cmd.event().canonical_body();
        if !stored.compacted {
            let outcome =
                if stored.body == body { AdvanceOutcome::Existing } else { AdvanceOutcome::Conflict };
            return answer(outcome, Some(stored.clone()));
        }
        // A tombstone: the digests decide. The same digest means the body rebuilt from this
        // request IS the stored body byte for byte, so EXISTING answers it unchanged; a
        // CONFLICT shows the tombstone (no body, its digest).
        let same = stored.body_sha256 == Some(runtime::retention::body_digest(body.as_bytes()));
        return if same {
            answer(AdvanceOutcome::Existing, Some(OutboxRecord { body, compacted: false, ..stored.clone() }))
        } else {
            answer(AdvanceOutcome::Conflict, Some(stored.clone()))
        };
    }
    if flow.seq != cmd.expected_seq {
        return answer(AdvanceOutcome::Stale, None);
    }
    let next = match check_step(flow.state, flow.amount, cmd.kind, cmd.amount) {
        Ok(next) => next,
        Err(e) => return answer(AdvanceOutcome::InvalidTransition(e), None),
    };
    if let Some((unaccepted, cap)) = backlog {
        if unaccepted >= cap {
            return answer(AdvanceOutcome::OutboxFull { unaccepted }, None);
        }
    }
    let event = cmd.event();
    let body = event.canonical_body();
    let stored = OutboxRecord {
        event_id: event.event_id,
        flow_id: event.flow_id,
        seq: event.seq,
        kind: event.kind,
        schema: event.schema,
        body,
        compacted: false,
        body_sha256: None,
        accepted: false,
        attempts: 0,
        last_outcome: None,
        committed_at_us: None,
        row_id: None,
    };
    let flow = FlowRecord {
        seq: stored.seq,
        state: next,
        amount: if flow.state == FlowState::New { cmd.amount } else { flow.amount },
    };
    Decision::Write { flow, event: stored }
}

/// Refuses a compacted row among rows to send: compaction only takes accepted rows, so an
/// unaccepted tombstone means the database was edited (or a bug), and sending its empty body
/// would be a lie.
fn refuse_compacted(rows: Vec<OutboxRecord>) -> Result<Vec<OutboxRecord>, StoreError> {
    if let Some(row) = rows.iter().find(|r| r.compacted) {
        return Err(StoreError::Corrupt(format!(
            "outbox row {} (flow {} seq {}) is unaccepted but compacted: its body is gone and it cannot be sent",
            row.event_id, row.flow_id, row.seq
        )));
    }
    Ok(rows)
}

/// The consumer's answer to one delivered envelope, as the outbox records it. Built from the
/// wire value with [`DeliveryAnswer::from_wire`]; only [`DeliveryAnswer::holds_event`] answers
/// mark a row accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryAnswer {
    /// Stored durably as pending.
    Accepted,
    /// The identical event was already stored.
    Duplicate,
    /// The event id is stored with a different body (a human must decide).
    IdConflict,
    /// Another event id holds this `(flow_id, seq)` (a human must decide).
    SequenceConflict,
    /// The envelope breaks a transport limit.
    Rejected,
    /// The consumer's backlog is at its cap: nothing stored, send again later.
    BacklogFull,
    /// `RECEIVE_OUTCOME_UNSPECIFIED`: a broken consumer answered without an outcome.
    Unspecified,
    /// A number this build does not know (a newer consumer).
    Unknown(i32),
}

impl DeliveryAnswer {
    /// The answer for the wire value of `ReceiveResult.outcome`. Every known value has its own
    /// variant; anything else is `Unknown`, never silently another answer.
    pub fn from_wire(outcome: i32) -> DeliveryAnswer {
        use proto::pb::ReceiveOutcome as W;
        match W::try_from(outcome) {
            Ok(W::Accepted) => DeliveryAnswer::Accepted,
            Ok(W::Duplicate) => DeliveryAnswer::Duplicate,
            Ok(W::IdConflict) => DeliveryAnswer::IdConflict,
            Ok(W::SequenceConflict) => DeliveryAnswer::SequenceConflict,
            Ok(W::Rejected) => DeliveryAnswer::Rejected,
            Ok(W::BacklogFull) => DeliveryAnswer::BacklogFull,
            Ok(W::Unspecified) => DeliveryAnswer::Unspecified,
            Err(_) => DeliveryAnswer::Unknown(outcome),
        }
    }

    /// True when the answer means the consumer durably holds the event: the only answers that
    /// mark an outbox row accepted.
    pub fn holds_event(self) -> bool {
        matches!(self, DeliveryAnswer::Accepted | DeliveryAnswer::Duplicate)
    }

    /// The short word stored in `last_outcome` and printed by the relay, e.g. `ID_CONFLICT`;
    /// an unknown number keeps its value (`UNKNOWN_17`).
    pub fn word(self) -> std::borrow::Cow<'static, str> {
        use std::borrow::Cow::Borrowed;
        match self {
            DeliveryAnswer::Accepted => Borrowed("ACCEPTED"),
            DeliveryAnswer::Duplicate => Borrowed("DUPLICATE"),
            DeliveryAnswer::IdConflict => Borrowed("ID_CONFLICT"),
            DeliveryAnswer::SequenceConflict => Borrowed("SEQUENCE_CONFLICT"),
            DeliveryAnswer::Rejected => Borrowed("REJECTED"),
            DeliveryAnswer::BacklogFull => Borrowed("BACKLOG_FULL"),
            DeliveryAnswer::Unspecified => Borrowed("UNSPECIFIED"),
            DeliveryAnswer::Unknown(n) => std::borrow::Cow::Owned(format!("UNKNOWN_{n}")),
        }
    }
}

/// Where an accepted event now lives: the consumer database that answered and the inbox
/// position it answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcceptedBy<'a> {
    /// The consumer database's identity.
    pub consumer_db: &'a str,
    /// The event's position in that database's inbox (above 0).
    pub position: u64,
}

/// One answer to record on its outbox row.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// The row's event id.
    pub event_id: String,
    /// The row's key where the backend has one ([`OutboxRecord::row_id`]): the mark finds
    /// the row by it (and still checks the event id).
    pub row_id: Option<i64>,
    /// The consumer's answer.
    pub answer: DeliveryAnswer,
    /// Where the consumer holds it (its inbox position; 0 when it did not say).
    pub position: u64,
    /// The lease the row was sent under (`relay run` on PostgreSQL): the answer is recorded
    /// only while the lease row still names this owner and epoch. `None`: unfenced (SQLite,
    /// and the one-shot modes, which take no lease).
    pub fence: Option<Fence>,
}

/// A relay's claim on one partition, proven on every mark (a fencing token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The relay instance that holds the lease.
    pub owner: std::sync::Arc<str>,
    /// The partition ([`proto::partition::flow_partition`] of the row's flow).
    pub partition: u16,
    /// The lease's epoch when the row was read.
    pub epoch: u64,
}

/// One partition's lease row as a relay reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRow {
    /// The partition.
    pub partition: u16,
    /// The instance that last took it (`None`: never taken, or released).
    pub owner: Option<String>,
    /// How often it was taken.
    pub epoch: u64,
    /// Unowned, or its lease expired by the database's clock: anyone may take it.
    pub free: bool,
}

/// What a relay's heartbeat saw: every lease row and the relays alive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseView {
    /// The leases this relay renewed: `(partition, epoch)`; a lease it sent and does not get
    /// back is lost (taken over, or released by hand).
    pub renewed: Vec<(u16, u64)>,
    /// Every partition's lease row.
    pub leases: Vec<LeaseRow>,
    /// Relay instances whose heartbeat has not expired (this one included).
    pub live_relays: u64,
}

impl Recorded {
    /// Where the row now lives, when the answer holds the event, the consumer database is
    /// known and the consumer said at which position.
    fn accepted_by<'a>(&self, consumer_db: Option<&'a str>) -> Option<AcceptedBy<'a>> {
        match consumer_db {
            Some(consumer_db) if self.position > 0 && self.answer.holds_event() => {
                Some(AcceptedBy { consumer_db, position: self.position })
            }
            _ => None,
        }
    }
}

/// Why lease calls fail on SQLite.
const LEASES_NEED_POSTGRES: &str =
    "partition leases need the PostgreSQL backend: on SQLite one relay serves the outbox";

/// The word `last_outcome` gets for a send that was never answered (the stream broke, the
/// consumer stopped answering, or the relay stopped first).
pub const NO_ANSWER: &str = "NO_ANSWER";

/// The `last_outcome` of a row marked unaccepted again because its consumer lost it.
pub const LOST_BY_CONSUMER: &str = "LOST_BY_CONSUMER";

/// The `last_outcome` of a compacted row its consumer lost, whose loss an operator accepted
/// (`relay accept-lost`): it stays accepted (it cannot be sent again) and names no consumer
/// database any more, so no relay judges it lost again.
pub const LOST_ACCEPTED: &str = "LOST_ACCEPTED";

/// Accepted rows the consumer database `consumer_db` no longer holds: rows another consumer
/// database accepted, and rows this one accepted that it lost (it was restored from an older
/// copy; see [`Lost`]). Rows accepted before positions were recorded are not counted (nothing
/// is known about them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LostRows {
    /// Rows accepted by another consumer database.
    pub other_database: u64,
    /// Rows this consumer database accepted and no longer holds ([`Lost`]: recorded beyond its
    /// history, or probed and not held).
    pub beyond_history: u64,
    /// The highest position this consumer database answered.
    pub highest_recorded: u64,
    /// A few of the lost rows' event ids, for the log.
    pub sample: Vec<String>,
    /// Of the lost rows, those compaction already reduced to tombstones: they cannot be sent
    /// again. When above 0 nothing was unmarked (sending only the rest would leave gaps).
    pub compacted: u64,
    /// A few of the compacted lost rows' event ids, for the log.
    pub compacted_sample: Vec<String>,
    /// Compacted lost rows whose loss was accepted ([`ProducerStore::accept_lost`]: marked
    /// [`LOST_ACCEPTED`]); 0 for [`ProducerStore::resend_lost`], which never accepts a loss.
    pub loss_accepted: u64,
}

/// A probed row a consumer does not hold that is still recorded as accepted by it, at the
/// position probed.
#[derive(Clone, Debug)]
pub(crate) struct ProbedRow {
    pub event_id: String,
    pub flow_id: String,
    pub seq: u64,
    /// Compaction reduced it to a tombstone: it cannot be sent again.
    pub compacted: bool,
}

/// Adds the probed rows still recorded to what the backend found of the other databases'
/// rows (counts and the first few ids, in `(flow_id, seq)` order).
pub(crate) fn add_probed(found: &mut LostRows, probed: &[ProbedRow]) {
    if probed.is_empty() {
        return;
    }
    found.beyond_history += probed.len() as u64;
    let mut in_order: Vec<&ProbedRow> = probed.iter().collect();
    in_order.sort_by(|a, b| (&a.flow_id, a.seq).cmp(&(&b.flow_id, b.seq)));
    let room = 5usize.saturating_sub(found.sample.len());
    found.sample.extend(in_order.iter().take(room).map(|r| r.event_id.clone()));
    let compacted: Vec<&&ProbedRow> = in_order.iter().filter(|r| r.compacted).collect();
    found.compacted += compacted.len() as u64;
    let room = 5usize.saturating_sub(found.compacted_sample.len());
    found.compacted_sample.extend(compacted.iter().take(room).map(|r| r.event_id.clone()));
}

/// The outbox backlog as the metrics report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Outbox rows committed and not yet accepted (the exact counter).
    pub unaccepted: u64,
    /// When the oldest unaccepted row was committed (µs since the epoch), if any.
    pub oldest_committed_at_us: Option<i64>,
}

/// Why a store call failed. Answers (conflicts, stale calls, a full outbox) are never errors.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The database is busy or unreachable, or the transaction lost a serialization race
    /// more often than the store retries: nothing of the call was committed; retry it.
    #[error("{what}: database unavailable, retry: {detail}")]
    Unavailable {
        /// What was being done.
        what: &'static str,
        /// The backend's message.
        detail: String,
    },
    /// The database refused or failed the work (a constraint, a user's trigger, I/O).
    #[error("{what}: storage failure: {detail}")]
    Storage {
        /// What was being done.
        what: &'static str,
        /// The backend's message.
        detail: String,
        /// The storage itself failed, not the work: a full disk, an I/O error, a file that
        /// refuses writes (SQLite's `SQLITE_FULL`, `SQLITE_IOERR`, `SQLITE_READONLY`), or
        /// PostgreSQL's `53100` disk full and `58030` I/O error, classified by the error's
        /// code where the backend's error becomes this one.
        outage: bool,
    },
    /// A row holds a value this module never writes (edited by hand, or a newer build).
    #[error("corrupt producer database: {0}")]
    Corrupt(String),
    /// The handle cannot do this (e.g. `advance` on a store opened for the relay).
    #[error("{0}")]
    NotSupported(&'static str),
}

impl StoreError {
    /// True when retrying the same call later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    /// True for a failure of the storage itself rather than of the work (see
    /// [`StoreError::Storage`]'s `outage`). It may pass once the operator mends the storage,
    /// so `relay run` waits for it instead of exiting.
    pub fn is_storage_outage(&self) -> bool {
        matches!(self, StoreError::Storage { outage: true, .. })
    }

    /// A failure of the work, not of the storage (a constraint, a trigger, a thread lost).
    fn storage(what: &'static str, detail: String) -> StoreError {
        StoreError::Storage { what, detail, outage: false }
    }

    /// The same error about `what` (each layer names the step that failed).
    fn during(self, what: &'static str) -> StoreError {
        match self {
            StoreError::Unavailable { detail, .. } => StoreError::Unavailable { what, detail },
            StoreError::Storage { detail, outage, .. } => StoreError::Storage { what, detail, outage },
            other => other,
        }
    }
}

/// Who opens the store, and what it may do.
#[derive(Clone, Copy, Debug)]
pub enum Role {
    /// The producer server: creates (or upgrades) the schema and starts the group-committing
    /// writer that runs `advance`.
    Server {
        /// The most `Advance` calls one transaction may hold.
        max_batch: usize,
        /// Refuse new steps while this many outbox rows wait for the relay.
        max_unaccepted: Option<u64>,
    },
    /// The relay: the schema must exist (the producer created it); no writer is started.
    Relay,
}

impl Role {
    fn mode(self) -> OpenMode {
        match self {
            Role::Server { .. } => OpenMode::Create,
            Role::Relay => OpenMode::Existing,
        }
    }
}

/// The producer database, on either backend.
#[derive(Clone)]
pub enum ProducerStore {
    /// A SQLite file.
    Sqlite(sqlite::SqliteStore),
    /// A PostgreSQL schema.
    Postgres(pg::PgStore),
}

impl ProducerStore {
    /// Opens `target` for `role`, logging the `producer database open` line with the
    /// backend's durability settings. Crash points reached by writes come from `crash`.
    pub async fn open(target: &DbTarget, role: Role, crash: CrashSwitch) -> Result<ProducerStore, OpenError> {
        Ok(match target {
            DbTarget::Sqlite(path) => ProducerStore::Sqlite(sqlite::SqliteStore::open(path, role, crash)?),
            DbTarget::Postgres(url) => ProducerStore::Postgres(pg::PgStore::open(url, role, crash).await?),
        })
    }

    /// The backend's name: `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        match self {
            ProducerStore::Sqlite(_) => "sqlite",
            ProducerStore::Postgres(_) => "postgres",
        }
    }

    /// SPEC §5 for one call, group-committed with the calls queued beside it (each in its own
    /// savepoint); answered only after the commit that holds it.
    pub async fn advance(&self, cmd: AdvanceCommand) -> Result<AdvanceReply, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.advance(cmd).await,
            ProducerStore::Postgres(s) => s.advance(cmd).await,
        }
    }

    /// The flow and its outbox rows in seq order, one snapshot.
    pub async fn flow(&self, flow_id: String) -> Result<(FlowRecord, Vec<OutboxRecord>), StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.flow(flow_id).await,
            ProducerStore::Postgres(s) => s.flow(flow_id).await,
        }
    }

    /// The scrape-time reader of the outbox gauges: reads the [`Backlog`] and turns it into
    /// samples with `to_gauges`, on a blocking thread. SQLite reads through a read-only
    /// connection of its own (never the writer's), PostgreSQL through the pool.
    pub fn backlog_gauges<G>(&self, to_gauges: G) -> runtime::metrics::GaugeReader
    where
        G: Fn(Backlog) -> Vec<runtime::metrics::GaugeSample> + Send + Sync + 'static,
    {
        match self {
            ProducerStore::Sqlite(s) => s.backlog_gauges(to_gauges),
            ProducerStore::Postgres(s) => s.backlog_gauges(to_gauges),
        }
    }

    /// The server's health from its storage (`None` for the relay's store): on SQLite `false`
    /// once producer.db was found deleted or replaced under the running producer, on
    /// PostgreSQL while the server is found gone.
    pub fn serving(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        match self {
            ProducerStore::Sqlite(s) => s.serving(),
            ProducerStore::Postgres(s) => s.serving(),
        }
    }

    /// The connection pool's state (PostgreSQL only).
    pub fn pool_status(&self) -> Option<runtime::metrics::PoolStatus> {
        match self {
            ProducerStore::Sqlite(_) => None,
            ProducerStore::Postgres(s) => Some(s.pool_status()),
        }
    }

    /// This producer database's random identity, created with it.
    pub async fn database_id(&self) -> Result<String, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.database_id().await,
            ProducerStore::Postgres(s) => Ok(s.database_id().to_owned()),
        }
    }

    /// Up to `limit` unaccepted rows after `(flow_id, seq)` in `(flow_id, seq)` order (start
    /// with `("", 0)`). One short read; no transaction is held between pages.
    pub async fn unaccepted_after(
        &self,
        after: (String, u64),
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.unaccepted_after(after, limit).await,
            ProducerStore::Postgres(s) => s.unaccepted_after(after, limit).await,
        }
    }

    /// The outbox row of `event_id`, accepted or not.
    pub async fn outbox_row(&self, event_id: String) -> Result<Option<OutboxRecord>, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.outbox_row(event_id).await,
            ProducerStore::Postgres(s) => s.outbox_row(event_id).await,
        }
    }

    /// Records the consumer's answers for a run of rows in ONE transaction, in order (each
    /// counts one send); a row is marked accepted when its answer holds the event, with where
    /// it lives when `consumer_db` and the position are known. Crash points
    /// `relay.after_mark` (written, not committed) and `relay.after_mark_commit` sit on the
    /// marking path only: a run with no answer that holds its event reaches neither.
    ///
    /// An answer with a [`Fence`] is recorded only while its lease row still says (owner,
    /// epoch) (PostgreSQL; checked and held in the same statement). Returns the partitions
    /// where fewer rows were recorded than answered: their lease was lost.
    pub async fn record_deliveries(
        &self,
        answers: Vec<Recorded>,
        consumer_db: Option<String>,
    ) -> Result<Vec<u16>, StoreError> {
        if answers.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            ProducerStore::Sqlite(s) => s.record_deliveries(answers, consumer_db).await.map(|()| Vec::new()),
            ProducerStore::Postgres(s) => s.record_deliveries(answers, consumer_db).await,
        }
    }

    /// The partition of `flow_id` and its lease row (owner only while the lease is live), on
    /// PostgreSQL; `None` on SQLite, which has no partitions.
    pub async fn flow_lease(&self, flow_id: &str) -> Result<Option<LeaseRow>, StoreError> {
        match self {
            ProducerStore::Sqlite(_) => Ok(None),
            ProducerStore::Postgres(s) => {
                s.flow_lease(proto::partition::flow_partition(flow_id)).await.map(Some)
            }
        }
    }

    /// True when several relays can share this outbox through partition leases (PostgreSQL).
    pub fn has_leases(&self) -> bool {
        matches!(self, ProducerStore::Postgres(_))
    }

    /// Like [`ProducerStore::unaccepted_after`], only rows of `partitions` (PostgreSQL).
    pub async fn unaccepted_in(
        &self,
        after: (String, u64),
        limit: usize,
        partitions: Vec<u16>,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        match self {
            ProducerStore::Sqlite(_) => Err(StoreError::NotSupported(LEASES_NEED_POSTGRES)),
            ProducerStore::Postgres(s) => s.unaccepted_in(after, limit, partitions).await,
        }
    }

    /// A relay's heartbeat, by the database's clock: `instance` is alive for `ttl_us` more,
    /// each lease of `held` whose row still names it at that epoch is renewed for as long;
    /// then every lease row and the number of live relays are read.
    pub async fn lease_heartbeat(
        &self,
        instance: &str,
        ttl_us: i64,
        held: Vec<(u16, u64)>,
    ) -> Result<LeaseView, StoreError> {
        match self {
            ProducerStore::Sqlite(_) => Err(StoreError::NotSupported(LEASES_NEED_POSTGRES)),
            ProducerStore::Postgres(s) => s.lease_heartbeat(instance, ttl_us, held).await,
        }
    }

    /// Takes each of `partitions` whose lease is free (unowned or expired), one more epoch
    /// each, for `ttl_us`. Returns what was taken: `(partition, epoch)`.
    pub async fn lease_acquire(
        &self,
        instance: &str,
        ttl_us: i64,
        partitions: Vec<u16>,
    ) -> Result<Vec<(u16, u64)>, StoreError> {
        match self {
            ProducerStore::Sqlite(_) => Err(StoreError::NotSupported(LEASES_NEED_POSTGRES)),
            ProducerStore::Postgres(s) => s.lease_acquire(instance, ttl_us, partitions).await,
        }
    }

    /// Gives up each of `leases` still held at that epoch (free for anyone at once); with
    /// `retire`, also ends `instance`'s heartbeat (a clean shutdown). Returns the partitions
    /// released.
    pub async fn lease_release(
        &self,
        instance: &str,
        leases: Vec<(u16, u64)>,
        retire: bool,
    ) -> Result<Vec<u16>, StoreError> {
        match self {
            ProducerStore::Sqlite(_) => Err(StoreError::NotSupported(LEASES_NEED_POSTGRES)),
            ProducerStore::Postgres(s) => s.lease_release(instance, leases, retire).await,
        }
    }

    /// Counts one send of each of `event_ids` that got no answer, in ONE transaction: the
    /// rows stay unaccepted (`last_outcome` [`NO_ANSWER`]) and are sent again.
    pub async fn record_unanswered(&self, event_ids: Vec<String>) -> Result<(), StoreError> {
        if event_ids.is_empty() {
            return Ok(());
        }
        match self {
            ProducerStore::Sqlite(s) => s.record_unanswered(event_ids).await,
            ProducerStore::Postgres(s) => s.record_unanswered(event_ids).await,
        }
    }

    /// One compaction pass: every outbox row accepted before `cutoff_us` (µs since the
    /// epoch) that still has its body is reduced to a tombstone (its digest kept, the body
    /// dropped), in transactions of at most `batch` rows; unaccepted rows are never touched.
    /// Crash points `producer.compact.after_batch` (a batch rewritten, not committed) and
    /// `producer.compact.after_commit`. On SQLite the freed pages are then given back
    /// (`incremental_vacuum`, in bounded steps) when the file allows it. On PostgreSQL the
    /// pass also reports the rows relays compacted as they recorded acceptance, and with
    /// `on_accept` (a producer serving at retention 0) asks them to go on doing so.
    pub async fn compact(
        &self,
        cutoff_us: i64,
        batch: usize,
        keep_free_pages: u64,
        on_accept: bool,
    ) -> Result<CompactReport, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.compact(cutoff_us, batch.max(1), keep_free_pages).await,
            ProducerStore::Postgres(s) => s.compact(cutoff_us, batch.max(1), on_accept).await,
        }
    }

    /// In ONE transaction: what `consumer_db` lacks of what the outbox recorded as accepted
    /// (rows another consumer database accepted, and the rows `lost` names), marked
    /// unaccepted again (last outcome [`LOST_BY_CONSUMER`]) so it is sent again. Returns what
    /// was found (and unmarked). If any of those rows is compacted ([`LostRows::compacted`]),
    /// nothing is unmarked: they cannot be sent again, and the caller must stop.
    pub async fn resend_lost(&self, consumer_db: String, lost: Lost) -> Result<LostRows, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.resolve_lost(consumer_db, lost, false).await,
            ProducerStore::Postgres(s) => s.resolve_lost(consumer_db, lost, None, false).await,
        }
    }

    /// An operator's decision (`relay accept-lost`), in ONE transaction: what
    /// [`ProducerStore::resend_lost`] finds, over the whole outbox, with the compacted rows
    /// among it no longer a reason to stop: they stay accepted, name no consumer database any
    /// more and get the last outcome [`LOST_ACCEPTED`] ([`LostRows::loss_accepted`] counts
    /// them); the other lost rows are marked unaccepted again and sent again, as always.
    pub async fn accept_lost(&self, consumer_db: String, lost: Lost) -> Result<LostRows, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.resolve_lost(consumer_db, lost, true).await,
            ProducerStore::Postgres(s) => s.resolve_lost(consumer_db, lost, None, true).await,
        }
    }

    /// [`ProducerStore::resend_lost`] over the rows of `partitions` only (PostgreSQL): what a
    /// relay under leases checks, since only it marks those rows while it asks its consumer.
    pub async fn resend_lost_in(
        &self,
        consumer_db: String,
        lost: Lost,
        partitions: Vec<u16>,
    ) -> Result<LostRows, StoreError> {
        match self {
            ProducerStore::Sqlite(_) => Err(StoreError::NotSupported(LEASES_NEED_POSTGRES)),
            ProducerStore::Postgres(s) => s.resolve_lost(consumer_db, lost, Some(partitions), false).await,
        }
    }

    /// The consumer database most likely to answer a relay's next `Identify`: the one the
    /// accepted rows name (one index read). `None` when no accepted row names one. When rows
    /// name several (a replaced database, until its rows are sent again), one of them.
    pub async fn recorded_consumer_db(&self) -> Result<Option<String>, StoreError> {
        match self {
            ProducerStore::Sqlite(s) => s.recorded_consumer_db().await,
            ProducerStore::Postgres(s) => s.recorded_consumer_db().await,
        }
    }

    /// Up to `limit` accepted rows `consumer_db` answered for, as `(position, event_id)`,
    /// highest position first (ties by event id, descending), strictly below `below` when
    /// given (the last row of the previous page); under leases only rows of `partitions`
    /// (PostgreSQL). A range read of the index on `(accepted_by, accepted_position)` of
    /// accepted rows, on both backends.
    pub async fn accepted_page(
        &self,
        consumer_db: String,
        below: Option<(u64, String)>,
        limit: usize,
        partitions: Option<Vec<u16>>,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        match (self, partitions) {
            (ProducerStore::Sqlite(s), None) => s.accepted_page(consumer_db, below, limit).await,
            (ProducerStore::Sqlite(_), Some(_)) => Err(StoreError::NotSupported(LEASES_NEED_POSTGRES)),
            (ProducerStore::Postgres(s), partitions) => {
                s.accepted_page(consumer_db, below, limit, partitions).await
            }
        }
    }
}

/// Which rows of a consumer database's own a relay found lost (see
/// [`ProducerStore::resend_lost`]); rows another consumer database accepted are lost either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lost {
    /// Every row recorded above this inbox position (the consumer's highest): the judgement
    /// of a consumer that cannot answer probes (an older build). It misses rows whose
    /// positions a restored consumer gave to new events since.
    Beyond(u64),
    /// Exactly the rows recorded at these `(position, event_id)` pairs, still recorded so:
    /// the consumer answered that its inbox does not hold them there. A row accepted again
    /// (or unmarked) since the probe is left as it is.
    Probed(Vec<(u64, String)>),
}

#[cfg(test)]
mod tests;
