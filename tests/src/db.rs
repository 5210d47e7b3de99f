//! Reads the databases back, independently of the services' store modules: the one place in
//! the harness that holds SQL over the services' tables (SQLite files and PostgreSQL schemas
//! alike), shared by the tests, the scenarios, the chaos driver and the chaos checker, so each
//! judges what is really stored.
//!
//! The `read_*` functions take an open [`Session`] (so a caller can read several tables in one
//! read transaction, [`Session::snapshot`]) and report errors as text naming the query; the
//! target-taking functions (`flows`, `outbox`, …) are the tests' shorthand and panic with that
//! text. On PostgreSQL the tables are found in `ordered_events_producer` and
//! `ordered_events_consumer`; SQLite's rowid (arrival and apply order) is the `position`
//! column there.

use std::sync::mpsc;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use serde::Serialize;

use crate::backend::Target;

/// How long a reader waits for a writer's lock (SQLite) or a connection (PostgreSQL).
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The PostgreSQL schema of the producer's tables.
pub const PG_PRODUCER_SCHEMA: &str = "ordered_events_producer";
/// The PostgreSQL schema of the consumer's tables.
pub const PG_CONSUMER_SCHEMA: &str = "ordered_events_consumer";

/// Which store a table belongs to (on PostgreSQL: which schema it is in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// `flow`, `outbox`, the producer's `backlog`.
    Producer,
    /// `inbox`, `projection`, `effect`, the consumer's `backlog`.
    Consumer,
}

impl Store {
    /// The PostgreSQL schema holding its tables.
    pub fn pg_schema(self) -> &'static str {
        match self {
            Store::Producer => PG_PRODUCER_SCHEMA,
            Store::Consumer => PG_CONSUMER_SCHEMA,
        }
    }
}

/// One column value, whatever the backend.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Value {
    Null,
    Int(i64),
    Text(String),
}

/// One result row, read by position.
struct Row(Vec<Value>);

impl Row {
    fn int(&self, i: usize) -> Result<i64, String> {
        match self.0.get(i) {
            Some(Value::Int(n)) => Ok(*n),
            other => Err(format!("column {i}: expected an integer, got {other:?}")),
        }
    }
    fn uint(&self, i: usize) -> Result<u64, String> {
        let n = self.int(i)?;
        u64::try_from(n).map_err(|_| format!("column {i}: negative {n}"))
    }
    fn text(&self, i: usize) -> Result<String, String> {
        match self.0.get(i) {
            Some(Value::Text(s)) => Ok(s.clone()),
            other => Err(format!("column {i}: expected text, got {other:?}")),
        }
    }
    fn opt_text(&self, i: usize) -> Result<Option<String>, String> {
        match self.0.get(i) {
            Some(Value::Null) => Ok(None),
            _ => self.text(i).map(Some),
        }
    }
}

/// A read connection to one store's database.
pub enum Session {
    /// A read-only SQLite connection.
    Sqlite(Connection),
    /// A PostgreSQL connection owned by a thread of its own.
    Postgres(PgSession),
}

/// Opens a database read-only (the services own the writes).
pub fn try_open_ro(target: &Target) -> Result<Session, String> {
    match target {
        Target::Sqlite(path) => {
            let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
                .map_err(|e| format!("open {}: {e}", path.display()))?;
            conn.busy_timeout(BUSY_TIMEOUT).map_err(|e| format!("{}: busy timeout: {e}", path.display()))?;
            Ok(Session::Sqlite(conn))
        }
        Target::Postgres(url) => PgSession::connect(url, true).map(Session::Postgres),
    }
}

/// [`try_open_ro`] for tests: panics with the reason.
pub fn open_ro(target: &Target) -> Session {
    try_open_ro(target).unwrap_or_else(|e| panic!("{e}"))
}

