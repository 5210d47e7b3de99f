//! All SQL of producer.db. `advance` makes the flow update and its outbox row one
//! `BEGIN IMMEDIATE` transaction (the caller's); the relay reads and marks outbox rows only
//! through the functions below, so this module is the one owner of the file's invariants.

use std::path::Path;

use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, DbError, DbKind, OpenMode};
use proto::flow::{FlowState, TransitionError, check_step};
use rusqlite::{Connection, OptionalExtension, Transaction, params};

use crate::request::AdvanceCommand;

/// producer.db: identity and schema (version 2: version 1, then the database identity and
/// which consumer database accepted each row, at which position; version 3: the flow state
/// check without an `IN` list).
pub const KIND: DbKind = DbKind::producer(3, SCHEMA, &[IDENTITY_SQL, PLAIN_CHECKS_SQL]);

/// Version 3: the same check on `flow.state`, written as comparisons. SQLite evaluates a
/// constant `IN` list of more than two values through a temporary b-tree built anew at every
/// execution (two zeroed pages, a cursor, three inserts), and a CHECK runs on every write of
/// the row: that was about a seventh of the producer's instructions per event. The
/// definition is edited in place (`writable_schema`, SQLite's documented way to change a
/// CHECK whose stored rows already satisfy it), so no row is copied.
const PLAIN_CHECKS_SQL: &str = "
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
SET sql = replace(sql, 'CHECK(state IN (''reserved'',''confirmed'',''released''))',
                  'CHECK(state = ''reserved'' OR state = ''confirmed'' OR state = ''released'')')
WHERE type = 'table' AND name = 'flow';
PRAGMA writable_schema = RESET;
";

/// Version 2: the database's random identity, and on every accepted outbox row the consumer
/// database that accepted it and the inbox position it answered, so a relay can tell when
/// that consumer lost history (recreated: another id; restored from a backup: a highest
/// position below one it answered) and send the lost rows again.
const IDENTITY_SQL: &str = "
CREATE TABLE database_identity(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    database_id TEXT NOT NULL,
    created_at_us INTEGER NOT NULL
);
INSERT INTO database_identity(id, database_id, created_at_us)
VALUES (1, lower(hex(randomblob(16))), CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER));
ALTER TABLE outbox ADD COLUMN accepted_by TEXT;
ALTER TABLE outbox ADD COLUMN accepted_position INTEGER;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
-- A row sent again because its consumer lost it counts as unaccepted again.
CREATE TRIGGER backlog_unmarked AFTER UPDATE OF accepted ON outbox
WHEN old.accepted = 1 AND new.accepted = 0
BEGIN UPDATE backlog SET unaccepted = unaccepted + 1 WHERE id = 1; END;
";

const SCHEMA: &str = "
CREATE TABLE flow(
    flow_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL CHECK(seq >= 1),
    state TEXT NOT NULL CHECK(state IN ('reserved','confirmed','released')),
    amount INTEGER NOT NULL CHECK(amount >= 1)
);
CREATE TABLE outbox(
    event_id TEXT PRIMARY KEY,
    flow_id TEXT NOT NULL REFERENCES flow(flow_id),
    seq INTEGER NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    body TEXT NOT NULL,
    accepted INTEGER NOT NULL DEFAULT 0 CHECK(accepted IN (0,1)),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_outcome TEXT,
    committed_at_us INTEGER NOT NULL,
    accepted_at_us INTEGER,
    UNIQUE(flow_id, seq)
);
-- Only unaccepted rows are indexed: finding the relay's work never scans the history.
CREATE INDEX outbox_unaccepted ON outbox(flow_id, seq) WHERE accepted = 0;
-- The number of unaccepted outbox rows, kept exact by triggers inside the transactions that
-- change it, so the outbox cap is an O(1) read.
CREATE TABLE backlog(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    unaccepted INTEGER NOT NULL CHECK(unaccepted >= 0)
);
INSERT INTO backlog(id, unaccepted) VALUES (1, 0);
CREATE TRIGGER backlog_insert AFTER INSERT ON outbox WHEN new.accepted = 0
BEGIN UPDATE backlog SET unaccepted = unaccepted + 1 WHERE id = 1; END;
CREATE TRIGGER backlog_accepted AFTER UPDATE OF accepted ON outbox
WHEN old.accepted = 0 AND new.accepted = 1
BEGIN UPDATE backlog SET unaccepted = unaccepted - 1 WHERE id = 1; END;
";

