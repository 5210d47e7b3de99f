//! All SQL of consumer.db (the SQLite backend). `insert_pending` (accepted) and `apply_step`
//! (projection, effect and inbox mark: applied) each run inside a `BEGIN IMMEDIATE`
//! transaction the batch functions here open, so this module is the one owner of the file's
//! invariants: a stored body never changes, and a flow's effects are a contiguous prefix of
//! its seqs, each applied once. Work runs on blocking threads, never the async runtime's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use proto::body::Event;
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, DbError, DbKind, Held, StepFailure, Steps};
use proto::flow::Kind;
use runtime::blocking::{lock, with_locked};
use runtime::retention::Examined;
use rusqlite::{Connection, OptionalExtension, Transaction, params};

use super::{
    Admission, Backlog, BacklogCounts, BacklogReader, BatchAnswer, BatchEvents, CompactReport, EffectRecord,
    FlowRun, FlowView, Identity, InboxRecord, InboxState, Incoming, Next, RawInbox, ReceiveContext,
    ReceiveOutcome, Received, Result, StepOutcome, StoreError, StoredBody, checked_projection, commit_lag_us,
    reason_index, reports, settle,
};
use crate::apply::{ApplyFailure, ApplyOptions, FlowResult, Stop};
use crate::rules::{BlockReason, Decision, Projection, Waiting, decide_next};
use crate::storage::StorageWatch;
use crate::waiting::{WaitDelta, state_of};

/// consumer.db: identity and schema (version 2: version 1 plus the database identity;
/// version 3: the state and reason checks without `IN` lists; version 4: the backlog counter
/// kept by the store, not by triggers; version 5: the committed time beside each row and the
/// blocked rows counted by reason; version 6: bodies in their own table, tombstones;
/// version 7: the gap and ready flows counted; version 8: effects keyed by their inbox row's
/// position; version 9: projections keyed by flow; version 10: the effect log's rowid is the
/// position; version 11: tombstones' digests in a table of their own; version 12: an applied
/// row's time kept by its effect alone; a new file gets version 1's schema and then every
/// upgrade).
pub const KIND: DbKind = DbKind::consumer(
    12,
    SCHEMA,
    &[
        IDENTITY_SQL,
        PLAIN_CHECKS_SQL,
        COUNTER_WITHOUT_TRIGGERS_SQL,
        COMMITTED_AT_AND_BLOCKED_SQL,
        BODIES_APART_SQL,
        GAP_AND_READY_SQL,
        EFFECTS_BY_POSITION_SQL,
        PROJECTION_BY_FLOW_SQL,
        EFFECT_LOG_BY_POSITION_SQL,
        DIGESTS_APART_SQL,
        APPLIED_AT_IN_EFFECT_SQL,
    ],
);

/// Version 12 (issues 16 and 18): an applied row's time is its effect's
/// (`effect_log.applied_at_us`, which the same step writes with the same value), no longer a
/// column of the inbox row as well. Setting that column grew each applied inbox row by 6 to
/// 8 bytes: rows are packed in position order, so the apply's UPDATE split their pages and
/// left them partly empty. Without it the UPDATE rewrites the row in place (`pending`,
/// `blocked` and `applied` are the same length). Measured on 30 000 rows received in
/// transactions of 60 and applied after each (`scripts/measure_applied_at_sqlite.py`,
/// Python's `sqlite3` under callgrind): 17.2k against 19.0k instructions per applied row, and
/// 789 against 912 pages in use. Every applied row has its effect (written in the same
/// step), so nothing is lost; the column is dropped.
const APPLIED_AT_IN_EFFECT_SQL: &str = "
ALTER TABLE inbox DROP COLUMN applied_at_us;
";

/// Version 11 (issues 16 and 18): a compacted row's digest is a row of `inbox_digest`, keyed
/// by the inbox position, instead of the column `inbox.body_sha256`. Writing the column grew
/// every compacted inbox row by 33 bytes: rows packed in position order no longer fit their
/// page, so compaction split about every page it rewrote, and left the inbox's pages half
/// empty. An insert in position order appends to the digests' b-tree instead. Measured on
/// 30 000 rows compacted in batches of 500 (the same statements, Python's `sqlite3` under
/// callgrind, `scripts/measure_digest_apart_sqlite.py`): 25.8k against 32.5k instructions
/// per compacted row, and the same pages in use afterwards (1 157 against 1 161: the inbox
/// no longer grows by 1.2 MB, the digests take that). Rows still waiting or being applied
/// never have a digest, so the hot path reads none. The digests are moved once, and the
/// column dropped.
const DIGESTS_APART_SQL: &str = "
CREATE TABLE inbox_digest(
    position INTEGER PRIMARY KEY,
    sha256 BLOB NOT NULL CHECK(length(sha256) = 32)
);
INSERT INTO inbox_digest(position, sha256)
SELECT rowid, body_sha256 FROM inbox WHERE body_sha256 IS NOT NULL ORDER BY rowid;
ALTER TABLE inbox DROP COLUMN body_sha256;
";

/// Version 10 (issues 16 and 18): `effect_log` is stored in the b-tree of its inbox position
/// (its rowid) instead of a rowid of its own plus a unique index on the position: each
/// applied step wrote two b-tree entries where it now writes one (the index insert was ~2.3k
/// instructions in the system's `sqlite3` shell; the index took 11.6 bytes per effect,
/// `dbstat`). The apply order, which was the rowid, is the column `applied` (1, 2, 3, …):
/// the store numbers each effect from `backlog.effects`, the count of effects, kept exact in
/// the same UPDATE as the other counters (see [`Unapplied`]). `effect` reads as before (its
/// `rowid` column is the apply order). The rows are copied once.
const EFFECT_LOG_BY_POSITION_SQL: &str = "
ALTER TABLE backlog ADD COLUMN effects INTEGER NOT NULL DEFAULT 0 CHECK(effects >= 0);
CREATE TABLE effect_log_v10(
    position INTEGER PRIMARY KEY,
    applied INTEGER NOT NULL,
    kind TEXT NOT NULL,
    held INTEGER NOT NULL,
    applied_at_us INTEGER NOT NULL
);
INSERT INTO effect_log_v10(position, applied, kind, held, applied_at_us)
SELECT position, id, kind, held, applied_at_us FROM effect_log ORDER BY position;
UPDATE backlog SET effects = (SELECT coalesce(max(id), 0) FROM effect_log) WHERE id = 1;
DROP VIEW effect;
DROP TABLE effect_log;
ALTER TABLE effect_log_v10 RENAME TO effect_log;
CREATE VIEW effect(rowid, event_id, flow_id, seq, kind, held, applied_at_us) AS
SELECT e.applied, i.event_id, i.flow_id, i.seq, e.kind, e.held, e.applied_at_us
FROM effect_log e JOIN inbox i ON i.rowid = e.position;
";

/// Version 9 (issues 16 and 18): `projection` is a `WITHOUT ROWID` table, stored in the
/// b-tree of its `flow_id` key. As a rowid table it kept each flow id twice (in the row and in
/// the key's index) and every read or write of a flow's projection took two seeks, one of
/// them by text. The rows are copied once; nothing refers to a projection's rowid.
const PROJECTION_BY_FLOW_SQL: &str = "
CREATE TABLE projection_v9(
    flow_id TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL CHECK(last_seq >= 1),
    state TEXT NOT NULL CHECK(state = 'reserved' OR state = 'confirmed' OR state = 'released'),
    held INTEGER NOT NULL,
    amount INTEGER NOT NULL CHECK(amount >= 1)
) WITHOUT ROWID;
INSERT INTO projection_v9(flow_id, last_seq, state, held, amount)
SELECT flow_id, last_seq, state, held, amount FROM projection;
DROP TABLE projection;
ALTER TABLE projection_v9 RENAME TO projection;
";

/// Version 8 (issues 16 and 18): an effect is stored in `effect_log` as its inbox row's
/// position (the inbox rowid, which compaction keeps with the tombstone) and what the step
/// did (kind, held, time); its event id, flow id and seq are read from that inbox row. The
/// old `effect` table kept the two text ids and seq again in the row and in two unique
/// indexes, and checked its foreign key by a third text seek: each applied step wrote three
/// b-tree entries keyed by text: about 11k instructions per event in the consumer, and ~90
/// bytes per effect where `effect_log` keeps ~43 (`dbstat`, 30 000 events). One effect per
/// event and per (flow, seq) is the position's uniqueness together with the inbox's own keys;
/// the rowid is still apply order. There is no foreign key (one must name a declared key,
/// and the position is the inbox's implicit rowid): the store writes the effect in the
/// transaction whose mark of that very position must change one row, and inbox rows are
/// never deleted (compaction keeps them as tombstones).
/// `effect` becomes a view with the old columns (its `rowid` column is the apply order), so
/// every reader of the old table reads the same rows. The rows are copied once, in apply
/// order; a foreign key made every old effect's event id an inbox row's.
const EFFECTS_BY_POSITION_SQL: &str = "
CREATE TABLE effect_log(
    id INTEGER PRIMARY KEY,
    position INTEGER NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    held INTEGER NOT NULL,
    applied_at_us INTEGER NOT NULL
);
INSERT INTO effect_log(id, position, kind, held, applied_at_us)
SELECT e.rowid, i.rowid, e.kind, e.held, e.applied_at_us
FROM effect e JOIN inbox i ON i.event_id = e.event_id ORDER BY e.rowid;
DROP TABLE effect;
CREATE VIEW effect(rowid, event_id, flow_id, seq, kind, held, applied_at_us) AS
SELECT e.id, i.event_id, i.flow_id, i.seq, e.kind, e.held, e.applied_at_us
FROM effect_log e JOIN inbox i ON i.rowid = e.position;
";

/// Version 7: `backlog` counts the flows waiting at a gap (unapplied rows, the next seq not
/// stored) and the ready ones (the next seq stored and pending), kept exact by the store in
/// the same UPDATE as the other counters (see [`Unapplied`] and [`crate::waiting`]), so the
/// metrics scrape reads them instead of walking the waiting flows. They start from the rows
/// an older build left (each waiting flow's lowest unapplied row against its projection,
/// once).
const GAP_AND_READY_SQL: &str = "
ALTER TABLE backlog ADD COLUMN gap_flows INTEGER NOT NULL DEFAULT 0 CHECK(gap_flows >= 0);
ALTER TABLE backlog ADD COLUMN ready_flows INTEGER NOT NULL DEFAULT 0 CHECK(ready_flows >= 0);
WITH w AS (
         SELECT flow_id, min(seq) AS lowest FROM inbox WHERE state <> 'applied' GROUP BY flow_id),
     s AS (
         SELECT w.lowest > coalesce(p.last_seq, 0) + 1 AS gap,
                w.lowest = coalesce(p.last_seq, 0) + 1 AND i.state = 'pending' AS ready
         FROM w LEFT JOIN projection p ON p.flow_id = w.flow_id
         JOIN inbox i ON i.flow_id = w.flow_id AND i.seq = w.lowest)
UPDATE backlog SET gap_flows = (SELECT count(*) FROM s WHERE gap),
                   ready_flows = (SELECT count(*) FROM s WHERE ready)
WHERE id = 1;
";

/// Version 6 (retention, issue 16): the canonical bodies move to `inbox_body`, keyed by the
/// inbox row's position (its rowid), and `inbox.body_sha256` holds the SHA-256 digest of a
/// compacted row's body. Compaction deletes an applied row's body from `inbox_body` and
/// writes its digest: the inbox row itself (event id, flow id, seq, kind, schema, state,
/// times) stays, so its position, its uniqueness constraints and every Receive answer stay
/// exactly as before. Why a table of its own: an in-place `UPDATE inbox SET body = NULL`
/// frees bytes inside pages that new rows never reuse (new rowids append at the end), so the
/// file grows as fast as without compaction (measured: 355 vs 356 bytes per event, 100k
/// events); bodies deleted in position order free whole pages, which new bodies reuse and
/// `incremental_vacuum` gives back (271 to 276 bytes per event with compaction). The digest
/// is written at compaction, not at insert, so a new event's Receive does no hashing. An
/// older file's bodies are moved once, here.
const BODIES_APART_SQL: &str = "
CREATE TABLE inbox_body(
    position INTEGER PRIMARY KEY,
    -- The canonical body, stored verbatim and never edited; deleted only by compaction.
    body TEXT NOT NULL
);
INSERT INTO inbox_body(position, body) SELECT rowid, body FROM inbox ORDER BY rowid;
ALTER TABLE inbox DROP COLUMN body;
ALTER TABLE inbox ADD COLUMN body_sha256 BLOB CHECK(body_sha256 IS NULL OR length(body_sha256) = 32);
";

/// Version 5: `inbox.committed_at_us`, the producer's committed time as the envelope carried
/// it (NULL when it did not: older relays, grpcurl), kept beside the body and never compared,
/// so `Apply` can measure commit→applied; and `backlog` counts the blocked rows by reason,
/// kept exact by the store in the same UPDATE as `unapplied` (see [`Unapplied`]). The counts
/// start from the rows an older build blocked (a walk of the unapplied rows, once).
const COMMITTED_AT_AND_BLOCKED_SQL: &str = "
ALTER TABLE inbox ADD COLUMN committed_at_us INTEGER;
ALTER TABLE backlog ADD COLUMN blocked_unsupported_schema INTEGER NOT NULL DEFAULT 0
    CHECK(blocked_unsupported_schema >= 0);
