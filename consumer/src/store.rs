//! All SQL of consumer.db. `insert_pending` (accepted) and `apply_step` (projection, effect
//! and inbox mark: applied) each run inside the caller's `BEGIN IMMEDIATE` transaction, so
//! this module is the one owner of the file's invariants: a stored body never changes, and
//! a flow's effects are a contiguous prefix of its seqs, each applied once.

use std::path::Path;

use proto::body::Event;
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, DbError, DbKind};
use proto::flow::{FlowState, Kind};
use rusqlite::{Connection, OptionalExtension, Transaction, params};

use crate::rules::{BlockReason, Projection};

/// consumer.db: identity and schema (version 2: version 1 plus the database identity;
/// version 3: the state and reason checks without `IN` lists; a new file gets version 1's
/// schema and then every upgrade).
pub const KIND: DbKind = DbKind::consumer(3, SCHEMA, &[IDENTITY_SQL, PLAIN_CHECKS_SQL]);

/// Version 3: the same checks on `inbox.state`, `inbox.reason` and `projection.state`,
/// written as comparisons. SQLite evaluates a constant `IN` list of more than two values
/// through a temporary b-tree built anew at every execution (two zeroed pages, a cursor,
/// three inserts), and a CHECK runs on every write of the row: receiving and applying one
/// event wrote such rows four times, about a third of the consumer's instructions. The
/// definitions are edited in place (`writable_schema`, SQLite's documented way to change a
/// CHECK whose stored rows already satisfy it), so no row is copied. A NULL reason still
/// passes (`NULL = x` is NULL, as `NULL IN (...)` was).
const PLAIN_CHECKS_SQL: &str = "
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
SET sql = replace(replace(sql,
        'CHECK(state IN (''pending'',''blocked'',''applied''))',
        'CHECK(state = ''pending'' OR state = ''blocked'' OR state = ''applied'')'),
        'CHECK(reason IN (''unsupported_schema'',''invalid_payload'',''invalid_transition''))',
        'CHECK(reason = ''unsupported_schema'' OR reason = ''invalid_payload'' OR reason = ''invalid_transition'')')
WHERE type = 'table' AND name = 'inbox';
UPDATE sqlite_schema
SET sql = replace(sql, 'CHECK(state IN (''reserved'',''confirmed'',''released''))',
                  'CHECK(state = ''reserved'' OR state = ''confirmed'' OR state = ''released'')')
WHERE type = 'table' AND name = 'projection';
PRAGMA writable_schema = RESET;
";

/// The database's identity, created with it: a random id that a copy restored from a backup
/// keeps, and a recreated database does not. The inbox's rowid is the position of an
/// accepted row in this database's history (rows are never deleted), so "how far the durable
/// history reaches" is its highest rowid.
const IDENTITY_SQL: &str = "
CREATE TABLE database_identity(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    database_id TEXT NOT NULL,
    created_at_us INTEGER NOT NULL,
    -- Written by the storage probe while commits fail; nothing reads it.
    probed_at_us INTEGER
);
INSERT INTO database_identity(id, database_id, created_at_us)
VALUES (1, lower(hex(randomblob(16))), CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER));
";

const SCHEMA: &str = "
CREATE TABLE inbox(
    event_id TEXT PRIMARY KEY,
    flow_id TEXT NOT NULL,
    seq INTEGER NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    -- The canonical body, stored verbatim and never edited.
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending' CHECK(state IN ('pending','blocked','applied')),
    reason TEXT CHECK(reason IN ('unsupported_schema','invalid_payload','invalid_transition')),
    received_at_us INTEGER NOT NULL,
    applied_at_us INTEGER,
    UNIQUE(flow_id, seq),
    -- A reason exists exactly while the row is blocked.
    CHECK((state = 'blocked') = (reason IS NOT NULL))
);
-- Only unapplied rows are indexed: the backlog is counted and found without scanning history.
-- `state` is a column too so the backlog queries read the index alone (covering).
CREATE INDEX inbox_unapplied ON inbox(flow_id, seq, state) WHERE state <> 'applied';
CREATE TABLE projection(
    flow_id TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL CHECK(last_seq >= 1),
    state TEXT NOT NULL CHECK(state IN ('reserved','confirmed','released')),
    held INTEGER NOT NULL,
    amount INTEGER NOT NULL CHECK(amount >= 1)
);
-- rowid order is apply order.
CREATE TABLE effect(
    event_id TEXT NOT NULL UNIQUE REFERENCES inbox(event_id),
    flow_id TEXT NOT NULL,
    seq INTEGER NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    held INTEGER NOT NULL,
    applied_at_us INTEGER NOT NULL,
    UNIQUE(flow_id, seq)
);
-- The number of unapplied (pending + blocked) inbox rows, kept exact by triggers inside the
-- same transactions that change it, so the backlog cap is checked in O(1).
CREATE TABLE backlog(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    unapplied INTEGER NOT NULL CHECK(unapplied >= 0)
);
INSERT INTO backlog(id, unapplied) VALUES (1, 0);
CREATE TRIGGER backlog_insert AFTER INSERT ON inbox WHEN new.state <> 'applied'
BEGIN UPDATE backlog SET unapplied = unapplied + 1 WHERE id = 1; END;
CREATE TRIGGER backlog_applied AFTER UPDATE OF state ON inbox
WHEN old.state <> 'applied' AND new.state = 'applied'
BEGIN UPDATE backlog SET unapplied = unapplied - 1 WHERE id = 1; END;
";

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed (busy, I/O, constraint).
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    /// The file holds something this module never writes (edited by hand, or a bug).
    #[error("consumer.db is inconsistent: {0}")]
    Inconsistent(String),
    /// The file at the database's path is no longer the one this process has open.
    #[error("{0}")]
    FileReplaced(String),
}