/// Opens producer.db with the shared settings (`Create` for the server, `Existing` for the
/// relay, which refuses a file the producer has not created).
pub fn open(path: &Path, mode: OpenMode) -> Result<Connection, DbError> {
    db::open_logged(path, &KIND, mode)
}

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
    const NEW: FlowRecord = FlowRecord { seq: 0, state: FlowState::New, amount: 0 };
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
    /// The canonical body, exactly as committed and sent.
    pub body: String,
    /// The consumer durably holds it (answered `ACCEPTED` or `DUPLICATE`).
    pub accepted: bool,
    /// Answers the relay recorded for it.
    pub attempts: u64,
    /// The last answer's word, e.g. `BACKLOG_FULL` (none before the first answer).
    pub last_outcome: Option<String>,
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

/// SPEC §5 inside the caller's `BEGIN IMMEDIATE` transaction, in order: event-id history
/// (EXISTING/CONFLICT), expected seq (STALE), legal step (INVALID_TRANSITION), then the flow
/// update and the outbox insert. Nothing is written unless the outcome is `Committed`; the
/// caller commits, then reaches `producer.after_commit`.
pub fn advance(
    tx: &Transaction<'_>,
    cmd: &AdvanceCommand,
    crash: &CrashSwitch,
    now_us: i64,
    max_unaccepted: Option<u64>,
) -> rusqlite::Result<AdvanceReply> {
    let flow = flow_record(tx, &cmd.flow_id)?;
    if let Some(stored) = outbox_row(tx, &cmd.event_id)? {
        let outcome = if stored.body == cmd.event().canonical_body() {
            AdvanceOutcome::Existing
        } else {
            AdvanceOutcome::Conflict
        };
        return Ok(AdvanceReply { outcome, flow, event: Some(stored) });
    }
    if flow.seq != cmd.expected_seq {
        return Ok(AdvanceReply { outcome: AdvanceOutcome::Stale, flow, event: None });
    }
    let next = match check_step(flow.state, flow.amount, cmd.kind, cmd.amount) {
        Ok(next) => next,
        Err(e) => {
            return Ok(AdvanceReply { outcome: AdvanceOutcome::InvalidTransition(e), flow, event: None });
        }
    };
    if let Some(cap) = max_unaccepted {
        let unaccepted = unaccepted_count(tx)?;
        if unaccepted >= cap {
            return Ok(AdvanceReply {
                outcome: AdvanceOutcome::OutboxFull { unaccepted },
                flow,
                event: None,
            });
        }
    }
    let event = cmd.event();
    tx.prepare_cached(
        "INSERT INTO flow(flow_id, seq, state, amount) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(flow_id) DO UPDATE SET seq = excluded.seq, state = excluded.state",
    )?
    .execute(params![event.flow_id, event.seq, next.as_str(), cmd.amount])?;
    crash.reach(CrashPoint::ProducerAfterFlowUpdate);
    let body = event.canonical_body();
    tx.prepare_cached(
        "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        event.event_id,
        event.flow_id,
        event.seq,
        event.kind,
        event.schema,
        body,
        now_us
    ])?;
    crash.reach(CrashPoint::ProducerAfterOutboxInsert);
    let stored = OutboxRecord {
        event_id: event.event_id,
        flow_id: event.flow_id,
        seq: event.seq,
        kind: event.kind,
        schema: event.schema,
        body,
        accepted: false,
        attempts: 0,
        last_outcome: None,
    };
    let flow = FlowRecord {
        seq: stored.seq,
        state: next,
        amount: if flow.state == FlowState::New { cmd.amount } else { flow.amount },
    };
    Ok(AdvanceReply { outcome: AdvanceOutcome::Committed, flow, event: Some(stored) })
}

