//! The SQLite backend of the producer store: every rusqlite statement on producer.db.
//! `advance` makes the flow update and its outbox row one `BEGIN IMMEDIATE` transaction (the
//! writer's, see [`writer`]); the relay reads and marks outbox rows only through the
//! functions below, so this module is the one owner of the file's invariants.

mod writer;

use std::path::Path;
use std::sync::{Arc, Mutex};

use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, DbError, DbKind, Held, OpenMode, Steps};
use proto::flow::FlowState;
use runtime::metrics::{GaugeReader, GaugeSample};
use rusqlite::{Connection, OptionalExtension, Transaction, params};
use tokio::sync::{mpsc, oneshot};

use super::{
    AdvanceReply, Backlog, CompactReport, Decision, DeliveryAnswer, FlowRecord, LOST_ACCEPTED,
    LOST_BY_CONSUMER, Lost, LostRows, MARK_BATCHES, NO_ANSWER, OutboxRecord, ProbedRow, Recorded, Role,
    StoreError, add_probed, decide,
};
use crate::request::AdvanceCommand;

/// producer.db: identity and schema (version 2: version 1, then the database identity and
/// which consumer database accepted each row, at which position; version 3: the flow state
/// check without an `IN` list; version 4: the backlog counter kept by the store, not by
/// triggers; version 5: bodies in their own table, so compaction can drop them; version 6:
/// consumer databases named by an integer key in each accepted row; version 7: `flow` stored
/// in the b-tree of its key; version 8: no foreign key from `outbox` to `flow`; version 9:
/// tombstones' digests in a table of their own).
pub const KIND: DbKind = DbKind::producer(
    9,
    SCHEMA,
    &[
        IDENTITY_SQL,
        PLAIN_CHECKS_SQL,
        COUNTER_WITHOUT_TRIGGERS_SQL,
        BODIES_APART_SQL,
        CONSUMER_KEYS_SQL,
        FLOW_BY_ID_SQL,
        NO_FLOW_FOREIGN_KEY_SQL,
        DIGESTS_APART_SQL,
    ],
);

/// Version 9 (issues 16 and 18): a compacted row's digest is a row of `outbox_digest`, keyed
/// by the outbox row's id, instead of the column `outbox.body_sha256`. Writing the column
/// grew every compacted row by 33 bytes, so compaction split about every outbox page it
/// rewrote (rows are packed in id order) and left them half empty; an insert in id order
/// appends to the digests' b-tree instead (consumer.db version 11 does the same, with the
/// measurement). Rows the relay still sends never have a digest, so its page reads none.
/// The digests are moved once, and the column dropped.
const DIGESTS_APART_SQL: &str = "
CREATE TABLE outbox_digest(
    id INTEGER PRIMARY KEY,
    sha256 BLOB NOT NULL CHECK(length(sha256) = 32)
);
INSERT INTO outbox_digest(id, sha256)
SELECT id, body_sha256 FROM outbox WHERE body_sha256 IS NOT NULL ORDER BY id;
ALTER TABLE outbox DROP COLUMN body_sha256;
";

/// Version 8 (issue 18): `outbox.flow_id` no longer declares a foreign key to `flow`. Its
/// check was a seek of `flow` by the text key on every outbox insert (~2.8k instructions per
/// insert in the `sqlite3` shell under callgrind, the same 30 000 inserts with and without
/// it; ~1.7k per event in the producer by `bench --callgrind`), for a row the store has just
/// written: [`advance`] is the only writer of outbox rows, and it inserts one only in the
/// transaction that inserted or moved that very flow's row (an `INSERT`, or an `UPDATE`
/// required to change one row), and flow rows are never deleted. The PostgreSQL producer
/// dropped the same key for the same reason (its version 4); `foreign_keys` stays on for
/// every connection (SPEC §2). The definition is edited in place (`writable_schema`, as in
/// version 3): a constraint is not part of the stored rows, so nothing is copied.
const NO_FLOW_FOREIGN_KEY_SQL: &str = "
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
SET sql = replace(sql, 'flow_id TEXT NOT NULL REFERENCES flow(flow_id),', 'flow_id TEXT NOT NULL,')
WHERE type = 'table' AND name = 'outbox';
PRAGMA writable_schema = RESET;
";

/// Version 7 (issues 16 and 18): `flow` is a `WITHOUT ROWID` table, stored in the b-tree of
/// its `flow_id` key. As a rowid table it kept each flow id twice (in the row and in the key's
/// index), and every `Advance` took two seeks to read its flow and wrote two b-trees to step
/// it. The rows are copied once; `outbox.flow_id` refers to the new table by name (the
/// upgrade runs with foreign keys off and checks them all before it commits).
const FLOW_BY_ID_SQL: &str = "
CREATE TABLE flow_v7(
    flow_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL CHECK(seq >= 1),
    state TEXT NOT NULL CHECK(state = 'reserved' OR state = 'confirmed' OR state = 'released'),
    amount INTEGER NOT NULL CHECK(amount >= 1)
) WITHOUT ROWID;
INSERT INTO flow_v7(flow_id, seq, state, amount) SELECT flow_id, seq, state, amount FROM flow;
DROP TABLE flow;
ALTER TABLE flow_v7 RENAME TO flow;
";

/// Version 6: `outbox.accepted_by` holds the integer key of the consumer database in
/// `consumer_database` instead of its 32-character id. Every accepted row kept that id twice
/// for ever (in the row and in `outbox_accepted_by`), ~62 of the ~270 bytes a finished
/// outbox row keeps after compaction (`dbstat`, 30 000 events); a key is one byte in each.
/// The CHECK makes a build that still writes the text id (an older relay left running across
/// the upgrade) fail its write instead of mixing the two. The column is rebuilt once (added,
/// filled, the old one dropped, renamed), its index dropped and made again around it.
const CONSUMER_KEYS_SQL: &str = "
CREATE TABLE consumer_database(
    id INTEGER PRIMARY KEY,
    database_id TEXT NOT NULL UNIQUE
);
INSERT INTO consumer_database(database_id)
SELECT DISTINCT accepted_by FROM outbox WHERE accepted_by IS NOT NULL ORDER BY accepted_by;
DROP INDEX outbox_accepted_by;
ALTER TABLE outbox ADD COLUMN accepted_by_key INTEGER
    CHECK(accepted_by_key IS NULL OR typeof(accepted_by_key) = 'integer');
UPDATE outbox SET accepted_by_key =
    (SELECT c.id FROM consumer_database c WHERE c.database_id = outbox.accepted_by)
WHERE accepted_by IS NOT NULL;
ALTER TABLE outbox DROP COLUMN accepted_by;
ALTER TABLE outbox RENAME COLUMN accepted_by_key TO accepted_by;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
";

/// The key `consumer_database` gives a consumer database's id; 0, which no row holds, for an
/// id never recorded (so it matches no row, and every recorded one is another database).
fn consumer_key(conn: &Connection, consumer_db: &str) -> Result<i64, StoreError> {
    Ok(conn
        .prepare_cached("SELECT id FROM consumer_database WHERE database_id = ?1")?
        .query_row([consumer_db], |r| r.get(0))
        .optional()?
        .unwrap_or(0))
}

/// Inside a write transaction: the key of a consumer database's id, recorded first if new
/// (a read in the common case: every mark transaction asks).
fn recorded_consumer_key(tx: &Transaction<'_>, consumer_db: &str) -> Result<i64, StoreError> {
    match consumer_key(tx, consumer_db)? {
        0 => {
            tx.prepare_cached("INSERT INTO consumer_database(database_id) VALUES (?1)")?
                .execute([consumer_db])?;
            Ok(tx.last_insert_rowid())
        }
        key => Ok(key),
    }
}

/// Version 5 (retention): each outbox row gets a stable `id` (an `INTEGER PRIMARY KEY`, which
/// `VACUUM` never renumbers) and its canonical body moves to `outbox_body`, keyed by that id;
/// `body_sha256` holds the body's digest once compaction dropped it. Measured on 100 000
/// events (three-step flows, ~110-byte bodies) compacted as they were accepted
/// (`auto_vacuum = INCREMENTAL`): without compaction the file ends at 385 bytes per event;
/// setting an inline body to NULL (digest added) at 382, nothing saved (a shrunk row frees
/// space inside its page, and new rows, appended at the end of the rowid order, never reuse
/// it); deleting the body rows (whole pages, in id order) at 289, the tombstone and its index
/// entries. The digest is written at compaction, not at insert (289 against 294 bytes per
/// event, and the `Advance` path computes nothing more). The table is rebuilt once, in id
/// order.
const BODIES_APART_SQL: &str = "
CREATE TABLE outbox_v5(
    id INTEGER PRIMARY KEY,
    event_id TEXT NOT NULL UNIQUE,
    flow_id TEXT NOT NULL REFERENCES flow(flow_id),
    seq INTEGER NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    accepted INTEGER NOT NULL DEFAULT 0 CHECK(accepted IN (0,1)),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_outcome TEXT,
    committed_at_us INTEGER NOT NULL,
    accepted_at_us INTEGER,
    accepted_by TEXT,
    accepted_position INTEGER,
    body_sha256 BLOB CHECK(body_sha256 IS NULL OR length(body_sha256) = 32),
    UNIQUE(flow_id, seq)
);
-- A row of `outbox` has its body here until compaction deletes it (then `body_sha256` is set).
CREATE TABLE outbox_body(
    id INTEGER PRIMARY KEY,
    body TEXT NOT NULL
);
INSERT INTO outbox_v5(id, event_id, flow_id, seq, kind, schema, accepted, attempts, last_outcome,
                      committed_at_us, accepted_at_us, accepted_by, accepted_position)