impl Session {
    /// The column that orders `inbox` and `effect` rows by arrival / apply.
    fn position(&self) -> &'static str {
        match self {
            Session::Sqlite(_) => "rowid",
            Session::Postgres(_) => "position",
        }
    }

    /// Runs `read` inside one read transaction, so every table it reads is seen at one instant
    /// (PostgreSQL: `REPEATABLE READ`).
    pub fn snapshot<T>(&self, read: impl FnOnce(&Session) -> Result<T, String>) -> Result<T, String> {
        let (begin, end) = match self {
            Session::Sqlite(_) => ("BEGIN", "COMMIT"),
            Session::Postgres(_) => ("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", "COMMIT"),
        };
        self.batch(begin)?;
        let out = read(self);
        // A read transaction commits nothing: ending it is only releasing the snapshot.
        let ended = self.batch(end);
        let out = out?;
        ended.map(|()| out)
    }

    fn batch(&self, sql: &str) -> Result<(), String> {
        match self {
            Session::Sqlite(conn) => conn.execute_batch(sql).map_err(|e| format!("{sql}: {e}")),
            Session::Postgres(pg) => {
                let sql = sql.to_owned();
                pg.run(move |client| {
                    client.batch_execute(&sql).map_err(|e| format!("{sql}: {}", pg_error(&e)))
                })?
            }
        }
    }

    /// Every row `sql` returns, or none when `store`'s `table` (or view) does not exist yet (a
    /// database whose server never started).
    fn rows(&self, store: Store, table: &str, sql: &str) -> Result<Vec<Row>, String> {
        match self {
            Session::Sqlite(conn) => {
                let exists = conn
                    .query_row(
                        "SELECT count(*) FROM sqlite_schema WHERE type IN ('table', 'view') AND name=?1",
                        [table],
                        |r| r.get::<_, i64>(0),
                    )
                    .map_err(|e| format!("schema of {table}: {e}"))?;
                if exists == 0 {
                    return Ok(Vec::new());
                }
                let mut stmt = conn.prepare(sql).map_err(|e| format!("{sql}: {e}"))?;
                let width = stmt.column_count();
                let out = stmt
                    .query_map([], |r| {
                        (0..width)
                            .map(|i| {
                                Ok(match r.get_ref(i)? {
                                    rusqlite::types::ValueRef::Null => Value::Null,
                                    rusqlite::types::ValueRef::Integer(n) => Value::Int(n),
                                    rusqlite::types::ValueRef::Text(t) => {
                                        Value::Text(String::from_utf8_lossy(t).into_owned())
                                    }
                                    rusqlite::types::ValueRef::Real(x) => Value::Text(x.to_string()),
                                    rusqlite::types::ValueRef::Blob(b) => {
                                        Value::Text(String::from_utf8_lossy(b).into_owned())
                                    }
                                })
                            })
                            .collect::<rusqlite::Result<Vec<Value>>>()
                            .map(Row)
                    })
                    .map_err(|e| format!("{sql}: {e}"))?;
                out.collect::<rusqlite::Result<Vec<Row>>>().map_err(|e| format!("{sql}: {e}"))
            }
            Session::Postgres(pg) => {
                let qualified = format!("{}.{table}", store.pg_schema());
                let sql = sql.to_owned();
                let schema = store.pg_schema();
                pg.run(move |client| {
                    let exists: bool = client
                        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
                        .map_err(|e| format!("schema of {qualified}: {}", pg_error(&e)))?
                        .get(0);
                    if !exists {
                        return Ok(Vec::new());
                    }
                    // Unqualified names resolve in the table's own schema (both stores may
                    // share the database, and both have a `backlog`).
                    client
                        .batch_execute(&format!("SET search_path TO {schema}"))
                        .map_err(|e| format!("search_path {schema}: {}", pg_error(&e)))?;
                    let rows =
                        client.query(sql.as_str(), &[]).map_err(|e| format!("{sql}: {}", pg_error(&e)))?;
                    rows.iter().map(|r| pg_row(r).map_err(|e| format!("{sql}: {e}"))).collect()
                })?
            }
        }
    }

    fn one(&self, store: Store, table: &str, sql: &str) -> Result<u64, String> {
        match self.rows(store, table, sql)?.first() {
            Some(row) => row.uint(0),
            None => Ok(0),
        }
    }
}

/// A PostgreSQL row as [`Value`]s, by the columns' types.
fn pg_row(row: &postgres::Row) -> Result<Row, String> {
    use postgres::types::Type;
    let mut out = Vec::with_capacity(row.len());
    for (i, col) in row.columns().iter().enumerate() {
        let ty = col.type_();
        let value = if *ty == Type::INT8 {
            row.try_get::<_, Option<i64>>(i).map(|v| v.map(Value::Int))
        } else if *ty == Type::INT4 {
            row.try_get::<_, Option<i32>>(i).map(|v| v.map(|n| Value::Int(n.into())))
        } else if *ty == Type::INT2 {
            row.try_get::<_, Option<i16>>(i).map(|v| v.map(|n| Value::Int(n.into())))
        } else if *ty == Type::BOOL {
            row.try_get::<_, Option<bool>>(i).map(|v| v.map(|b| Value::Int(b.into())))
        } else if [Type::TEXT, Type::VARCHAR, Type::NAME, Type::BPCHAR].contains(ty) {
            row.try_get::<_, Option<String>>(i).map(|v| v.map(Value::Text))
        } else {
            return Err(format!("column {} has type {ty}, which the harness does not read", col.name()));
        };
        out.push(value.map_err(|e| format!("column {}: {e}", col.name()))?.unwrap_or(Value::Null));
    }
    Ok(Row(out))
}