ALTER TABLE backlog ADD COLUMN blocked_invalid_payload INTEGER NOT NULL DEFAULT 0
    CHECK(blocked_invalid_payload >= 0);
ALTER TABLE backlog ADD COLUMN blocked_invalid_transition INTEGER NOT NULL DEFAULT 0
    CHECK(blocked_invalid_transition >= 0);
UPDATE backlog SET
    blocked_unsupported_schema =
        (SELECT count(*) FROM inbox WHERE state <> 'applied' AND reason = 'unsupported_schema'),
    blocked_invalid_payload =
        (SELECT count(*) FROM inbox WHERE state <> 'applied' AND reason = 'invalid_payload'),
    blocked_invalid_transition =
        (SELECT count(*) FROM inbox WHERE state <> 'applied' AND reason = 'invalid_transition')
WHERE id = 1;
";

/// Version 4: `backlog.unapplied` is kept exact by the store functions that change it
/// ([`Unapplied`]: one UPDATE per transaction, before its commit), not by a trigger per row.
/// A trigger on `inbox` made every insert and every applied mark a multi-statement write
/// that opens its own statement journal (every page it touches copied first) and ran an
/// UPDATE of the counter per row. The counter is exact when the triggers are dropped, and
/// stays exact: every insert into `inbox` and every change of its `state` is in this module.
const COUNTER_WITHOUT_TRIGGERS_SQL: &str = "
DROP TRIGGER backlog_insert;
DROP TRIGGER backlog_applied;
";

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

/// Opens (creating if needed) consumer.db with the shared settings.
pub fn open(path: &Path) -> std::result::Result<Connection, DbError> {
    db::open_logged(path, &KIND, db::OpenMode::Create)
}

impl From<rusqlite::Error> for StoreError {
    /// Busy or locked is contention (retryable); a constraint or trigger refused one row;
    /// anything else is the storage failing. The text is SQLite's own.
    fn from(e: rusqlite::Error) -> StoreError {
        if db::is_busy(&e) {
            StoreError::Busy(e.to_string())
        } else if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) {
            StoreError::Refused(e.to_string())
        } else {
            StoreError::Failed(e.to_string())
        }
    }
}

/// consumer.db: one connection, used on blocking threads only (the async methods run their
/// work with `spawn_blocking`), and the file's path for the metrics' read-only connection.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    /// What the last Receive batch to be auto-applied knew at its commit (see [`Settled`]),
    /// taken by the apply that follows it.
    settled: Arc<Mutex<Option<Settled>>>,
}