SELECT rowid, event_id, flow_id, seq, kind, schema, accepted, attempts, last_outcome,
       committed_at_us, accepted_at_us, accepted_by, accepted_position
FROM outbox ORDER BY rowid;
INSERT INTO outbox_body(id, body) SELECT rowid, body FROM outbox ORDER BY rowid;
DROP TABLE outbox;
ALTER TABLE outbox_v5 RENAME TO outbox;
CREATE INDEX outbox_unaccepted ON outbox(flow_id, seq) WHERE accepted = 0;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
";

/// Version 4: `backlog.unaccepted` is kept exact by the store functions that change it
/// ([`Unaccepted`]: one UPDATE per transaction, before its commit), not by a trigger per row.
/// A trigger on `outbox` made every insert and every answer's UPDATE a multi-statement write
/// that opens its own statement journal (every page it touches copied first) and ran an
/// UPDATE of the counter per row. The counter is exact when the triggers are dropped, and
/// stays exact: every write of `outbox.accepted` is in this module.
const COUNTER_WITHOUT_TRIGGERS_SQL: &str = "
DROP TRIGGER backlog_insert;
DROP TRIGGER backlog_accepted;
DROP TRIGGER backlog_unmarked;
";

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

impl From<rusqlite::Error> for StoreError {
    /// Busy or locked is retryable; anything else (a constraint, a trigger's `RAISE`, I/O) is
    /// a storage failure, an outage when the file itself failed (full, I/O, read-only). The
    /// step is named by the caller ([`StoreError::during`]).
    fn from(e: rusqlite::Error) -> StoreError {
        use rusqlite::ErrorCode::{DiskFull, ReadOnly, SystemIoFailure};
        if db::is_busy(&e) {
            StoreError::Unavailable { what: "sqlite", detail: e.to_string() }
        } else {
            let outage = matches!(e.sqlite_error_code(), Some(DiskFull | SystemIoFailure | ReadOnly));
            StoreError::Storage { what: "sqlite", detail: e.to_string(), outage }
        }
    }
}

/// Opens producer.db with the shared settings (`Create` for the server, `Existing` for the
/// relay, which refuses a file the producer has not created).
pub fn open(path: &Path, mode: OpenMode) -> Result<Connection, DbError> {
    db::open_logged(path, &KIND, mode)
}

/// The SQLite producer store: one connection used on blocking threads only (the writer
/// thread for `advance`, `spawn_blocking` for the rest), and the file's path for the
/// metrics' own read-only connection.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: std::path::PathBuf,
    crash: CrashSwitch,
    writer: Option<mpsc::Sender<writer::AdvanceJob>>,
    /// The server's: whether producer.db takes its commits (see [`writer::StorageWatch`]).
    files: Option<Arc<writer::StorageWatch>>,
}

impl SqliteStore {
    /// Opens (the server: creating) producer.db; the server's role also starts the writer.
    pub fn open(path: &Path, role: Role, crash: CrashSwitch) -> Result<SqliteStore, runtime::OpenError> {
        let conn = Arc::new(Mutex::new(open(path, role.mode())?));
        let (writer, files) = match role {
            Role::Server { max_batch, max_unaccepted } => {
                tracing::info!(max_batch, ?max_unaccepted, "advance writer");
                let files = Arc::new(writer::StorageWatch::new(path));
                let jobs =
                    writer::spawn(Arc::clone(&conn), crash, max_batch, max_unaccepted, Arc::clone(&files))?;
                writer::spawn_prober(Arc::clone(&conn), Arc::clone(&files));
                (Some(jobs), Some(files))
            }
            Role::Relay => (None, None),
        };
        Ok(SqliteStore { conn, path: path.to_owned(), crash, writer, files })
    }

    /// The server's health from its storage: `false` while commits fail, and once producer.db
    /// was found deleted or replaced under it.
    pub(super) fn serving(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        self.files.as_ref().map(|f| f.serving())
    }

    async fn blocking<T, F>(&self, what: &'static str, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, CrashSwitch) -> Result<T, StoreError> + Send + 'static,
    {
        let crash = self.crash;
        runtime::blocking::with_locked(&self.conn, move |conn| f(conn, crash))
            .await
            .map_err(|e| StoreError::storage(what, e.to_string()))?
            .map_err(|e| e.during(what))
    }

    pub(super) async fn advance(&self, cmd: AdvanceCommand) -> Result<AdvanceReply, StoreError> {
        let Some(writer) = &self.writer else {
            return Err(StoreError::NotSupported("advance: this store was opened for the relay"));
        };
        let writer_gone =
            || StoreError::Unavailable { what: "advance", detail: "the writer thread stopped".into() };
        let (reply, answer) = oneshot::channel();
        writer.send(writer::AdvanceJob { cmd, reply }).await.map_err(|_| writer_gone())?;
        answer.await.map_err(|_| writer_gone())?
    }

    pub(super) async fn flow(&self, flow_id: String) -> Result<(FlowRecord, Vec<OutboxRecord>), StoreError> {
        self.blocking("get_flow", move |conn, _| {
            // One read transaction so the flow and its rows are one snapshot.
            let tx = conn.transaction()?;
            let flow = flow_record(&tx, &flow_id)?;
            let rows = flow_outbox(&tx, &flow_id)?;
            Ok((flow, rows))
        })
        .await
    }

    pub(super) fn backlog_gauges<G>(&self, to_gauges: G) -> GaugeReader
    where
        G: Fn(Backlog) -> Vec<GaugeSample> + Send + Sync + 'static,
    {
        runtime::metrics::gauges_from_db(self.path.clone(), move |conn| backlog(conn).map(&to_gauges))
    }

    pub(super) async fn database_id(&self) -> Result<String, StoreError> {
        self.blocking("read the database identity", |conn, _| database_id(conn)).await
    }

    pub(super) async fn unaccepted_after(
        &self,
        after: (String, u64),
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        self.blocking("read unaccepted rows", move |conn, _| {
            unaccepted_after(conn, (&after.0, after.1), limit)
        })
        .await
    }

    pub(super) async fn outbox_row(&self, event_id: String) -> Result<Option<OutboxRecord>, StoreError> {
        self.blocking("read an outbox row", move |conn, _| outbox_row(conn, &event_id)).await
    }

    pub(super) async fn record_deliveries(
        &self,
        answers: Vec<Recorded>,
        consumer_db: Option<String>,
    ) -> Result<(), StoreError> {
        self.blocking("record answers", move |conn, crash| {
            let started = std::time::Instant::now();
            let tx = db::begin_immediate(conn)?;
            let now = runtime::now_us();
            let mut marked = false;
            let mut unaccepted = Unaccepted::new(None);
            let key = consumer_db.as_deref().map(|db| recorded_consumer_key(&tx, db)).transpose()?;
            let mut held = Held::new(&tx);
            for answer in &answers {
                let accepted_by =
                    key.zip(answer.accepted_by(consumer_db.as_deref())).map(|(key, by)| (key, by.position));
                record_delivery(
                    &mut held,
                    &answer.event_id,
                    answer.row_id,
                    answer.answer,
                    now,
                    accepted_by,
                    &mut unaccepted,
                )?;
                marked |= answer.answer.holds_event();
            }
            drop(held);
            unaccepted.write(&tx)?;
            if marked {
                crash.reach(CrashPoint::RelayAfterMark);
            }
            tx.commit()?;
            MARK_BATCHES.record_timed(answers.len(), started);
            tracing::debug!(answers = answers.len(), "answers recorded");
            if marked {
                crash.reach(CrashPoint::RelayAfterMarkCommit);
            }
            Ok(())
        })
        .await
    }

    pub(super) async fn record_unanswered(&self, event_ids: Vec<String>) -> Result<(), StoreError> {
        self.blocking("record unanswered sends", move |conn, _| {
            let tx = db::begin_immediate(conn)?;
            for id in &event_ids {
                record_unanswered_send(&tx, id)?;
            }
            Ok(tx.commit()?)
        })
        .await
    }

    /// `accept`: an operator accepted the loss of the compacted lost rows (see
    /// [`super::ProducerStore::accept_lost`]); otherwise they make it unmark nothing.
    pub(super) async fn resolve_lost(
        &self,
        consumer_db: String,
        lost: Lost,
        accept: bool,
    ) -> Result<LostRows, StoreError> {
        self.blocking("unmark rows the consumer lost", move |conn, _| {
            let tx = db::begin_immediate(conn)?;
            // Probes judge this database's rows: no row is lost for being above a position.
            let highest_position = match &lost {
                Lost::Beyond(highest) => *highest,
                Lost::Probed(_) => NOTHING_BEYOND,
            };
            let key = consumer_key(&tx, &consumer_db)?;
            let mut found = lost_rows(&tx, key, highest_position)?;
            let probed = match &lost {
                Lost::Beyond(_) => Vec::new(),
                Lost::Probed(pairs) => still_recorded(&tx, key, pairs)?,
            };
            add_probed(&mut found, &probed);
            // Rows compacted to tombstones cannot be sent again: unmark nothing, the caller
            // stops, unless an operator accepted their loss.
            if found.other_database + found.beyond_history > 0 && (found.compacted == 0 || accept) {
                if found.compacted > 0 {
                    found.loss_accepted = accept_compacted(&tx, key, highest_position, &probed)?;
                }
                let mut unaccepted = Unaccepted::new(None);
                unmark_lost(&tx, key, highest_position, &mut unaccepted)?;
                unmark_probed(&tx, key, &probed, &mut unaccepted)?;
                unaccepted.write(&tx)?;
                tx.commit()?;
            }
            Ok(found)
        })
        .await
    }

    pub(super) async fn recorded_consumer_db(&self) -> Result<Option<String>, StoreError> {
        self.blocking("read the consumer database of accepted rows", |conn, _| {
            Ok(conn
                .prepare_cached(
                    "SELECT (SELECT database_id FROM consumer_database WHERE id =
                       (SELECT max(accepted_by) FROM outbox INDEXED BY outbox_accepted_by WHERE accepted = 1))",
                )?
                .query_row([], |r| r.get(0))?)
        })
        .await
    }