/// The server's message (code, text, detail) rather than the client's bare "db error".
fn pg_error(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{}: {} ({detail})", db.code().code(), db.message()),
            None => format!("{}: {}", db.code().code(), db.message()),
        },
        None => e.to_string(),
    }
}

type PgJob = Box<dyn FnOnce(&mut postgres::Client) + Send>;

/// A PostgreSQL connection living on a plain thread of its own: the blocking client panics
/// when called on a tokio runtime thread, and the harness reads from async tests and plain
/// threads alike. Calls block the caller until the thread answers, as a SQLite read does.
pub struct PgSession {
    jobs: Option<mpsc::Sender<PgJob>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl PgSession {
    /// Connects to `url` (read-only sessions: `default_transaction_read_only`).
    pub fn connect(url: &str, read_only: bool) -> Result<PgSession, String> {
        let mut config: postgres::Config =
            url.parse().map_err(|e| format!("{url}: not a PostgreSQL URL: {e}"))?;
        config.connect_timeout(BUSY_TIMEOUT);
        if config.get_application_name().is_none() {
            config.application_name("ordered-events-harness");
        }
        if read_only {
            config.options("-c default_transaction_read_only=on");
        }
        let (jobs, inbox) = mpsc::channel::<PgJob>();
        let (ready, connected) = mpsc::channel::<Result<(), String>>();
        let shown = url.to_owned();
        let worker = std::thread::Builder::new()
            .name("harness-pg".into())
            .spawn(move || match config.connect(postgres::NoTls) {
                Ok(mut client) => {
                    let _ = ready.send(Ok(()));
                    for job in inbox {
                        job(&mut client);
                    }
                }
                Err(e) => {
                    let _ = ready.send(Err(format!("connect {shown}: {}", pg_error(&e))));
                }
            })
            .map_err(|e| format!("spawn the PostgreSQL reader thread: {e}"))?;
        let session = PgSession { jobs: Some(jobs), worker: Some(worker) };
        match connected.recv() {
            Ok(Ok(())) => Ok(session),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!("connect {url}: the reader thread died")),
        }
    }

    /// Runs `job` on the connection's thread and returns its answer.
    pub fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut postgres::Client) -> T + Send + 'static,
    ) -> Result<T, String> {
        let (tx, rx) = mpsc::channel();
        let jobs = self.jobs.as_ref().ok_or("the PostgreSQL session is closed")?;
        jobs.send(Box::new(move |client: &mut postgres::Client| {
            let _ = tx.send(job(client));
        }))
        .map_err(|_| "the PostgreSQL reader thread is gone".to_owned())?;
        rx.recv().map_err(|_| "the PostgreSQL reader thread died during a call".to_owned())
    }
}