/// Result of a store call.
pub type Result<T> = std::result::Result<T, StoreError>;

/// Opens (creating if needed) consumer.db with the shared settings.
pub fn open(path: &Path) -> std::result::Result<Connection, DbError> {
    db::open_logged(path, &KIND, db::OpenMode::Create)
}

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
    /// The canonical body, stored verbatim.
    pub body: String,
    /// Where it is: pending, blocked or applied.
    pub state: InboxState,
    /// Why it is blocked (only while blocked).
    pub reason: Option<BlockReason>,
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

/// What `insert_pending` decided (SPEC §6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiveOutcome {
    /// Inserted as pending; the caller commits, then answers.
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

/// Inside the caller's `BEGIN IMMEDIATE` transaction: stores `event` as pending unless its
/// event id or its (flow_id, seq) is already taken, or the backlog is full under
/// `admission`. Writes only for `Accepted`. Below the cap the insert is tried first
/// (`ON CONFLICT DO NOTHING`: one statement for the common case); only when it stored
/// nothing are the stored rows read to tell a duplicate from a conflict. At the cap, a
/// duplicate or conflict is still answered as such before the backlog is.
pub fn insert_pending(
    tx: &Transaction<'_>,
    event: &Event,
    now_us: i64,
    admission: Admission,
) -> Result<ReceiveOutcome> {
    let body = event.canonical_body();
    if let Admission::Cap(cap) = admission {
        let unapplied = unapplied_count(tx)?;
        if unapplied >= cap {
            if let Some(known) = stored_outcome(tx, event, &body)? {
                return Ok(known);
            }
            if !fills_gap(tx, event)? {
                return Ok(ReceiveOutcome::BacklogFull { unapplied });
            }
        }
    }
    let inserted = tx
        .prepare_cached(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', ?7) ON CONFLICT DO NOTHING",
        )?
        .execute(params![event.event_id, event.flow_id, event.seq, event.kind, event.schema, body, now_us])?;
    if inserted == 1 {
        return Ok(ReceiveOutcome::Accepted);
    }
    stored_outcome(tx, event, &body)?.ok_or_else(|| {
        StoreError::Inconsistent(format!(
            "inbox insert of {} stored nothing, yet neither its event_id nor its (flow_id, seq) is taken",
            event.event_id
        ))
    })
}

/// What the stored rows say about `event`: the same body under its id (`Duplicate`), another
/// body (`IdConflict`), another id at its (flow_id, seq) (`SequenceConflict`), or nothing.
fn stored_outcome(tx: &Transaction<'_>, event: &Event, body: &str) -> Result<Option<ReceiveOutcome>> {
    let stored: Option<String> = tx
        .prepare_cached("SELECT body FROM inbox WHERE event_id = ?1")?
        .query_row([&event.event_id], |r| r.get(0))
        .optional()?;
    if let Some(stored) = stored {
        return Ok(Some(if stored == body { ReceiveOutcome::Duplicate } else { ReceiveOutcome::IdConflict }));
    }
    let holder: Option<String> = tx
        .prepare_cached("SELECT event_id FROM inbox WHERE flow_id = ?1 AND seq = ?2")?
        .query_row(params![event.flow_id, event.seq], |r| r.get(0))
        .optional()?;
    Ok(holder.map(|held_by| ReceiveOutcome::SequenceConflict { held_by }))
}