    pub(super) async fn accepted_page(
        &self,
        consumer_db: String,
        below: Option<(u64, String)>,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        self.blocking("read accepted rows by position", move |conn, _| {
            // The first page: below a position no row has (the id is then never compared).
            let (position, event_id) = below.unwrap_or((NOTHING_BEYOND, String::new()));
            let key = consumer_key(conn, &consumer_db)?;
            let rows = conn
                .prepare_cached(
                    "SELECT accepted_position, event_id FROM outbox INDEXED BY outbox_accepted_by
                     WHERE accepted = 1 AND accepted_by = ?1 AND accepted_position <= ?2
                       AND (accepted_position < ?2 OR event_id < ?3)
                     ORDER BY accepted_position DESC, event_id DESC LIMIT ?4",
                )?
                .query_map(params![key, position, event_id, limit as i64], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<rusqlite::Result<_>>()?;
            Ok(rows)
        })
        .await
    }
}

impl SqliteStore {
    pub(super) async fn compact(
        &self,
        cutoff_us: i64,
        batch: usize,
        keep_free_pages: u64,
    ) -> Result<CompactReport, StoreError> {
        let size = |conn: &mut Connection, _: CrashSwitch| -> Result<Option<u64>, StoreError> {
            Ok(Some(db::database_bytes(conn)?))
        };
        let before = self.blocking("read the database size", size).await?;
        let mut report = CompactReport { file_bytes_before: before, ..CompactReport::default() };
        let mut after_id = 0;
        loop {
            let done = self
                .blocking("compact outbox rows", move |conn: &mut Connection, crash: CrashSwitch| {
                    compact_batch(conn, after_id, cutoff_us, batch, &crash)
                })
                .await?;
            if done.rows > 0 {
                report.compacted += done.rows;
                report.body_bytes += done.body_bytes;
                report.batches += 1;
            }
            after_id = done.after_id;
            if done.pass_over {
                break;
            }
            tokio::time::sleep(runtime::retention::COMPACT_PAUSE).await;
        }
        let incremental = self
            .blocking("read auto_vacuum", |conn: &mut Connection, _: CrashSwitch| {
                Ok(conn.query_row("PRAGMA auto_vacuum", [], |r| r.get::<_, i64>(0))? == 2)
            })
            .await?;
        if incremental {
            let mut freed = 0;
            loop {
                let step = self
                    .blocking("give pages back", move |conn: &mut Connection, _: CrashSwitch| {
                        let step = |free| runtime::retention::vacuum_step(free, keep_free_pages);
                        Ok(db::give_back_free_pages(conn, step)?)
                    })
                    .await?;
                freed += step;
                if step == 0 {
                    break;
                }
                tokio::time::sleep(runtime::retention::COMPACT_PAUSE).await;
            }
            report.pages_freed = Some(freed);
            if freed > 0 {
                // The file is truncated when a checkpoint copies the whole WAL back; a reader
                // holding an old snapshot only delays that to a later checkpoint.
                self.blocking("checkpoint", |conn: &mut Connection, _: CrashSwitch| {
                    Ok(conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?)
                })
                .await?;
            }
        }
        report.file_bytes_after = self.blocking("read the database size", size).await?;
        Ok(report)
    }
}

/// What one compaction transaction did, and where the pass goes on.
struct CompactedBatch {
    rows: u64,
    body_bytes: u64,
    /// The last id it looked at and is done with: the next transaction starts after it.
    after_id: i64,
    /// Nothing after `after_id` can be compacted at this cutoff.
    pass_over: bool,
}

/// ONE `BEGIN IMMEDIATE` transaction: walks the outbox rows that still have a body, after id
/// `after_id`, in id order, looking at [`COMPACT_EXAMINE`](runtime::retention::COMPACT_EXAMINE)
/// rows at most; up to `batch` of them accepted at or before `cutoff_us` get their body's
/// digest (a row of `outbox_digest`) and lose their `outbox_body` row (deleted in id order, so
/// whole pages are freed); rows not accepted by then are passed over. The walk ends the pass
/// at the first row committed after the cutoff: ids follow commits, and a row is accepted
/// after its commit, so no later row is finished. Reaches `producer.compact.after_batch`
/// before a commit and
/// `producer.compact.after_commit` after; a crash anywhere leaves each row whole or a
/// tombstone.
fn compact_batch(
    conn: &mut Connection,
    after_id: i64,
    cutoff_us: i64,
    batch: usize,
    crash: &CrashSwitch,
) -> Result<CompactedBatch, StoreError> {
    use runtime::retention::{COMPACT_EXAMINE, Examined};
    let tx = db::begin_immediate(conn)?;
    // Each examined row as (id, committed, what to do with it: see `Examined::of`).
    let mut to_compact = 0;
    let examined: Vec<(i64, i64, Examined)> = tx
        .prepare_cached(
            "SELECT outbox_body.id, outbox.committed_at_us,
                    coalesce(outbox.accepted = 1 AND outbox.accepted_at_us <= ?3, 0), outbox_body.body
             FROM outbox_body JOIN outbox ON outbox.id = outbox_body.id
             WHERE outbox_body.id > ?1 ORDER BY outbox_body.id LIMIT ?2",
        )?
        .query_map(params![after_id, COMPACT_EXAMINE as i64, cutoff_us], |r| {
            let examined = Examined::of(r, 2, 3, &mut to_compact, batch)?;
            Ok((r.get(0)?, r.get(1)?, examined))
        })?
        .collect::<rusqlite::Result<_>>()?;
    let mut done =
        CompactedBatch { rows: 0, body_bytes: 0, after_id, pass_over: examined.len() < COMPACT_EXAMINE };
    {
        // The rows were read in this transaction as accepted with a body, so none has a
        // digest yet: a taken id is the corruption of a row compacted twice.
        let mut digest = tx
            .prepare_cached("INSERT INTO outbox_digest(id, sha256) VALUES (?1, ?2) ON CONFLICT DO NOTHING")?;
        let mut drop_body = tx.prepare_cached("DELETE FROM outbox_body WHERE id = ?1")?;
        for (id, committed_at_us, examined) in examined {
            if committed_at_us > cutoff_us {
                done.pass_over = true;
                break;
            }
            let (sha, len) = match examined {
                Examined::Unfinished => {
                    done.after_id = id;
                    continue;
                }
                Examined::NextBatch => {
                    done.pass_over = false;
                    break;
                }
                Examined::Compact(sha, len) => (sha, len),
            };
            done.after_id = id;
            if digest.execute(params![id, &sha[..]])? != 1 {
                return Err(StoreError::Corrupt(format!("outbox row {id} has a body and a digest")));
            }
            drop_body.execute([id])?;
            done.rows += 1;
            done.body_bytes += len;
        }
    }
    if done.rows > 0 {
        crash.reach(CrashPoint::ProducerCompactAfterBatch);
        tx.commit()?;
        crash.reach(CrashPoint::ProducerCompactAfterCommit);
    } else {
        // Nothing written: dropping the transaction releases the lock.
        drop(tx);
    }
    Ok(done)
}

/// The `backlog.unaccepted` counter inside one write transaction: read at most once (when the
/// cap needs it), this transaction's changes summed, and written once before the commit
/// ([`Unaccepted::write`]). Every function here that inserts an outbox row or changes its
/// `accepted` takes one, so the counter stays exact in the same transaction as the rows.
#[derive(Debug)]
pub struct Unaccepted {
    cap: Option<u64>,
    stored: Option<u64>,
    delta: i64,
}

impl Unaccepted {
    /// No change yet; `cap` is the outbox cap the transaction's calls are checked against.
    pub fn new(cap: Option<u64>) -> Unaccepted {
        Unaccepted { cap, stored: None, delta: 0 }
    }