impl Drop for PgSession {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop; it then drops (closes) the client.
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Runs `sql` (several statements) on a database from outside the services: test setup only
/// (a trigger that rejects a write, say). On SQLite it is done while no service holds the
/// file; on PostgreSQL, name tables with their schema ([`PG_PRODUCER_SCHEMA`], …) or use
/// [`Trigger`], which writes both dialects.
pub fn execute(target: &Target, sql: &str) {
    try_execute(target, sql).unwrap_or_else(|e| panic!("{target}: {e}"));
}

/// [`execute`] that reports the failure.
pub fn try_execute(target: &Target, sql: &str) -> Result<(), String> {
    match target {
        Target::Sqlite(path) => {
            let conn = Connection::open_with_flags(
                path,
                OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
            )
            .map_err(|e| format!("open {}: {e}", path.display()))?;
            conn.busy_timeout(BUSY_TIMEOUT).map_err(|e| format!("busy timeout: {e}"))?;
            conn.execute_batch(sql).map_err(|e| format!("{sql}: {e}"))
        }
        Target::Postgres(url) => {
            let session = PgSession::connect(url, false)?;
            let sql = sql.to_owned();
            session.run(move |client| {
                client.batch_execute(&sql).map_err(|e| format!("{sql}: {}", pg_error(&e)))
            })?
        }
    }
}

/// A test trigger that rejects inserts into one table, said once and written in both dialects:
/// a SQLite `RAISE(ABORT, …)` trigger, or a PL/pgSQL function and its `BEFORE INSERT` trigger.
/// The message reaches the service's error, so tests can look for it.
#[derive(Clone, Copy, Debug)]
pub struct Trigger {
    /// The trigger's name (and, on PostgreSQL, its function's).
    pub name: &'static str,
    /// The store owning the table.
    pub store: Store,
    /// The table whose inserts it rejects.
    pub table: &'static str,
    /// Which rows it rejects: a condition on `NEW` valid in both dialects
    /// (`NEW.flow_id = 'A'`), or `None` for every row.
    pub when: Option<&'static str>,
    /// The error message.
    pub message: &'static str,
    /// Where the stores keep those rows when `table` is a view over another table (`table`
    /// and `when` there): the consumer's `effect` is a view over `effect_log` (consumer.db
    /// schema 8, PostgreSQL consumer schema 7).
    pub stored: Option<StoredRows>,
}

/// A trigger's table and condition when the rows are stored apart from the view the
/// trigger names; the condition per dialect (`NEW` names the stored row).
#[derive(Clone, Copy, Debug)]
pub struct StoredRows {
    /// The table whose inserts it rejects.
    pub table: &'static str,
    /// Which rows on SQLite (a condition on `NEW`), or `None` for every row.
    pub sqlite_when: Option<&'static str>,
    /// Which rows on PostgreSQL (a condition on `NEW`, subqueries allowed), or `None`.
    pub pg_when: Option<&'static str>,
}

impl StoredRows {
    /// The consumer's effects (`effect_log`), every row.
    pub const EFFECTS: StoredRows = StoredRows { table: "effect_log", sqlite_when: None, pg_when: None };
}

impl Trigger {
    /// The DDL installing it on `target`'s backend.
    pub fn create_sql(&self, target: &Target) -> String {
        let Trigger { name, table, message, .. } = *self;
        match target {
            Target::Sqlite(_) => {
                let (table, when) = match self.stored {
                    Some(rows) => (rows.table, rows.sqlite_when),
                    None => (table, self.when),
                };
                let when = when.map(|w| format!(" WHEN {w}")).unwrap_or_default();
                format!(
                    "CREATE TRIGGER {name} BEFORE INSERT ON {table}{when} BEGIN SELECT RAISE(ABORT, '{message}'); END;"
                )
            }
            Target::Postgres(_) => {
                let schema = self.store.pg_schema();
                let (table, when) = match self.stored {
                    Some(rows) => (rows.table, rows.pg_when),
                    None => (table, self.when),
                };
                let when = when.unwrap_or("true");
                format!(
                    "CREATE FUNCTION {schema}.{name}() RETURNS trigger LANGUAGE plpgsql AS $body$
                     BEGIN
                         IF {when} THEN RAISE EXCEPTION '{message}'; END IF;
                         RETURN NEW;
                     END $body$;
                     CREATE TRIGGER {name} BEFORE INSERT ON {schema}.{table}
                         FOR EACH ROW EXECUTE FUNCTION {schema}.{name}();"
                )
            }
        }
    }

    /// The DDL removing it.
    pub fn drop_sql(&self, target: &Target) -> String {
        let Trigger { name, .. } = *self;
        let table = self.stored.map_or(self.table, |rows| rows.table);
        match target {
            Target::Sqlite(_) => format!("DROP TRIGGER {name};"),
            Target::Postgres(_) => {
                let schema = self.store.pg_schema();
                format!("DROP TRIGGER {name} ON {schema}.{table}; DROP FUNCTION {schema}.{name}();")
            }
        }
    }

    /// Installs it (the table must exist: start its service first).
    pub fn install(&self, target: &Target) {
        execute(target, &self.create_sql(target));
    }