/// The flow's committed state; a flow with no row is `new`, seq 0.
pub fn flow_record(conn: &Connection, flow_id: &str) -> rusqlite::Result<FlowRecord> {
    let row = conn
        .prepare_cached("SELECT seq, state, amount FROM flow WHERE flow_id = ?1")?
        .query_row([flow_id], |r| Ok((r.get::<_, u64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?)))
        .optional()?;
    match row {
        None => Ok(FlowRecord::NEW),
        Some((seq, state, amount)) => {
            let state = FlowState::parse(&state)
                .ok_or_else(|| corrupt(format!("flow {flow_id}: unknown state {state:?}")))?;
            Ok(FlowRecord { seq, state, amount })
        }
    }
}

/// The columns `outbox_from_row` reads, as a macro so the statements below are literals
/// (built once at compile time, not formatted at every call).
macro_rules! outbox_columns {
    () => {
        "event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome"
    };
}

fn outbox_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxRecord> {
    Ok(OutboxRecord {
        event_id: r.get(0)?,
        flow_id: r.get(1)?,
        seq: r.get(2)?,
        kind: r.get(3)?,
        schema: r.get(4)?,
        body: r.get(5)?,
        accepted: r.get::<_, i64>(6)? != 0,
        attempts: r.get(7)?,
        last_outcome: r.get(8)?,
    })
}

/// The outbox row of `event_id`, accepted or not.
pub fn outbox_row(conn: &Connection, event_id: &str) -> rusqlite::Result<Option<OutboxRecord>> {
    conn.prepare_cached(concat!("SELECT ", outbox_columns!(), " FROM outbox WHERE event_id = ?1"))?
        .query_row([event_id], outbox_from_row)
        .optional()
}

/// The flow's outbox rows in seq order.
pub fn flow_outbox(conn: &Connection, flow_id: &str) -> rusqlite::Result<Vec<OutboxRecord>> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT ",
        outbox_columns!(),
        " FROM outbox WHERE flow_id = ?1 ORDER BY seq"
    ))?;
    stmt.query_map([flow_id], outbox_from_row)?.collect()
}

/// The SQL that pages through unaccepted rows in `(flow_id, seq)` order, after a cursor.
/// It is answered from the partial index `outbox_unaccepted` alone (see the
/// `EXPLAIN QUERY PLAN` test), so the accepted history is never scanned.
pub const UNACCEPTED_PAGE_SQL: &str =
    "SELECT event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome
     FROM outbox WHERE accepted = 0 AND (flow_id, seq) > (?1, ?2)
     ORDER BY flow_id, seq LIMIT ?3";