    /// Unaccepted rows as this transaction sees them now (the stored counter read once, plus
    /// this transaction's changes), with the cap; `None` when uncapped.
    fn against_cap(&mut self, tx: &Transaction<'_>) -> Result<Option<(u64, u64)>, StoreError> {
        let Some(cap) = self.cap else { return Ok(None) };
        let stored = match self.stored {
            Some(n) => n,
            None => *self.stored.insert(unaccepted_count(tx)?),
        };
        Ok(Some((stored.saturating_add_signed(self.delta), cap)))
    }

    /// Rows this transaction inserted (net of rows it marked accepted).
    pub fn added(&self) -> i64 {
        self.delta
    }

    /// Writes this transaction's change of the counter (nothing when there is none).
    pub fn write(&mut self, tx: &Transaction<'_>) -> Result<(), StoreError> {
        if self.delta != 0 {
            tx.prepare_cached("UPDATE backlog SET unaccepted = unaccepted + ?1 WHERE id = 1")?
                .execute([self.delta])?;
            self.stored = self.stored.map(|n| n.saturating_add_signed(self.delta));
            self.delta = 0;
        }
        Ok(())
    }
}

/// SPEC §5 inside the caller's `BEGIN IMMEDIATE` transaction: reads the flow, the event id's
/// row and (when capped) the backlog, [`decide`]s, and for a step writes the flow, reaches
/// `producer.after_flow_update`, inserts the outbox row (counted in `unaccepted`) and reaches
/// `producer.after_outbox_insert`. Nothing is written unless the outcome is `Committed`; the
/// caller writes `unaccepted` and commits, then reaches `producer.after_commit`. `held` keeps
/// the batch's statements prepared ([`Held`]) and belongs to `tx`.
///
/// In a [`Steps::Direct`] run a call at the flow's expected seq does not look its event id
/// up first: a new id is the common case, and the outbox insert's `UNIQUE(event_id)` finds
/// a used one anyway (a seek saved per step, ~3.6k instructions). Such an insert fails, which
/// abandons the direct run, and the run with savepoints reads the id's history first, so
/// every answer is the one SPEC §5 gives. A call that turns out not to write reads it before
/// it answers (the history decides first). A call that skipped the lookup reaches
/// `producer.after_flow_update` only once its outbox insert succeeded, right before
/// `producer.after_outbox_insert`: a call answered by its history reaches no crash point, and
/// a crash at either point leaves the same file (nothing of the transaction is committed).
pub fn advance(
    tx: &Transaction<'_>,
    held: &mut Held<'_>,
    cmd: &AdvanceCommand,
    crash: &CrashSwitch,
    now_us: i64,
    unaccepted: &mut Unaccepted,
    steps: Steps,
) -> Result<AdvanceReply, StoreError> {
    let flow = flow_record_with(held, &cmd.flow_id)?;
    let unread = steps == Steps::Direct && flow.seq == cmd.expected_seq;
    let mut stored = if unread { None } else { outbox_row_with(held, &cmd.event_id)? };
    // The counter is only worth reading for a call that may write.
    let backlog =
        if stored.is_none() && flow.seq == cmd.expected_seq { unaccepted.against_cap(tx)? } else { None };
    let mut decision = decide(&flow, stored.as_ref(), cmd, backlog);
    if unread && !matches!(decision, Decision::Write { .. }) {
        stored = outbox_row_with(held, &cmd.event_id)?;
        if stored.is_some() {
            decision = decide(&flow, stored.as_ref(), cmd, None);
        }
    }
    if let Decision::Write { flow: after, event } = &decision {
        // The transaction read the flow: a row exists exactly when its seq is above 0, so a
        // new flow is an INSERT and a step of an existing one an UPDATE (an upsert would try
        // the insert first and meet the key every time).
        if flow.seq == 0 {
            held.get("INSERT INTO flow(flow_id, seq, state, amount) VALUES (?1, ?2, ?3, ?4)")?
                .execute(params![event.flow_id, after.seq, after.state.as_str(), after.amount])?;
        } else {
            let changed = held
                .get("UPDATE flow SET seq = ?2, state = ?3 WHERE flow_id = ?1 AND seq = ?4")?
                .execute(params![event.flow_id, after.seq, after.state.as_str(), flow.seq])?;
            if changed != 1 {
                return Err(StoreError::Corrupt(format!(
                    "flow {} moved inside the advance transaction (read at seq {})",
                    event.flow_id, flow.seq
                )));
            }
        }
        if !unread {
            crash.reach(CrashPoint::ProducerAfterFlowUpdate);
        }
        held.get(
            "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, committed_at_us)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?
        .execute(params![
            event.event_id,
            event.flow_id,
            event.seq,
            event.kind,
            event.schema,
            now_us
        ])?;
        held.get("INSERT INTO outbox_body(id, body) VALUES (last_insert_rowid(), ?1)")?
            .execute([&event.body])?;
        unaccepted.delta += 1;
        if unread {
            // Only now is the id known to be new: a call answered by its history reaches no
            // crash point.
            crash.reach(CrashPoint::ProducerAfterFlowUpdate);
        }
        crash.reach(CrashPoint::ProducerAfterOutboxInsert);
    }
    Ok(decision.into_reply())
}

/// The flow's committed state; a flow with no row is `new`, seq 0.
pub fn flow_record(conn: &Connection, flow_id: &str) -> Result<FlowRecord, StoreError> {
    flow_record_with(&mut Held::new(conn), flow_id)
}

fn flow_record_with(held: &mut Held<'_>, flow_id: &str) -> Result<FlowRecord, StoreError> {
    // The state is parsed where it lies (no String per read); an unknown one is kept as
    // text only for the error.
    let row = held
        .get("SELECT seq, state, amount FROM flow WHERE flow_id = ?1")?
        .query_row([flow_id], |r| {
            let state = r.get_ref(1)?.as_str()?;
            let state = FlowState::parse(state).ok_or_else(|| state.to_owned());
            Ok((r.get::<_, u64>(0)?, state, r.get::<_, i64>(2)?))
        })
        .optional()?;
    match row {
        None => Ok(FlowRecord::NEW),
        Some((seq, state, amount)) => {
            let state = state
                .map_err(|state| StoreError::Corrupt(format!("flow {flow_id}: unknown state {state:?}")))?;
            Ok(FlowRecord { seq, state, amount })
        }
    }
}

/// The columns `outbox_from_row` reads, as a macro so the statements below are literals
/// (built once at compile time, not formatted at every call).
/// A row without an `outbox_body` row is a tombstone (its body compacted). The body comes by
/// a `LEFT JOIN`; it was a correlated scalar subquery (a sub-program run for every row,
/// ~0.75k instructions more per row of the relay's page, callgrind, bench), chosen when the
/// join's statements were seen re-prepared at almost every run. Those re-prepares were the
/// bound values the plans depended on (the page's `LIMIT ?`), which the planner stability
/// guarantee set by `proto::db::open` stops: `bench --callgrind` shows no `sqlite3Reprepare`
/// in any process with the join.
///
/// A tombstone's digest comes by a second `LEFT JOIN`, of `outbox_digest`; the relay's page
/// (`outbox_columns!(without digest)`) reads unaccepted rows, which compaction never touches
/// (a compacted row made unaccepted again is refused by its missing body), and reads none.
macro_rules! outbox_columns {
    () => {
        outbox_columns!("outbox_digest.sha256", " LEFT JOIN outbox_digest ON outbox_digest.id = outbox.id")
    };
    (without digest) => {
        outbox_columns!("NULL", "")
    };
    ($digest:literal, $join:literal) => {
        concat!(
            "outbox.event_id, outbox.flow_id, outbox.seq, outbox.kind, outbox.schema, outbox_body.body,
             outbox.accepted, outbox.attempts, outbox.last_outcome, outbox.committed_at_us, ",
            $digest,
            ", outbox.id
             FROM outbox LEFT JOIN outbox_body ON outbox_body.id = outbox.id",
            $join
        )
    };
}

fn outbox_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<OutboxRecord> {
    let body: Option<String> = r.get(5)?;
    let digest: Option<Vec<u8>> = r.get(10)?;
    Ok(OutboxRecord {
        event_id: r.get(0)?,
        flow_id: r.get(1)?,
        seq: r.get(2)?,
        kind: r.get(3)?,
        schema: r.get(4)?,
        compacted: body.is_none(),
        body: body.unwrap_or_default(),
        // The schema's CHECK keeps it 32 bytes long.
        body_sha256: digest.and_then(|d| <[u8; 32]>::try_from(d.as_slice()).ok()),
        accepted: r.get::<_, i64>(6)? != 0,
        attempts: r.get(7)?,
        last_outcome: r.get(8)?,
        committed_at_us: r.get(9)?,
        row_id: Some(r.get(11)?),
    })
}

/// The outbox row of `event_id`, accepted or not.
pub fn outbox_row(conn: &Connection, event_id: &str) -> Result<Option<OutboxRecord>, StoreError> {
    outbox_row_with(&mut Held::new(conn), event_id)
}

fn outbox_row_with(held: &mut Held<'_>, event_id: &str) -> Result<Option<OutboxRecord>, StoreError> {
    Ok(held
        .get(concat!("SELECT ", outbox_columns!(), " WHERE outbox.event_id = ?1"))?
        .query_row([event_id], outbox_from_row)
        .optional()?)
}

/// The flow's outbox rows in seq order.
pub fn flow_outbox(conn: &Connection, flow_id: &str) -> Result<Vec<OutboxRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT ",
        outbox_columns!(),
        " WHERE outbox.flow_id = ?1 ORDER BY outbox.seq"
    ))?;
    Ok(stmt.query_map([flow_id], outbox_from_row)?.collect::<rusqlite::Result<_>>()?)
}