    /// Removes it.
    pub fn remove(&self, target: &Target) {
        execute(target, &self.drop_sql(target));
    }
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
    /// The canonical body, byte for byte as committed (empty once compacted).
    pub body: String,
    /// Retention compacted it: the body is gone, its digest kept.
    pub compacted: bool,
    /// A compacted row's SHA-256 digest of its canonical body (lower-case hex); `None` while
    /// the body is stored.
    pub body_sha256: Option<String>,
    /// Whether the consumer accepted it (the relay's mark).
    pub accepted: bool,
    /// How many times the relay sent it.
    pub attempts: u64,
    /// The answer to its last sending (`ACCEPTED`, `ID_CONFLICT`, `NO_ANSWER`, …), if sent.
    pub last_outcome: Option<String>,
}

/// The SHA-256 digest of `body` in lower-case hex: what a store keeps of a compacted body.
pub fn sha256_hex(body: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(body.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// A row whose body retention may have compacted to its digest (outbox and inbox rows).
pub trait Compactable {
    /// The body as stored (empty once compacted).
    fn stored_body(&self) -> &str;
    /// The digest kept for a compacted row (lower-case hex), `None` while the body is stored.
    fn kept_digest(&self) -> Option<&str>;

    /// The body's digest: the one kept for a compacted row, else computed from the body.
    fn digest(&self) -> String {
        self.kept_digest().map_or_else(|| sha256_hex(self.stored_body()), str::to_owned)
    }

    /// Whether the row holds exactly `body` (by its digest once compacted).
    fn holds(&self, body: &str) -> bool {
        match self.kept_digest() {
            Some(d) if self.stored_body().is_empty() => d == sha256_hex(body),
            _ => self.stored_body() == body,
        }
    }

    /// The body for a message, or the digest a compacted row keeps.
    fn shown(&self) -> String {
        match self.kept_digest() {
            Some(d) if self.stored_body().is_empty() => format!("<compacted, sha256 {d}>"),
            _ => self.stored_body().to_owned(),
        }
    }
}

impl Compactable for OutboxRow {
    fn stored_body(&self) -> &str {
        &self.body
    }
    fn kept_digest(&self) -> Option<&str> {
        self.body_sha256.as_deref()
    }
}

/// A consumer `inbox` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InboxRow {
    /// Arrival order: the row's SQLite rowid (PostgreSQL: its `position`).
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
    /// The canonical body as received; empty once the row is compacted (retention).
    pub body: String,
    /// A compacted row's SHA-256 digest of its canonical body (lower-case hex); `None` while
    /// the body is stored.
    pub body_sha256: Option<String>,
}

impl Compactable for InboxRow {
    fn stored_body(&self) -> &str {
        &self.body
    }
    fn kept_digest(&self) -> Option<&str> {
        self.body_sha256.as_deref()
    }
}

/// A consumer `effect` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EffectRow {
    /// Apply order: the row's SQLite rowid (PostgreSQL: its `position`).
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

/// The highest inbox position the outbox recorded on an accepted row (0 for none).
pub fn highest_recorded_position(target: &Target) -> u64 {
    let sql = "SELECT coalesce(max(accepted_position), 0) FROM outbox WHERE accepted = 1";
    open_ro(target).one(Store::Producer, "outbox", sql).unwrap_or_else(|e| panic!("{target}: {e}"))
}

/// All producer flows, by flow_id.
pub fn read_flows(s: &Session) -> Result<Vec<FlowRow>, String> {
    let sql = "SELECT flow_id, seq, state, amount FROM flow ORDER BY flow_id";
    s.rows(Store::Producer, "flow", sql)?
        .iter()
        .map(|r| Ok(FlowRow { flow_id: r.text(0)?, seq: r.uint(1)?, state: r.text(2)?, amount: r.int(3)? }))
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{sql}: {e}"))
}

/// All outbox rows, by (flow_id, seq).
pub fn read_outbox(s: &Session) -> Result<Vec<OutboxRow>, String> {
    // SQLite keeps each body in `outbox_body` (schema 5); PostgreSQL in place. A compacted
    // row has none.
    // From schema 9 a compacted row's digest is in `outbox_digest`; before, in the row.
    let sql = match s {
        Session::Sqlite(conn) if sqlite_has_table(conn, "outbox_digest") => {
            "SELECT o.event_id, o.flow_id, o.seq, o.kind, b.body, o.accepted, o.attempts, o.last_outcome,
                    lower(hex(d.sha256))
             FROM outbox o LEFT JOIN outbox_body b ON b.id = o.id LEFT JOIN outbox_digest d ON d.id = o.id
             ORDER BY o.flow_id, o.seq"
        }
        Session::Sqlite(_) => {
            "SELECT o.event_id, o.flow_id, o.seq, o.kind, b.body, o.accepted, o.attempts, o.last_outcome,
                    lower(hex(o.body_sha256))
             FROM outbox o LEFT JOIN outbox_body b ON b.id = o.id ORDER BY o.flow_id, o.seq"
        }
        Session::Postgres(_) => {
            "SELECT event_id, flow_id, seq, kind, body, accepted, attempts, last_outcome,
                    encode(body_sha256, 'hex')
             FROM outbox ORDER BY flow_id, seq"
        }
    };
    s.rows(Store::Producer, "outbox", sql)?
        .iter()
        .map(|r| {
            let body = r.opt_text(4)?;
            Ok(OutboxRow {
                event_id: r.text(0)?,
                flow_id: r.text(1)?,
                seq: r.uint(2)?,
                kind: r.text(3)?,
                compacted: body.is_none(),
                body: body.unwrap_or_default(),
                accepted: r.int(5)? != 0,
                attempts: r.uint(6)?,
                last_outcome: r.opt_text(7)?,
                body_sha256: r.opt_text(8)?.filter(|d| !d.is_empty()),
            })
        })
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{sql}: {e}"))
}

/// All inbox rows, by (flow_id, seq); `rowid` keeps the arrival order.
/// On SQLite the bodies live in `inbox_body` (keyed by the row's position) from schema
/// version 6 on; a compacted row has no body and keeps its digest (in `inbox_digest` from
/// version 11 on, in the row before). Tables written by hand in an older shape (body in
/// `inbox`, no digest column) read as well.
pub fn read_inbox(s: &Session) -> Result<Vec<InboxRow>, String> {
    let sql = match s {
        Session::Sqlite(conn) if sqlite_has_table(conn, "inbox_digest") => {
            "SELECT i.rowid, i.event_id, i.flow_id, i.seq, i.state, i.reason,
                    coalesce(b.body, ''), lower(hex(d.sha256))
             FROM inbox i LEFT JOIN inbox_body b ON b.position = i.rowid
                          LEFT JOIN inbox_digest d ON d.position = i.rowid
             ORDER BY i.flow_id, i.seq"
        }
        Session::Sqlite(conn) if sqlite_has_table(conn, "inbox_body") => {
            "SELECT i.rowid, i.event_id, i.flow_id, i.seq, i.state, i.reason,
                    coalesce(b.body, ''), lower(hex(i.body_sha256))
             FROM inbox i LEFT JOIN inbox_body b ON b.position = i.rowid ORDER BY i.flow_id, i.seq"
        }
        Session::Sqlite(_) => {
            "SELECT rowid, event_id, flow_id, seq, state, reason, body, NULL FROM inbox ORDER BY flow_id, seq"
        }
        // `to_jsonb` reads a column that may not exist (NULL then); a bytea shows as `\x…`.
        Session::Postgres(_) => {
            "SELECT position, event_id, flow_id, seq, state, reason, coalesce(body, ''),
                    substr(to_jsonb(i) ->> 'body_sha256', 3)
             FROM inbox i ORDER BY flow_id, seq"
        }
    };
    s.rows(Store::Consumer, "inbox", sql)?
        .iter()
        .map(|r| {
            Ok(InboxRow {
                rowid: r.int(0)?,
                event_id: r.text(1)?,
                flow_id: r.text(2)?,
                seq: r.uint(3)?,
                state: r.text(4)?,
                reason: r.opt_text(5)?,
                body: r.text(6)?,
                body_sha256: r.opt_text(7)?.filter(|d| !d.is_empty()),
            })
        })
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{sql}: {e}"))
}

/// All effect rows, in apply (rowid / position) order.
pub fn read_effects(s: &Session) -> Result<Vec<EffectRow>, String> {
    let pos = s.position();
    let sql = format!("SELECT {pos}, event_id, flow_id, seq, kind, held FROM effect ORDER BY {pos}");
    s.rows(Store::Consumer, "effect", &sql)?
        .iter()
        .map(|r| {
            Ok(EffectRow {
                rowid: r.int(0)?,
                event_id: r.text(1)?,
                flow_id: r.text(2)?,
                seq: r.uint(3)?,
                kind: r.text(4)?,
                held: r.int(5)?,
            })
        })
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{sql}: {e}"))
}

/// All projections, by flow_id.
pub fn read_projections(s: &Session) -> Result<Vec<ProjectionRow>, String> {
    let sql = "SELECT flow_id, last_seq, state, held FROM projection ORDER BY flow_id";
    s.rows(Store::Consumer, "projection", sql)?
        .iter()
        .map(|r| {
            Ok(ProjectionRow {
                flow_id: r.text(0)?,
                last_seq: r.uint(1)?,
                state: r.text(2)?,
                held: r.int(3)?,
            })
        })
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{sql}: {e}"))
}

/// The backlog counter `store` keeps exact inside its transactions (producer: unaccepted
/// outbox rows; consumer: unapplied inbox rows), `None` before the store exists.
pub fn read_backlog_counter(s: &Session, store: Store) -> Result<Option<u64>, String> {
    let sql = match store {
        Store::Producer => "SELECT unaccepted FROM backlog WHERE id = 1",
        Store::Consumer => "SELECT unapplied FROM backlog WHERE id = 1",
    };
    s.rows(store, "backlog", sql)?.first().map(|r| r.uint(0)).transpose()
}

/// Outbox rows the consumer has not accepted yet.
pub fn count_unaccepted(s: &Session) -> Result<u64, String> {
    s.one(Store::Producer, "outbox", "SELECT count(*) FROM outbox WHERE accepted = 0")
}

/// Inbox rows not applied yet (pending or blocked).
pub fn count_unapplied(s: &Session) -> Result<u64, String> {
    s.one(Store::Consumer, "inbox", "SELECT count(*) FROM inbox WHERE state <> 'applied'")
}

/// A number that grows with every outbox commit (0 for none): the highest rowid on SQLite,
/// the row count on PostgreSQL (whose outbox has no position column; rows are never deleted).
pub fn outbox_high_water(s: &Session) -> Result<u64, String> {
    match s {
        Session::Sqlite(_) => s.one(Store::Producer, "outbox", "SELECT coalesce(max(rowid), 0) FROM outbox"),
        Session::Postgres(_) => s.one(Store::Producer, "outbox", "SELECT count(*) FROM outbox"),
    }
}

/// The highest inbox rowid / position (0 for none): grows with every accepted envelope.
pub fn inbox_high_water(s: &Session) -> Result<u64, String> {
    s.one(Store::Consumer, "inbox", &format!("SELECT coalesce(max({}), 0) FROM inbox", s.position()))
}

/// How many effects were recorded.
pub fn count_effects(s: &Session) -> Result<u64, String> {
    s.one(Store::Consumer, "effect", "SELECT count(*) FROM effect")
}

/// The bodies of the newest unaccepted outbox rows whose predecessor in their flow is
/// unaccepted too (newest first, at most `limit`): sent now, they are likely to overtake it.
pub fn unaccepted_successor_bodies(s: &Session, limit: u32) -> Result<Vec<String>, String> {
    let (newest, body, join) = match s {
        Session::Sqlite(_) => ("o.rowid DESC", "b.body", "JOIN outbox_body b ON b.id = o.id"),
        Session::Postgres(_) => ("o.committed_at_us DESC, o.event_id DESC", "o.body", ""),
    };
    let sql = format!(
        "SELECT {body} FROM outbox o {join} WHERE o.accepted = 0 AND o.seq > 1 AND EXISTS(
             SELECT 1 FROM outbox p WHERE p.flow_id = o.flow_id AND p.seq = o.seq - 1 AND p.accepted = 0)
         ORDER BY {newest} LIMIT {limit}"
    );
    s.rows(Store::Producer, "outbox", &sql)?.iter().map(|r| r.text(0)).collect()
}

/// Whether a SQLite database has table `name`.
fn sqlite_has_table(conn: &Connection, name: &str) -> bool {
    conn.query_row("SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = ?1", [name], |r| {
        r.get::<_, i64>(0)
    })
    .is_ok_and(|n| n > 0)
}

/// The bodies of the newest inbox rows that still have one (newest first, at most `limit`;
/// compacted rows have none).
pub fn newest_inbox_bodies(s: &Session, limit: u32) -> Result<Vec<String>, String> {
    let sql = match s {
        Session::Sqlite(conn) if sqlite_has_table(conn, "inbox_body") => {
            format!("SELECT body FROM inbox_body ORDER BY position DESC LIMIT {limit}")
        }
        Session::Sqlite(_) => format!("SELECT body FROM inbox ORDER BY rowid DESC LIMIT {limit}"),
        Session::Postgres(_) => {
            format!("SELECT body FROM inbox WHERE body IS NOT NULL ORDER BY position DESC LIMIT {limit}")
        }
    };
    s.rows(Store::Consumer, "inbox", &sql)?.iter().map(|r| r.text(0)).collect()
}

/// The store's own consistency check: SQLite's `PRAGMA integrity_check` (`Ok` when it answers
/// exactly `ok`, else its lines); on PostgreSQL, whose server guards its own pages, that
/// `store`'s backlog counter equals the rows it counts.
pub fn integrity_check(s: &Session, store: Store) -> Result<(), String> {
    match s {
        Session::Sqlite(conn) => {
            let mut stmt =
                conn.prepare("PRAGMA integrity_check").map_err(|e| format!("integrity_check: {e}"))?;
            let lines = stmt
                .query_map([], |r| r.get::<_, String>(0))
                .and_then(|rows| rows.collect::<rusqlite::Result<Vec<String>>>())
                .map_err(|e| format!("integrity_check: {e}"))?;
            if lines == ["ok"] { Ok(()) } else { Err(lines.join("; ")) }
        }
        Session::Postgres(_) => s.snapshot(|s| {
            let Some(counter) = read_backlog_counter(s, store)? else { return Ok(()) };
            let (rows, what) = match store {
                Store::Producer => (count_unaccepted(s)?, "unaccepted outbox rows"),
                Store::Consumer => (count_unapplied(s)?, "unapplied inbox rows"),
            };
            if counter == rows {
                Ok(())
            } else {
                Err(format!("the backlog counter says {counter} {what}, there are {rows}"))
            }
        }),
    }
}

/// PostgreSQL only: the transactions other sessions of `target`'s database hold open now, as
/// `pid application_name xact_start` texts (a session idle between polls holds none).
pub fn open_transactions(target: &Target) -> Vec<String> {
    let Target::Postgres(url) = target else { panic!("{target}: open_transactions is for PostgreSQL") };
    let session = PgSession::connect(url, true).unwrap_or_else(|e| panic!("{e}"));
    session
        .run(|client| {
            client
                .query(
                    "SELECT pid::text || ' ' || application_name || ' ' || xact_start::text
                     FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid()
                       AND xact_start IS NOT NULL",
                    &[],
                )
                .map(|rows| rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<String>>())
                .map_err(|e| pg_error(&e))
        })
        .and_then(|r| r)
        .unwrap_or_else(|e| panic!("{target}: pg_stat_activity: {e}"))
}

/// Reads one table of `target` for a test, panicking with the reason.
fn read_or_panic<T>(target: &Target, read: fn(&Session) -> Result<Vec<T>, String>) -> Vec<T> {
    read(&open_ro(target)).unwrap_or_else(|e| panic!("{target}: {e}"))
}

/// All producer flows, by flow_id.
pub fn flows(target: &Target) -> Vec<FlowRow> {
    read_or_panic(target, read_flows)
}

/// All outbox rows, by (flow_id, seq).
pub fn outbox(target: &Target) -> Vec<OutboxRow> {
    read_or_panic(target, read_outbox)
}

/// All inbox rows, by (flow_id, seq).
pub fn inbox(target: &Target) -> Vec<InboxRow> {
    read_or_panic(target, read_inbox)
}

/// All effect rows, in apply order.
pub fn effects(target: &Target) -> Vec<EffectRow> {
    read_or_panic(target, read_effects)
}

/// All projections, by flow_id.
pub fn projections(target: &Target) -> Vec<ProjectionRow> {
    read_or_panic(target, read_projections)
}

/// The outbox row `event_id`, if committed.
pub fn outbox_row(target: &Target, event_id: &str) -> Option<OutboxRow> {
    outbox(target).into_iter().find(|r| r.event_id == event_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Workdir;

    /// The consumer tables the trigger test needs, as the schema contract has them.
    fn create_effect_table(target: &Target) {
        let sql = match target {
            Target::Sqlite(_) => {
                "CREATE TABLE effect(event_id TEXT, flow_id TEXT, seq INTEGER, kind TEXT, held INTEGER);"
            }
            Target::Postgres(_) => {
                "CREATE SCHEMA ordered_events_consumer;
                 CREATE TABLE ordered_events_consumer.effect(event_id TEXT, flow_id TEXT, seq BIGINT,
                     kind TEXT, held BIGINT, position BIGINT GENERATED ALWAYS AS IDENTITY);"
            }
        };
        execute(target, sql);
    }

    fn insert_effect(target: &Target, id: &str, flow: &str) -> Result<(), String> {
        let table = match target {
            Target::Sqlite(_) => "effect".to_owned(),
            Target::Postgres(_) => format!("{PG_CONSUMER_SCHEMA}.effect"),
        };
        try_execute(
            target,
            &format!(
                "INSERT INTO {table}(event_id, flow_id, seq, kind, held) VALUES ('{id}', '{flow}', 1, 'reserved', 3)"
            ),
        )
    }

    /// One trigger description rejects exactly the rows it names on the selected backend,
    /// with its message, and is gone after `remove`; the reader sees apply order.
    #[test]
    fn a_trigger_rejects_its_rows_in_both_dialects() {
        let Some(work) = Workdir::for_test() else { return };
        let target = work.consumer_db();
        create_effect_table(&target);
        let trigger = Trigger {
            name: "reject_a",
            store: Store::Consumer,
            table: "effect",
            when: Some("NEW.flow_id = 'A'"),
            message: "rejected by the harness test",
            stored: None,
        };
        trigger.install(&target);
        let err = insert_effect(&target, "A1", "A").expect_err("flow A is rejected");
        assert!(err.contains("rejected by the harness test"), "{err}");
        insert_effect(&target, "B1", "B").expect("flow B passes");
        trigger.remove(&target);
        insert_effect(&target, "A1", "A").expect("no trigger any more");
        let ids: Vec<String> = effects(&target).into_iter().map(|e| e.event_id).collect();
        assert_eq!(ids, ["B1", "A1"], "apply (rowid / position) order");
        assert_eq!(count_effects(&open_ro(&target)), Ok(2));
    }

    /// Readers of a store whose tables were never created (a database that exists, a server
    /// that never started on it) see nothing rather than failing.
    #[test]
    fn an_empty_database_reads_as_empty() {
        let Some(work) = Workdir::for_test() else { return };
        for target in [work.producer_db(), work.consumer_db()] {
            if target.sqlite_path().is_some() {
                execute(&target, "CREATE TABLE unrelated(x);");
            }
        }
        assert!(outbox(&work.producer_db()).is_empty());
        assert!(inbox(&work.consumer_db()).is_empty());
        let s = open_ro(&work.consumer_db());
        assert_eq!((inbox_high_water(&s), count_unapplied(&s)), (Ok(0), Ok(0)));
        assert_eq!(read_backlog_counter(&s, Store::Consumer), Ok(None));
        assert_eq!(integrity_check(&s, Store::Consumer), Ok(()));
    }
}