/// This database's identity and how far its durable history reaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// The random id created with the database.
    pub database_id: String,
    /// The highest inbox position (rowid); 0 for an empty inbox.
    pub highest_position: u64,
}

/// Reads the identity and the highest inbox position (run it in one read transaction).
pub fn identity(conn: &Connection) -> Result<Identity> {
    let database_id: String = conn
        .prepare_cached("SELECT database_id FROM database_identity WHERE id = 1")?
        .query_row([], |r| r.get(0))?;
    let highest_position: u64 =
        conn.prepare_cached("SELECT coalesce(max(rowid), 0) FROM inbox")?.query_row([], |r| r.get(0))?;
    Ok(Identity { database_id, highest_position })
}

/// The inbox position of a stored event (its rowid), if stored.
pub fn inbox_position(conn: &Connection, event_id: &str) -> Result<Option<u64>> {
    Ok(conn
        .prepare_cached("SELECT rowid FROM inbox WHERE event_id = ?1")?
        .query_row([event_id], |r| r.get(0))
        .optional()?)
}

/// Inside the caller's `BEGIN IMMEDIATE` transaction: the storage probe's write (a real
/// page change, so its commit meets the same disk as any other).
pub fn touch_probe(tx: &Transaction<'_>, now_us: i64) -> Result<()> {
    tx.prepare_cached("UPDATE database_identity SET probed_at_us = ?1 WHERE id = 1")?.execute([now_us])?;
    Ok(())
}

/// Unapplied (pending + blocked) inbox rows, from the trigger-kept counter.
pub fn unapplied_count(conn: &Connection) -> Result<u64> {
    Ok(conn.prepare_cached("SELECT unapplied FROM backlog WHERE id = 1")?.query_row([], |r| r.get(0))?)
}

/// Whether `event` is exactly the next seq of a flow that already has rows waiting behind it.
fn fills_gap(conn: &Connection, event: &Event) -> Result<bool> {
    let next = projection(conn, &event.flow_id)?.last_seq + 1;
    if event.seq != next {
        return Ok(false);
    }
    Ok(conn
        .prepare_cached(LATER_UNAPPLIED_SQL)?
        .query_row(params![event.flow_id, event.seq], |r| r.get(0))?)
}

/// The flow's projection; a flow nothing was applied to is [`Projection::NEW`].
pub fn projection(conn: &Connection, flow_id: &str) -> Result<Projection> {
    let row = conn
        .prepare_cached("SELECT last_seq, state, held, amount FROM projection WHERE flow_id = ?1")?
        .query_row([flow_id], |r| {
            Ok((r.get::<_, u64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?, r.get::<_, i64>(3)?))
        })
        .optional()?;
    match row {
        None => Ok(Projection::NEW),
        Some((last_seq, state, held, amount)) => {
            let state = FlowState::parse(&state).ok_or_else(|| {
                StoreError::Inconsistent(format!("projection {flow_id}: unknown state {state:?}"))
            })?;
            Ok(Projection { last_seq, state, held, amount })
        }
    }
}

/// The columns `raw_inbox` reads, as a macro so the statements below are literals (built
/// once at compile time, not formatted at every call).
macro_rules! inbox_columns {
    () => {
        "event_id, flow_id, seq, kind, schema, body, state, reason"
    };
}

/// The row at one (flow_id, seq).
const INBOX_AT_SEQ_SQL: &str =
    concat!("SELECT ", inbox_columns!(), " FROM inbox WHERE flow_id = ?1 AND seq = ?2");

type RawInbox = (String, String, u64, String, u32, String, String, Option<String>);

fn raw_inbox(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawInbox> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?))
}