/// The SQL that pages through unaccepted rows in `(flow_id, seq)` order, after a cursor.
/// It is answered from the partial index `outbox_unaccepted` alone (see the
/// `EXPLAIN QUERY PLAN` test), so the accepted history is never scanned.
pub const UNACCEPTED_PAGE_SQL: &str = concat!(
    "SELECT ",
    outbox_columns!(without digest),
    " WHERE outbox.accepted = 0 AND (outbox.flow_id, outbox.seq) > (?1, ?2)
     ORDER BY outbox.flow_id, outbox.seq LIMIT ?3"
);

/// Up to `limit` unaccepted rows after `(flow_id, seq)` in `(flow_id, seq)` order.
pub fn unaccepted_after(
    conn: &Connection,
    after: (&str, u64),
    limit: usize,
) -> Result<Vec<OutboxRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(UNACCEPTED_PAGE_SQL)?;
    super::refuse_compacted(
        stmt.query_map(params![after.0, after.1, limit as i64], outbox_from_row)?
            .collect::<rusqlite::Result<_>>()?,
    )
}

/// The common mark of [`record_delivery`] without its `WHERE`: one answer counted on a row
/// it makes accepted (`?1` event id, `?2` the answer's word, `?3` now, `?4`/`?5` the
/// consumer database's key and inbox position, when known).
macro_rules! mark_accepted {
    () => {
        "UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2, accepted = 1,
             accepted_at_us = ?3,
             accepted_by = CASE WHEN ?4 IS NOT NULL THEN ?4 ELSE accepted_by END,
             accepted_position = CASE WHEN ?4 IS NOT NULL THEN ?5 ELSE accepted_position END"
    };
}

/// Inside a relay's transaction: counts one send of `event_id` with the consumer's answer,
/// and when the answer [holds the event](DeliveryAnswer::holds_event) sets `accepted = 1`
/// (counted in `unaccepted`) and, when known, which consumer database holds it at which inbox
/// position (`accepted_by`: the database's key, see [`recorded_consumer_key`], and the
/// position). Any other answer leaves the row unaccepted and `accepted_by` as it was (`held`:
/// the run's statements, see [`Held`]). One statement in the common case (a row accepted by
/// this answer); a row already accepted (a resend answered `DUPLICATE`) or refused takes the
/// plain count. With the row's key (`row_id`, as the relay's page read it) the common
/// statement finds the row by it instead of searching the event id's index (~0.8k fewer
/// instructions per event in the relay), and still requires the event id. Returns false
/// when no such row exists.
pub fn record_delivery(
    held: &mut Held<'_>,
    event_id: &str,
    row_id: Option<i64>,
    answer: DeliveryAnswer,
    now_us: i64,
    accepted_by: Option<(i64, u64)>,
    unaccepted: &mut Unaccepted,
) -> Result<bool, StoreError> {
    let word = answer.word();
    if answer.holds_event() {
        let (by, position) = accepted_by.map_or((None, None), |(key, position)| (Some(key), Some(position)));
        let newly = match row_id {
            Some(id) => held
                .get(concat!(mark_accepted!(), " WHERE id = ?6 AND event_id = ?1 AND accepted = 0"))?
                .execute(params![event_id, word, now_us, by, position, id])?,
            None => held
                .get(concat!(mark_accepted!(), " WHERE event_id = ?1 AND accepted = 0"))?
                .execute(params![event_id, word, now_us, by, position])?,
        };
        if newly == 1 {
            unaccepted.delta -= 1;
            return Ok(true);
        }
        // Already accepted: the answer is counted, and where it now lives is updated.
        let changed = held
            .get(
                "UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2,
                     accepted_by = CASE WHEN ?3 IS NOT NULL THEN ?3 ELSE accepted_by END,
                     accepted_position = CASE WHEN ?3 IS NOT NULL THEN ?4 ELSE accepted_position END
                 WHERE event_id = ?1",
            )?
            .execute(params![event_id, word, by, position])?;
        return Ok(changed == 1);
    }
    let changed = held
        .get("UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2 WHERE event_id = ?1")?
        .execute(params![event_id, word])?;
    Ok(changed == 1)
}

/// Inside a relay's transaction: counts one send of `event_id` that got no answer. The row
/// stays unaccepted (it will be sent again); `last_outcome` becomes [`NO_ANSWER`]. Returns
/// false when no such row exists.
pub fn record_unanswered_send(tx: &Transaction<'_>, event_id: &str) -> Result<bool, StoreError> {
    let mut stmt = tx
        .prepare_cached("UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2 WHERE event_id = ?1")?;
    Ok(stmt.execute(params![event_id, NO_ANSWER])? == 1)
}

/// This producer database's random identity, created with it.
pub fn database_id(conn: &Connection) -> Result<String, StoreError> {
    Ok(conn
        .prepare_cached("SELECT database_id FROM database_identity WHERE id = 1")?
        .query_row([], |r| r.get(0))?)
}

/// A position no inbox reaches (rowids and BIGINTs are i64): judging "beyond" it judges no
/// row of the consumer database's own.
pub const NOTHING_BEYOND: u64 = i64::MAX as u64;

/// Of the probed `(position, event_id)` pairs, the rows still recorded as accepted by
/// the consumer database of `key` ([`consumer_key`]) at that position.
fn still_recorded(
    conn: &Connection,
    key: i64,
    pairs: &[(u64, String)],
) -> Result<Vec<ProbedRow>, StoreError> {
    let mut read = conn.prepare_cached(
        "SELECT flow_id, seq, NOT EXISTS (SELECT 1 FROM outbox_body WHERE outbox_body.id = outbox.id)
         FROM outbox WHERE event_id = ?1 AND accepted = 1 AND accepted_by = ?2 AND accepted_position = ?3",
    )?;
    let mut rows = Vec::new();
    for (position, event_id) in pairs {
        let Ok(position) = i64::try_from(*position) else { continue };
        let row = read
            .query_row(params![event_id, key, position], |r| {
                Ok(ProbedRow {
                    event_id: event_id.clone(),
                    flow_id: r.get(0)?,
                    seq: r.get(1)?,
                    compacted: r.get(2)?,
                })
            })
            .optional()?;
        rows.extend(row);
    }
    Ok(rows)
}

/// Inside a relay's transaction: marks the probed rows [`still_recorded`] found unaccepted
/// again, each only while still recorded at its position by the consumer database of `key`.
fn unmark_probed(
    tx: &Transaction<'_>,
    key: i64,
    probed: &[ProbedRow],
    unaccepted: &mut Unaccepted,
) -> Result<u64, StoreError> {
    let mut unmark = tx.prepare_cached(
        "UPDATE outbox SET accepted = 0, accepted_at_us = NULL, accepted_by = NULL,
             accepted_position = NULL, last_outcome = ?3
         WHERE event_id = ?1 AND accepted = 1 AND accepted_by = ?2",
    )?;
    let mut changed = 0;
    for row in probed {
        changed += unmark.execute(params![row.event_id, key, LOST_BY_CONSUMER])? as u64;
    }
    unaccepted.delta += changed as i64;
    Ok(changed)
}

const LOST_WHERE: &str = "accepted = 1 AND accepted_by IS NOT NULL
     AND (accepted_by <> ?1 OR accepted_position > ?2)";

