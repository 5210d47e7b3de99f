//! Reads the database files back, independently of the services' store modules: the one
//! place in the harness that holds SQL over the services' tables, shared by the tests, the
//! scenarios, the chaos driver and the chaos checker, so each judges what is really on disk.
//!
//! The `read_*` functions take an open connection (so a caller can read several tables in one
//! read transaction) and report errors as text naming the query; the path-taking functions
//! (`flows`, `outbox`, …) are the tests' shorthand and panic with that text.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use serde::Serialize;

/// How long a reader waits for a writer's lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a database read-only (the services own the writes).
pub fn try_open_ro(path: &Path) -> Result<Connection, String> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(|e| format!("{}: busy timeout: {e}", path.display()))?;
    Ok(conn)
}

/// [`try_open_ro`] for tests: panics with the reason.
pub fn open_ro(path: &Path) -> Connection {
    try_open_ro(path).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `sql` on a database file from outside the services: test setup only (a trigger that
/// rejects a write, say), done while no service holds the file.
pub fn execute(path: &Path, sql: &str) {
    let conn =
        Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    conn.busy_timeout(BUSY_TIMEOUT).expect("busy timeout");
    conn.execute_batch(sql).unwrap_or_else(|e| panic!("{}: {sql}: {e}", path.display()));
}

/// A producer `flow` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowRow {
    /// The flow.
    pub flow_id: String,
    /// The last committed step (0 for none).
    pub seq: u64,
    /// The state name reached.
    pub state: String,
    /// The amount fixed by the first step.
    pub amount: i64,
}

/// A producer `outbox` row: one committed event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutboxRow {
    /// The event id.
    pub event_id: String,
    /// Its flow.
    pub flow_id: String,
    /// Its step in the flow.
    pub seq: u64,
    /// Its step kind.
    pub kind: String,
    /// The canonical body, byte for byte as committed.
    pub body: String,
    /// Whether the consumer accepted it (the relay's mark).
    pub accepted: bool,
    /// How many times the relay sent it.
    pub attempts: u64,
}

/// A consumer `inbox` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InboxRow {
    /// Arrival order: the row's SQLite rowid.
    pub rowid: i64,
    /// The event id.
    pub event_id: String,
    /// Its flow.
    pub flow_id: String,
    /// Its step in the flow.
    pub seq: u64,
    /// `pending`, `blocked` or `applied`.
    pub state: String,
    /// Why it is blocked, exactly while blocked.
    pub reason: Option<String>,
    /// The canonical body as received.
    pub body: String,
}

/// A consumer `effect` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EffectRow {
    /// Apply order: the row's SQLite rowid.
    pub rowid: i64,
    /// The event applied.
    pub event_id: String,
    /// Its flow.
    pub flow_id: String,
    /// Its step in the flow.
    pub seq: u64,
    /// Its step kind.
    pub kind: String,
    /// Units held after it.
    pub held: i64,
}

/// A consumer `projection` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProjectionRow {
    /// The flow.
    pub flow_id: String,
    /// The last applied step.
    pub last_seq: u64,
    /// The state name reached.
    pub state: String,
    /// Units held.
    pub held: i64,
}

fn table_exists(conn: &Connection, table: &str) -> Result<bool, String> {
    conn.query_row("SELECT count(*) FROM sqlite_schema WHERE type='table' AND name=?1", [table], |r| {
        r.get::<_, i64>(0)
    })
    .map(|n| n > 0)
    .map_err(|e| format!("schema of {table}: {e}"))
}