fn inbox_record(raw: RawInbox) -> Result<InboxRecord> {
    let (event_id, flow_id, seq, kind, schema, body, state, reason) = raw;
    let state = InboxState::parse(&state)
        .ok_or_else(|| StoreError::Inconsistent(format!("inbox {event_id}: unknown state {state:?}")))?;
    let reason = match reason {
        None => None,
        Some(r) => Some(
            BlockReason::parse(&r)
                .ok_or_else(|| StoreError::Inconsistent(format!("inbox {event_id}: unknown reason {r:?}")))?,
        ),
    };
    Ok(InboxRecord { event_id, flow_id, seq, kind, schema, body, state, reason })
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

/// The row at exactly `next_seq` of the flow ("greater than last_seq" would skip a gap), or
/// whether a later one waits.
pub fn next_to_apply(conn: &Connection, flow_id: &str, next_seq: u64) -> Result<Next> {
    let raw =
        conn.prepare_cached(INBOX_AT_SEQ_SQL)?.query_row(params![flow_id, next_seq], raw_inbox).optional()?;
    if let Some(raw) = raw {
        let row = inbox_record(raw)?;
        if row.state == InboxState::Applied {
            return Err(StoreError::Inconsistent(format!(
                "inbox {} (flow {flow_id}, seq {next_seq}) is applied but the projection is before it",
                row.event_id
            )));
        }
        return Ok(Next::Row(row));
    }
    let later: bool =
        conn.prepare_cached(LATER_UNAPPLIED_SQL)?.query_row(params![flow_id, next_seq], |r| r.get(0))?;
    Ok(if later { Next::Gap } else { Next::Idle })
}

/// Whether the flow has an unapplied row after a seq (answered from `inbox_unapplied`).
pub const LATER_UNAPPLIED_SQL: &str =
    "SELECT EXISTS(SELECT 1 FROM inbox WHERE flow_id = ?1 AND seq > ?2 AND state <> 'applied')";

/// Inside the caller's `BEGIN IMMEDIATE` transaction: marks an unapplied row `blocked` with
/// `reason` (a re-evaluation may change the reason). Returns false when nothing changed
/// (already blocked for this reason, or applied meanwhile). The body is never touched.
pub fn mark_blocked(tx: &Transaction<'_>, event_id: &str, reason: BlockReason) -> Result<bool> {
    let changed = tx
        .prepare_cached(
            "UPDATE inbox SET state = 'blocked', reason = ?2
             WHERE event_id = ?1 AND state <> 'applied' AND (state <> 'blocked' OR reason IS NOT ?2)",
        )?
        .execute(params![event_id, reason.as_str()])?;
    Ok(changed == 1)
}

/// What `apply_step` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// Projection, effect and inbox mark written; the caller commits.
    Applied,
    /// The stored projection is not the one the decision was made
    /// on (another applier won): nothing written, decide again.
    Raced,
}

/// Inside the caller's `BEGIN IMMEDIATE` transaction, the applied step of SPEC §7: only if
/// the stored projection is still `from` (checked by the guarded write itself, never
/// trusting the caller's copy) updates it to `after`, inserts the effect and marks `row`
/// applied. Any failure (a constraint, a trigger) is returned before commit, so the caller's
/// rollback undoes all three. Crash points `consumer.apply.after_projection` and `.after_effect` sit inside.
pub fn apply_step(
    tx: &Transaction<'_>,
    row: &InboxRecord,
    from: &Projection,
    kind: Kind,
    after: &Projection,
    crash: &CrashSwitch,
    now_us: i64,
) -> Result<StepOutcome> {
    if after.last_seq != row.seq {
        return Ok(StepOutcome::Raced);
    }
    // The write itself checks that the stored projection is still `from` (no row at all for
    // a new flow), so nothing is written when another applier moved it.
    let moved = if *from == Projection::NEW {
        tx.prepare_cached(
            "INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(flow_id) DO NOTHING",
        )?
        .execute(params![
            row.flow_id,
            after.last_seq,
            after.state.as_str(),
            after.held,
            after.amount
        ])?
    } else {
        tx.prepare_cached(
            "UPDATE projection SET last_seq = ?2, state = ?3, held = ?4, amount = ?5
             WHERE flow_id = ?1 AND last_seq = ?6 AND state = ?7 AND held = ?8 AND amount = ?9",
        )?
        .execute(params![
            row.flow_id,
            after.last_seq,
            after.state.as_str(),
            after.held,
            after.amount,
            from.last_seq,
            from.state.as_str(),
            from.held,
            from.amount
        ])?
    };
    if moved != 1 {
        return Ok(StepOutcome::Raced);
    }
    crash.reach(CrashPoint::ConsumerApplyAfterProjection);
    tx.prepare_cached(
        "INSERT INTO effect(event_id, flow_id, seq, kind, held, applied_at_us)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![row.event_id, row.flow_id, row.seq, kind.as_str(), after.held, now_us])?;
    let marked = tx
        .prepare_cached(
            "UPDATE inbox SET state = 'applied', reason = NULL, applied_at_us = ?2
             WHERE event_id = ?1 AND state <> 'applied'",
        )?
        .execute(params![row.event_id, now_us])?;
    if marked != 1 {
        return Err(StoreError::Inconsistent(format!(
            "inbox {} vanished or was applied while the projection was at seq {}",
            row.event_id, from.last_seq
        )));
    }
    crash.reach(CrashPoint::ConsumerApplyAfterEffect);
    Ok(StepOutcome::Applied)
}

/// The flow's inbox rows in seq order.
pub fn flow_inbox(conn: &Connection, flow_id: &str) -> Result<Vec<InboxRecord>> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT ",
        inbox_columns!(),
        " FROM inbox WHERE flow_id = ?1 ORDER BY seq"
    ))?;
    let raws = stmt.query_map([flow_id], raw_inbox)?.collect::<rusqlite::Result<Vec<_>>>()?;
    raws.into_iter().map(inbox_record).collect()
}