/// What the consumer database of `key` ([`consumer_key`]) at `highest_position` lacks of what
/// the outbox recorded as accepted.
pub fn lost_rows(conn: &Connection, key: i64, highest_position: u64) -> Result<LostRows, StoreError> {
    // Range reads of `outbox_accepted_by` only (the other databases' ids on either side of
    // this one, rows past the position, the last one), so a relay that checks an unchanged
    // consumer reads a few index entries, not the accepted history.
    let other_database: u64 = conn
        .prepare_cached(
            "SELECT (SELECT count(*) FROM outbox WHERE accepted = 1 AND accepted_by < ?1)
                  + (SELECT count(*) FROM outbox WHERE accepted = 1 AND accepted_by > ?1)",
        )?
        .query_row([key], |r| r.get(0))?;
    let beyond_history = conn
        .prepare_cached(
            "SELECT count(*) FROM outbox
             WHERE accepted = 1 AND accepted_by = ?1 AND accepted_position > ?2",
        )?
        .query_row(params![key, highest_position], |r| r.get(0))?;
    let highest_recorded = conn
        .prepare_cached(
            "SELECT coalesce(max(accepted_position), 0) FROM outbox WHERE accepted = 1 AND accepted_by = ?1",
        )?
        .query_row([key], |r| r.get(0))?;
    if other_database + beyond_history == 0 {
        return Ok(LostRows { other_database, beyond_history, highest_recorded, ..LostRows::default() });
    }
    let sample = conn
        .prepare_cached(&format!(
            "SELECT event_id FROM outbox WHERE {LOST_WHERE} ORDER BY flow_id, seq LIMIT 5"
        ))?
        .query_map(params![key, highest_position], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let compacted = conn
        .prepare_cached(&format!(
            "SELECT count(*) FROM outbox WHERE {LOST_WHERE}
             AND NOT EXISTS (SELECT 1 FROM outbox_body WHERE outbox_body.id = outbox.id)"
        ))?
        .query_row(params![key, highest_position], |r| r.get(0))?;
    let compacted_sample = if compacted == 0 {
        Vec::new()
    } else {
        conn.prepare_cached(&format!(
            "SELECT event_id FROM outbox WHERE {LOST_WHERE}
             AND NOT EXISTS (SELECT 1 FROM outbox_body WHERE outbox_body.id = outbox.id)
             ORDER BY flow_id, seq LIMIT 5"
        ))?
        .query_map(params![key, highest_position], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?
    };
    Ok(LostRows {
        other_database,
        beyond_history,
        highest_recorded,
        sample,
        compacted,
        compacted_sample,
        loss_accepted: 0,
    })
}

/// Inside `relay accept-lost`'s transaction: the compacted rows among those [`lost_rows`]
/// counts and among `probed` stay accepted, name no consumer database any more (so no relay
/// judges them lost again) and get the last outcome [`LOST_ACCEPTED`]. Returns how many.
fn accept_compacted(
    tx: &Transaction<'_>,
    key: i64,
    highest_position: u64,
    probed: &[ProbedRow],
) -> Result<u64, StoreError> {
    let mut changed = tx
        .prepare_cached(&format!(
            "UPDATE outbox SET accepted_by = NULL, accepted_position = NULL, last_outcome = ?3
             WHERE {LOST_WHERE}
               AND NOT EXISTS (SELECT 1 FROM outbox_body WHERE outbox_body.id = outbox.id)"
        ))?
        .execute(params![key, highest_position, LOST_ACCEPTED])? as u64;
    let mut accept = tx.prepare_cached(
        "UPDATE outbox SET accepted_by = NULL, accepted_position = NULL, last_outcome = ?3
         WHERE event_id = ?1 AND accepted = 1 AND accepted_by = ?2",
    )?;
    for row in probed.iter().filter(|r| r.compacted) {
        changed += accept.execute(params![row.event_id, key, LOST_ACCEPTED])? as u64;
    }
    Ok(changed)
}

/// Inside a relay's transaction: marks every row [`lost_rows`] counts unaccepted again (its
/// `last_outcome` says why), so it is sent again; the consumer answers `DUPLICATE` where it
/// still holds one. Returns how many rows changed.
pub fn unmark_lost(
    tx: &Transaction<'_>,
    key: i64,
    highest_position: u64,
    unaccepted: &mut Unaccepted,
) -> Result<u64, StoreError> {
    let changed = tx
        .prepare_cached(&format!(
            "UPDATE outbox SET accepted = 0, accepted_at_us = NULL, accepted_by = NULL,
                 accepted_position = NULL, last_outcome = ?3
             WHERE {LOST_WHERE}"
        ))?
        .execute(params![key, highest_position, LOST_BY_CONSUMER])?;
    unaccepted.delta += changed as i64;
    Ok(changed as u64)
}

/// Unaccepted outbox rows, from the trigger-kept counter.
pub fn unaccepted_count(conn: &Connection) -> Result<u64, StoreError> {
    Ok(conn.prepare_cached("SELECT unaccepted FROM backlog WHERE id = 1")?.query_row([], |r| r.get(0))?)
}

/// The backlog counter and the oldest unaccepted row's commit time, in one read transaction.
fn backlog(conn: &Connection) -> rusqlite::Result<Backlog> {
    let tx = conn.unchecked_transaction()?;
    let unaccepted =
        tx.prepare_cached("SELECT unaccepted FROM backlog WHERE id = 1")?.query_row([], |r| r.get(0))?;
    // The oldest unaccepted row is the one with the smallest rowid (rows are inserted in
    // commit order and never deleted): a scan of the partial index of unaccepted rows
    // (covering, no table reads), bounded by the unaccepted count, never the history.
    let oldest_committed_at_us: Option<i64> = tx
        .prepare_cached(
            "SELECT committed_at_us FROM outbox WHERE rowid =
               (SELECT min(rowid) FROM outbox INDEXED BY outbox_unaccepted WHERE accepted = 0)",
        )?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(Backlog { unaccepted, oldest_committed_at_us })
}

/// Counts of outbox rows: (all, unaccepted).
#[cfg(test)]
pub fn outbox_counts(conn: &Connection) -> Result<(u64, u64), StoreError> {
    let total = conn.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
    let unaccepted = conn.query_row("SELECT count(*) FROM outbox WHERE accepted = 0", [], |r| r.get(0))?;
    Ok((total, unaccepted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::validate;
    use proto::pb;

    fn cmd(event: &str, expected: u64, kind: &str, schema: u32, amount: i64) -> AdvanceCommand {
        validate(pb::AdvanceRequest {
            flow_id: "A".into(),
            event_id: event.into(),
            expected_seq: expected,
            kind: kind.into(),
            schema,
            amount,
        })
        .unwrap()
    }

    /// A schema 1 step of `flow` with amount 3 (also the writer's tests').
    pub(super) fn step_of(flow: &str, event: &str, expected: u64, kind: &str) -> AdvanceCommand {
        validate(pb::AdvanceRequest {
            flow_id: flow.into(),
            event_id: event.into(),
            expected_seq: expected,
            kind: kind.into(),
            schema: 1,
            amount: 3,
        })
        .unwrap()
    }

    fn run(conn: &mut Connection, c: &AdvanceCommand) -> AdvanceReply {
        run_with(conn, c, Steps::Savepoint)
    }

    /// A new step of a file of schema 5 to 8 as those builds wrote it: run directly, today's
    /// `advance` writes only tables they have (it reads `outbox_digest` only with savepoints,
    /// or when it does not write).
    fn run_on_old_file(conn: &mut Connection, c: &AdvanceCommand) -> AdvanceReply {
        let reply = run_with(conn, c, Steps::Direct);
        assert_eq!(reply.outcome, super::super::AdvanceOutcome::Committed);
        reply
    }

    /// [`flow_outbox`] of a file of schema 5 to 8 (each digest in its row).
    fn flow_outbox_of_old_file(conn: &Connection, flow_id: &str) -> Vec<OutboxRecord> {
        let sql = concat!(
            "SELECT ",
            outbox_columns!("outbox.body_sha256", ""),
            " WHERE outbox.flow_id = ?1 ORDER BY outbox.seq"
        );
        conn.prepare(sql)
            .unwrap()
            .query_map([flow_id], outbox_from_row)
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    fn run_with(conn: &mut Connection, c: &AdvanceCommand, steps: Steps) -> AdvanceReply {
        let tx = db::begin_immediate(conn).unwrap();
        let mut unaccepted = Unaccepted::new(None);
        let reply =
            advance(&tx, &mut Held::new(&tx), c, &CrashSwitch::default(), 1, &mut unaccepted, steps).unwrap();
        unaccepted.write(&tx).unwrap();
        tx.commit().unwrap();
        reply
    }

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
    fn a_version_3_file_loses_its_counter_triggers_and_keeps_its_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v3 = DbKind::producer(3, SCHEMA, &[IDENTITY_SQL, PLAIN_CHECKS_SQL]);
        let mut conn = db::open(&path, &v3, OpenMode::Create).unwrap();
        // A row committed by a version 3 build: its trigger counts it.
        let tx = db::begin_immediate(&mut conn).unwrap();
        tx.execute_batch(
            "INSERT INTO flow(flow_id, seq, state, amount) VALUES ('A', 1, 'reserved', 3);
             INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us)
             VALUES ('A1', 'A', 1, 'reserved', 1, '{}', 1);",
        )
        .unwrap();
        tx.commit().unwrap();
        assert_eq!(unaccepted_count(&conn).unwrap(), 1);
        drop(conn);
        let mut conn = open(&path, OpenMode::Create).unwrap();
        let triggers: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_schema WHERE type = 'trigger'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(triggers, 0);
        assert_eq!(unaccepted_count(&conn).unwrap(), 1, "the count survives the upgrade");
        // From now on the store keeps it: the next step adds one, an accepted answer takes one.
        run(&mut conn, &cmd("A2", 1, "confirmed", 1, 3));
        assert_eq!(unaccepted_count(&conn).unwrap(), 2);
        let tx = db::begin_immediate(&mut conn).unwrap();
        let mut unaccepted = Unaccepted::new(None);
        let mut held = Held::new(&tx);
        for _ in 0..2 {
            // The second answer is a resend: the row is already accepted, nothing more counts.
            assert!(
                record_delivery(&mut held, "A1", None, DeliveryAnswer::Accepted, 2, None, &mut unaccepted)
                    .unwrap()
            );
        }
        drop(held);
        unaccepted.write(&tx).unwrap();
        tx.commit().unwrap();
        assert_eq!(unaccepted_count(&conn).unwrap(), 1);
        assert_eq!(outbox_counts(&conn).unwrap(), (2, 1));
    }

    #[test]
    fn a_version_2_file_is_upgraded_and_no_step_builds_a_temporary_btree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v2 = DbKind::producer(2, SCHEMA, &[IDENTITY_SQL]);
        let conn = db::open(&path, &v2, OpenMode::Create).unwrap();
        // A step as a version 2 build wrote it (its trigger counts the row).
        conn.execute_batch(
            "INSERT INTO flow(flow_id, seq, state, amount) VALUES ('A', 1, 'reserved', 3);
             INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us)
             VALUES ('A1', 'A', 1, 'reserved', 1, '{}', 1);",
        )
        .unwrap();
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
        assert_eq!(
            run(&mut conn, &cmd("A2", 1, "confirmed", 1, 3)).outcome,
            super::super::AdvanceOutcome::Committed
        );
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
    fn a_version_5_file_names_its_consumer_databases_by_key_and_keeps_every_mark() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v5 = DbKind::producer(
            5,
            SCHEMA,
            &[IDENTITY_SQL, PLAIN_CHECKS_SQL, COUNTER_WITHOUT_TRIGGERS_SQL, BODIES_APART_SQL],
        );
        let conn = db::open(&path, &v5, OpenMode::Create).unwrap();
        conn.execute_batch(
            "INSERT INTO flow(flow_id, seq, state, amount) VALUES ('A', 3, 'released', 3), ('B', 1, 'reserved', 1);
             INSERT INTO outbox(id, event_id, flow_id, seq, kind, schema, committed_at_us, accepted, accepted_at_us,
                                accepted_by, accepted_position)
             VALUES (1, 'A1', 'A', 1, 'reserved', 1, 1, 1, 5, 'c2', 7),
                    (2, 'A2', 'A', 2, 'confirmed', 1, 2, 1, 6, 'c1', 3),
                    (3, 'A3', 'A', 3, 'released', 1, 3, 1, 6, NULL, NULL),
                    (4, 'B1', 'B', 1, 'reserved', 1, 4, 0, NULL, NULL, NULL);
             INSERT INTO outbox_body(id, body) VALUES (1, 'a1'), (2, 'a2'), (3, 'a3'), (4, 'b1');
             UPDATE backlog SET unaccepted = 1;",
        )
        .unwrap();
        drop(conn);
        let mut conn = open(&path, OpenMode::Create).unwrap();
        let version: i32 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, KIND.user_version);
        let marks: Vec<String> = conn
            .prepare(
                "SELECT event_id || ' ' || coalesce((SELECT database_id FROM consumer_database WHERE id = accepted_by), '-')
                        || '@' || coalesce(accepted_position, '-') || ' ' || typeof(accepted_by)
                 FROM outbox ORDER BY id",
            )
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(marks, ["A1 c2@7 integer", "A2 c1@3 integer", "A3 -@- null", "B1 -@- null"]);
        // The judgements read the keys: c1 restored to position 2 lost A2 and holds none of A1.
        let c1 = consumer_key(&conn, "c1").unwrap();
        let lost = lost_rows(&conn, c1, 2).unwrap();
        assert_eq!((lost.other_database, lost.beyond_history, lost.highest_recorded), (1, 1, 3));
        assert_eq!(lost_rows(&conn, consumer_key(&conn, "never").unwrap(), 0).unwrap().other_database, 2);
        // A text id in the column is refused, not mixed in.
        let refused = conn.execute("UPDATE outbox SET accepted_by = 'c1' WHERE event_id = 'A3'", []);
        assert!(refused.is_err(), "{refused:?}");
        // A new consumer database gets the next key; the index still serves the judgements.
        let tx = db::begin_immediate(&mut conn).unwrap();
        assert_eq!(recorded_consumer_key(&tx, "c3").unwrap(), 3);
        assert_eq!(recorded_consumer_key(&tx, "c1").unwrap(), c1);
        tx.commit().unwrap();
        let plan: String = conn
            .prepare("EXPLAIN QUERY PLAN SELECT count(*) FROM outbox WHERE accepted = 1 AND accepted_by = ?1 AND accepted_position > ?2")
            .unwrap()
            .query_map(params![c1, 0], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap()
            .join("\n");
        assert!(plan.contains("outbox_accepted_by"), "{plan}");
    }

    /// A version 6 file as its build left it: flows A (two steps, the first accepted) and B.
    fn version_6_file(path: &Path) -> Connection {
        let v6 = DbKind::producer(6, SCHEMA, KIND.upgrades.split_at(5).0);
        let conn = db::open(path, &v6, OpenMode::Create).unwrap();
        conn.execute_batch(
            "INSERT INTO flow(flow_id, seq, state, amount) VALUES ('A', 2, 'confirmed', 3), ('B', 1, 'reserved', 1);
             INSERT INTO outbox(id, event_id, flow_id, seq, kind, schema, committed_at_us, accepted)
             VALUES (1, 'A1', 'A', 1, 'reserved', 1, 1, 1), (2, 'A2', 'A', 2, 'confirmed', 1, 2, 0),
                    (3, 'B1', 'B', 1, 'reserved', 1, 3, 0);
             INSERT INTO outbox_body(id, body) VALUES (1, 'a1'), (2, 'a2'), (3, 'b1');
             UPDATE backlog SET unaccepted = 2;",
        )
        .unwrap();
        conn
    }

    fn flows(conn: &Connection) -> Vec<(String, u64, String, i64)> {
        conn.prepare("SELECT flow_id, seq, state, amount FROM flow ORDER BY flow_id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn a_version_6_file_keeps_its_flows_in_a_table_keyed_by_flow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let before = flows(&version_6_file(&path));
        let mut conn = open(&path, OpenMode::Existing).unwrap();
        let ddl: String =
            conn.query_row("SELECT sql FROM sqlite_schema WHERE name = 'flow'", [], |r| r.get(0)).unwrap();
        assert!(ddl.contains("WITHOUT ROWID"), "{ddl}");
        assert_eq!(flows(&conn), before);
        assert_eq!(
            run(&mut conn, &step_of("A", "A3", 2, "released")).outcome,
            super::super::AdvanceOutcome::Committed
        );
        assert_eq!(
            run(&mut conn, &step_of("C", "C1", 0, "reserved")).outcome,
            super::super::AdvanceOutcome::Committed
        );
        assert_eq!(
            run(&mut conn, &step_of("A", "A3", 2, "released")).outcome,
            super::super::AdvanceOutcome::Existing
        );
        assert_eq!(flows(&conn).iter().map(|f| f.1).collect::<Vec<_>>(), [3, 1, 1]);
        assert_eq!(unaccepted_count(&conn).unwrap(), 4);
        assert_intact(&conn);
    }

    /// `PRAGMA integrity_check` answers `ok`.
    fn assert_intact(conn: &Connection) {
        let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
        assert_eq!(check, "ok");
    }

    /// The outbox's definition as stored in the file, and how many foreign keys it declares.
    fn outbox_shape(conn: &Connection) -> (String, i64) {
        let ddl: String =
            conn.query_row("SELECT sql FROM sqlite_schema WHERE name = 'outbox'", [], |r| r.get(0)).unwrap();
        let keys: i64 = conn
            .query_row("SELECT count(*) FROM pragma_foreign_key_list('outbox')", [], |r| r.get(0))
            .unwrap();
        (ddl, keys)
    }

    #[test]
    fn a_version_7_file_loses_the_outbox_foreign_key_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v7 = DbKind::producer(7, SCHEMA, KIND.upgrades.split_at(6).0);
        let mut conn = db::open(&path, &v7, OpenMode::Create).unwrap();
        run_on_old_file(&mut conn, &step_of("A", "A1", 0, "reserved"));
        let rows = flow_outbox_of_old_file(&conn, "A");
        let (v7_ddl, v7_keys) = outbox_shape(&conn);
        assert_eq!(v7_keys, 1, "{v7_ddl}");
        drop(conn);
        // To version 8 (version 9 changes the outbox again, see the next test).
        let v8 = DbKind::producer(8, SCHEMA, KIND.upgrades.split_at(7).0);
        let mut conn = db::open(&path, &v8, OpenMode::Existing).unwrap();
        let (ddl, keys) = outbox_shape(&conn);
        assert_eq!(keys, 0, "{ddl}");
        assert_eq!(ddl, v7_ddl.replace(" REFERENCES flow(flow_id)", ""));
        assert_eq!(flow_outbox_of_old_file(&conn, "A"), rows);
        run_on_old_file(&mut conn, &step_of("A", "A2", 1, "confirmed"));
        assert_intact(&conn);
        // A new file is built the same way.
        let fresh = db::open(&dir.path().join("new.db"), &v8, OpenMode::Create).unwrap();
        assert_eq!(outbox_shape(&fresh), (ddl, 0));
    }

    /// A version 8 file's tombstones keep their digests, moved to `outbox_digest`; the rows
    /// lose the column, and Advance answers a retry of a compacted step as before.
    #[test]
    fn a_version_8_file_moves_its_digests_apart_and_answers_retries_as_before() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v8 = DbKind::producer(8, SCHEMA, KIND.upgrades.split_at(7).0);
        let mut conn = db::open(&path, &v8, OpenMode::Create).unwrap();
        let first = step_of("A", "A1", 0, "reserved");
        run_on_old_file(&mut conn, &first);
        run_on_old_file(&mut conn, &step_of("A", "A2", 1, "confirmed"));
        // A1 accepted and compacted as a version 8 build did: digest in the row, body gone.
        let body: String =
            conn.query_row("SELECT body FROM outbox_body WHERE id = 1", [], |r| r.get(0)).unwrap();
        let digest = runtime::retention::body_digest(body.as_bytes());
        conn.execute(
            "UPDATE outbox SET accepted = 1, accepted_at_us = 1, attempts = 1, last_outcome = 'ACCEPTED',
                               body_sha256 = ?1 WHERE id = 1",
            [&digest[..]],
        )
        .unwrap();
        conn.execute_batch("DELETE FROM outbox_body WHERE id = 1; UPDATE backlog SET unaccepted = 1;")
            .unwrap();
        let before = flow_outbox_of_old_file(&conn, "A");
        assert!(before[0].compacted && !before[1].compacted, "{before:?}");
        drop(conn);
        let mut conn = open(&path, OpenMode::Existing).unwrap();
        let column: i64 = conn
            .query_row(
                "SELECT count(*) FROM pragma_table_info('outbox') WHERE name = 'body_sha256'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(column, 0, "the column is dropped");
        let after = flow_outbox(&conn, "A").unwrap();
        assert_eq!(after, before);
        assert_eq!(after[0].body_sha256, Some(digest));
        // A retry of the compacted step is answered from its digest; a changed one conflicts.
        assert_eq!(run(&mut conn, &first).outcome, super::super::AdvanceOutcome::Existing);
        let changed = cmd("A1", 0, "reserved", 1, 4);
        assert_eq!(run(&mut conn, &changed).outcome, super::super::AdvanceOutcome::Conflict);
        // A2 is compacted into the new table once accepted.
        conn.execute("UPDATE outbox SET accepted = 1, accepted_at_us = 2 WHERE id = 2", []).unwrap();
        let done = compact_batch(&mut conn, 0, runtime::now_us(), 500, &CrashSwitch::default()).unwrap();
        assert_eq!(done.rows, 1);
        let digests: i64 = conn.query_row("SELECT count(*) FROM outbox_digest", [], |r| r.get(0)).unwrap();
        assert_eq!(digests, 2);
        assert!(flow_outbox(&conn, "A").unwrap().iter().all(|r| r.compacted && r.body_sha256.is_some()));
        assert_intact(&conn);
    }

    #[test]
    fn an_upgrade_that_would_leave_orphans_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let conn = version_6_file(&path);
        // A row whose flow is gone, as only a hand edit with the checks off can leave.
        conn.execute_batch("PRAGMA foreign_keys = OFF; DELETE FROM flow WHERE flow_id = 'B';").unwrap();
        drop(conn);
        // To version 7, whose outbox still refers to `flow` (version 8 declares no key).
        let v7 = DbKind::producer(7, SCHEMA, KIND.upgrades.split_at(6).0);
        let refused = db::open(&path, &v7, OpenMode::Existing).unwrap_err().to_string();
        assert!(
            refused.contains("1 rows whose foreign key names no row")
                && refused.contains("nothing was changed"),
            "{refused}"
        );
        let conn = Connection::open(&path).unwrap();
        let version: i32 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, 6);
        let ddl: String =
            conn.query_row("SELECT sql FROM sqlite_schema WHERE name = 'flow'", [], |r| r.get(0)).unwrap();
        assert!(!ddl.contains("WITHOUT ROWID"), "{ddl}");
    }

    #[test]
    fn a_version_4_file_moves_its_bodies_apart_and_keeps_every_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let v4 = DbKind::producer(4, SCHEMA, &[IDENTITY_SQL, PLAIN_CHECKS_SQL, COUNTER_WITHOUT_TRIGGERS_SQL]);
        let conn = db::open(&path, &v4, OpenMode::Create).unwrap();
        conn.execute_batch(
            "INSERT INTO flow(flow_id, seq, state, amount) VALUES ('A', 2, 'confirmed', 3);
             INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us, accepted, accepted_at_us,
                                accepted_by, accepted_position)
             VALUES ('A1', 'A', 1, 'reserved', 1, 'body-1', 1, 1, 5, 'c1', 1),
                    ('A2', 'A', 2, 'confirmed', 1, 'body-2', 2, 0, NULL, NULL, NULL);
             UPDATE backlog SET unaccepted = 1;",
        )
        .unwrap();
        drop(conn);
        let mut conn = open(&path, OpenMode::Create).unwrap();
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, KIND.user_version as i64);
        let rows = flow_outbox(&conn, "A").unwrap();
        assert_eq!(rows.iter().map(|r| r.body.as_str()).collect::<Vec<_>>(), ["body-1", "body-2"]);
        assert!(rows.iter().all(|r| !r.compacted && r.body_sha256.is_none()));
        assert!(rows[0].accepted && !rows[1].accepted);
        assert_eq!(unaccepted_count(&conn).unwrap(), 1);
        // The upgraded rows compact (their digest computed then); the unaccepted one does not.
        let done = compact_batch(&mut conn, 0, runtime::now_us(), 500, &CrashSwitch::default()).unwrap();
        assert_eq!((done.rows, done.body_bytes), (1, 6));
        let rows = flow_outbox(&conn, "A").unwrap();
        assert!(rows[0].compacted && rows[0].body.is_empty());
        assert_eq!(rows[0].body_sha256, Some(runtime::retention::body_digest(b"body-1")));
        assert!(!rows[1].compacted);
        // New rows get the next id and their body row.
        run(&mut conn, &cmd("A3", 2, "released", 1, 3));
        let ids: Vec<i64> = conn
            .prepare("SELECT id FROM outbox_body ORDER BY id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(ids, [2, 3]);
        assert_intact(&conn);
    }

    /// A flow row in a state the code does not know (a hand-edited file) is refused as
    /// corrupt, naming the state; a missing row is a new flow.
    #[test]
    fn a_flow_in_an_unknown_state_is_reported_with_that_state() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("producer.db"), OpenMode::Create).unwrap();
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        // Only a hand-edited file gets here: the CHECK refuses it otherwise.
        conn.execute_batch(
            "PRAGMA ignore_check_constraints = ON; UPDATE flow SET state = 'lost' WHERE flow_id = 'A';",
        )
        .unwrap();
        match flow_record(&conn, "A") {
            Err(StoreError::Corrupt(message)) => assert_eq!(message, r#"flow A: unknown state "lost""#),
            other => panic!("expected Corrupt, got {other:?}"),
        }
        assert_eq!(flow_record(&conn, "B").unwrap(), FlowRecord::NEW);
    }

    /// The relay marks a row by the key its page read, and only while that row still holds
    /// the answer's event id: a key of another row marks nothing accepted.
    #[test]
    fn a_mark_by_row_key_still_requires_its_event_id() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), OpenMode::Create).unwrap();
        run(&mut conn, &cmd("A1", 0, "reserved", 1, 3));
        run(&mut conn, &cmd("A2", 1, "confirmed", 1, 3));
        let page = unaccepted_after(&conn, ("", 0), 10).unwrap();
        let keys: Vec<_> = page.iter().map(|r| (r.event_id.as_str(), r.row_id)).collect();
        assert_eq!(keys, [("A1", Some(1)), ("A2", Some(2))]);
        let tx = db::begin_immediate(&mut conn).unwrap();
        let mut unaccepted = Unaccepted::new(None);
        let mut held = Held::new(&tx);
        let mut mark = |event: &str, key: i64| {
            record_delivery(&mut held, event, Some(key), DeliveryAnswer::Accepted, 2, None, &mut unaccepted)
                .unwrap()
        };
        // A2's answer with A1's key: counted on A2 as an answer, neither row accepted.
        assert!(mark("A2", 1));
        assert!(mark("A1", 1));
        drop(held);
        unaccepted.write(&tx).unwrap();
        tx.commit().unwrap();
        let rows = flow_outbox(&conn, "A").unwrap();
        let seen: Vec<_> = rows.iter().map(|r| (r.event_id.as_str(), r.accepted, r.attempts)).collect();
        assert_eq!(seen, [("A1", true, 1), ("A2", false, 1)]);
        assert_eq!(unaccepted_count(&conn).unwrap(), 1);
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
    fn the_relay_page_is_prepared_once_however_its_limit_is_bound() {
        // A plan that depended on the value bound to `LIMIT ?` made SQLite prepare the page
        // afresh at every call after a new binding (see `proto::db::open`).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let mut producer = open(&path, OpenMode::Create).unwrap();
        let relay = open(&path, OpenMode::Existing).unwrap();
        for (round, limit) in [10, 3, 7].into_iter().enumerate() {
            let flow = format!("F{round}");
            let step = step_of(&flow, &flow, 0, "reserved");
            assert_eq!(run(&mut producer, &step).outcome, super::super::AdvanceOutcome::Committed);
            assert_eq!(unaccepted_after(&relay, ("", 0), limit).unwrap().len(), (round + 1).min(limit));
        }
        let page = relay.prepare_cached(UNACCEPTED_PAGE_SQL).unwrap();
        assert_eq!(page.get_status(rusqlite::StatementStatus::RePrepare), 0);
    }
}