/// Up to `limit` unaccepted rows after `(flow_id, seq)` in `(flow_id, seq)` order (start
/// with `("", 0)`). One short read; no transaction is held between pages.
pub fn unaccepted_after(
    conn: &Connection,
    after: (&str, u64),
    limit: usize,
) -> rusqlite::Result<Vec<OutboxRecord>> {
    let mut stmt = conn.prepare_cached(UNACCEPTED_PAGE_SQL)?;
    stmt.query_map(params![after.0, after.1, limit as i64], outbox_from_row)?.collect()
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

/// Inside a relay's transaction: counts one send of `event_id` with the consumer's answer,
/// and when the answer [holds the event](DeliveryAnswer::holds_event) sets `accepted = 1`
/// and, when known, which consumer database holds it at which inbox position
/// (`accepted_by`). Any other answer leaves the row unaccepted and `accepted_by` as it was.
/// One statement: the row and its indexes are written once per answer. Returns false when
/// no such row exists.
pub fn record_delivery(
    tx: &Transaction<'_>,
    event_id: &str,
    answer: DeliveryAnswer,
    now_us: i64,
    accepted_by: Option<AcceptedBy<'_>>,
) -> rusqlite::Result<bool> {
    let mut stmt = tx.prepare_cached(
        "UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2,
             accepted_at_us = CASE WHEN ?3 AND accepted = 0 THEN ?4 ELSE accepted_at_us END,
             accepted = CASE WHEN ?3 THEN 1 ELSE accepted END,
             accepted_by = CASE WHEN ?3 AND ?5 IS NOT NULL THEN ?5 ELSE accepted_by END,
             accepted_position = CASE WHEN ?3 AND ?5 IS NOT NULL THEN ?6 ELSE accepted_position END
         WHERE event_id = ?1",
    )?;
    let holds = answer.holds_event();
    let (by, position) = match accepted_by {
        Some(a) if holds => (Some(a.consumer_db), Some(a.position)),
        _ => (None, None),
    };
    Ok(stmt.execute(params![event_id, answer.word(), holds, now_us, by, position])? == 1)
}

/// The word `last_outcome` gets for a send that was never answered (the stream broke, the
/// consumer stopped answering, or the relay stopped first).
pub const NO_ANSWER: &str = "NO_ANSWER";

/// Inside a relay's transaction: counts one send of `event_id` that got no answer. The row
/// stays unaccepted (it will be sent again); `last_outcome` becomes [`NO_ANSWER`]. Returns
/// false when no such row exists.
pub fn record_unanswered_send(tx: &Transaction<'_>, event_id: &str) -> rusqlite::Result<bool> {
    let mut stmt = tx
        .prepare_cached("UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2 WHERE event_id = ?1")?;
    Ok(stmt.execute(params![event_id, NO_ANSWER])? == 1)
}

/// This producer database's random identity, created with it.
pub fn database_id(conn: &Connection) -> rusqlite::Result<String> {
    conn.prepare_cached("SELECT database_id FROM database_identity WHERE id = 1")?.query_row([], |r| r.get(0))
}

/// Accepted rows the consumer database `consumer_db`, whose history reaches
/// `highest_position`, no longer holds: rows another consumer database accepted, and rows
/// this one accepted at a later position (it was restored from an older copy). Rows accepted
/// before positions were recorded are not counted (nothing is known about them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LostRows {
    /// Rows accepted by another consumer database.
    pub other_database: u64,
    /// Rows this consumer database accepted beyond its history.
    pub beyond_history: u64,
    /// The highest position this consumer database answered.
    pub highest_recorded: u64,
    /// A few of the lost rows' event ids, for the log.
    pub sample: Vec<String>,
}

const LOST_WHERE: &str = "accepted = 1 AND accepted_by IS NOT NULL
     AND (accepted_by <> ?1 OR accepted_position > ?2)";