/// The flow's effects in seq order (which is also their apply order).
pub fn flow_effects(conn: &Connection, flow_id: &str) -> Result<Vec<EffectRecord>> {
    let mut stmt = conn.prepare_cached(
        "SELECT event_id, flow_id, seq, kind, held FROM effect WHERE flow_id = ?1 ORDER BY seq",
    )?;
    let rows = stmt.query_map([flow_id], |r| {
        Ok(EffectRecord {
            event_id: r.get(0)?,
            flow_id: r.get(1)?,
            seq: r.get(2)?,
            kind: r.get(3)?,
            held: r.get(4)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

/// Flows with unapplied rows, after a cursor, in flow_id order (answered from the partial
/// index `inbox_unapplied` alone).
pub const UNAPPLIED_FLOWS_SQL: &str = "SELECT DISTINCT flow_id FROM inbox
     WHERE state <> 'applied' AND flow_id > ?1 ORDER BY flow_id LIMIT ?2";

/// Up to `limit` flows with unapplied rows whose id sorts after `after` (start with "").
pub fn flows_with_unapplied(conn: &Connection, after: &str, limit: usize) -> Result<Vec<String>> {
    let mut stmt = conn.prepare_cached(UNAPPLIED_FLOWS_SQL)?;
    let rows = stmt.query_map(params![after, limit as i64], |r| r.get(0))?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

/// Per flow with unapplied rows: how many, and the lowest unapplied seq (answered from the
/// partial index `inbox_unapplied` alone, already in flow order).
pub const BACKLOG_BY_FLOW_SQL: &str = "SELECT flow_id, count(*), min(seq) FROM inbox
     WHERE state <> 'applied' GROUP BY flow_id ORDER BY flow_id LIMIT ?1";

/// Unapplied rows over all flows (a count over the partial index, not the history).
pub const UNAPPLIED_COUNT_SQL: &str = "SELECT count(*) FROM inbox WHERE state <> 'applied'";

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

/// Up to `limit` flows with unapplied rows in flow_id order, each with its projection and
/// lowest unapplied row, and the total of unapplied rows. Run it in one read transaction.
pub fn backlog(conn: &Connection, limit: usize) -> Result<(Vec<Backlog>, u64)> {
    let total: u64 = conn.prepare_cached(UNAPPLIED_COUNT_SQL)?.query_row([], |r| r.get(0))?;
    let groups: Vec<(String, u64, u64)> = conn
        .prepare_cached(BACKLOG_BY_FLOW_SQL)?
        .query_map([limit as i64], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut flows = Vec::with_capacity(groups.len());
    for (flow_id, waiting_rows, lowest_seq) in groups {
        let raw =
            conn.prepare_cached(INBOX_AT_SEQ_SQL)?.query_row(params![flow_id, lowest_seq], raw_inbox)?;
        flows.push(Backlog {
            projection: projection(conn, &flow_id)?,
            flow_id,
            waiting_rows,
            lowest: inbox_record(raw)?,
        });
    }
    Ok((flows, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Decision, decide_next};
    use proto::limits::parse_payload;

    fn event(flow: &str, seq: u64, kind: &str, schema: u32, payload: &str) -> Event {
        Event {
            event_id: format!("{flow}{seq}"),
            flow_id: flow.into(),
            seq,
            kind: kind.into(),
            schema,
            payload: parse_payload(payload).expect("valid payload"),
        }
    }

    fn reference(flow: &str, seq: u64) -> Event {
        let kind = ["reserved", "confirmed", "released"][seq as usize - 1];
        event(flow, seq, kind, 1, r#"{"amount":3}"#)
    }

    fn receive(conn: &mut Connection, e: &Event) -> ReceiveOutcome {
        let tx = db::begin_immediate(conn).unwrap();
        let outcome = insert_pending(&tx, e, 1, Admission::Unlimited).unwrap();
        tx.commit().unwrap();
        outcome
    }

    /// One step as the Apply loop makes it: read, decide, write.
    fn step(conn: &mut Connection, flow: &str) -> Option<StepOutcome> {
        let from = projection(conn, flow).unwrap();
        let Next::Row(row) = next_to_apply(conn, flow, from.next_seq()).unwrap() else { return None };
        let event = Event::from_canonical_body(&row.body).unwrap();
        let Decision::Apply { kind, after } = decide_next(&from, &event, false) else { return None };
        let tx = db::begin_immediate(conn).unwrap();
        let outcome = apply_step(&tx, &row, &from, kind, &after, &CrashSwitch::default(), 2).unwrap();
        tx.commit().unwrap();
        Some(outcome)
    }

    fn receive_capped(conn: &mut Connection, e: &Event, cap: u64) -> ReceiveOutcome {
        let tx = db::begin_immediate(conn).unwrap();
        let outcome = insert_pending(&tx, e, 1, Admission::Cap(cap)).unwrap();
        tx.commit().unwrap();
        outcome
    }

    #[test]
    fn a_full_backlog_refuses_new_work_but_admits_the_awaited_seq() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        assert_eq!(receive_capped(&mut conn, &reference("A", 1), 3), ReceiveOutcome::Accepted);
        assert!(step(&mut conn, "A").is_some());
        // A waits for seq 2 behind seq 3; B and C fill the backlog to its cap of 3.
        for e in [reference("A", 3), reference("B", 1), reference("C", 1)] {
            assert_eq!(receive_capped(&mut conn, &e, 3), ReceiveOutcome::Accepted, "{}", e.event_id);
        }
        assert_eq!(unapplied_count(&conn).unwrap(), 3);
        // A new flow's first event and a non-next seq are refused; nothing is stored.
        assert_eq!(
            receive_capped(&mut conn, &reference("D", 1), 3),
            ReceiveOutcome::BacklogFull { unapplied: 3 }
        );
        assert_eq!(
            receive_capped(&mut conn, &reference("B", 2), 3),
            ReceiveOutcome::BacklogFull { unapplied: 3 }
        );
        // Duplicates and conflicts are still told apart when full.
        assert_eq!(receive_capped(&mut conn, &reference("B", 1), 3), ReceiveOutcome::Duplicate);
        // The seq A waits for is admitted over the cap, and the backlog drains as it applies.
        assert_eq!(receive_capped(&mut conn, &reference("A", 2), 3), ReceiveOutcome::Accepted);
        assert_eq!(unapplied_count(&conn).unwrap(), 4);
        while step(&mut conn, "A").is_some() {}
        assert_eq!(unapplied_count(&conn).unwrap(), 2);
        let stored: i64 =
            conn.query_row("SELECT count(*) FROM inbox WHERE state <> 'applied'", [], |r| r.get(0)).unwrap();
        assert_eq!(stored, 2, "the counter matches the rows");
        assert_eq!(receive_capped(&mut conn, &reference("D", 1), 3), ReceiveOutcome::Accepted);
    }

    /// Opcodes of `sql` that build a temporary b-tree at every execution.
    fn ephemeral_opens(conn: &Connection, sql: &str) -> usize {
        let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).unwrap();
        // Listing the program binds nothing: `raw_query` skips the parameter count check.
        let ops: Vec<String> =
            stmt.raw_query().mapped(|r| r.get(1)).collect::<rusqlite::Result<_>>().unwrap();
        ops.iter().filter(|op| *op == "OpenEphemeral").count()
    }

    /// Every write a received and applied event makes to a checked row.
    const STEP_WRITES: [&str; 4] = [
        "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', ?7) ON CONFLICT DO NOTHING",
        "UPDATE inbox SET state = 'applied', reason = NULL, applied_at_us = ?2
         WHERE event_id = ?1 AND state <> 'applied'",
        "INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(flow_id) DO NOTHING",
        "UPDATE projection SET last_seq = ?2, state = ?3, held = ?4, amount = ?5
         WHERE flow_id = ?1 AND last_seq = ?6 AND state = ?7 AND held = ?8 AND amount = ?9",
    ];

    #[test]
    fn a_version_2_file_is_upgraded_and_no_step_builds_a_temporary_btree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v2 = DbKind::consumer(2, SCHEMA, &[IDENTITY_SQL]);
        let mut conn = db::open(&path, &v2, db::OpenMode::Create).unwrap();
        receive(&mut conn, &reference("A", 1));
        assert!(
            STEP_WRITES.iter().all(|sql| ephemeral_opens(&conn, sql) > 0),
            "version 2 checks through temporary b-trees"
        );
        let upgraded = open(&path).unwrap();
        // The other connection's next statement notices the changed schema cookie.
        conn.query_row("SELECT count(*) FROM inbox", [], |r| r.get::<_, i64>(0)).unwrap();
        for c in [&conn, &upgraded] {
            for sql in STEP_WRITES {
                assert_eq!(ephemeral_opens(c, sql), 0, "{sql}");
            }
        }
        drop(conn);
        let mut conn = upgraded;
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        for bad in [
            "UPDATE inbox SET state = 'gone'",
            "UPDATE inbox SET state = 'blocked', reason = 'tired'",
            "UPDATE projection SET state = 'gone'",
        ] {
            let err = conn.execute(bad, []).unwrap_err();
            assert!(err.to_string().contains("CHECK constraint failed"), "{bad}: {err}");
        }
        // Every allowed value still passes (rolled back: the row stays applied).
        let tx = db::begin_immediate(&mut conn).unwrap();
        for reason in ["unsupported_schema", "invalid_payload", "invalid_transition"] {
            tx.execute("UPDATE inbox SET state = 'blocked', reason = ?1", [reason]).unwrap();
        }
        tx.execute("UPDATE inbox SET state = 'pending', reason = NULL", []).unwrap();
        drop(tx);
        // A new file gets the same definitions.
        let fresh = open(&dir.path().join("new.db")).unwrap();
        let sql = |c: &Connection| -> Vec<String> {
            c.prepare("SELECT sql FROM sqlite_schema WHERE type = 'table' ORDER BY name")
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        assert_eq!(sql(&fresh), sql(&conn));
        assert!(sql(&fresh).iter().all(|t| !t.contains(" IN (")), "{:?}", sql(&fresh));
    }

    fn plan(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> String {
        let rows: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .unwrap()
            .query_map(params, |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        rows.join("\n")
    }

    #[test]
    fn receive_outcomes() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        assert_eq!(receive(&mut conn, &reference("A", 1)), ReceiveOutcome::Accepted);
        assert_eq!(receive(&mut conn, &reference("A", 1)), ReceiveOutcome::Duplicate);
        let changed = event("A", 1, "reserved", 1, r#"{"amount":4}"#);
        assert_eq!(receive(&mut conn, &changed), ReceiveOutcome::IdConflict);
        let other_id = Event { event_id: "X".into(), ..reference("A", 1) };
        assert_eq!(receive(&mut conn, &other_id), ReceiveOutcome::SequenceConflict { held_by: "A1".into() });
        let unknown = event("A", 2, "teleported", 77, r#"{"who":"knows"}"#);
        assert_eq!(receive(&mut conn, &unknown), ReceiveOutcome::Accepted);
        let rows = flow_inbox(&conn, "A").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].body, unknown.canonical_body());
        assert!(rows.iter().all(|r| r.state == InboxState::Pending && r.reason.is_none()));
    }

    #[test]
    fn next_to_apply_looks_at_exactly_the_next_seq() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        assert_eq!(next_to_apply(&conn, "A", 1).unwrap(), Next::Idle);
        receive(&mut conn, &reference("A", 3));
        assert_eq!(next_to_apply(&conn, "A", 1).unwrap(), Next::Gap);
        assert_eq!(next_to_apply(&conn, "A", 4).unwrap(), Next::Idle);
        receive(&mut conn, &reference("A", 1));
        assert!(matches!(next_to_apply(&conn, "A", 1).unwrap(), Next::Row(r) if r.event_id == "A1"));
    }

    #[test]
    fn a_stale_projection_races_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let mut a = open(&path).unwrap();
        let mut b = open(&path).unwrap();
        for seq in 1..=2 {
            receive(&mut a, &reference("A", seq));
        }
        // Both appliers decide on projection NEW; only the first write applies seq 1.
        let from = projection(&a, "A").unwrap();
        let Next::Row(row) = next_to_apply(&a, "A", 1).unwrap() else { panic!("row 1") };
        assert_eq!(step(&mut b, "A"), Some(StepOutcome::Applied));
        let Decision::Apply { kind, after } =
            decide_next(&from, &Event::from_canonical_body(&row.body).unwrap(), false)
        else {
            panic!("apply")
        };
        let tx = db::begin_immediate(&mut a).unwrap();
        assert_eq!(
            apply_step(&tx, &row, &from, kind, &after, &CrashSwitch::default(), 3).unwrap(),
            StepOutcome::Raced
        );
        drop(tx);
        assert_eq!(step(&mut a, "A"), Some(StepOutcome::Applied));
        let effects = flow_effects(&a, "A").unwrap();
        assert_eq!(effects.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(projection(&a, "A").unwrap().state, FlowState::Confirmed);
    }

    #[test]
    fn a_failing_effect_insert_rolls_the_projection_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        receive(&mut conn, &reference("A", 1));
        conn.execute_batch(
            "CREATE TRIGGER no_effects BEFORE INSERT ON effect BEGIN SELECT RAISE(ABORT, 'effects frozen'); END;",
        )
        .unwrap();
        let from = projection(&conn, "A").unwrap();
        let Next::Row(row) = next_to_apply(&conn, "A", 1).unwrap() else { panic!("row") };
        let Decision::Apply { kind, after } =
            decide_next(&from, &Event::from_canonical_body(&row.body).unwrap(), false)
        else {
            panic!("apply")
        };
        let tx = db::begin_immediate(&mut conn).unwrap();
        let err = apply_step(&tx, &row, &from, kind, &after, &CrashSwitch::default(), 3).unwrap_err();
        assert!(err.to_string().contains("effects frozen"), "{err}");
        drop(tx);
        assert_eq!(projection(&conn, "A").unwrap(), Projection::NEW);
        assert_eq!(flow_inbox(&conn, "A").unwrap()[0].state, InboxState::Pending);
        assert!(flow_effects(&conn, "A").unwrap().is_empty());
    }

    #[test]
    fn blocking_keeps_the_body_and_re_evaluation_updates_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        let v2 = event("A", 1, "reserved", 2, r#"{"units":3}"#);
        receive(&mut conn, &v2);
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(mark_blocked(&tx, "A1", BlockReason::UnsupportedSchema).unwrap());
        assert!(!mark_blocked(&tx, "A1", BlockReason::UnsupportedSchema).unwrap());
        assert!(mark_blocked(&tx, "A1", BlockReason::InvalidPayload).unwrap());
        tx.commit().unwrap();
        let row = &flow_inbox(&conn, "A").unwrap()[0];
        assert_eq!((row.state, row.reason), (InboxState::Blocked, Some(BlockReason::InvalidPayload)));
        assert_eq!(row.body, v2.canonical_body());
        // Applying a blocked row clears its reason.
        let from = Projection::NEW;
        let Decision::Apply { kind, after } = decide_next(&from, &v2, true) else { panic!("apply") };
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert_eq!(
            apply_step(&tx, row, &from, kind, &after, &CrashSwitch::default(), 3).unwrap(),
            StepOutcome::Applied
        );
        assert!(!mark_blocked(&tx, "A1", BlockReason::InvalidPayload).unwrap());
        tx.commit().unwrap();
        let row = &flow_inbox(&conn, "A").unwrap()[0];
        assert_eq!((row.state, row.reason), (InboxState::Applied, None));
    }

    #[test]
    fn the_backlog_is_found_through_the_partial_index() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open(&dir.path().join("c.db")).unwrap();
        for (sql, plan) in [
            (UNAPPLIED_COUNT_SQL, plan(&conn, UNAPPLIED_COUNT_SQL, [])),
            (BACKLOG_BY_FLOW_SQL, plan(&conn, BACKLOG_BY_FLOW_SQL, [10])),
            (UNAPPLIED_FLOWS_SQL, plan(&conn, UNAPPLIED_FLOWS_SQL, params!["", 10])),
            (LATER_UNAPPLIED_SQL, plan(&conn, LATER_UNAPPLIED_SQL, params!["A", 1])),
        ] {
            assert!(plan.contains("USING COVERING INDEX inbox_unapplied"), "{sql}\n{plan}");
            assert!(!plan.contains("TEMP B-TREE"), "{sql}\n{plan}");
        }
    }

    #[test]
    fn backlog_reports_each_waiting_flow() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        receive(&mut conn, &reference("G", 1));
        receive(&mut conn, &reference("G", 3));
        receive(&mut conn, &reference("R", 1));
        receive(&mut conn, &reference("R", 2));
        assert_eq!(step(&mut conn, "G"), Some(StepOutcome::Applied));
        let (flows, total) = backlog(&conn, 10).unwrap();
        assert_eq!(total, 3);
        assert_eq!(flows.len(), 2);
        assert_eq!((flows[0].flow_id.as_str(), flows[0].waiting_rows, flows[0].lowest.seq), ("G", 1, 3));
        assert_eq!(flows[0].projection.last_seq, 1);
        assert_eq!((flows[1].flow_id.as_str(), flows[1].waiting_rows, flows[1].lowest.seq), ("R", 2, 1));
        let (first, _) = backlog(&conn, 1).unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(flows_with_unapplied(&conn, "", 10).unwrap(), ["G", "R"]);
        assert_eq!(flows_with_unapplied(&conn, "G", 10).unwrap(), ["R"]);
    }
}
