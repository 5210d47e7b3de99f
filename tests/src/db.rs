//! Reads the database files back, independently of the services' store modules, so tests
//! and the experiment runner check what is really on disk.

use std::path::Path;

use rusqlite::{Connection, OpenFlags};
use serde::Serialize;

/// Opens a database read-only (the services own the writes).
pub fn open_ro(path: &Path) -> Connection {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    conn.busy_timeout(std::time::Duration::from_secs(10)).expect("busy timeout");
    conn
}

/// Runs `sql` on a database file from outside the services: test setup only (a trigger that
/// rejects a write, say), done while no service holds the file.
pub fn execute(path: &Path, sql: &str) {
    let conn =
        Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    conn.busy_timeout(std::time::Duration::from_secs(10)).expect("busy timeout");
    conn.execute_batch(sql).unwrap_or_else(|e| panic!("{}: {sql}: {e}", path.display()));
}

/// A producer `flow` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlowRow {
    pub flow_id: String,
    pub seq: u64,
    pub state: String,
    pub amount: i64,
}

/// A producer `outbox` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutboxRow {
    pub event_id: String,
    pub flow_id: String,
    pub seq: u64,
    pub accepted: bool,
    pub body: String,
}

/// A consumer `inbox` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InboxRow {
    pub event_id: String,
    pub flow_id: String,
    pub seq: u64,
    pub state: String,
    pub reason: Option<String>,
    pub body: String,
}

/// A consumer `effect` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EffectRow {
    pub event_id: String,
    pub flow_id: String,
    pub seq: u64,
    pub kind: String,
    pub held: i64,
}

/// A consumer `projection` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProjectionRow {
    pub flow_id: String,
    pub last_seq: u64,
    pub state: String,
    pub held: i64,
}

fn table_exists(conn: &Connection, table: &str) -> bool {
    conn.query_row("SELECT count(*) FROM sqlite_schema WHERE type='table' AND name=?1", [table], |r| {
        r.get::<_, i64>(0)
    })
    .map(|n| n > 0)
    .unwrap_or(false)
}

/// All producer flows, by flow_id.
pub fn flows(path: &Path) -> Vec<FlowRow> {
    let conn = open_ro(path);
    if !table_exists(&conn, "flow") {
        return Vec::new();
    }
    let mut stmt =
        conn.prepare("SELECT flow_id, seq, state, amount FROM flow ORDER BY flow_id").expect("flow query");
    stmt.query_map([], |r| {
        Ok(FlowRow { flow_id: r.get(0)?, seq: r.get(1)?, state: r.get(2)?, amount: r.get(3)? })
    })
    .expect("flow rows")
    .collect::<Result<_, _>>()
    .expect("flow row")
}

/// All outbox rows, by (flow_id, seq).
pub fn outbox(path: &Path) -> Vec<OutboxRow> {
    let conn = open_ro(path);
    if !table_exists(&conn, "outbox") {
        return Vec::new();
    }
    let mut stmt = conn
        .prepare("SELECT event_id, flow_id, seq, accepted, body FROM outbox ORDER BY flow_id, seq")
        .expect("outbox query");
    stmt.query_map([], |r| {
        Ok(OutboxRow {
            event_id: r.get(0)?,
            flow_id: r.get(1)?,
            seq: r.get(2)?,
            accepted: r.get::<_, i64>(3)? != 0,
            body: r.get(4)?,
        })
    })
    .expect("outbox rows")
    .collect::<Result<_, _>>()
    .expect("outbox row")
}

/// All inbox rows, by (flow_id, seq).
pub fn inbox(path: &Path) -> Vec<InboxRow> {
    let conn = open_ro(path);
    if !table_exists(&conn, "inbox") {
        return Vec::new();
    }
    let mut stmt = conn
        .prepare("SELECT event_id, flow_id, seq, state, reason, body FROM inbox ORDER BY flow_id, seq")
        .expect("inbox query");
    stmt.query_map([], |r| {
        Ok(InboxRow {
            event_id: r.get(0)?,
            flow_id: r.get(1)?,
            seq: r.get(2)?,
            state: r.get(3)?,
            reason: r.get(4)?,
            body: r.get(5)?,
        })
    })
    .expect("inbox rows")
    .collect::<Result<_, _>>()
    .expect("inbox row")
}

/// All effect rows, in apply order.
pub fn effects(path: &Path) -> Vec<EffectRow> {
    let conn = open_ro(path);
    if !table_exists(&conn, "effect") {
        return Vec::new();
    }
    let mut stmt = conn
        .prepare("SELECT event_id, flow_id, seq, kind, held FROM effect ORDER BY rowid")
        .expect("effect query");
    stmt.query_map([], |r| {
        Ok(EffectRow {
            event_id: r.get(0)?,
            flow_id: r.get(1)?,
            seq: r.get(2)?,
            kind: r.get(3)?,
            held: r.get(4)?,
        })
    })
    .expect("effect rows")
    .collect::<Result<_, _>>()
    .expect("effect row")
}

/// All projections, by flow_id.
pub fn projections(path: &Path) -> Vec<ProjectionRow> {
    let conn = open_ro(path);
    if !table_exists(&conn, "projection") {
        return Vec::new();
    }
    let mut stmt = conn
        .prepare("SELECT flow_id, last_seq, state, held FROM projection ORDER BY flow_id")
        .expect("projection query");
    stmt.query_map([], |r| {
        Ok(ProjectionRow { flow_id: r.get(0)?, last_seq: r.get(1)?, state: r.get(2)?, held: r.get(3)? })
    })
    .expect("projection rows")
    .collect::<Result<_, _>>()
    .expect("projection row")
}