/// What `consumer_db` at `highest_position` lacks of what the outbox recorded as accepted.
pub fn lost_rows(conn: &Connection, consumer_db: &str, highest_position: u64) -> rusqlite::Result<LostRows> {
    let other_database = conn
        .prepare_cached("SELECT count(*) FROM outbox WHERE accepted = 1 AND accepted_by IS NOT NULL AND accepted_by <> ?1")?
        .query_row([consumer_db], |r| r.get(0))?;
    let (beyond_history, highest_recorded) = conn
        .prepare_cached(
            "SELECT count(*) FILTER (WHERE accepted_position > ?2), coalesce(max(accepted_position), 0)
             FROM outbox WHERE accepted = 1 AND accepted_by = ?1",
        )?
        .query_row(params![consumer_db, highest_position], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let sample = conn
        .prepare_cached(&format!(
            "SELECT event_id FROM outbox WHERE {LOST_WHERE} ORDER BY flow_id, seq LIMIT 5"
        ))?
        .query_map(params![consumer_db, highest_position], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(LostRows { other_database, beyond_history, highest_recorded, sample })
}

/// Inside a relay's transaction: marks every row [`lost_rows`] counts unaccepted again (its
/// `last_outcome` says why), so it is sent again; the consumer answers `DUPLICATE` where it
/// still holds one. Returns how many rows changed.
pub fn unmark_lost(tx: &Transaction<'_>, consumer_db: &str, highest_position: u64) -> rusqlite::Result<u64> {
    let changed = tx
        .prepare_cached(&format!(
            "UPDATE outbox SET accepted = 0, accepted_at_us = NULL, accepted_by = NULL,
                 accepted_position = NULL, last_outcome = 'LOST_BY_CONSUMER'
             WHERE {LOST_WHERE}"
        ))?
        .execute(params![consumer_db, highest_position])?;
    Ok(changed as u64)
}

/// Unaccepted outbox rows, from the trigger-kept counter.
pub fn unaccepted_count(conn: &Connection) -> rusqlite::Result<u64> {
    conn.prepare_cached("SELECT unaccepted FROM backlog WHERE id = 1")?.query_row([], |r| r.get(0))
}

/// Counts of outbox rows: (all, unaccepted).
pub fn outbox_counts(conn: &Connection) -> rusqlite::Result<(u64, u64)> {
    let total = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
    let unaccepted = conn.query_row("SELECT count(*) FROM outbox WHERE accepted = 0", [], |r| r.get(0))?;
    Ok((total, unaccepted))
}

fn corrupt(msg: String) -> rusqlite::Error {
    rusqlite::Error::InvalidColumnType(0, msg, rusqlite::types::Type::Text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::validate;
    use proto::pb;

    fn cmd(event: &str, expected: u64, kind: &str, schema: u32, amount: i64) -> AdvanceCommand {
        validate(&pb::AdvanceRequest {
            flow_id: "A".into(),
            event_id: event.into(),
            expected_seq: expected,
            kind: kind.into(),
            schema,
            amount,
        })
        .unwrap()
    }

    fn run(conn: &mut Connection, c: &AdvanceCommand) -> AdvanceReply {
        let tx = db::begin_immediate(conn).unwrap();
        let reply = advance(&tx, c, &CrashSwitch::default(), 1, None).unwrap();
        tx.commit().unwrap();
        reply
    }

    #[test]
    fn advance_table_of_spec_section_10() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        assert_eq!(run(&mut conn, &cmd("A1", 0, "reserved", 1, 3)).outcome, AdvanceOutcome::Committed);
        assert_eq!(run(&mut conn, &cmd("A2", 1, "confirmed", 1, 3)).outcome, AdvanceOutcome::Committed);
        assert_eq!(run(&mut conn, &cmd("A3", 2, "released", 1, 3)).outcome, AdvanceOutcome::Committed);
        let retry = run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        assert_eq!(retry.outcome, AdvanceOutcome::Existing);
        assert_eq!(retry.flow.seq, 3);
        assert_eq!(retry.flow.state, FlowState::Released);
        assert_eq!(run(&mut conn, &cmd("A1", 0, "reserved", 1, 4)).outcome, AdvanceOutcome::Conflict);
        assert_eq!(run(&mut conn, &cmd("A1", 0, "reserved", 2, 3)).outcome, AdvanceOutcome::Conflict);
        let other_flow = AdvanceCommand { flow_id: "B".into(), ..cmd("A1", 0, "reserved", 1, 3) };
        assert_eq!(run(&mut conn, &other_flow).outcome, AdvanceOutcome::Conflict);
        assert_eq!(run(&mut conn, &cmd("A9", 1, "confirmed", 1, 3)).outcome, AdvanceOutcome::Stale);
        assert_eq!(flow_outbox(&conn, "A").unwrap().len(), 3);
    }

    #[test]
    fn a_full_outbox_refuses_new_steps_but_still_answers_retries() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        let capped = |conn: &mut Connection, c: &AdvanceCommand| {
            let tx = db::begin_immediate(conn).unwrap();
            let reply = advance(&tx, c, &CrashSwitch::default(), 1, Some(2)).unwrap();
            tx.commit().unwrap();
            reply.outcome
        };
        assert_eq!(capped(&mut conn, &cmd("A1", 0, "reserved", 1, 3)), AdvanceOutcome::Committed);
        assert_eq!(capped(&mut conn, &cmd("A2", 1, "confirmed", 1, 3)), AdvanceOutcome::Committed);
        assert_eq!(unaccepted_count(&conn).unwrap(), 2);
        assert_eq!(
            capped(&mut conn, &cmd("A3", 2, "released", 1, 3)),
            AdvanceOutcome::OutboxFull { unaccepted: 2 }
        );
        // Retries and rejections are still answered as usual when full.
        assert_eq!(capped(&mut conn, &cmd("A1", 0, "reserved", 1, 3)), AdvanceOutcome::Existing);
        assert_eq!(capped(&mut conn, &cmd("A9", 0, "reserved", 1, 3)), AdvanceOutcome::Stale);
        assert_eq!(flow_record(&conn, "A").unwrap().seq, 2);
        // Once the relay marks a row accepted, there is room again.
        let tx = db::begin_immediate(&mut conn).unwrap();
        record_delivery(&tx, "A1", DeliveryAnswer::Accepted, 2, None).unwrap();
        record_delivery(&tx, "A1", DeliveryAnswer::Duplicate, 3, None).unwrap();
        tx.commit().unwrap();
        assert_eq!(unaccepted_count(&conn).unwrap(), 1);
        assert_eq!(capped(&mut conn, &cmd("A3", 2, "released", 1, 3)), AdvanceOutcome::Committed);
    }

    #[test]
    fn illegal_steps_and_amount_changes_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        assert!(matches!(
            run(&mut conn, &cmd("A2", 0, "confirmed", 1, 3)).outcome,
            AdvanceOutcome::InvalidTransition(_)
        ));
        assert_eq!(flow_record(&conn, "A").unwrap(), FlowRecord::NEW);
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        assert!(matches!(
            run(&mut conn, &cmd("A2", 1, "confirmed", 1, 5)).outcome,
            AdvanceOutcome::InvalidTransition(TransitionError::AmountChanged { fixed: 3, got: 5 })
        ));
        assert!(matches!(
            run(&mut conn, &cmd("A2", 1, "released", 1, 3)).outcome,
            AdvanceOutcome::InvalidTransition(_)
        ));
        assert_eq!(flow_record(&conn, "A").unwrap().seq, 1);
        assert_eq!(flow_outbox(&conn, "A").unwrap().len(), 1);
    }

    /// Opcodes of `sql` that build a temporary b-tree at every execution.
    fn ephemeral_opens(conn: &Connection, sql: &str) -> usize {
        let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).unwrap();
        // Listing the program binds nothing: `raw_query` skips the parameter count check.
        let ops: Vec<String> =
            stmt.raw_query().mapped(|r| r.get(1)).collect::<rusqlite::Result<_>>().unwrap();
        ops.iter().filter(|op| *op == "OpenEphemeral").count()
    }

    const FLOW_WRITE_SQL: &str = "INSERT INTO flow(flow_id, seq, state, amount) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(flow_id) DO UPDATE SET seq = excluded.seq, state = excluded.state";

    #[test]
    fn a_version_2_file_is_upgraded_and_no_step_builds_a_temporary_btree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v2 = DbKind::producer(2, SCHEMA, &[IDENTITY_SQL]);
        let mut conn = db::open(&path, &v2, OpenMode::Create).unwrap();
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        assert_eq!(ephemeral_opens(&conn, FLOW_WRITE_SQL), 2, "version 2 checks through a temporary b-tree");
        // The relay's connection stays open across the upgrade and must see the new schema.
        let upgraded = open(&path, OpenMode::Create).unwrap();
        // Its next statement notices the changed schema cookie and reloads the definitions.
        conn.query_row("SELECT count(*) FROM flow", [], |r| r.get::<_, i64>(0)).unwrap();
        for c in [&conn, &upgraded] {
            assert_eq!(ephemeral_opens(c, FLOW_WRITE_SQL), 0);
        }
        drop(conn);
        let mut conn = upgraded;
        assert_eq!(run(&mut conn, &cmd("A2", 1, "confirmed", 1, 3)).outcome, AdvanceOutcome::Committed);
        let err = conn.execute("UPDATE flow SET state = 'gone' WHERE flow_id = 'A'", []).unwrap_err();
        assert!(err.to_string().contains("CHECK constraint failed"), "{err}");
        // A new file gets the same definitions.
        let fresh = open(&dir.path().join("new.db"), OpenMode::Create).unwrap();
        let sql = |c: &Connection| -> String {
            c.query_row("SELECT sql FROM sqlite_schema WHERE name = 'flow'", [], |r| r.get(0)).unwrap()
        };
        assert_eq!(sql(&fresh), sql(&conn));
        assert!(!sql(&fresh).contains(" IN ("), "{}", sql(&fresh));
    }

    #[test]
    fn unaccepted_rows_come_from_the_partial_index() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {UNACCEPTED_PAGE_SQL}"))
            .unwrap()
            .query_map(params!["", 0, 10], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("USING INDEX outbox_unaccepted"), "{plan}");
        assert!(!plan.contains("SCAN outbox\n") && !plan.ends_with("SCAN outbox"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }

    #[test]
    fn deliveries_are_recorded_and_marked() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::IdConflict, 5, None).unwrap());
        assert!(!record_delivery(&tx, "nope", DeliveryAnswer::Accepted, 5, None).unwrap());
        tx.commit().unwrap();
        assert_eq!(unaccepted_after(&conn, ("", 0), 10).unwrap().len(), 1);
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::Accepted, 6, None).unwrap());
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::Duplicate, 7, None).unwrap());
        tx.commit().unwrap();
        let row = outbox_row(&conn, "A1").unwrap().unwrap();
        assert!(row.accepted);
        assert_eq!(row.attempts, 3);
        assert_eq!(row.last_outcome.as_deref(), Some("DUPLICATE"));
        assert!(unaccepted_after(&conn, ("", 0), 10).unwrap().is_empty());
    }

    #[test]
    fn only_an_answer_that_holds_the_event_records_where_it_lives() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        let at = |position| Some(AcceptedBy { consumer_db: "c1", position });
        let where_ = |conn: &Connection| -> (Option<String>, Option<u64>) {
            conn.query_row(
                "SELECT accepted_by, accepted_position FROM outbox WHERE event_id = 'A1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::BacklogFull, 5, at(4)).unwrap());
        tx.commit().unwrap();
        assert_eq!(where_(&conn), (None, None));
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::Accepted, 6, at(7)).unwrap());
        tx.commit().unwrap();
        assert_eq!(where_(&conn), (Some("c1".into()), Some(7)));
        // A later answer without a known position keeps what was recorded.
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::Duplicate, 7, None).unwrap());
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::IdConflict, 8, at(9)).unwrap());
        tx.commit().unwrap();
        assert_eq!(where_(&conn), (Some("c1".into()), Some(7)));
        assert_eq!(lost_rows(&conn, "c1", 6).unwrap().beyond_history, 1);
    }

    #[test]
    fn every_wire_answer_has_its_own_delivery_answer_and_only_two_mark() {
        use pb::ReceiveOutcome as W;
        let table = [
            (W::Accepted, DeliveryAnswer::Accepted, "ACCEPTED", true),
            (W::Duplicate, DeliveryAnswer::Duplicate, "DUPLICATE", true),
            (W::IdConflict, DeliveryAnswer::IdConflict, "ID_CONFLICT", false),
            (W::SequenceConflict, DeliveryAnswer::SequenceConflict, "SEQUENCE_CONFLICT", false),
            (W::Rejected, DeliveryAnswer::Rejected, "REJECTED", false),
            (W::BacklogFull, DeliveryAnswer::BacklogFull, "BACKLOG_FULL", false),
            (W::Unspecified, DeliveryAnswer::Unspecified, "UNSPECIFIED", false),
        ];
        for (wire, answer, word, holds) in table {
            assert_eq!(DeliveryAnswer::from_wire(wire as i32), answer);
            assert_eq!(answer.word(), word);
            // The stored word is the wire name without its prefix: no second spelling.
            assert_eq!(Some(word), wire.as_str_name().strip_prefix("RECEIVE_OUTCOME_"));
            assert_eq!(answer.holds_event(), holds, "{word}");
        }
        assert_eq!(DeliveryAnswer::from_wire(17), DeliveryAnswer::Unknown(17));
        assert_eq!(DeliveryAnswer::Unknown(17).word(), "UNKNOWN_17");
        assert!(!DeliveryAnswer::Unknown(17).holds_event());
    }

    #[test]
    fn an_unanswered_send_is_counted_and_leaves_the_row_unaccepted() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert!(record_unanswered_send(&tx, "A1").unwrap());
        assert!(record_delivery(&tx, "A1", DeliveryAnswer::Unknown(9), 5, None).unwrap());
        assert!(!record_unanswered_send(&tx, "nope").unwrap());
        tx.commit().unwrap();
        let row = outbox_row(&conn, "A1").unwrap().unwrap();
        assert!(!row.accepted);
        assert_eq!((row.attempts, row.last_outcome.as_deref()), (2, Some("UNKNOWN_9")));
    }
}