/// Every row `sql` returns, or none when `table` does not exist yet (a file whose server
/// never started).
fn rows<T>(
    conn: &Connection,
    table: &str,
    sql: &str,
    map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>, String> {
    if !table_exists(conn, table)? {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare(sql).map_err(|e| format!("{sql}: {e}"))?;
    let out = stmt.query_map([], map).map_err(|e| format!("{sql}: {e}"))?;
    out.collect::<rusqlite::Result<Vec<T>>>().map_err(|e| format!("{sql}: {e}"))
}

fn one(conn: &Connection, table: &str, sql: &str) -> Result<u64, String> {
    Ok(rows(conn, table, sql, |r| r.get::<_, i64>(0))?.first().map_or(0, |n| *n as u64))
}

/// All producer flows, by flow_id.
pub fn read_flows(conn: &Connection) -> Result<Vec<FlowRow>, String> {
    rows(conn, "flow", "SELECT flow_id, seq, state, amount FROM flow ORDER BY flow_id", |r| {
        Ok(FlowRow { flow_id: r.get(0)?, seq: r.get(1)?, state: r.get(2)?, amount: r.get(3)? })
    })
}

/// All outbox rows, by (flow_id, seq).
pub fn read_outbox(conn: &Connection) -> Result<Vec<OutboxRow>, String> {
    rows(
        conn,
        "outbox",
        "SELECT event_id, flow_id, seq, kind, body, accepted, attempts FROM outbox ORDER BY flow_id, seq",
        |r| {
            Ok(OutboxRow {
                event_id: r.get(0)?,
                flow_id: r.get(1)?,
                seq: r.get(2)?,
                kind: r.get(3)?,
                body: r.get(4)?,
                accepted: r.get::<_, i64>(5)? != 0,
                attempts: r.get(6)?,
            })
        },
    )
}

/// All inbox rows, by (flow_id, seq); `rowid` keeps the arrival order.
pub fn read_inbox(conn: &Connection) -> Result<Vec<InboxRow>, String> {
    rows(
        conn,
        "inbox",
        "SELECT rowid, event_id, flow_id, seq, state, reason, body FROM inbox ORDER BY flow_id, seq",
        |r| {
            Ok(InboxRow {
                rowid: r.get(0)?,
                event_id: r.get(1)?,
                flow_id: r.get(2)?,
                seq: r.get(3)?,
                state: r.get(4)?,
                reason: r.get(5)?,
                body: r.get(6)?,
            })
        },
    )
}

/// All effect rows, in apply (rowid) order.
pub fn read_effects(conn: &Connection) -> Result<Vec<EffectRow>, String> {
    rows(conn, "effect", "SELECT rowid, event_id, flow_id, seq, kind, held FROM effect ORDER BY rowid", |r| {
        Ok(EffectRow {
            rowid: r.get(0)?,
            event_id: r.get(1)?,
            flow_id: r.get(2)?,
            seq: r.get(3)?,
            kind: r.get(4)?,
            held: r.get(5)?,
        })
    })
}

/// All projections, by flow_id.
pub fn read_projections(conn: &Connection) -> Result<Vec<ProjectionRow>, String> {
    rows(conn, "projection", "SELECT flow_id, last_seq, state, held FROM projection ORDER BY flow_id", |r| {
        Ok(ProjectionRow { flow_id: r.get(0)?, last_seq: r.get(1)?, state: r.get(2)?, held: r.get(3)? })
    })
}

/// Outbox rows the consumer has not accepted yet.
pub fn count_unaccepted(conn: &Connection) -> Result<u64, String> {
    one(conn, "outbox", "SELECT count(*) FROM outbox WHERE accepted = 0")
}

/// Inbox rows not applied yet (pending or blocked).
pub fn count_unapplied(conn: &Connection) -> Result<u64, String> {
    one(conn, "inbox", "SELECT count(*) FROM inbox WHERE state <> 'applied'")
}

/// The highest outbox rowid (0 for none): grows with every commit.
pub fn outbox_high_water(conn: &Connection) -> Result<u64, String> {
    one(conn, "outbox", "SELECT coalesce(max(rowid), 0) FROM outbox")
}

/// The highest inbox rowid (0 for none): grows with every accepted envelope.
pub fn inbox_high_water(conn: &Connection) -> Result<u64, String> {
    one(conn, "inbox", "SELECT coalesce(max(rowid), 0) FROM inbox")
}

/// How many effects were recorded.
pub fn count_effects(conn: &Connection) -> Result<u64, String> {
    one(conn, "effect", "SELECT count(*) FROM effect")
}

/// The bodies of the newest unaccepted outbox rows whose predecessor in their flow is
/// unaccepted too (newest first, at most `limit`): sent now, they are likely to overtake it.
pub fn unaccepted_successor_bodies(conn: &Connection, limit: u32) -> Result<Vec<String>, String> {
    let sql = format!(
        "SELECT o.body FROM outbox o WHERE o.accepted = 0 AND o.seq > 1 AND EXISTS(
             SELECT 1 FROM outbox p WHERE p.flow_id = o.flow_id AND p.seq = o.seq - 1 AND p.accepted = 0)
         ORDER BY o.rowid DESC LIMIT {limit}"
    );
    rows(conn, "outbox", &sql, |r| r.get(0))
}

/// The bodies of the newest inbox rows (newest first, at most `limit`).
pub fn newest_inbox_bodies(conn: &Connection, limit: u32) -> Result<Vec<String>, String> {
    rows(conn, "inbox", &format!("SELECT body FROM inbox ORDER BY rowid DESC LIMIT {limit}"), |r| r.get(0))
}

/// `PRAGMA integrity_check`: `Ok` when it answers exactly `ok`, else its lines.
pub fn integrity_check(conn: &Connection) -> Result<(), String> {
    let mut stmt = conn.prepare("PRAGMA integrity_check").map_err(|e| format!("integrity_check: {e}"))?;
    let lines = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .and_then(|rows| rows.collect::<rusqlite::Result<Vec<String>>>())
        .map_err(|e| format!("integrity_check: {e}"))?;
    if lines == ["ok"] { Ok(()) } else { Err(lines.join("; ")) }
}

/// Reads one table of the file at `path` for a test, panicking with the reason.
fn read_or_panic<T>(path: &Path, read: fn(&Connection) -> Result<Vec<T>, String>) -> Vec<T> {
    read(&open_ro(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// All producer flows, by flow_id.
pub fn flows(path: &Path) -> Vec<FlowRow> {
    read_or_panic(path, read_flows)
}

/// All outbox rows, by (flow_id, seq).
pub fn outbox(path: &Path) -> Vec<OutboxRow> {
    read_or_panic(path, read_outbox)
}

/// All inbox rows, by (flow_id, seq).
pub fn inbox(path: &Path) -> Vec<InboxRow> {
    read_or_panic(path, read_inbox)
}

/// All effect rows, in apply order.
pub fn effects(path: &Path) -> Vec<EffectRow> {
    read_or_panic(path, read_effects)
}

/// All projections, by flow_id.
pub fn projections(path: &Path) -> Vec<ProjectionRow> {
    read_or_panic(path, read_projections)
}