impl SqliteStore {
    /// Opens (creating if needed) consumer.db and logs its settings. Blocking.
    pub fn open(path: &Path) -> std::result::Result<SqliteStore, DbError> {
        let conn = open(path)?;
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            path: path.to_owned(),
            settled: Default::default(),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` with the connection locked, on a blocking thread.
    async fn with_conn<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        with_locked(&self.conn, f).await.map_err(|e| StoreError::Failed(e.to_string()))?
    }

    pub(crate) async fn identify(&self, probes: Vec<(u64, String)>) -> Result<(Identity, Vec<bool>)> {
        self.with_conn(move |conn| {
            let tx = conn.transaction()?;
            let identity = identity(&tx)?;
            let held = probes_held(&tx, &probes)?;
            Ok((identity, held))
        })
        .await
    }

    pub(crate) async fn receive_batch(
        &self,
        batch: Arc<Vec<Incoming>>,
        ctx: ReceiveContext,
    ) -> Vec<BatchAnswer> {
        let len = batch.len();
        let conn = Arc::clone(&self.conn);
        let stash = Arc::clone(&self.settled);
        let received = tokio::task::spawn_blocking(move || {
            let (answers, settled) = receive_batch(&mut lock(&conn), &batch, ctx);
            if ctx.applied_next {
                *lock(&stash) = settled;
            }
            answers
        });
        match received.await {
            Ok(answers) => answers,
            Err(e) => {
                let e = StoreError::Failed(format!("receive task failed: {e}"));
                (0..len).map(|_| Some(Err(e.clone()))).collect()
            }
        }
    }

    pub(crate) async fn apply_flows(
        &self,
        flows: Vec<String>,
        max_steps: u32,
        opts: ApplyOptions,
    ) -> Vec<FlowResult> {
        self.apply(flows, None, None, max_steps, opts).await
    }

    pub(crate) async fn apply_received(
        &self,
        flows: Vec<String>,
        events: BatchEvents,
        max_steps: u32,
        opts: ApplyOptions,
    ) -> Vec<FlowResult> {
        let settled = lock(&self.settled).take();
        self.apply(flows, Some(events), settled, max_steps, opts).await
    }

    async fn apply(
        &self,
        flows: Vec<String>,
        events: Option<BatchEvents>,
        settled: Option<Settled>,
        max_steps: u32,
        opts: ApplyOptions,
    ) -> Vec<FlowResult> {
        let names = flows.clone();
        let conn = Arc::clone(&self.conn);
        let applied = tokio::task::spawn_blocking(move || {
            apply_flows(&conn, flows, events.as_ref(), settled, max_steps, opts)
        });
        match applied.await {
            Ok(results) => results,
            Err(e) => names
                .into_iter()
                .map(|flow_id| FlowResult {
                    flow_id,
                    outcome: Err(ApplyFailure {
                        applied: Vec::new(),
                        source: StoreError::Failed(format!("apply task failed: {e}")),
                    }),
                })
                .collect(),
        }
    }

    pub(crate) async fn flows_with_unapplied(&self, after: String, limit: usize) -> Result<Vec<String>> {
        self.with_conn(move |conn| flows_with_unapplied(conn, &after, limit)).await
    }

    pub(crate) async fn flows_blocked(
        &self,
        reason: BlockReason,
        after: String,
        limit: usize,
    ) -> Result<Vec<String>> {
        self.with_conn(move |conn| {
            let mut stmt = conn.prepare_cached(BLOCKED_FLOWS_SQL)?;
            let rows = stmt.query_map(params![reason.as_str(), after, limit as i64], |r| r.get(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    pub(crate) async fn flow(&self, flow_id: String) -> Result<FlowView> {
        self.with_conn(move |conn| {
            // One read transaction so projection, inbox and effects are one snapshot.
            let tx = conn.transaction()?;
            Ok(FlowView {
                projection: projection(&tx, &flow_id)?,
                inbox: flow_inbox(&tx, &flow_id)?,
                effects: flow_effects(&tx, &flow_id)?,
            })
        })
        .await
    }

    pub(crate) async fn backlog(&self, limit: usize) -> Result<(Vec<Backlog>, u64)> {
        self.with_conn(move |conn| {
            let tx = conn.transaction()?;
            backlog(&tx, limit)
        })
        .await
    }

    pub(crate) async fn probe(&self, watch: &'static StorageWatch) -> Result<()> {
        self.with_conn(move |conn| {
            let tx = db::begin_immediate(conn)?;
            touch_probe(&tx, runtime::now_us())?;
            watch.before_commit()?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    pub(crate) async fn unapplied_count(&self) -> Result<u64> {
        self.with_conn(|conn| unapplied_count(conn)).await
    }

    pub(crate) async fn backlog_counts(&self) -> Result<BacklogCounts> {
        self.with_conn(backlog_counts).await
    }

    pub(crate) fn backlog_reader(&self) -> BacklogReader {
        let path = self.path.clone();
        let conn: Mutex<Option<Connection>> = Mutex::new(None);
        Arc::new(move || {
            let mut conn = lock(&conn);
            if conn.is_none() {
                let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY;
                let opened = Connection::open_with_flags(&path, flags)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                *conn = Some(opened);
            }
            let Some(conn) = conn.as_mut() else { return Ok(BacklogCounts::default()) };
            backlog_counts(conn).map_err(|e| e.to_string())
        })
    }

    pub(crate) async fn compact(
        &self,
        cutoff_us: i64,
        crash: CrashSwitch,
        keep_free_pages: u64,
    ) -> Result<CompactReport> {
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || compact_pass(&conn, cutoff_us, crash, keep_free_pages))
            .await
            .map_err(|e| StoreError::Failed(format!("compaction task failed: {e}")))?
    }

    /// Runs SQL on the connection (tests add triggers and edit rows by hand).
    #[cfg(test)]
    pub(crate) fn execute_batch(&self, sql: &str) {
        lock(&self.conn).execute_batch(sql).unwrap();
    }
}

/// The Receive batch on SQLite: one `BEGIN IMMEDIATE` transaction, the envelopes decided in
/// order (see [`ConsumerStore::receive_batch`](super::ConsumerStore::receive_batch)): first
/// directly in the transaction, and if one fails, once more with a savepoint per envelope
/// (see [`db::Steps`]). An envelope whose stream already failed is not stored; every failed
/// envelope fails its stream.
/// With `ctx.applied_next`, also what the transaction knew at its commit ([`Settled`]),
/// unless an envelope failed.
fn receive_batch(
    conn: &mut Connection,
    jobs: &[Incoming],
    ctx: ReceiveContext,
) -> (Vec<BatchAnswer>, Option<Settled>) {
    match receive_in_tx(conn, jobs, ctx, Steps::Direct) {
        Some(received) => received,
        // With savepoints every failure is answered; nothing asks for another run.
        None => receive_in_tx(conn, jobs, ctx, Steps::Savepoint).unwrap_or_default(),
    }
}

/// One run of [`receive_batch`]; `None` when an envelope failed in a `Direct` run (the
/// transaction is rolled back; nothing is answered, no stream is failed, nothing reported).
fn receive_in_tx(
    conn: &mut Connection,
    jobs: &[Incoming],
    ctx: ReceiveContext,
    steps: Steps,
) -> Option<(Vec<BatchAnswer>, Option<Settled>)> {
    let storage = ctx.storage;
    let report = |e: &StoreError| {
        if let Some(watch) = storage {
            watch.commit_failed(e);
        }
    };
    let fail_all = |e: StoreError| -> Option<(Vec<BatchAnswer>, Option<Settled>)> {
        report(&e);
        let answers = jobs
            .iter()
            .map(|job| {
                job.stream.fail();
                Some(Err(e.clone()))
            })
            .collect();
        Some((answers, None))
    };
    let tx = match db::begin_immediate(conn) {
        Ok(tx) => tx,
        Err(e) => return fail_all(StoreError::from(e)),
    };
    let mut unapplied = Unapplied::default();
    let mut held = Held::new(&tx);
    let mut results = Vec::with_capacity(jobs.len());
    // Sized for the batch: a map grown row by row rehashes as it goes.
    let mut flows = ctx.applied_next.then(|| ReceivedFlows { flows: HashMap::with_capacity(jobs.len()) });
    for job in jobs {
        if job.stream.failed() {
            results.push(None);
            continue;
        }
        let now = runtime::now_us();
        let decided = db::in_step(&tx, steps, |tx| {
            let outcome = insert_pending_with(
                &mut held,
                &job.event,
                job.committed_at_us,
                now,
                ctx.admission,
                &mut unapplied,
                flows.as_mut(),
            )?;
            let position = match outcome {
                ReceiveOutcome::Accepted => u64::try_from(tx.last_insert_rowid()).unwrap_or(0),
                ReceiveOutcome::Duplicate => inbox_position(tx, &job.event.event_id)?.unwrap_or(0),
                _ => 0,
            };
            Ok::<_, StoreError>(Received { outcome, position })
        });
        match decided {
            Ok(received) => {
                if received.outcome == ReceiveOutcome::Accepted {
                    ctx.crash.reach(CrashPoint::ConsumerReceiveAfterInsert);
                }
                results.push(Some(Ok(received)));
            }
            Err(_) if steps == Steps::Direct => return None,
            Err(StepFailure::RolledBack(e)) => {
                report(&e);
                job.stream.fail();
                results.push(Some(Err(e)));
                // What the rolled-back envelope's statements saw is not kept.
                flows = None;
            }
            Err(StepFailure::TransactionLost(e)) => {
                drop(held);
                drop(tx);
                return fail_all(e);
            }
        }
    }
    drop(held);
    if !unapplied.changed() {
        // Nothing was written; dropping the transaction releases the lock.
        return Some((results, None));
    }
    if let Err(e) = unapplied.write(&tx) {
        drop(tx);
        return fail_all(e);
    }
    if let Some(refused) = storage.map_or(Ok(()), |watch| watch.before_commit()).err() {
        drop(tx);
        return fail_all(refused);
    }
    if let Err(e) = tx.commit() {
        return fail_all(StoreError::from(e));
    }
    if let Some(watch) = storage {
        watch.commit_succeeded();
    }
    ctx.crash.reach(CrashPoint::ConsumerReceiveAfterCommit);
    let settled = flows.and_then(|flows| Some(Settled { stamp: Stamp::now(conn).ok()?, flows }));
    Some((results, settled))
}

/// Where a connection's view of the file stands: the rows its own statements changed since
/// it opened (`sqlite3_total_changes64`: every write of this process's store, receive,
/// apply, block, compaction or probe, goes through its one connection) and SQLite's
/// `data_version`, which moves with every commit of any other connection. Equal stamps
/// mean nothing was written in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    changes: u64,
    data_version: i64,
}

impl Stamp {
    fn now(conn: &Connection) -> Result<Stamp> {
        let data_version = conn.prepare_cached("PRAGMA data_version")?.query_row([], |r| r.get(0))?;
        Ok(Stamp { changes: conn.total_changes(), data_version })
    }
}

/// What a committed Receive transaction knew of the flows it stored rows for (see
/// [`ReceivedFlows`]), and the [`Stamp`] right after its commit. The apply that follows
/// (auto-apply) uses it in its first transaction, and only when that transaction's stamp
/// is the same: nothing was written in between, so it is still exactly what is stored.
/// Such a flow's run then reads nothing before its steps: neither its projection nor its
/// next rows, which took ~17k instructions per flow run (callgrind, bench).
struct Settled {
    stamp: Stamp,
    flows: ReceivedFlows,
}

/// Per flow a Receive transaction stored rows for: its projection, when the transaction's
/// read of the flow's facts (after its first row's insert) found no other unapplied row, so
/// that its unapplied rows are exactly the rows the transaction itself stored (all pending,
/// their events held by the batch); `None` otherwise.
struct ReceivedFlows {
    flows: HashMap<String, ReceivedFlow>,
}

struct ReceivedFlow {
    /// `None`: other unapplied rows existed; nothing is known.
    projection: Option<Projection>,
    /// (seq, position, committed time) of each row stored, in the order stored.
    rows: Vec<(u64, i64, Option<i64>)>,
}

impl ReceivedFlows {
    /// The facts of the flow's first row in this transaction (later reads of the same flow
    /// find the transaction's own rows and change nothing).
    fn facts(&mut self, flow_id: &str, projection: Projection, others_waiting: bool) {
        if !self.flows.contains_key(flow_id) {
            let projection = (!others_waiting).then_some(projection);
            self.flows.insert(flow_id.to_owned(), ReceivedFlow { projection, rows: Vec::new() });
        }
    }

    /// A row the transaction inserted (after its flow's facts).
    fn stored(&mut self, flow_id: &str, seq: u64, position: i64, committed_at_us: Option<i64>) {
        if let Some(flow) = self.flows.get_mut(flow_id).filter(|f| f.projection.is_some()) {
            flow.rows.push((seq, position, committed_at_us));
        }
    }
}

/// One compaction pass on consumer.db (see [`ConsumerStore::compact`](super::ConsumerStore::compact)):
/// walks `inbox_body` (the rows that still have a body) in position order, each transaction
/// under the connection's lock like every other writer, looking at up to
/// [`COMPACT_EXAMINE`](runtime::retention::COMPACT_EXAMINE) rows and compacting up to
/// `COMPACT_BATCH` of them: the digest is appended to `inbox_digest` and the body deleted (a
/// row is finished when its effect, which holds its applied time, is older than the
/// cutoff). The walk ends at the first row received at or
/// after the cutoff (every later position was received later still, so none of them can have
/// been applied before it). Then, when the file was created with `auto_vacuum=INCREMENTAL`,
/// the free pages are given back in steps of [`VACUUM_STEP`]. Blocking.
fn compact_pass(
    shared: &Mutex<Connection>,
    cutoff_us: i64,
    crash: CrashSwitch,
    keep_free_pages: u64,
) -> Result<CompactReport> {
    let mut report = CompactReport::default();
    let incremental = {
        let conn = lock(shared);
        report.file_bytes_before = Some(db::database_bytes(&conn)?);
        conn.query_row("PRAGMA auto_vacuum", [], |r| r.get::<_, i64>(0))? == 2
    };
    let mut after: i64 = 0;
    loop {
        let mut guard = lock(shared);
        let tx = db::begin_immediate(&mut guard)?;
        // Each examined row as (position, received, what to do with it: see `Examined::of`,
        // which caps the batch at `COMPACT_BATCH`; the next finished row ends the transaction).
        let mut to_compact = 0;
        let examined: Vec<(i64, i64, Examined)> = tx
            .prepare_cached(
                "SELECT b.position, i.received_at_us,
                        i.state = 'applied' AND e.applied_at_us IS NOT NULL AND e.applied_at_us < ?3,
                        b.body
                 FROM inbox_body b JOIN inbox i ON i.rowid = b.position
                                   LEFT JOIN effect_log e ON e.position = b.position
                 WHERE b.position > ?1 ORDER BY b.position LIMIT ?2",
            )?
            .query_map(params![after, runtime::retention::COMPACT_EXAMINE as i64, cutoff_us], |r| {
                let examined = Examined::of(r, 2, 3, &mut to_compact, runtime::retention::COMPACT_BATCH)?;
                Ok((r.get(0)?, r.get(1)?, examined))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let mut done = examined.len() < runtime::retention::COMPACT_EXAMINE;
        let (mut rows, mut bytes) = (0u64, 0u64);
        // The rows were read in this transaction as applied with a body, so none has a
        // digest yet: a taken position is the inconsistency of a row compacted twice.
        let mut mark = tx.prepare_cached(
            "INSERT INTO inbox_digest(position, sha256) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
        )?;
        let mut drop_body = tx.prepare_cached("DELETE FROM inbox_body WHERE position = ?1")?;
        for (position, received_at_us, examined) in examined {
            if received_at_us >= cutoff_us {
                done = true;
                break;
            }
            let (digest, len) = match examined {
                Examined::Unfinished => {
                    after = position;
                    continue;
                }
                Examined::NextBatch => {
                    done = false;
                    break;
                }
                Examined::Compact(digest, len) => (digest, len),
            };
            after = position;
            if mark.execute(params![position, &digest[..]])? != 1 {
                return Err(StoreError::Inconsistent(format!("inbox position {position}: compacted twice")));
            }
            drop_body.execute([position])?;
            rows += 1;
            bytes += len;
        }
        drop((mark, drop_body));
        if rows > 0 {
            crash.reach(CrashPoint::ConsumerCompactAfterBatch);
            tx.commit()?;
            crash.reach(CrashPoint::ConsumerCompactAfterCommit);
            report.compacted += rows;
            report.body_bytes += bytes;
            report.batches += 1;
        } else {
            // Nothing written: dropping the transaction releases the lock.
            drop(tx);
        }
        drop(guard);
        if done {
            break;
        }
        std::thread::sleep(runtime::retention::COMPACT_PAUSE);
    }
    let mut pages_freed = 0;
    if incremental {
        // One step per lock, so Receive and Apply wait for one short step at most.
        let step = |free| runtime::retention::vacuum_step(free, keep_free_pages);
        loop {
            let given = db::give_back_free_pages(&mut lock(shared), step)?;
            if given == 0 {
                break;
            }
            pages_freed += given;
            std::thread::sleep(runtime::retention::COMPACT_PAUSE);
        }
    }
    report.pages_freed = Some(pages_freed);
    report.file_bytes_after = Some(db::database_bytes(&lock(shared))?);
    Ok(report)
}

/// What one step inside the open transaction did.
enum Progress {
    Applied { event_id: String, after: Projection, lag_us: Option<u64> },
    Stopped { stop: Stop, projection: Projection, wrote: bool },
}

/// Applies each of `flows` in turn, up to `max_steps` each, with consecutive steps of many
/// flows in one `BEGIN IMMEDIATE` transaction of up to `opts.max_batch` steps. A failing step
/// rolls back alone and fails only its flow (the others' steps in the same transaction
/// commit): each transaction first runs its steps directly, and if one fails, runs again from
/// the same flow with a savepoint per step (see [`db::Steps`]). If the whole transaction is
/// lost, every flow that wrote in it fails and keeps only what was committed before.
/// `consumer.apply.after_commit` is reached after each commit that holds an applied step.
/// A step whose row `events` holds takes its event from there (see [`BatchEvents`]), and
/// the first transaction takes what `settled` knows when it is still true (see [`Settled`]).
/// Blocking: call it on a blocking thread.
fn apply_flows(
    shared: &Mutex<Connection>,
    flows: Vec<String>,
    events: Option<&BatchEvents>,
    mut settled: Option<Settled>,
    max_steps: u32,
    opts: ApplyOptions,
) -> Vec<FlowResult> {
    let mut runs = FlowRun::all(flows);
    // The projection each flow's last step wrote inside the open transaction (what a read
    // would return now); `None` at the start of each transaction, so it is read again.
    let mut known: Vec<Option<Projection>> = vec![None; runs.len()];
    let mut next = 0;
    let mut steps = Steps::Direct;
    while next < runs.len() {
        let mut guard = lock(shared);
        let started = std::time::Instant::now();
        let tx = match db::begin_immediate(&mut guard) {
            Ok(tx) => tx,
            Err(e) => {
                let e = StoreError::from(e);
                if let Some(watch) = opts.storage {
                    watch.commit_failed(&e);
                }
                // No write lock (busy past the timeout, or worse): every flow not yet done fails.
                for run in &mut runs[next..] {
                    run.end = Some(Err(e.clone()));
                }
                break;
            }
        };
        let first = next;
        // Only the first transaction, run directly, may take it (a transaction after it
        // follows this call's own commits; a rerun follows a rollback).
        let received = settled
            .take()
            .filter(|s| steps == Steps::Direct && Stamp::now(&tx).is_ok_and(|now| now == s.stamp))
            .map(|s| s.flows);
        let mut ahead = Ahead::new(events, received);
        let ran = apply_in_tx(&tx, &mut runs, &mut known, &mut next, max_steps, &opts, steps, &mut ahead);
        known.fill(None);
        let Some(mut ran) = ran else {
            // A step failed in a direct run: nothing of it stays; the same flows run again
            // with a savepoint per step.
            drop(tx);
            for run in runs.iter_mut().take(next + 1).skip(first) {
                run.forget_pending();
                run.wrote = false;
                run.end = None;
            }
            next = first;
            steps = Steps::Savepoint;
            continue;
        };
        steps = Steps::Direct;
        let wrote_any = runs.iter().any(|r| r.wrote);
        let finished = if let Some(e) = ran.lost {
            drop(tx);
            Err(e)
        } else if wrote_any {
            let checked = ran.unapplied.write(&tx).and_then(|()| match opts.storage {
                Some(watch) => watch.before_commit(),
                None => Ok(()),
            });
            match checked {
                Ok(()) => tx.commit().map_err(StoreError::from),
                Err(refused) => {
                    drop(tx);
                    Err(refused)
                }
            }
        } else {
            // Nothing written: dropping the transaction releases the lock.
            drop(tx);
            Ok(())
        };
        drop(guard);
        settle(&mut runs, finished, started, &opts);
    }
    reports(runs, &opts)
}

/// What one transaction of [`apply_flows`] left to settle.
struct Ran {
    /// The counter change its applied steps made.
    unapplied: Unapplied,
    /// The whole transaction was lost (the flow that lost it already has its error).
    lost: Option<StoreError>,
}

/// The steps of one transaction of [`apply_flows`], from flow `*next` on, up to
/// `opts.max_batch` steps; `None` when a step, or a flow's held-back projection write (see
/// [`HeldBack`]), failed in a `Direct` run (the caller rolls the transaction back and runs
/// the same flows again with savepoints).
#[allow(clippy::too_many_arguments)]
fn apply_in_tx(
    tx: &Transaction<'_>,
    runs: &mut [FlowRun],
    known: &mut [Option<Projection>],
    next: &mut usize,
    max_steps: u32,
    opts: &ApplyOptions,
    steps: Steps,
    ahead: &mut Ahead<'_>,
) -> Option<Ran> {
    let max_batch = opts.max_batch.max(1);
    let mut ran = Ran { unapplied: Unapplied::default(), lost: None };
    let mut held = Held::new(tx);
    let mut written = 0;
    // The waiting state of the flow being applied, as first read in this transaction and now.
    let mut seen: Option<Seen> = None;
    // In a direct run, the projection write of the flow being applied (see [`HeldBack`]).
    let mut held_back: Option<HeldBack> = None;
    while *next < runs.len() && written < max_batch {
        let run = &mut runs[*next];
        if seen.is_none() && known[*next].is_none() {
            // The flow's first step in this transaction.
            known[*next] = ahead.received(&run.flow_id);
        }
        let budget_left = run.committed.len() + run.pending.len() < max_steps as usize;
        let stepped = step_in_tx(
            tx,
            &mut held,
            &run.flow_id,
            known[*next],
            budget_left,
            opts,
            steps,
            &mut ran.unapplied,
            &mut seen,
            ahead,
            &mut held_back,
        );
        let failed = match stepped {
            Ok(Progress::Applied { event_id, after, lag_us }) => {
                known[*next] = Some(after);
                run.applied(event_id, lag_us);
                run.wrote = true;
                written += 1;
                continue;
            }
            Ok(Progress::Stopped { stop, projection, wrote }) => {
                run.wrote |= wrote;
                written += usize::from(wrote);
                run.end = Some(Ok((stop, projection)));
                None
            }
            Err(_) if steps == Steps::Direct => return None,
            Err(StepFailure::RolledBack(e)) => Some(e),
            Err(StepFailure::TransactionLost(e)) => {
                ran.lost = Some(e.clone());
                run.end = Some(Err(e));
                run.forget_pending();
                run.wrote = false;
                *next += 1;
                return Some(ran);
            }
        };
        // The flow is done in this transaction: its projection is written, and its change
        // of the counters is final.
        if !write_held_back(&mut held, held_back.take()) {
            return None;
        }
        let closed = close_flow(&mut held, &run.flow_id, known[*next], &mut seen, &mut ran.unapplied);
        // A run that stopped may have taken its next row without applying it (its step
        // limit): the flow's next run in this call reads again.
        ahead.forget();
        *next += 1;
        match (failed, closed) {
            (None, Ok(())) => {}
            (Some(e), Ok(())) => run.end = Some(Err(e)),
            (_, Err(e)) => {
                // Without the flow's state the counters cannot be kept: nothing commits.
                ran.lost = Some(e.clone());
                run.end = Some(Err(e));
                return Some(ran);
            }
        }
    }
    if !write_held_back(&mut held, held_back.take()) {
        return None;
    }
    if let Some(run) = runs.get_mut(*next) {
        // The batch filled up inside this flow: it goes on in the next transaction.
        if let Err(e) = close_flow(&mut held, &run.flow_id, known[*next], &mut seen, &mut ran.unapplied) {
            ran.lost = Some(e.clone());
            run.end = Some(Err(e));
            *next += 1;
        }
    }
    Some(ran)
}

/// One flow's waiting state inside the open transaction (`None`: not waiting): as its first
/// step read it, and now (`None` right after an applied step, until the next read).
#[derive(Clone, Copy)]
struct Seen {
    first: Option<Waiting>,
    now: Option<Option<Waiting>>,
}

/// Adds the flow's change of waiting state in this transaction to the counters (reading its
/// next seq once more when its last step applied a row) and forgets it.
fn close_flow(
    held: &mut Held<'_>,
    flow_id: &str,
    known: Option<Projection>,
    seen: &mut Option<Seen>,
    counter: &mut Unapplied,
) -> Result<()> {
    let Some(Seen { first, now }) = seen.take() else { return Ok(()) };
    let now = match now {
        Some(now) => now,
        None => {
            let from = match known {
                Some(projection) => projection,
                None => projection_with(held, flow_id)?,
            };
            state_of(&next_to_apply_with(held, flow_id, from.next_seq())?, from.next_seq())
        }
    };
    counter.waiting.add(WaitDelta::between(first, now));
    Ok(())
}

/// A failure outside a savepoint (a read): the transaction survives unless SQLite dropped it.
fn classify(tx: &Transaction<'_>, e: StoreError) -> StepFailure<StoreError> {
    if tx.is_autocommit() { StepFailure::TransactionLost(e) } else { StepFailure::RolledBack(e) }
}

/// Reads the projection (unless this transaction's previous step of the flow just wrote it:
/// `known`) and the row at its next seq inside the open transaction, decides, and writes the
/// decision in its own savepoint. `seen` follows the flow's waiting state: what this read
/// found, then what the step's write made of it.
#[allow(clippy::too_many_arguments)]
fn step_in_tx(
    tx: &Transaction<'_>,
    held: &mut Held<'_>,
    flow_id: &str,
    known: Option<Projection>,
    budget_left: bool,
    opts: &ApplyOptions,
    steps: Steps,
    unapplied: &mut Unapplied,
    seen: &mut Option<Seen>,
    ahead: &mut Ahead<'_>,
    held_back: &mut Option<HeldBack>,
) -> std::result::Result<Progress, StepFailure<StoreError>> {
    let from = match known {
        Some(projection) => projection,
        None => projection_with(held, flow_id).map_err(|e| classify(tx, e))?,
    };
    let (next, position) = ahead.next_row(held, flow_id, from.next_seq()).map_err(|e| classify(tx, e))?;
    let state = state_of(&next, from.next_seq());
    seen.get_or_insert(Seen { first: state, now: None }).now = Some(state);
    let row = match next {
        Next::Idle => return Ok(Progress::Stopped { stop: Stop::Idle, projection: from, wrote: false }),
        Next::Gap => {
            let stop = Stop::Gap { waiting_for_seq: from.next_seq() };
            return Ok(Progress::Stopped { stop, projection: from, wrote: false });
        }
        Next::Row(row) => row,
    };
    if !budget_left {
        return Ok(Progress::Stopped { stop: Stop::Limit, projection: from, wrote: false });
    }
    let parsed;
    let event = match ahead.event_at(position) {
        Some(event) => event,
        None => {
            parsed = Event::from_canonical_body(&row.body).map_err(|e| {
                StepFailure::RolledBack(StoreError::Inconsistent(format!("inbox {}: {e}", row.event_id)))
            })?;
            &parsed
        }
    };
    match decide_next(&from, event, opts.support_v2) {
        Decision::Block { reason, detail } => {
            let mut wrote = false;
            if row.state != InboxState::Blocked || row.reason != Some(reason) {
                wrote = db::in_step(tx, steps, |tx| mark_blocked(tx, &row.event_id, reason))?;
                if wrote {
                    // The row was read in this transaction: what it was is what changed.
                    unapplied.blocked(row.reason, Some(reason));
                    if let Some(seen) = seen.as_mut() {
                        seen.now = Some(Some(Waiting::Blocked(reason)));
                    }
                    tracing::warn!(
                        flow_id,
                        event_id = %row.event_id,
                        seq = row.seq,
                        reason = reason.as_str(),
                        %detail,
                        "event blocked: kept stored, re-evaluated on every Apply"
                    );
                }
            }
            let stop = Stop::Blocked { event_id: row.event_id, reason, detail };
            Ok(Progress::Stopped { stop, projection: from, wrote })
        }
        Decision::Apply { kind, after } => {
            let now = runtime::now_us();
            let held_back = (steps == Steps::Direct).then_some(held_back);
            let applied = db::in_step(tx, steps, |_| {
                apply_step_with(
                    held,
                    &row,
                    position,
                    &from,
                    kind,
                    &after,
                    &opts.crash,
                    now,
                    unapplied,
                    held_back,
                )
            })?;
            match applied {
                StepOutcome::Applied => {
                    if let Some(seen) = seen.as_mut() {
                        // Known again at the next read.
                        seen.now = None;
                    }
                    tracing::debug!(flow_id, event_id = %row.event_id, seq = row.seq, "applied");
                    let lag_us = commit_lag_us(row.committed_at_us, now);
                    Ok(Progress::Applied { event_id: row.event_id, after, lag_us })
                }
                // The projection was read inside this same transaction: it cannot have moved.
                StepOutcome::Raced => Err(StepFailure::RolledBack(StoreError::Inconsistent(format!(
                    "projection of {flow_id} moved inside the apply transaction"
                )))),
            }
        }
    }
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
    committed_at_us: Option<i64>,
    now_us: i64,
    admission: Admission,
    counter: &mut Unapplied,
) -> Result<ReceiveOutcome> {
    insert_pending_with(&mut Held::new(tx), event, committed_at_us, now_us, admission, counter, None)
}

/// [`insert_pending`] with the batch's held statements, telling `flows` what it learns of
/// the flows it stores rows for.
fn insert_pending_with(
    held: &mut Held<'_>,
    event: &Event,
    committed_at_us: Option<i64>,
    now_us: i64,
    admission: Admission,
    counter: &mut Unapplied,
    mut flows: Option<&mut ReceivedFlows>,
) -> Result<ReceiveOutcome> {
    let tx = held.conn();
    let body = event.canonical_body();
    if let Admission::Cap(cap) = admission {
        let unapplied = counter.count(tx)?;
        if unapplied >= cap {
            if let Some(known) = stored_outcome(tx, event, &body)? {
                return Ok(known);
            }
            if !fills_gap(tx, event)? {
                return Ok(ReceiveOutcome::BacklogFull { unapplied });
            }
        }
    }
    let inserted = held
        .get(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, state, received_at_us, committed_at_us)
             VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ?6, ?7) ON CONFLICT DO NOTHING",
        )?
        .execute(params![
            event.event_id,
            event.flow_id,
            event.seq,
            event.kind,
            event.schema,
            now_us,
            committed_at_us
        ])?;
    if inserted == 1 {
        let position = held.conn().last_insert_rowid();
        held.get("INSERT INTO inbox_body(position, body) VALUES (?1, ?2)")?
            .execute(params![position, body])?;
        // A relay sends a flow's rows one after another, so a batch often inserts several
        // rows of one flow in a row. After the first, the facts are known without a read: a
        // receive transaction applies nothing (the last applied seq stays), and the row just
        // inserted before is unapplied at another seq (so others wait). ~5.6k instructions
        // a row saved (callgrind, bench).
        let (last_seq, others_waiting): (u64, bool) = match &mut counter.last_inserted {
            Some((flow, last_seq)) if *flow == event.flow_id => (*last_seq, true),
            last => {
                let (projection, others_waiting) =
                    held.get(RECEIVED_FACTS_SQL)?.query_row(params![event.flow_id, event.seq], |r| {
                        let projection = match r.get::<_, Option<u64>>(0)? {
                            None => None,
                            Some(last_seq) => Some((last_seq, r.get(1)?, r.get(2)?, r.get(3)?)),
                        };
                        Ok((projection, r.get::<_, bool>(4)?))
                    })?;
                let projection = checked_projection(&event.flow_id, projection)?;
                *last = Some((event.flow_id.clone(), projection.last_seq));
                if let Some(flows) = flows.as_deref_mut() {
                    flows.facts(&event.flow_id, projection, others_waiting);
                }
                (projection.last_seq, others_waiting)
            }
        };
        if let Some(flows) = flows {
            flows.stored(&event.flow_id, event.seq, position, committed_at_us);
        }
        counter.delta += 1;
        counter.waiting.add(WaitDelta::received(last_seq + 1, event.seq, others_waiting));
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
/// A compacted row is compared by the SHA-256 digest of the body, so the answers stay exact.
fn stored_outcome(tx: &Connection, event: &Event, body: &str) -> Result<Option<ReceiveOutcome>> {
    let stored: Option<(Option<String>, Option<Vec<u8>>)> = tx
        .prepare_cached(
            "SELECT b.body, d.sha256
             FROM inbox i LEFT JOIN inbox_body b ON b.position = i.rowid
                          LEFT JOIN inbox_digest d ON d.position = i.rowid
             WHERE i.event_id = ?1",
        )?
        .query_row([&event.event_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    if let Some((stored_body, digest)) = stored {
        let stored = StoredBody::from_columns(stored_body, digest).ok_or_else(|| {
            StoreError::Inconsistent(format!("inbox {}: no body and no digest of one", event.event_id))
        })?;
        return Ok(Some(if stored.is(body) {
            ReceiveOutcome::Duplicate
        } else {
            ReceiveOutcome::IdConflict
        }));
    }
    let holder: Option<String> = tx
        .prepare_cached("SELECT event_id FROM inbox WHERE flow_id = ?1 AND seq = ?2")?
        .query_row(params![event.flow_id, event.seq], |r| r.get(0))
        .optional()?;
    Ok(holder.map(|held_by| ReceiveOutcome::SequenceConflict { held_by }))
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

/// For each `(position, event_id)`, whether the inbox row at that position (its rowid) holds
/// that event; a tombstone keeps its row, so it does. One cached primary-key lookup each,
/// inside the caller's read transaction.
pub fn probes_held(conn: &Connection, probes: &[(u64, String)]) -> Result<Vec<bool>> {
    if probes.is_empty() {
        return Ok(Vec::new());
    }
    let mut at = conn.prepare_cached("SELECT event_id FROM inbox WHERE rowid = ?1")?;
    let mut held = Vec::with_capacity(probes.len());
    for (position, event_id) in probes {
        // A position past i64 names no row (rowids are i64).
        let found: Option<String> = match i64::try_from(*position) {
            Ok(rowid) => at.query_row([rowid], |r| r.get(0)).optional()?,
            Err(_) => None,
        };
        held.push(found.as_deref() == Some(event_id.as_str()));
    }
    Ok(held)
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

/// Unapplied (pending + blocked) inbox rows, from the counter the store keeps exact.
pub fn unapplied_count(conn: &Connection) -> Result<u64> {
    Ok(conn.prepare_cached("SELECT unapplied FROM backlog WHERE id = 1")?.query_row([], |r| r.get(0))?)
}

/// The counters' UPDATE that [`Unapplied::write`] completes.
macro_rules! backlog_update {
    () => {
        "UPDATE backlog SET unapplied = unapplied + ?1,
             blocked_unsupported_schema = blocked_unsupported_schema + ?2,
             blocked_invalid_payload = blocked_invalid_payload + ?3,
             blocked_invalid_transition = blocked_invalid_transition + ?4,
             gap_flows = gap_flows + ?5, ready_flows = ready_flows + ?6"
    };
}

/// The `backlog` counters inside one write transaction: `unapplied` read at most once (when
/// the cap needs it), this transaction's changes of it, of the blocked rows by reason and of
/// the gap and ready flows summed, and written once before the commit ([`Unapplied::write`],
/// one UPDATE). [`insert_pending`], [`apply_step_with`] and the apply loop (its blocked marks, and
/// each flow's waiting state as read before and after its steps), the only writes that
/// change how many rows are unapplied or blocked or what a flow waits for, take one, so the
/// counters stay exact in the same transaction as the rows.
#[derive(Debug, Default)]
pub struct Unapplied {
    stored: Option<u64>,
    delta: i64,
    /// Blocked rows gained (+) or lost (-) per reason, in [`super::BLOCK_REASONS`] order.
    blocked: [i64; 3],
    /// Flows gained or lost by the gap and ready counts.
    waiting: WaitDelta,
    /// The flow of the last row this transaction inserted, and its last applied seq then
    /// (see [`insert_pending_with`]); only a receive transaction inserts, and it applies
    /// nothing, so the seq stays true to the commit.
    last_inserted: Option<(String, u64)>,
    /// `backlog.effects` as stored (read at this transaction's first applied step).
    effects_stored: Option<i64>,
    /// Effects this transaction inserted.
    effects: i64,
}

impl Unapplied {
    /// The apply order of the effect the next applied step inserts: the stored count of
    /// effects (read once) plus this transaction's, plus one.
    fn next_effect(&mut self, tx: &Connection) -> Result<i64> {
        let stored = match self.effects_stored {
            Some(n) => n,
            None => *self.effects_stored.insert(
                tx.prepare_cached("SELECT effects FROM backlog WHERE id = 1")?.query_row([], |r| r.get(0))?,
            ),
        };
        Ok(stored + self.effects + 1)
    }

    /// Unapplied rows as this transaction sees them now: the stored counter (read once) plus
    /// this transaction's changes.
    pub fn count(&mut self, tx: &Connection) -> Result<u64> {
        let stored = match self.stored {
            Some(n) => n,
            None => *self.stored.insert(unapplied_count(tx)?),
        };
        Ok(stored.saturating_add_signed(self.delta))
    }

    /// Whether this transaction changed a counter (it inserted, applied or blocked a row).
    pub fn changed(&self) -> bool {
        self.delta != 0 || self.blocked != [0; 3] || self.waiting != WaitDelta::NONE || self.effects != 0
    }

    /// A row's block reason went from `was` to `now` (`None`: not blocked).
    pub fn blocked(&mut self, was: Option<BlockReason>, now: Option<BlockReason>) {
        if was != now {
            if let Some(was) = was {
                self.blocked[reason_index(was)] -= 1;
            }
            if let Some(now) = now {
                self.blocked[reason_index(now)] += 1;
            }
        }
    }

    /// Writes this transaction's change of the counters (nothing when there is none). A
    /// transaction that inserted no effect (a receive, a block) leaves `effects` out.
    pub fn write(&mut self, tx: &Transaction<'_>) -> Result<()> {
        if self.changed() {
            let [schema, payload, transition] = self.blocked;
            let counters = [self.delta, schema, payload, transition, self.waiting.gap, self.waiting.ready];
            if self.effects == 0 {
                tx.prepare_cached(concat!(backlog_update!(), " WHERE id = 1"))?.execute(counters)?;
            } else {
                tx.prepare_cached(concat!(backlog_update!(), ", effects = effects + ?7 WHERE id = 1"))?
                    .execute(rusqlite::params_from_iter(counters.iter().chain([&self.effects])))?;
            }
            self.stored = self.stored.map(|n| n.saturating_add_signed(self.delta));
            self.effects_stored = self.effects_stored.map(|n| n + self.effects);
            self.effects = 0;
            self.delta = 0;
            self.blocked = [0; 3];
            self.waiting = WaitDelta::NONE;
        }
        Ok(())
    }
}

/// The backlog counters, as the store keeps them exact (one row read).
pub fn backlog_counts(conn: &mut Connection) -> Result<BacklogCounts> {
    Ok(conn.prepare_cached(BACKLOG_COUNTERS_SQL)?.query_row([], |r| {
        Ok(BacklogCounts {
            unapplied: r.get(0)?,
            blocked: [r.get(1)?, r.get(2)?, r.get(3)?],
            gap: r.get(4)?,
            ready: r.get(5)?,
        })
    })?)
}

/// The counters the store keeps exact.
const BACKLOG_COUNTERS_SQL: &str = "SELECT unapplied, blocked_unsupported_schema, blocked_invalid_payload,
            blocked_invalid_transition, gap_flows, ready_flows FROM backlog WHERE id = 1";

/// What a new row's flow looked like before it (read after the insert, in the same
/// transaction): its projection (NULLs for a new flow) and whether another of its rows
/// waits (from the projection's key and the partial index `inbox_unapplied`).
pub const RECEIVED_FACTS_SQL: &str = "SELECT p.last_seq, p.state, p.held, p.amount,
        EXISTS(SELECT 1 FROM inbox WHERE flow_id = ?1 AND seq <> ?2 AND state <> 'applied')
    FROM (SELECT 1) LEFT JOIN projection p ON p.flow_id = ?1";

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
    projection_with(&mut Held::new(conn), flow_id)
}

/// [`projection`] with the batch's held statements.
fn projection_with(held: &mut Held<'_>, flow_id: &str) -> Result<Projection> {
    let row = held
        .get("SELECT last_seq, state, held, amount FROM projection WHERE flow_id = ?1")?
        .query_row([flow_id], |r| {
            Ok((r.get::<_, u64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?, r.get::<_, i64>(3)?))
        })
        .optional()?;
    checked_projection(flow_id, row)
}

/// The columns `raw_inbox` reads, as a macro so the statements below are literals (built
/// once at compile time, not formatted at every call). The body comes by a `LEFT JOIN` of
/// `inbox_body` on the position (no body: a tombstone). It was a correlated scalar subquery,
/// a sub-program run for every row (~1.1k instructions more per read of a flow's next rows,
/// callgrind, bench), chosen when the join's statements were re-prepared at almost every
/// run because their plans depended on the bound values; every connection now has the
/// planner stability guarantee (`proto::db::open`), and `bench --callgrind` shows no
/// `sqlite3Reprepare` in any process with the join.
///
/// Only reads of any row (`inbox_columns!(with digest)`: GetFlow) join `inbox_digest` for a
/// tombstone's digest; the others read rows that wait (after the flow's projection, or in
/// `inbox_unapplied`), which compaction never touches, and read no digest.
macro_rules! inbox_columns {
    () => {
        inbox_columns!("NULL", "")
    };
    (with digest) => {
        inbox_columns!("d.sha256", " LEFT JOIN inbox_digest d ON d.position = i.rowid")
    };
    ($digest:literal, $join:literal) => {
        concat!(
            "i.event_id, i.flow_id, i.seq, i.kind, i.schema, b.body, ",
            $digest,
            ", i.state, i.reason, i.committed_at_us, i.rowid
             FROM inbox i LEFT JOIN inbox_body b ON b.position = i.rowid",
            $join
        )
    };
}

/// The row at one (flow_id, seq) (ListStuck's lowest unapplied row).
const INBOX_AT_SEQ_SQL: &str = concat!("SELECT ", inbox_columns!(), " WHERE i.flow_id = ?1 AND i.seq = ?2");

/// The flow's first row at or after a seq, in one seek of the `(flow_id, seq)` key: the row
/// to apply when it sits at exactly that seq, a gap when it sits later, nothing when the flow
/// has no row there (every row after the projection is unapplied, so this finds what the
/// partial index would, and an applied one is reported as the inconsistency it is). One
/// statement where a row at the seq and then "a later unapplied one?" took two each time a
/// flow's steps ran out.
const INBOX_FROM_SEQ_SQL: &str =
    concat!("SELECT ", inbox_columns!(), " WHERE i.flow_id = ?1 AND i.seq >= ?2 ORDER BY i.seq LIMIT 1");

fn raw_inbox(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawInbox> {
    Ok(RawInbox {
        event_id: r.get(0)?,
        flow_id: r.get(1)?,
        seq: r.get(2)?,
        kind: r.get(3)?,
        schema: r.get(4)?,
        body: r.get(5)?,
        sha256: r.get(6)?,
        state: r.get(7)?,
        reason: r.get(8)?,
        committed_at_us: r.get(9)?,
    })
}

fn inbox_record(raw: RawInbox) -> Result<InboxRecord> {
    raw.check()
}

/// The row at exactly `next_seq` of the flow ("greater than last_seq" would skip a gap), or
/// whether a later one waits.
pub fn next_to_apply(conn: &Connection, flow_id: &str, next_seq: u64) -> Result<Next> {
    next_to_apply_with(&mut Held::new(conn), flow_id, next_seq)
}

/// [`next_to_apply`] with the batch's held statements.
fn next_to_apply_with(held: &mut Held<'_>, flow_id: &str, next_seq: u64) -> Result<Next> {
    Ok(next_row_with(held, flow_id, next_seq)?.0)
}

/// [`next_to_apply_with`], and for a row its position (rowid), which the step's mark uses
/// as its key (0 for a gap or idle).
fn next_row_with(held: &mut Held<'_>, flow_id: &str, next_seq: u64) -> Result<(Next, i64)> {
    let found = held
        .get(INBOX_FROM_SEQ_SQL)?
        .query_row(params![flow_id, next_seq], |r| Ok((raw_inbox(r)?, r.get::<_, i64>(10)?)))
        .optional()?;
    let Some((raw, position)) = found else { return Ok((Next::Idle, 0)) };
    next_from(raw, position, flow_id, next_seq)
}

/// The flow's first stored row at or after `next_seq` (at `position`) as [`Next`] and the
/// position of a row to apply (0 for a gap): every row there is unapplied, so an applied one
/// is an inconsistency.
fn next_from(raw: RawInbox, position: i64, flow_id: &str, next_seq: u64) -> Result<(Next, i64)> {
    // Told before the row is checked: these reads take no digest, so an applied row that was
    // compacted would otherwise be reported as a row without body or digest.
    if raw.state == InboxState::Applied.as_str() {
        return Err(StoreError::Inconsistent(format!(
            "inbox {} (flow {flow_id}, seq {}) is applied but the projection is before it (next seq {next_seq})",
            raw.event_id, raw.seq
        )));
    }
    let row = inbox_record(raw)?;
    Ok(if row.seq == next_seq { (Next::Row(row), position) } else { (Next::Gap, 0) })
}

/// The most rows of one flow [`Ahead`] reads in one statement: a flow has at most three
/// valid steps, so one read answers a whole flow, its idle check included.
const READ_AHEAD: usize = 4;

/// A flow's next rows from [`INBOX_FROM_SEQ_SQL`] (up to [`READ_AHEAD`]).
const INBOX_AHEAD_SQL: &str =
    concat!("SELECT ", inbox_columns!(), " WHERE i.flow_id = ?1 AND i.seq >= ?2 ORDER BY i.seq LIMIT ?3");

/// [`INBOX_AHEAD_SQL`] without the body (the rows' bodies are read one by one, and only
/// those the Receive batch being applied does not hold).
const INBOX_AHEAD_BARE_SQL: &str = "SELECT i.event_id, i.flow_id, i.seq, i.kind, i.schema, NULL, NULL,
        i.state, i.reason, i.committed_at_us, i.rowid
    FROM inbox i WHERE i.flow_id = ?1 AND i.seq >= ?2 ORDER BY i.seq LIMIT ?3";

/// The rows of the flow being applied, read ahead in one statement inside the apply
/// transaction: one seek of the `(flow_id, seq)` key for a run of steps, where a read per
/// step took a seek each and one more to find the flow idle (~9k instructions per read,
/// callgrind, bench). Only the apply transaction writes while it holds the write lock, and
/// a step writes only the row it took, so the rows still here are as stored. Forgotten when
/// the flow stops and with the transaction (one per transaction of [`apply_flows`]).
///
/// With the events of the Receive batch being applied (auto-apply, [`BatchEvents`]), the
/// rows are read without their bodies: a row the batch holds is never given its body (its
/// record's `body` stays empty, and its step takes the batch's event: [`Ahead::event_at`]);
/// any other row's body is read by its position. With what that batch's transaction knew
/// and is still true ([`Settled`]), a flow whose unapplied rows are exactly the batch's is
/// not read at all ([`Ahead::received`]).
struct Ahead<'a> {
    flow_id: String,
    rows: std::collections::VecDeque<(RawInbox, i64)>,
    /// The last read found fewer rows than it asked for: the flow has none after these.
    complete: bool,
    events: Option<&'a BatchEvents>,
    received: Option<ReceivedFlows>,
}

impl<'a> Ahead<'a> {
    fn new(events: Option<&'a BatchEvents>, received: Option<ReceivedFlows>) -> Ahead<'a> {
        Ahead { flow_id: String::new(), rows: Default::default(), complete: false, events, received }
    }

    /// At a flow's first step in the transaction: when the Receive transaction knew all of
    /// the flow's unapplied rows (and nothing was written since, see [`Settled`]), takes them
    /// as the flow's rows (the flow has no others) and returns its projection as stored.
    /// Once per flow: a flow named again finds what its first run left by reading.
    fn received(&mut self, flow_id: &str) -> Option<Projection> {
        let flow = self.received.as_mut()?.flows.remove(flow_id)?;
        let (projection, events) = (flow.projection?, self.events?);
        let mut rows = flow.rows;
        rows.sort_unstable_by_key(|&(seq, _, _)| seq);
        let mut taken = std::collections::VecDeque::with_capacity(rows.len());
        for (seq, position, committed_at_us) in rows {
            let event = events.event_at(position)?;
            if seq <= projection.last_seq || event.seq != seq || event.flow_id != flow_id {
                return None;
            }
            let raw = RawInbox {
                event_id: event.event_id.clone(),
                flow_id: event.flow_id.clone(),
                seq,
                kind: event.kind.clone(),
                schema: event.schema,
                // Never read: the step takes the batch's event.
                body: Some(String::new()),
                sha256: None,
                state: InboxState::Pending.as_str().to_owned(),
                reason: None,
                committed_at_us,
            };
            taken.push_back((raw, position));
        }
        flow_id.clone_into(&mut self.flow_id);
        self.rows = taken;
        self.complete = true;
        Some(projection)
    }

    /// The event of the row at `position` when the Receive batch being applied holds it
    /// (that row's record was read without its body).
    fn event_at(&self, position: i64) -> Option<&'a Event> {
        self.events.and_then(|events| events.event_at(position))
    }

    /// Up to [`READ_AHEAD`] of the flow's rows from `next_seq` on.
    fn read(
        &self,
        held: &mut Held<'_>,
        flow_id: &str,
        next_seq: u64,
    ) -> Result<std::collections::VecDeque<(RawInbox, i64)>> {
        let sql = if self.events.is_some() { INBOX_AHEAD_BARE_SQL } else { INBOX_AHEAD_SQL };
        let mut rows: std::collections::VecDeque<(RawInbox, i64)> = held
            .get(sql)?
            .query_map(params![flow_id, next_seq, READ_AHEAD as i64], |r| {
                Ok((raw_inbox(r)?, r.get::<_, i64>(10)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        if self.events.is_some() {
            for (raw, position) in &mut rows {
                if self.event_at(*position).is_some() {
                    // Never read: the step takes the batch's event.
                    raw.body = Some(String::new());
                } else {
                    raw.body = held
                        .get("SELECT body FROM inbox_body WHERE position = ?1")?
                        .query_row([*position], |r| r.get(0))
                        .optional()?;
                }
            }
        }
        Ok(rows)
    }

    /// What [`next_row_with`] would read now. A row at `next_seq` is taken; a gap (or the
    /// inconsistency of an applied row) forgets the flow's rows. Rows below `next_seq` (never
    /// left by a step that applied its row) are read again rather than trusted.
    fn next_row(&mut self, held: &mut Held<'_>, flow_id: &str, next_seq: u64) -> Result<(Next, i64)> {
        let behind = self.rows.front().is_some_and(|(row, _)| row.seq < next_seq);
        if self.flow_id != flow_id || behind {
            self.forget();
            flow_id.clone_into(&mut self.flow_id);
        }
        if self.rows.is_empty() && !self.complete {
            self.rows = self.read(held, flow_id, next_seq)?;
            self.complete = self.rows.len() < READ_AHEAD;
        }
        let Some((raw, position)) = self.rows.pop_front() else { return Ok((Next::Idle, 0)) };
        let next = next_from(raw, position, flow_id, next_seq);
        if !matches!(next, Ok((Next::Row(_), _))) {
            self.forget();
        }
        next
    }

    /// Drops the rows read: the next read asks SQLite again.
    fn forget(&mut self) {
        self.flow_id.clear();
        self.rows.clear();
        self.complete = false;
    }
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

/// [`apply_step_with`] on statements of its own, for tests. It does not move the gap and
/// ready counts, which the apply loop keeps from each flow's reads before and after its steps
/// ([`close_flow`]); every apply of the service goes through that loop.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn apply_step(
    tx: &Transaction<'_>,
    row: &InboxRecord,
    from: &Projection,
    kind: Kind,
    after: &Projection,
    crash: &CrashSwitch,
    now_us: i64,
    unapplied: &mut Unapplied,
) -> Result<StepOutcome> {
    let position = inbox_position(tx, &row.event_id)?.and_then(|p| i64::try_from(p).ok()).unwrap_or(0);
    apply_step_with(&mut Held::new(tx), row, position, from, kind, after, crash, now_us, unapplied, None)
}

/// A flow's projection write held back by the steps of a direct run (`Steps::Direct`): the
/// projection as stored when the flow's first step in the transaction read it, and as its
/// last applied step left it. The apply loop writes it once ([`write_held_back`]) when the
/// flow's run in the transaction ends, instead of once per step (~7.5k instructions a write
/// in the sqlite3 shell, most of it the b-tree update of a text-keyed row). The effects and
/// inbox marks are written by every step as before; only this transaction's steps see the
/// projection between them, and they take it from memory (`known`). With savepoints every
/// step writes its own.
struct HeldBack {
    flow_id: String,
    stored: Projection,
    after: Projection,
}

/// Moves the stored projection of `flow_id` from `from` (no row: [`Projection::NEW`]) to
/// `after`; false when it was not `from` (nothing written).
fn write_projection(
    held: &mut Held<'_>,
    flow_id: &str,
    from: &Projection,
    after: &Projection,
) -> Result<bool> {
    // The write itself checks that the stored projection is still `from` (no row at all for
    // a new flow), so nothing is written when another applier moved it.
    let moved = if *from == Projection::NEW {
        held.get(
            "INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(flow_id) DO NOTHING",
        )?
        .execute(params![
            flow_id,
            after.last_seq,
            after.state.as_str(),
            after.held,
            after.amount
        ])?
    } else {
        held.get(
            "UPDATE projection SET last_seq = ?2, state = ?3, held = ?4, amount = ?5
             WHERE flow_id = ?1 AND last_seq = ?6 AND state = ?7 AND held = ?8 AND amount = ?9",
        )?
        .execute(params![
            flow_id,
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
    Ok(moved == 1)
}

/// Writes a held-back projection (see [`HeldBack`]); false when the stored one was not what
/// the flow's first step read, or the write failed: the direct run must not commit.
fn write_held_back(held: &mut Held<'_>, back: Option<HeldBack>) -> bool {
    match back {
        None => true,
        Some(back) => matches!(write_projection(held, &back.flow_id, &back.stored, &back.after), Ok(true)),
    }
}

/// Inside the caller's `BEGIN IMMEDIATE` transaction, with the batch's held statements, the
/// applied step of SPEC §7: only if the stored projection is still `from` (checked by the
/// guarded write itself, never trusting the caller's copy) updates it to `after`, inserts
/// the effect and marks `row` applied (counted in `unapplied`). Any failure (a constraint, a
/// trigger) is returned before commit, so the caller's rollback undoes all three. Crash
/// points `consumer.apply.after_projection` and `.after_effect` sit inside.
///
/// With `held_back` (a direct run, see [`HeldBack`]) the projection is not written here: the
/// step records `after` there and the apply loop writes the flow's last one, guarded by the
/// projection its first step read, before the transaction can commit. A crash point between
/// the two changes nothing anyone sees: nothing of the transaction is committed then.
#[allow(clippy::too_many_arguments)]
fn apply_step_with(
    held: &mut Held<'_>,
    row: &InboxRecord,
    position: i64,
    from: &Projection,
    kind: Kind,
    after: &Projection,
    crash: &CrashSwitch,
    now_us: i64,
    unapplied: &mut Unapplied,
    held_back: Option<&mut Option<HeldBack>>,
) -> Result<StepOutcome> {
    if after.last_seq != row.seq {
        return Ok(StepOutcome::Raced);
    }
    match held_back {
        None => {
            if !write_projection(held, &row.flow_id, from, after)? {
                return Ok(StepOutcome::Raced);
            }
        }
        Some(Some(back)) if back.flow_id == row.flow_id && back.after == *from => back.after = *after,
        // Another flow's write still held back (the loop writes it before it moves on), or
        // this flow's from another start: never written over.
        Some(Some(_)) => return Ok(StepOutcome::Raced),
        Some(slot @ None) => {
            *slot = Some(HeldBack { flow_id: row.flow_id.clone(), stored: *from, after: *after });
        }
    }
    crash.reach(CrashPoint::ConsumerApplyAfterProjection);
    let order = unapplied.next_effect(held.conn())?;
    held.get(
        "INSERT INTO effect_log(position, applied, kind, held, applied_at_us) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![position, order, kind.as_str(), after.held, now_us])?;
    let marked = held
        .get("UPDATE inbox SET state = 'applied', reason = NULL WHERE rowid = ?1 AND state <> 'applied'")?
        .execute([position])?;
    if marked != 1 {
        return Err(StoreError::Inconsistent(format!(
            "inbox {} vanished or was applied while the projection was at seq {}",
            row.event_id, from.last_seq
        )));
    }
    unapplied.delta -= 1;
    unapplied.effects += 1;
    if row.state == InboxState::Blocked {
        unapplied.blocked(row.reason, None);
    }
    crash.reach(CrashPoint::ConsumerApplyAfterEffect);
    Ok(StepOutcome::Applied)
}

/// The flow's inbox rows in seq order.
pub fn flow_inbox(conn: &Connection, flow_id: &str) -> Result<Vec<InboxRecord>> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT ",
        inbox_columns!(with digest),
        " WHERE i.flow_id = ?1 ORDER BY i.seq"
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

/// Flows with a row blocked for one reason, in flow order (`state <> 'applied'` spelled as in
/// the partial index `inbox_unapplied`, so SQLite reads that index, not the history).
const BLOCKED_FLOWS_SQL: &str = "SELECT DISTINCT flow_id FROM inbox
     WHERE state <> 'applied' AND state = 'blocked' AND reason = ?1 AND flow_id > ?2
     ORDER BY flow_id LIMIT ?3";

/// Per flow with unapplied rows: how many, and the lowest unapplied seq (answered from the
/// partial index `inbox_unapplied` alone, already in flow order).
pub const BACKLOG_BY_FLOW_SQL: &str = "SELECT flow_id, count(*), min(seq) FROM inbox
     WHERE state <> 'applied' GROUP BY flow_id ORDER BY flow_id LIMIT ?1";

/// Unapplied rows over all flows (a count over the partial index, not the history).
pub const UNAPPLIED_COUNT_SQL: &str = "SELECT count(*) FROM inbox WHERE state <> 'applied'";

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
    use proto::flow::FlowState;
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
        let mut unapplied = Unapplied::default();
        let outcome = insert_pending(&tx, e, None, 1, Admission::Unlimited, &mut unapplied).unwrap();
        unapplied.write(&tx).unwrap();
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
        let mut unapplied = Unapplied::default();
        let outcome =
            apply_step(&tx, &row, &from, kind, &after, &CrashSwitch::default(), 2, &mut unapplied).unwrap();
        unapplied.write(&tx).unwrap();
        tx.commit().unwrap();
        Some(outcome)
    }

    fn receive_capped(conn: &mut Connection, e: &Event, cap: u64) -> ReceiveOutcome {
        let tx = db::begin_immediate(conn).unwrap();
        let mut unapplied = Unapplied::default();
        let outcome = insert_pending(&tx, e, None, 1, Admission::Cap(cap), &mut unapplied).unwrap();
        unapplied.write(&tx).unwrap();
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
        "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, state, received_at_us)
         VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ?6) ON CONFLICT DO NOTHING",
        "UPDATE inbox SET state = 'applied', reason = NULL WHERE event_id = ?1 AND state <> 'applied'",
        "INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(flow_id) DO NOTHING",
        "UPDATE projection SET last_seq = ?2, state = ?3, held = ?4, amount = ?5
         WHERE flow_id = ?1 AND last_seq = ?6 AND state = ?7 AND held = ?8 AND amount = ?9",
    ];

    #[test]
    fn a_version_3_file_loses_its_counter_triggers_and_keeps_its_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v3 = DbKind::consumer(3, SCHEMA, &[IDENTITY_SQL, PLAIN_CHECKS_SQL]);
        let conn = db::open(&path, &v3, db::OpenMode::Create).unwrap();
        // Rows written by a version 3 build: its triggers count them.
        for (id, seq) in [("A1", 1), ("A2", 2)] {
            let body = reference("A", seq).canonical_body();
            conn.execute(
                "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us)
                 VALUES (?1, 'A', ?2, 'reserved', 1, ?3, 'pending', 1)",
                params![id, seq, body],
            )
            .unwrap();
        }
        assert_eq!(unapplied_count(&conn).unwrap(), 2);
        drop(conn);
        let mut conn = open(&path).unwrap();
        let triggers: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_schema WHERE type = 'trigger'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(triggers, 0);
        assert_eq!(unapplied_count(&conn).unwrap(), 2, "the count survives the upgrade");
        // From now on the store keeps it: once per row, not twice.
        assert_eq!(receive(&mut conn, &reference("A", 3)), ReceiveOutcome::Accepted);
        assert_eq!(unapplied_count(&conn).unwrap(), 3);
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        let rows: i64 =
            conn.query_row("SELECT count(*) FROM inbox WHERE state <> 'applied'", [], |r| r.get(0)).unwrap();
        assert_eq!(unapplied_count(&conn).unwrap(), rows as u64);
        assert_eq!(rows, 2);
    }

    #[test]
    fn a_version_4_file_gains_the_committed_time_and_the_blocked_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v4 = DbKind::consumer(4, SCHEMA, &[IDENTITY_SQL, PLAIN_CHECKS_SQL, COUNTER_WITHOUT_TRIGGERS_SQL]);
        let conn = db::open(&path, &v4, db::OpenMode::Create).unwrap();
        // Rows as a version 4 build left them (it keeps `unapplied` itself).
        let b1 = event("B", 1, "reserved", 2, r#"{"units":3}"#);
        conn.execute(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, reason, received_at_us)
             VALUES ('A1', 'A', 1, 'reserved', 1, ?1, 'pending', NULL, 1),
                    ('B1', 'B', 1, 'reserved', 2, ?2, 'blocked', 'unsupported_schema', 1)",
            params![reference("A", 1).canonical_body(), b1.canonical_body()],
        )
        .unwrap();
        conn.execute("UPDATE backlog SET unapplied = 2", []).unwrap();
        drop(conn);
        let mut conn = open(&path).unwrap();
        let counts = backlog_counts(&mut conn).unwrap();
        assert_eq!(counts, BacklogCounts { unapplied: 2, blocked: [1, 0, 0], gap: 0, ready: 1 });
        assert_eq!(flow_inbox(&conn, "A").unwrap()[0].committed_at_us, None);
        // From now on the store stores the stamp and keeps the counts.
        let tx = db::begin_immediate(&mut conn).unwrap();
        let mut unapplied = Unapplied::default();
        let a2 = reference("A", 2);
        assert_eq!(
            insert_pending(&tx, &a2, Some(7), 8, Admission::Unlimited, &mut unapplied).unwrap(),
            ReceiveOutcome::Accepted
        );
        unapplied.write(&tx).unwrap();
        tx.commit().unwrap();
        assert_eq!(flow_inbox(&conn, "A").unwrap()[1].committed_at_us, Some(7));
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        assert_eq!(backlog_counts(&mut conn).unwrap().unapplied, 2);
        // A new file gets the same definitions.
        let fresh = open(&dir.path().join("new.db")).unwrap();
        let sql = |c: &Connection| -> Vec<String> {
            c.prepare("SELECT sql FROM sqlite_schema ORDER BY name")
                .unwrap()
                .query_map([], |r| r.get::<_, Option<String>>(0))
                .unwrap()
                .map(|r| r.unwrap().unwrap_or_default())
                .collect()
        };
        assert_eq!(sql(&fresh), sql(&conn));
    }

    #[test]
    fn a_version_5_file_moves_its_bodies_apart_and_compacts_only_applied_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v5 = DbKind::consumer(
            5,
            SCHEMA,
            &[IDENTITY_SQL, PLAIN_CHECKS_SQL, COUNTER_WITHOUT_TRIGGERS_SQL, COMMITTED_AT_AND_BLOCKED_SQL],
        );
        let mut conn = db::open(&path, &v5, db::OpenMode::Create).unwrap();
        for seq in 1..=2 {
            let tx = db::begin_immediate(&mut conn).unwrap();
            tx.execute(
                "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us)
                 VALUES (?1, 'A', ?2, 'reserved', 1, ?3, 'pending', 1)",
                params![format!("A{seq}"), seq, reference("A", seq).canonical_body()],
            )
            .unwrap();
            tx.execute("UPDATE backlog SET unapplied = unapplied + 1", []).unwrap();
            tx.commit().unwrap();
        }
        drop(conn);
        let mut conn = open(&path).unwrap();
        let rows = flow_inbox(&conn, "A").unwrap();
        assert_eq!(
            rows.iter().map(|r| r.body.clone()).collect::<Vec<_>>(),
            [reference("A", 1).canonical_body(), reference("A", 2).canonical_body()]
        );
        assert_eq!(inbox_position(&conn, "A2").unwrap(), Some(2), "positions are kept");
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        // Only the applied A1 is compacted; the pending A2 keeps its body.
        let shared = Mutex::new(conn);
        let report = compact_pass(&shared, i64::MAX, CrashSwitch::default(), 0).unwrap();
        assert_eq!((report.compacted, report.batches), (1, 1));
        assert_eq!(report.body_bytes, reference("A", 1).canonical_body().len() as u64);
        let mut conn = shared.into_inner().unwrap();
        let rows = flow_inbox(&conn, "A").unwrap();
        let digest = runtime::retention::body_digest(reference("A", 1).canonical_body().as_bytes());
        assert_eq!((rows[0].body.as_str(), rows[0].compacted), ("", Some(digest)));
        assert_eq!((rows[1].body.clone(), rows[1].compacted), (reference("A", 2).canonical_body(), None));
        // Answers stay exact against the tombstone; the position does not move.
        assert_answers_against_a1(&mut conn);
        assert_eq!(inbox_position(&conn, "A1").unwrap(), Some(1));
        assert_eq!(identity(&conn).unwrap().highest_position, 2);
        // Apply goes on; a pass with a cutoff before the apply compacts nothing.
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        let shared = Mutex::new(conn);
        assert_eq!(compact_pass(&shared, 0, CrashSwitch::default(), 0).unwrap().compacted, 0);
        let conn = shared.into_inner().unwrap();
        // A new file gets the same definitions.
        let fresh = open(&dir.path().join("new.db")).unwrap();
        let sql = |c: &Connection| -> Vec<String> {
            c.prepare("SELECT sql FROM sqlite_schema ORDER BY name")
                .unwrap()
                .query_map([], |r| r.get::<_, Option<String>>(0))
                .unwrap()
                .map(|r| r.unwrap().unwrap_or_default())
                .collect()
        };
        assert_eq!(sql(&fresh), sql(&conn));
    }

    /// A version 6 file with flows in every state gains the gap and ready counts, computed
    /// once from its rows, and keeps them from then on.
    #[test]
    fn a_version_6_file_gains_exact_gap_and_ready_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v6 = DbKind::consumer(
            6,
            SCHEMA,
            &[
                IDENTITY_SQL,
                PLAIN_CHECKS_SQL,
                COUNTER_WITHOUT_TRIGGERS_SQL,
                COMMITTED_AT_AND_BLOCKED_SQL,
                BODIES_APART_SQL,
            ],
        );
        let conn = db::open(&path, &v6, db::OpenMode::Create).unwrap();
        // G waits at a gap; R is ready; B is blocked; A applied 1 and waits for 2; Q applied 1
        // and 2 is ready; D applied everything it has.
        conn.execute_batch(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, state, reason, received_at_us) VALUES
                 ('G2', 'G', 2, 'confirmed', 1, 'pending', NULL, 1),
                 ('R1', 'R', 1, 'reserved', 1, 'pending', NULL, 1),
                 ('B1', 'B', 1, 'reserved', 2, 'blocked', 'unsupported_schema', 1),
                 ('A1', 'A', 1, 'reserved', 1, 'applied', NULL, 1),
                 ('A3', 'A', 3, 'released', 1, 'pending', NULL, 1),
                 ('Q1', 'Q', 1, 'reserved', 1, 'applied', NULL, 1),
                 ('Q2', 'Q', 2, 'confirmed', 1, 'pending', NULL, 1),
                 ('D1', 'D', 1, 'reserved', 1, 'applied', NULL, 1);
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES
                 ('A', 1, 'reserved', 3, 3), ('Q', 1, 'reserved', 3, 3), ('D', 1, 'reserved', 3, 3);
             UPDATE backlog SET unapplied = 5, blocked_unsupported_schema = 1;",
        )
        .unwrap();
        drop(conn);
        let mut conn = open(&path).unwrap();
        let counts = backlog_counts(&mut conn).unwrap();
        assert_eq!(counts, BacklogCounts { unapplied: 5, blocked: [1, 0, 0], gap: 2, ready: 2 });
        // Kept from then on: A2 fills A's gap.
        assert_eq!(receive(&mut conn, &reference("A", 2)), ReceiveOutcome::Accepted);
        assert_eq!(
            (backlog_counts(&mut conn).unwrap().gap, backlog_counts(&mut conn).unwrap().ready),
            (1, 3)
        );
    }

    /// A file as a build of schema `version` created it, with the reference events of
    /// `received` (flow, seq) accepted in that order.
    fn file_at(
        version: i32,
        received: &[(&str, u64)],
    ) -> (tempfile::TempDir, std::path::PathBuf, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let kind = DbKind::consumer(version, SCHEMA, KIND.upgrades.split_at(version as usize - 1).0);
        let mut conn = db::open(&path, &kind, db::OpenMode::Create).unwrap();
        for (flow, seq) in received {
            assert_eq!(receive(&mut conn, &reference(flow, *seq)), ReceiveOutcome::Accepted);
        }
        (dir, path, conn)
    }

    /// Receive's answers against flow A's stored A1, whole or compacted: the same event is
    /// `DUPLICATE`, another body under its id `ID_CONFLICT`, another id at its seq
    /// `SEQUENCE_CONFLICT`.
    fn assert_answers_against_a1(conn: &mut Connection) {
        assert_eq!(receive(conn, &reference("A", 1)), ReceiveOutcome::Duplicate);
        let changed = event("A", 1, "reserved", 1, r#"{"amount":4}"#);
        assert_eq!(receive(conn, &changed), ReceiveOutcome::IdConflict);
        let other_id = Event { event_id: "X".into(), ..reference("A", 1) };
        assert_eq!(receive(conn, &other_id), ReceiveOutcome::SequenceConflict { held_by: "A1".into() });
    }

    /// Whether `table` has a column named `column`.
    fn has_column(conn: &Connection, table: &str, column: &str) -> bool {
        let n: i64 = conn
            .query_row("SELECT count(*) FROM pragma_table_info(?1) WHERE name = ?2", [table, column], |r| {
                r.get(0)
            })
            .unwrap();
        n > 0
    }

    /// Every row of the `effect` view, in apply order: (apply order, event id, flow id, seq,
    /// kind, held).
    fn effect_rows(conn: &Connection) -> Vec<(i64, String, String, i64, String, i64)> {
        conn.prepare("SELECT rowid, event_id, flow_id, seq, kind, held FROM effect ORDER BY rowid")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    /// `PRAGMA integrity_check` answers `ok`.
    fn assert_intact(conn: &Connection) {
        let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
        assert_eq!(check, "ok");
    }

    /// The rows of a two-integer query.
    fn int_pairs(conn: &Connection, sql: &str) -> Vec<(i64, i64)> {
        conn.prepare(sql)
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    /// A version 7 file's effects move to `effect_log` keyed by their inbox rows' positions,
    /// in the same apply order (here not the receive order), and `effect` reads as before;
    /// new steps append to the log, and a second effect for one inbox row is refused.
    #[test]
    fn a_version_7_file_keeps_its_effects_in_apply_order_keyed_by_position() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v7 = DbKind::consumer(7, SCHEMA, KIND.upgrades.split_at(6).0);
        let mut conn = db::open(&path, &v7, db::OpenMode::Create).unwrap();
        // Received B1, A2, A1; applied B1, A1, A2 (the effects' rowids).
        for (flow, seq) in [("B", 1), ("A", 2), ("A", 1)] {
            assert_eq!(receive(&mut conn, &reference(flow, seq)), ReceiveOutcome::Accepted);
        }
        // Applied as a version 7 build did: effect rows with the ids, in apply order.
        conn.execute_batch(
            "INSERT INTO effect(event_id, flow_id, seq, kind, held, applied_at_us) VALUES
                 ('B1', 'B', 1, 'reserved', 3, 1), ('A1', 'A', 1, 'reserved', 3, 2),
                 ('A2', 'A', 2, 'confirmed', 3, 3);
             UPDATE inbox SET state = 'applied', applied_at_us = 3;
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES
                 ('B', 1, 'reserved', 3, 3), ('A', 2, 'confirmed', 3, 3);
             UPDATE backlog SET unapplied = 0, gap_flows = 0, ready_flows = 0;",
        )
        .unwrap();
        let before = effect_rows(&conn);
        assert_eq!(before.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(), ["B1", "A1", "A2"]);
        drop(conn);
        let mut conn = open(&path).unwrap();
        assert_eq!(effect_rows(&conn), before);
        let positions = int_pairs(&conn, "SELECT applied, position FROM effect_log ORDER BY applied");
        assert_eq!(positions, [(1, 1), (2, 3), (3, 2)]);
        assert_eq!(flow_effects(&conn, "A").unwrap().iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(receive(&mut conn, &reference("A", 3)), ReceiveOutcome::Accepted);
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        assert_eq!(flow_effects(&conn, "A").unwrap().iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
        let twice = conn
            .execute(
                "INSERT INTO effect_log(position, applied, kind, held, applied_at_us) VALUES (1, 9, 'reserved', 3, 1)",
                [],
            )
            .unwrap_err();
        assert!(twice.to_string().contains("UNIQUE"), "{twice}");
    }

    #[test]
    fn a_version_8_file_keeps_its_projections_in_a_table_keyed_by_flow() {
        let (_dir, path, conn) = file_at(8, &[("B", 1), ("A", 1), ("A", 2)]);
        // Applied as a version 8 build did.
        conn.execute_batch(
            "INSERT INTO effect_log(position, kind, held, applied_at_us) VALUES
                 (1, 'reserved', 3, 1), (2, 'reserved', 3, 2), (3, 'confirmed', 3, 3);
             UPDATE inbox SET state = 'applied', applied_at_us = 3;
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES
                 ('B', 1, 'reserved', 3, 3), ('A', 2, 'confirmed', 3, 3);
             UPDATE backlog SET unapplied = 0;",
        )
        .unwrap();
        type ProjectionRow = (String, i64, String, i64, i64);
        let projections = |conn: &Connection| -> Vec<ProjectionRow> {
            conn.prepare("SELECT flow_id, last_seq, state, held, amount FROM projection ORDER BY flow_id")
                .unwrap()
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        let before = projections(&conn);
        assert_eq!(before.len(), 2);
        let ddl = |conn: &Connection| -> String {
            conn.query_row("SELECT sql FROM sqlite_schema WHERE name = 'projection'", [], |r| r.get(0))
                .unwrap()
        };
        assert!(!ddl(&conn).contains("WITHOUT ROWID"));
        drop(conn);
        let mut conn = open(&path).unwrap();
        assert!(ddl(&conn).contains("WITHOUT ROWID"), "{}", ddl(&conn));
        assert_eq!(projections(&conn), before);
        assert_eq!(receive(&mut conn, &reference("A", 3)), ReceiveOutcome::Accepted);
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        assert_eq!(projection(&conn, "A").unwrap().last_seq, 3);
        assert_eq!(receive(&mut conn, &reference("C", 1)), ReceiveOutcome::Accepted);
        assert_eq!(step(&mut conn, "C"), Some(StepOutcome::Applied));
        assert_eq!(projections(&conn).len(), 3);
        assert_intact(&conn);
    }

    /// A version 9 file's effect log is rebuilt keyed by position: every effect reads as
    /// before, in the same apply order (here not the receive order), `backlog.effects` counts
    /// them, a new step is numbered after them, and a second effect for one inbox row is
    /// still refused.
    #[test]
    fn a_version_9_file_keys_its_effect_log_by_position_and_keeps_the_apply_order() {
        // Received B1, A2, A1 (positions 1, 2, 3); applied B1, A1 (apply order 1, 2).
        let (_dir, path, conn) = file_at(9, &[("B", 1), ("A", 2), ("A", 1)]);
        // Applied B1 then A1 as a version 9 build did (its log's ids are the apply order).
        conn.execute_batch(
            "INSERT INTO effect_log(position, kind, held, applied_at_us) VALUES
                 (1, 'reserved', 3, 1), (3, 'reserved', 3, 2);
             UPDATE inbox SET state = 'applied', applied_at_us = 2 WHERE rowid IN (1, 3);
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES
                 ('B', 1, 'reserved', 3, 3), ('A', 1, 'reserved', 3, 3);
             UPDATE backlog SET unapplied = 1, ready_flows = 1;",
        )
        .unwrap();
        let before = effect_rows(&conn);
        assert_eq!(before.iter().map(|e| (e.0, e.1.as_str())).collect::<Vec<_>>(), [(1, "B1"), (2, "A1")]);
        let indexes = |conn: &Connection| -> i64 {
            conn.query_row(
                "SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'effect_log'",
                [],
                |r| r.get(0),
            )
            .unwrap()
        };
        assert_eq!(indexes(&conn), 1, "version 9: the position's unique index");
        drop(conn);
        let mut conn = open(&path).unwrap();
        assert_eq!(indexes(&conn), 0);
        assert_eq!(effect_rows(&conn), before);
        let stored: i64 = conn.query_row("SELECT effects FROM backlog", [], |r| r.get(0)).unwrap();
        assert_eq!(stored, 2);
        let keyed = int_pairs(&conn, "SELECT rowid, applied FROM effect_log ORDER BY rowid");
        assert_eq!(keyed, [(1, 1), (3, 2)], "(position, apply order)");
        // A2 (position 2) applies third.
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        let after = effect_rows(&conn);
        assert_eq!(
            after.iter().map(|e| (e.0, e.1.as_str())).collect::<Vec<_>>(),
            [(1, "B1"), (2, "A1"), (3, "A2")]
        );
        let stored: i64 = conn.query_row("SELECT effects FROM backlog", [], |r| r.get(0)).unwrap();
        assert_eq!(stored, 3);
        assert_eq!(flow_effects(&conn, "A").unwrap().iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
        let twice = conn
            .execute(
                "INSERT INTO effect_log(position, applied, kind, held, applied_at_us) VALUES (3, 4, 'reserved', 3, 1)",
                [],
            )
            .unwrap_err();
        assert!(twice.to_string().contains("UNIQUE"), "{twice}");
        assert_intact(&conn);
    }

    /// A version 10 file's tombstones keep their digests, moved to `inbox_digest`; the rows
    /// lose the column, and Receive answers against them as before.
    #[test]
    fn a_version_10_file_moves_its_digests_apart_and_answers_as_before() {
        // Received A1, A2 (positions 1, 2); A1 applied and compacted as a version 10 build did.
        let (_dir, path, conn) = file_at(10, &[("A", 1), ("A", 2)]);
        let digest = runtime::retention::body_digest(reference("A", 1).canonical_body().as_bytes());
        conn.execute_batch(
            "INSERT INTO effect_log(position, applied, kind, held, applied_at_us) VALUES (1, 1, 'reserved', 3, 1);
             UPDATE inbox SET state = 'applied', applied_at_us = 1 WHERE rowid = 1;
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES ('A', 1, 'reserved', 3, 3);
             UPDATE backlog SET unapplied = 1, effects = 1;
             DELETE FROM inbox_body WHERE position = 1;",
        )
        .unwrap();
        conn.execute("UPDATE inbox SET body_sha256 = ?1 WHERE rowid = 1", [&digest[..]]).unwrap();
        drop(conn);
        let mut conn = open(&path).unwrap();
        assert!(!has_column(&conn, "inbox", "body_sha256"), "the column is dropped");
        let rows = flow_inbox(&conn, "A").unwrap();
        assert_eq!((rows[0].body.as_str(), rows[0].compacted), ("", Some(digest)));
        assert_eq!((rows[1].body.clone(), rows[1].compacted), (reference("A", 2).canonical_body(), None));
        assert_answers_against_a1(&mut conn);
        // A2 applies, and is compacted into the new table.
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        let shared = Mutex::new(conn);
        assert_eq!(compact_pass(&shared, i64::MAX, CrashSwitch::default(), 0).unwrap().compacted, 1);
        let conn = shared.into_inner().unwrap();
        let rows = flow_inbox(&conn, "A").unwrap();
        let second = runtime::retention::body_digest(reference("A", 2).canonical_body().as_bytes());
        assert_eq!((rows[1].body.as_str(), rows[1].compacted), ("", Some(second)));
        assert_eq!(int_pairs(&conn, "SELECT position, length(sha256) FROM inbox_digest"), [(1, 32), (2, 32)]);
        assert_intact(&conn);
    }

    /// A version 11 file's applied rows lose their own time and keep their effect's: the
    /// retention cutoff is judged by it, and new steps still apply.
    #[test]
    fn a_version_11_file_keeps_each_applied_time_in_its_effect() {
        // Received A1, A2, B1 (positions 1, 2, 3); A1 applied at 5 and B1 at 9, as a version
        // 11 build wrote it.
        let (_dir, path, conn) = file_at(11, &[("A", 1), ("A", 2), ("B", 1)]);
        conn.execute_batch(
            "INSERT INTO effect_log(position, applied, kind, held, applied_at_us) VALUES
                 (1, 1, 'reserved', 3, 5), (3, 2, 'reserved', 3, 9);
             UPDATE inbox SET state = 'applied', applied_at_us = 5 WHERE rowid = 1;
             UPDATE inbox SET state = 'applied', applied_at_us = 9 WHERE rowid = 3;
             INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES
                 ('A', 1, 'reserved', 3, 3), ('B', 1, 'reserved', 3, 3);
             UPDATE backlog SET unapplied = 1, effects = 2;",
        )
        .unwrap();
        drop(conn);
        let conn = open(&path).unwrap();
        assert!(!has_column(&conn, "inbox", "applied_at_us"), "the column is dropped");
        assert_eq!(
            int_pairs(&conn, "SELECT rowid, applied_at_us FROM effect ORDER BY rowid"),
            [(1, 5), (2, 9)]
        );
        // A cutoff of 9 compacts A1 (applied at 5) and not B1 (applied at 9), nor the waiting A2.
        let shared = Mutex::new(conn);
        let report = compact_pass(&shared, 9, CrashSwitch::default(), 0).unwrap();
        assert_eq!(report.compacted, 1);
        let mut conn = shared.into_inner().unwrap();
        assert_eq!(int_pairs(&conn, "SELECT position, length(sha256) FROM inbox_digest"), [(1, 32)]);
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        let states: Vec<String> = conn
            .prepare("SELECT state FROM inbox ORDER BY rowid")
            .unwrap()
            .query_map([], |r| r.get::<_, String>(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(states, ["applied", "applied", "applied"]);
        assert_intact(&conn);
    }

    #[test]
    fn a_version_2_file_is_upgraded_and_no_step_builds_a_temporary_btree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let v2 = DbKind::consumer(2, SCHEMA, &[IDENTITY_SQL]);
        let conn = db::open(&path, &v2, db::OpenMode::Create).unwrap();
        // A row as a version 2 build wrote it (its triggers count it).
        conn.execute(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us)
             VALUES ('A1', 'A', 1, 'reserved', 1, ?1, 'pending', 1)",
            [reference("A", 1).canonical_body()],
        )
        .unwrap();
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

    /// The statements a step runs per event are prepared once: a plan that depends on the
    /// bound values makes SQLite re-prepare the statement at each run (it did for the row
    /// read with a join to `inbox_body`).
    #[test]
    fn the_row_reads_are_never_re_prepared() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        for flow in ["A", "B", "C"] {
            receive(&mut conn, &reference(flow, 1));
        }
        for sql in [
            INBOX_AT_SEQ_SQL,
            INBOX_FROM_SEQ_SQL,
            concat!("SELECT ", inbox_columns!(with digest), " WHERE i.flow_id = ?1 ORDER BY i.seq"),
        ] {
            let mut stmt = conn.prepare(sql).unwrap();
            for flow in ["A", "B", "C", "A"] {
                let n = if sql.contains("?2") {
                    stmt.query(params![flow, 1]).unwrap().mapped(raw_inbox).count()
                } else {
                    stmt.query(params![flow]).unwrap().mapped(raw_inbox).count()
                };
                assert_eq!(n, 1, "{sql}");
            }
            assert_eq!(stmt.get_status(rusqlite::StatementStatus::RePrepare), 0, "{sql}");
        }
    }

    /// The step's row read is one seek of the `(flow_id, seq)` key, already in seq order.
    #[test]
    fn the_next_row_is_one_seek_of_the_flow_seq_key() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open(&dir.path().join("c.db")).unwrap();
        let plans = [
            ("from seq", plan(&conn, INBOX_FROM_SEQ_SQL, params!["A", 1])),
            ("ahead, bare", plan(&conn, INBOX_AHEAD_BARE_SQL, params!["A", 1, 4])),
        ];
        for (name, plan) in plans {
            assert!(
                plan.contains("SEARCH i USING INDEX sqlite_autoindex_inbox_2 (flow_id=? AND seq>?)"),
                "{name}: {plan}"
            );
            assert!(!plan.contains("TEMP B-TREE"), "{name}: {plan}");
        }
    }

    #[test]
    fn receive_outcomes() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("c.db")).unwrap();
        assert_eq!(receive(&mut conn, &reference("A", 1)), ReceiveOutcome::Accepted);
        assert_answers_against_a1(&mut conn);
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
        // An applied row where the projection says the next seq waits is reported, not skipped.
        assert_eq!(step(&mut conn, "A"), Some(StepOutcome::Applied));
        let err = next_to_apply(&conn, "A", 1).unwrap_err();
        assert!(matches!(err, StoreError::Inconsistent(_)), "{err}");
        assert_eq!(next_to_apply(&conn, "A", 2).unwrap(), Next::Gap);
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
            apply_step(&tx, &row, &from, kind, &after, &CrashSwitch::default(), 3, &mut Unapplied::default())
                .unwrap(),
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
            "CREATE TRIGGER no_effects BEFORE INSERT ON effect_log BEGIN SELECT RAISE(ABORT, 'effects frozen'); END;",
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
        let err =
            apply_step(&tx, &row, &from, kind, &after, &CrashSwitch::default(), 3, &mut Unapplied::default())
                .unwrap_err();
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
            apply_step(&tx, row, &from, kind, &after, &CrashSwitch::default(), 3, &mut Unapplied::default())
                .unwrap(),
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
            (RECEIVED_FACTS_SQL, plan(&conn, RECEIVED_FACTS_SQL, params!["A", 1])),
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
