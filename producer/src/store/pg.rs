//! The PostgreSQL backend of the producer store: every PostgreSQL statement on the producer
//! schema. `advance` runs in writer tasks ([`WRITERS`], each owning one connection) that put
//! each batch of queued calls in ONE transaction, each call's writes in its own savepoint,
//! answering every call after the commit. Decisions are made on rows read inside that
//! transaction, the outbox cap on a count checked again when the counter is updated at commit
//! ([`CapCheck`]), and every write is a compare-and-set (the flow at the seq read, the event
//! id and `(flow_id, seq)` unique), so the other writer, or a second producer on the same
//! schema, can only make a call decide again, never commit two events for one step.
//!
//! The backlog counter is kept by explicit statements in the same transactions (one update
//! per transaction, not one per row as a trigger would), so the cap stays exact.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use deadpool_postgres::ClientWrapper as Conn;
use deadpool_postgres::{Object, Pool};
use proto::crash::{CrashPoint, CrashSwitch};
use proto::flow::FlowState;
use proto::pg::{PgKind, is_retryable, is_serialization_failure};
use proto::target::PgUrl;
use runtime::health::StorageHealth;
use runtime::metrics::{GaugeReader, GaugeSample};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

/// Bound parameters of one statement.
type Params<'a, const N: usize> = [&'a (dyn ToSql + Sync); N];

use super::{
    ADVANCE_BATCHES, AdvanceReply, Backlog, CompactReport, Decision, FlowRecord, LOST_ACCEPTED,
    LOST_BY_CONSUMER, LeaseRow, LeaseView, Lost, LostRows, MARK_BATCHES, NO_ANSWER, OutboxRecord, ProbedRow,
    Recorded, Role, StoreError, add_probed, decide,
};
use crate::request::AdvanceCommand;

/// The producer schema on PostgreSQL (version 1: the SQLite schema's tables and columns, the
/// identity in `meta`, accepted-by columns from the start; version 2: each outbox row's
/// partition and who marked it, the relays' lease and heartbeat tables; version 3: tombstones,
/// see [`UPGRADE_TO_3`]; version 4: no foreign key from the outbox to `flow`, see
/// [`UPGRADE_TO_4`]; version 5: consumer databases by key, see [`UPGRADE_TO_5`]; version 6:
/// compaction as acceptance is recorded, see [`UPGRADE_TO_6`]).
pub const KIND: PgKind = PgKind {
    name: "producer",
    schema: "ordered_events_producer",
    version: 6,
    ddl: DDL,
    upgrades: &[UPGRADE_TO_2, UPGRADE_TO_3, UPGRADE_TO_4, UPGRADE_TO_5, UPGRADE_TO_6],
};

/// Version 3 (retention): compaction drops an accepted row's body in place (`body` NULL) and
/// keeps its SHA-256 digest (`body_sha256`); a row has one or the other, never neither. The
/// partial index finds the rows still to compact without scanning the history. Autovacuum
/// runs on the outbox after 2 % of its rows changed (not the default 20 %), so the dead
/// versions compaction leaves are reclaimed early and their space reused by new rows,
/// instead of the table bloating between vacuums.
macro_rules! tombstones_sql {
    () => {
        r#"
ALTER TABLE outbox ALTER COLUMN body DROP NOT NULL;
ALTER TABLE outbox ADD COLUMN body_sha256 BYTEA
    CHECK(body_sha256 IS NULL OR octet_length(body_sha256) = 32);
ALTER TABLE outbox ADD CONSTRAINT outbox_body_or_digest CHECK(body IS NOT NULL OR body_sha256 IS NOT NULL);
CREATE INDEX outbox_compactable ON outbox(accepted_at_us) WHERE accepted = 1 AND body IS NOT NULL;
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
                        autovacuum_vacuum_insert_scale_factor = 0.02);
"#
    };
}

/// Version 2 to 3: see [`tombstones_sql`].
const UPGRADE_TO_3: &str = tombstones_sql!();

/// Version 4: the outbox's foreign key to `flow` goes. Its check was a per-row query locking
/// the flow row (`FOR KEY SHARE`) for every outbox insert, about 8 % of the server's CPU
/// per event with the consumer's (perf, `bench --backend postgres`), and it guarded nothing
/// the store does not already: an outbox row is only ever inserted by the statement batch
/// that inserted or moved its flow row, in the same transaction, and neither row is ever
/// deleted. SQLite keeps `foreign_keys=ON` and its key (SPEC §2 asks it of every SQLite
/// connection).
macro_rules! no_outbox_flow_key {
    () => {
        "ALTER TABLE outbox DROP CONSTRAINT outbox_flow_id_fkey;\n"
    };
}
const UPGRADE_TO_4: &str = no_outbox_flow_key!();

/// Version 5: an accepted row names the consumer database that holds it by an integer key
/// into `consumer_database` instead of the 32-character database id, which every accepted row
/// kept for ever in the row and again in `outbox_accepted_by` (as SQLite's schema 6 does).
/// `consumer_key` gives a database id its key (NULL for NULL), adding it the first time;
/// each statement in it reads the newest committed rows, so two relays adding the same id
/// at once get the same key. The upgrade keys the ids already recorded and rewrites the column once (an
/// `ALTER ... TYPE`, not an `UPDATE` that would leave a dead version of every accepted row);
/// an older relay still running then fails its mark (a text id into an integer column)
/// instead of mixing the two.
macro_rules! consumer_keys {
    () => {
        r#"
CREATE TABLE consumer_database(
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    database_id TEXT COLLATE "C" NOT NULL UNIQUE
);
CREATE FUNCTION consumer_key(db TEXT) RETURNS BIGINT LANGUAGE plpgsql STRICT AS $fn$
DECLARE
    key BIGINT;
BEGIN
    SELECT id INTO key FROM consumer_database WHERE database_id = db;
    IF key IS NULL THEN
        INSERT INTO consumer_database(database_id) VALUES (db)
            ON CONFLICT (database_id) DO NOTHING RETURNING id INTO key;
    END IF;
    IF key IS NULL THEN
        SELECT id INTO key FROM consumer_database WHERE database_id = db;
    END IF;
    RETURN key;
END
$fn$;
INSERT INTO consumer_database(database_id)
    SELECT DISTINCT accepted_by FROM outbox WHERE accepted_by IS NOT NULL ORDER BY 1;
DROP INDEX outbox_accepted_by;
ALTER TABLE outbox ALTER COLUMN accepted_by TYPE BIGINT USING consumer_key(accepted_by);
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
"#
    };
}
const UPGRADE_TO_5: &str = consumer_keys!();

/// Version 6: at `--retention 0` an accepted row loses its body in the very statement that
/// records its acceptance, instead of in a later pass. On PostgreSQL every update writes a
/// new version of the row (and entries in its indexes) for vacuum to reclaim: the pass's
/// update was a second one per row, after the relay's mark, and with the consumer's the
/// server spent 300-313 us of CPU per event at retention 0 against 203-213 without
/// compaction (README, Retention). A producer serving at retention 0 keeps
/// `compact_on_accept_until_us` a few seconds ahead of the database's clock (renewed by each
/// pass, so it lapses soon after the last such producer stops); while it is ahead, a relay's
/// mark drops the body of each row it newly accepts, keeps the digest, and adds the row and
/// its body's bytes to `compacted_rows` and `compacted_bytes`, which the next pass of any
/// producer reports (log line, metrics) and sets back to 0, so each row is counted once.
macro_rules! compact_on_accept {
    () => {
        r#"
ALTER TABLE backlog
    ADD COLUMN compact_on_accept_until_us BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN compacted_rows BIGINT NOT NULL DEFAULT 0 CHECK(compacted_rows >= 0),
    ADD COLUMN compacted_bytes BIGINT NOT NULL DEFAULT 0 CHECK(compacted_bytes >= 0);
"#
    };
}
const UPGRADE_TO_6: &str = compact_on_accept!();

/// The relays' shared state (version 2): one lease row per partition (who holds it, the
/// epoch every mark proves, until when by the database's clock) and one heartbeat row per
/// live relay instance, from which each relay computes its fair share.
macro_rules! lease_ddl {
    () => {
        r#"
CREATE TABLE relay_lease(
    partition SMALLINT PRIMARY KEY CHECK(partition >= 0 AND partition < 64),
    owner TEXT,
    epoch BIGINT NOT NULL DEFAULT 0,
    expires_at_us BIGINT NOT NULL DEFAULT 0,
    acquired_at_us BIGINT
);
INSERT INTO relay_lease(partition) SELECT generate_series(0, 63);
CREATE TABLE relay_instance(
    instance_id TEXT PRIMARY KEY,
    started_at_us BIGINT NOT NULL,
    expires_at_us BIGINT NOT NULL
);
"#
    };
}

/// Ids compare bytewise (`COLLATE "C"`), as SQLite compares them, so `(flow_id, seq)` order,
/// and with it the relay's `once` and its paging, is the same on both backends whatever the
/// database's locale.
const DDL: &str = concat!(
    r#"
CREATE TABLE flow(
    flow_id TEXT COLLATE "C" PRIMARY KEY,
    seq BIGINT NOT NULL CHECK(seq >= 1),
    state TEXT NOT NULL CHECK(state = 'reserved' OR state = 'confirmed' OR state = 'released'),
    amount BIGINT NOT NULL CHECK(amount >= 1)
);
CREATE TABLE outbox(
    event_id TEXT COLLATE "C" PRIMARY KEY,
    flow_id TEXT COLLATE "C" NOT NULL REFERENCES flow(flow_id),
    seq BIGINT NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    body TEXT NOT NULL,
    accepted INTEGER NOT NULL DEFAULT 0 CHECK(accepted IN (0,1)),
    attempts BIGINT NOT NULL DEFAULT 0,
    last_outcome TEXT,
    committed_at_us BIGINT NOT NULL,
    accepted_at_us BIGINT,
    accepted_by TEXT,
    accepted_position BIGINT,
    partition SMALLINT NOT NULL CHECK(partition >= 0 AND partition < 64),
    marked_by TEXT,
    marked_epoch BIGINT,
    UNIQUE(flow_id, seq)
);
-- Only unaccepted rows are indexed: finding the relay's work never scans the history.
CREATE INDEX outbox_unaccepted ON outbox(flow_id, seq) WHERE accepted = 0;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
-- The number of unaccepted outbox rows, kept exact by the store's own statements inside the
-- transactions that change it, so the outbox cap is an O(1) read.
CREATE TABLE backlog(
    id BIGINT PRIMARY KEY CHECK(id = 1),
    unaccepted BIGINT NOT NULL CHECK(unaccepted >= 0)
);
INSERT INTO backlog(id, unaccepted) VALUES (1, 0);
"#,
    lease_ddl!(),
    proto::flow_partition_sql!(),
    tombstones_sql!(),
    no_outbox_flow_key!(),
    consumer_keys!(),
    compact_on_accept!()
);

/// Version 1 to 2: every existing row gets its partition computed by the database with the
/// same function the producer uses ([`proto::partition`]), then the column is required.
const UPGRADE_TO_2: &str = concat!(
    proto::flow_partition_sql!(),
    r#"
ALTER TABLE outbox ADD COLUMN partition SMALLINT;
ALTER TABLE outbox ADD COLUMN marked_by TEXT;
ALTER TABLE outbox ADD COLUMN marked_epoch BIGINT;
UPDATE outbox SET partition = flow_partition(flow_id);
ALTER TABLE outbox ALTER COLUMN partition SET NOT NULL;
ALTER TABLE outbox ADD CONSTRAINT outbox_partition_check CHECK(partition >= 0 AND partition < 64);
"#,
    lease_ddl!()
);

/// The database's clock in microseconds: lease expiry is judged by one clock, whatever the
/// relays' hosts think the time is.
macro_rules! db_now_us {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
    };
}

/// Connections of a server's pool: the writers', and the rest for `GetFlow` and the metrics.
const SERVER_POOL: usize = 8;

/// Connections of a relay's pool (its reads and marks run one at a time).
const RELAY_POOL: usize = 2;
/// How often a transaction that lost a serialization race or a deadlock is run again.
const SERIALIZATION_RETRIES: u32 = 3;
/// How often one call is decided again after a concurrent writer changed what it read.
const RACE_RETRIES: u32 = 3;

/// Writer tasks taking batches from the one queue, each on its own connection, so one batch
/// is read and written while the other commits (see [`CapCheck`] for how the cap stays exact
/// without the backlog row locked for the whole transaction).
const WRITERS: usize = 2;

/// How a batch keeps the outbox cap exact.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CapCheck {
    /// The backlog row is read without a lock; when the whole batch fits under the cap by
    /// that read, every call is decided without the cap and the counter's own update at
    /// commit (`RETURNING` the count after every concurrent commit before it) checks that it
    /// still fits, else the batch is rolled back and run again `Locked`. Batches of the two
    /// writers and relay marks then wait for each other only at that update, not from BEGIN.
    AtCommit,
    /// The backlog row is locked first (`FOR UPDATE`), so each call is decided on the exact
    /// count: near the cap, and after an `AtCommit` batch did not fit.
    Locked,
}

impl From<tokio_postgres::Error> for StoreError {
    /// Connection loss, serialization failure, deadlock, too many connections: retryable;
    /// anything else (a constraint, a user's trigger raising) is a storage failure.
    fn from(e: tokio_postgres::Error) -> StoreError {
        let detail = proto::pg::describe(&e);
        // A read-only session (a standby after a failover) is noted, so the pool replaces
        // the sessions opened before, and retryable.
        if proto::pg::refuses_writes(&e) || is_retryable(&e) {
            StoreError::Unavailable { what: "postgres", detail }
        } else {
            // 53100 disk full, 58030 I/O error: the server's storage, not the work.
            let outage = e.code().is_some_and(|c| matches!(c.code(), "53100" | "58030"));
            StoreError::Storage { what: "postgres", detail, outage }
        }
    }
}

fn pool_error(e: deadpool_postgres::PoolError) -> StoreError {
    StoreError::Unavailable { what: "postgres", detail: format!("no connection: {e}") }
}

/// The PostgreSQL producer store: a pool, the database identity read at start-up, and for
/// the server the queue of the writer task.
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    database_id: String,
    crash: CrashSwitch,
    writer: Option<mpsc::Sender<AdvanceJob>>,
    /// The server's: whether the database takes its commits (see [`ServerHealth`]).
    health: Option<Arc<ServerHealth>>,
}

/// Whether the PostgreSQL server takes the producer's commits, for gRPC health: an `Advance`
/// batch that gets no connection, loses its connection, or finds it read-only (a standby),
/// turns health `NOT_SERVING` (logged once per cause); a probe task (a connection from the
/// pool that is not read-only, with the backoff of [`StorageHealth::keep_probing`]), or the
/// next committed batch, turns it back.
/// Callers get `UNAVAILABLE` meanwhile, as before; a load balancer also sees it in health.
#[derive(Debug, Default)]
struct ServerHealth(StorageHealth);

impl ServerHealth {
    /// Starts the probe task on the current runtime.
    fn start(pool: Pool) -> Arc<ServerHealth> {
        let health = Arc::new(ServerHealth::default());
        let probing = Arc::clone(&health);
        tokio::spawn(async move {
            let owed = || probing.0.is_failing();
            probing
                .0
                .keep_probing(owed, || {
                    let (pool, probing) = (pool.clone(), Arc::clone(&probing));
                    async move {
                        match pool.get().await {
                            Ok(client) => match writable(&client).await {
                                Ok(true) => probing.succeeded(),
                                Ok(false) => {
                                    proto::pg::note_writes_refused();
                                    probing.failed(proto::pg::READ_ONLY);
                                }
                                Err(e) => probing.failed(&proto::pg::describe(&e)),
                            },
                            Err(e) => probing.failed(&proto::pg::pool_error(&e)),
                        }
                    }
                })
                .await;
        });
        health
    }

    /// The server went away (no connection, or a lost one) or takes no writes:
    /// `NOT_SERVING`, logged when the cause changes.
    fn failed(&self, cause: &str) {
        if self.0.failed(cause) {
            tracing::error!(
                error = %cause,
                "producer database cannot commit: health NOT_SERVING, every Advance is answered UNAVAILABLE \
                 until it can (probed with backoff)"
            );
        }
    }

    /// A batch committed, or a probe got through: after a failure, logged once, and
    /// `SERVING`.
    fn succeeded(&self) {
        if let Some(cause) = self.0.succeeded() {
            tracing::info!(after = %cause, "producer database commits again: health SERVING");
        }
    }
}

/// Whether `client`'s session may write: not a standby's, nor opened read-only by default.
async fn writable(client: &Object) -> Result<bool, tokio_postgres::Error> {
    let rows = client.simple_query("SELECT current_setting('transaction_read_only')").await?;
    Ok(!rows
        .iter()
        .any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(row) if row.get(0) == Some("on"))))
}

/// One queued `Advance` and where its answer goes.
struct AdvanceJob {
    cmd: AdvanceCommand,
    reply: oneshot::Sender<Result<AdvanceReply, StoreError>>,
}

impl PgStore {
    /// Opens (the server: creating or upgrading) the producer schema; the server's role also
    /// starts the writer task.
    pub async fn open(url: &PgUrl, role: Role, crash: CrashSwitch) -> Result<PgStore, proto::pg::PgError> {
        let size = match role {
            Role::Server { .. } => SERVER_POOL,
            Role::Relay => RELAY_POOL,
        };
        let opened = proto::pg::open(url, &KIND, role.mode(), size).await?;
        let (writer, health) = match role {
            Role::Server { max_batch, max_unaccepted } => {
                tracing::info!(max_batch, ?max_unaccepted, "advance writer");
                let max_batch = max_batch.max(1);
                let (tx, rx) = mpsc::channel(max_batch.saturating_mul(4).clamp(64, 1 << 16));
                let queue = Arc::new(tokio::sync::Mutex::new(rx));
                let health = ServerHealth::start(opened.pool.clone());
                for _ in 0..WRITERS {
                    let (pool, queue, health) =
                        (opened.pool.clone(), Arc::clone(&queue), Arc::clone(&health));
                    tokio::spawn(run_writer(pool, queue, crash, max_batch, max_unaccepted, health));
                }
                (Some(tx), Some(health))
            }
            Role::Relay => (None, None),
        };
        Ok(PgStore { pool: opened.pool, database_id: opened.database_id, crash, writer, health })
    }

    /// The server's health from its database: `false` while the server is found gone.
    pub(super) fn serving(&self) -> Option<watch::Receiver<bool>> {
        self.health.as_ref().map(|h| h.0.serving())
    }

    pub(super) fn database_id(&self) -> &str {
        &self.database_id
    }

    async fn client(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(pool_error)
    }

    pub(super) async fn advance(&self, cmd: AdvanceCommand) -> Result<AdvanceReply, StoreError> {
        let Some(writer) = &self.writer else {
            return Err(StoreError::NotSupported("advance: this store was opened for the relay"));
        };
        let writer_gone =
            || StoreError::Unavailable { what: "advance", detail: "the writer task stopped".into() };
        let (reply, answer) = oneshot::channel();
        writer.send(AdvanceJob { cmd, reply }).await.map_err(|_| writer_gone())?;
        answer.await.map_err(|_| writer_gone())?
    }

    pub(super) async fn flow(&self, flow_id: String) -> Result<(FlowRecord, Vec<OutboxRecord>), StoreError> {
        let client = self.client().await?;
        // One statement, so the flow and its rows are one snapshot.
        let stmt = client
            .prepare_cached(
                "SELECT f.seq, f.state, f.amount, o.event_id, o.flow_id, o.seq, o.kind, o.schema, o.body,
                        o.accepted, o.attempts, o.last_outcome, o.committed_at_us, o.body_sha256
                 FROM (SELECT $1::text AS id) k
                 LEFT JOIN flow f ON f.flow_id = k.id
                 LEFT JOIN outbox o ON o.flow_id = k.id
                 ORDER BY o.seq",
            )
            .await
            .map_err(|e| StoreError::from(e).during("get_flow"))?;
        let rows =
            client.query(&stmt, &[&flow_id]).await.map_err(|e| StoreError::from(e).during("get_flow"))?;
        let Some(first) = rows.first() else { return Ok((FlowRecord::NEW, Vec::new())) };
        let flow = if first.try_get::<_, Option<i64>>(0).map_err(corrupt)?.is_some() {
            flow_from_row(first, 0, &flow_id)?
        } else {
            FlowRecord::NEW
        };
        let mut outbox = Vec::with_capacity(rows.len());
        for row in &rows {
            if row.try_get::<_, Option<String>>(3).map_err(corrupt)?.is_some() {
                outbox.push(outbox_from_row(row, 3)?);
            }
        }
        Ok((flow, outbox))
    }

    pub(super) fn pool_status(&self) -> runtime::metrics::PoolStatus {
        let status = self.pool.status();
        runtime::metrics::PoolStatus {
            max: status.max_size,
            size: status.size,
            available: status.available,
            waiting: status.waiting,
        }
    }

    pub(super) fn backlog_gauges<G>(&self, to_gauges: G) -> GaugeReader
    where
        G: Fn(Backlog) -> Vec<GaugeSample> + Send + Sync + 'static,
    {
        let pool = self.pool.clone();
        // The reader runs on a blocking thread of this runtime (the scrape's), which may wait
        // on the runtime's I/O while the runtime's own thread drives it.
        let handle = tokio::runtime::Handle::current();
        std::sync::Arc::new(move || {
            handle.block_on(async {
                let client = pool.get().await.map_err(|e| e.to_string())?;
                let row = client
                    .query_one(
                        "SELECT (SELECT unaccepted FROM backlog WHERE id = 1),
                                (SELECT min(committed_at_us) FROM outbox WHERE accepted = 0)",
                        &[],
                    )
                    .await
                    .map_err(|e| proto::pg::describe(&e))?;
                let unaccepted: Option<i64> = row.try_get(0).map_err(|e| e.to_string())?;
                let oldest_committed_at_us: Option<i64> = row.try_get(1).map_err(|e| e.to_string())?;
                let unaccepted = unaccepted.and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
                Ok(to_gauges(Backlog { unaccepted, oldest_committed_at_us }))
            })
        })
    }

    pub(super) async fn unaccepted_after(
        &self,
        after: (String, u64),
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        let what = "read unaccepted rows";
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome,
                committed_at_us, body_sha256
                 FROM outbox WHERE accepted = 0 AND (flow_id, seq) > ($1, $2)
                 ORDER BY flow_id, seq LIMIT $3",
            )
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let after_seq = seq_param(after.1)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = client
            .query(&stmt, &[&after.0, &after_seq, &limit])
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        super::refuse_compacted(rows.iter().map(|r| outbox_from_row(r, 0)).collect::<Result<_, _>>()?)
    }

    pub(super) async fn outbox_row(&self, event_id: String) -> Result<Option<OutboxRecord>, StoreError> {
        let client = self.client().await?;
        read_event(&client, &event_id).await.map_err(|e| e.during("read an outbox row"))
    }

    pub(super) async fn unaccepted_in(
        &self,
        after: (String, u64),
        limit: usize,
        partitions: Vec<u16>,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        let what = "read unaccepted rows of held partitions";
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome,
                 committed_at_us, body_sha256
                 FROM outbox WHERE accepted = 0 AND (flow_id, seq) > ($1, $2) AND partition = ANY($4)
                 ORDER BY flow_id, seq LIMIT $3",
            )
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let after_seq = seq_param(after.1)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let partitions: Vec<i16> = partitions.iter().map(|&p| p as i16).collect();
        let rows = client
            .query(&stmt, &[&after.0, &after_seq, &limit, &partitions])
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        super::refuse_compacted(rows.iter().map(|r| outbox_from_row(r, 0)).collect::<Result<_, _>>()?)
    }

    pub(super) async fn recorded_consumer_db(&self) -> Result<Option<String>, StoreError> {
        let what = "read the consumer database of accepted rows";
        let client = self.client().await?;
        // The last entry of `outbox_accepted_by` (an index-only read backwards), by its id.
        let row = client
            .query_one(
                "SELECT (SELECT database_id FROM consumer_database WHERE id =
                   (SELECT max(accepted_by) FROM outbox WHERE accepted = 1))",
                &[],
            )
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        row.try_get(0).map_err(|e| StoreError::from(e).during(what))
    }

    pub(super) async fn accepted_page(
        &self,
        consumer_db: String,
        below: Option<(u64, String)>,
        limit: usize,
        partitions: Option<Vec<u16>>,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let what = "read accepted rows by position";
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(
                "SELECT accepted_position, event_id FROM outbox
                 WHERE accepted = 1 AND accepted_position <= $2
                   AND accepted_by = (SELECT id FROM consumer_database WHERE database_id = $1)
                   AND (accepted_position < $2 OR event_id < $3)
                   AND ($5::smallint[] IS NULL OR partition = ANY($5))
                 ORDER BY accepted_position DESC, event_id DESC LIMIT $4",
            )
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        // The first page: below a position no row has (the id is then never compared).
        let (position, event_id) = below.unwrap_or((i64::MAX as u64, String::new()));
        let position = seq_param(position)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let partitions: Option<Vec<i16>> = partitions.map(|ps| ps.iter().map(|&p| p as i16).collect());
        let rows = client
            .query(&stmt, &[&consumer_db, &position, &event_id, &limit, &partitions])
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        rows.iter().map(|r| Ok((unsigned(r, 0, "accepted position")?, r.try_get(1)?))).collect()
    }

    pub(super) async fn record_deliveries(
        &self,
        answers: Vec<Recorded>,
        consumer_db: Option<String>,
    ) -> Result<Vec<u16>, StoreError> {
        let what = "record answers";
        let started = Instant::now();
        let client = self.client().await?;
        let crash = self.crash;
        let marked = answers.iter().any(|a| a.answer.holds_event());
        let consumer_db = consumer_db.as_deref();
        let now = runtime::now_us();
        let ids: Vec<&str> = answers.iter().map(|a| a.event_id.as_str()).collect();
        let words: Vec<String> = answers.iter().map(|a| a.answer.word().into_owned()).collect();
        let holds: Vec<bool> = answers.iter().map(|a| a.answer.holds_event()).collect();
        let at: Vec<_> = answers.iter().map(|a| a.accepted_by(consumer_db)).collect();
        let by: Vec<Option<&str>> = at.iter().map(|at| at.map(|at| at.consumer_db)).collect();
        let positions: Vec<Option<i64>> =
            at.iter().map(|at| at.map(|at| i64::try_from(at.position).unwrap_or(i64::MAX))).collect();
        let parts: Vec<Option<i16>> =
            answers.iter().map(|a| a.fence.as_ref().map(|f| f.partition as i16)).collect();
        let epochs: Vec<Option<i64>> = answers
            .iter()
            .map(|a| a.fence.as_ref().map(|f| i64::try_from(f.epoch).unwrap_or(i64::MAX)))
            .collect();
        let owner: Option<&str> = answers.iter().find_map(|a| a.fence.as_ref().map(|f| &*f.owner));
        // Answers per fenced partition (each event once), to compare with what landed.
        let mut sent: BTreeMap<u16, BTreeSet<&str>> = BTreeMap::new();
        for a in &answers {
            if let Some(f) = &a.fence {
                sent.entry(f.partition).or_default().insert(a.event_id.as_str());
            }
        }
        let in_transaction = crash.is_armed_at(CrashPoint::RelayAfterMark);
        let landed = retrying(client, what, async |client: &Conn| {
            {
                let stmt = client.prepare_cached(RECORD_SQL).await?;
                let params: Params<'_, 9> =
                    [&ids, &words, &holds, &by, &positions, &parts, &epochs, &owner, &now];
                // ONE statement: alone it is its own transaction; only an armed
                // `relay.after_mark` needs it inside BEGIN/COMMIT, to crash between the two.
                let rows = if in_transaction {
                    let (begun, rows) =
                        futures::join!(client.batch_execute("BEGIN"), client.query(&stmt, &params));
                    begun?;
                    let rows = rows?;
                    if marked {
                        crash.reach(CrashPoint::RelayAfterMark);
                    }
                    client.batch_execute("COMMIT").await?;
                    rows
                } else {
                    client.query(&stmt, &params).await?
                };
                let mut landed: BTreeMap<u16, u64> = BTreeMap::new();
                for row in &rows {
                    let part: Option<i16> = row.try_get(0)?;
                    let count = unsigned(row, 1, "recorded rows")?;
                    let newly = unsigned(row, 2, "newly accepted rows")?;
                    let counted = unsigned(row, 3, "backlog rows")?;
                    if newly > 0 && counted != 1 {
                        return Err(StoreError::Corrupt(format!(
                            "the backlog row is missing ({counted} rows updated)"
                        )));
                    }
                    if let Some(part) = part {
                        landed.insert(part as u16, count);
                    }
                }
                Ok(landed)
            }
        })
        .await?;
        MARK_BATCHES.record_timed(answers.len(), started);
        tracing::debug!(answers = answers.len(), "answers recorded");
        if marked {
            crash.reach(CrashPoint::RelayAfterMarkCommit);
        }
        let fenced = sent
            .iter()
            .filter(|(part, ids)| landed.get(part).copied().unwrap_or(0) < ids.len() as u64)
            .map(|(part, _)| *part)
            .collect();
        Ok(fenced)
    }

    pub(super) async fn lease_heartbeat(
        &self,
        instance: &str,
        ttl_us: i64,
        held: Vec<(u16, u64)>,
    ) -> Result<LeaseView, StoreError> {
        let what = "relay heartbeat";
        let client = self.client().await?;
        let beat = client
            .prepare_cached(concat!(
                "INSERT INTO relay_instance(instance_id, started_at_us, expires_at_us) VALUES ($1, ",
                db_now_us!(),
                ", ",
                db_now_us!(),
                " + $2) ON CONFLICT (instance_id) DO UPDATE SET expires_at_us = excluded.expires_at_us"
            ))
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let renew = client
            .prepare_cached(concat!(
                "UPDATE relay_lease l SET expires_at_us = ",
                db_now_us!(),
                " + $2 FROM unnest($3::smallint[], $4::bigint[]) AS h(p, e)
                 WHERE l.partition = h.p AND l.epoch = h.e AND l.owner = $1
                 RETURNING l.partition, l.epoch"
            ))
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let read = client
            .prepare_cached(concat!(
                "SELECT partition, epoch, owner, owner IS NULL OR expires_at_us < ",
                db_now_us!(),
                ", (SELECT count(*) FROM relay_instance WHERE expires_at_us >= ",
                db_now_us!(),
                ") FROM relay_lease ORDER BY partition"
            ))
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let forget = client
            .prepare_cached(concat!(
                "DELETE FROM relay_instance WHERE expires_at_us < ",
                db_now_us!(),
                " - 600000000"
            ))
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let parts: Vec<i16> = held.iter().map(|h| h.0 as i16).collect();
        let epochs: Vec<i64> = held.iter().map(|h| i64::try_from(h.1).unwrap_or(i64::MAX)).collect();
        let beat_params: Params<'_, 2> = [&instance, &ttl_us];
        let renew_params: Params<'_, 4> = [&instance, &ttl_us, &parts, &epochs];
        // Each statement alone (autocommit), all in one round trip, in this order.
        let (beaten, renewed, rows, forgotten) = futures::join!(
            client.execute(&beat, &beat_params),
            client.query(&renew, &renew_params),
            client.query(&read, &[]),
            client.execute(&forget, &[]),
        );
        beaten.map_err(|e| StoreError::from(e).during(what))?;
        forgotten.map_err(|e| StoreError::from(e).during(what))?;
        let renewed = renewed.map_err(|e| StoreError::from(e).during(what))?;
        let rows = rows.map_err(|e| StoreError::from(e).during(what))?;
        let mut view = LeaseView::default();
        for row in &renewed {
            view.renewed.push(lease_key(row)?);
        }
        for row in &rows {
            let (partition, epoch) = lease_key(row)?;
            view.leases.push(LeaseRow {
                partition,
                owner: row.try_get(2).map_err(corrupt)?,
                epoch,
                free: row.try_get(3).map_err(corrupt)?,
            });
            view.live_relays = unsigned(row, 4, "live relays")?;
        }
        Ok(view)
    }

    pub(super) async fn flow_lease(&self, partition: u16) -> Result<LeaseRow, StoreError> {
        let what = "read a partition's lease";
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(concat!(
                "SELECT partition, epoch, CASE WHEN expires_at_us >= ",
                db_now_us!(),
                " THEN owner END FROM relay_lease WHERE partition = $1"
            ))
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let row = client
            .query_one(&stmt, &[&(partition as i16)])
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let (partition, epoch) = lease_key(&row)?;
        let owner: Option<String> = row.try_get(2).map_err(corrupt)?;
        Ok(LeaseRow { partition, free: owner.is_none(), owner, epoch })
    }

    pub(super) async fn lease_acquire(
        &self,
        instance: &str,
        ttl_us: i64,
        partitions: Vec<u16>,
    ) -> Result<Vec<(u16, u64)>, StoreError> {
        let what = "take partition leases";
        let client = self.client().await?;
        // The condition is checked again on the newest row version when another relay took
        // one first (READ COMMITTED), so a lease goes to one relay only.
        let stmt = client
            .prepare_cached(concat!(
                "UPDATE relay_lease SET owner = $1, epoch = epoch + 1, expires_at_us = ",
                db_now_us!(),
                " + $2, acquired_at_us = ",
                db_now_us!(),
                " WHERE partition = ANY($3) AND (owner IS NULL OR expires_at_us < ",
                db_now_us!(),
                ") RETURNING partition, epoch"
            ))
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let parts: Vec<i16> = partitions.iter().map(|&p| p as i16).collect();
        let rows = client
            .query(&stmt, &[&instance, &ttl_us, &parts])
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        rows.iter().map(lease_key).collect()
    }

    pub(super) async fn lease_release(
        &self,
        instance: &str,
        leases: Vec<(u16, u64)>,
        retire: bool,
    ) -> Result<Vec<u16>, StoreError> {
        let what = "release partition leases";
        let client = self.client().await?;
        let release = client
            .prepare_cached(
                "UPDATE relay_lease l SET owner = NULL, expires_at_us = 0
                 FROM unnest($2::smallint[], $3::bigint[]) AS h(p, e)
                 WHERE l.partition = h.p AND l.epoch = h.e AND l.owner = $1
                 RETURNING l.partition, l.epoch",
            )
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        let parts: Vec<i16> = leases.iter().map(|h| h.0 as i16).collect();
        let epochs: Vec<i64> = leases.iter().map(|h| i64::try_from(h.1).unwrap_or(i64::MAX)).collect();
        let rows = client
            .query(&release, &[&instance, &parts, &epochs])
            .await
            .map_err(|e| StoreError::from(e).during(what))?;
        if retire {
            client
                .execute("DELETE FROM relay_instance WHERE instance_id = $1", &[&instance])
                .await
                .map_err(|e| StoreError::from(e).during(what))?;
        }
        rows.iter().map(|r| lease_key(r).map(|(p, _)| p)).collect()
    }

    pub(super) async fn record_unanswered(&self, event_ids: Vec<String>) -> Result<(), StoreError> {
        let client = self.client().await?;
        retrying(client, "record unanswered sends", async |client: &Conn| {
            {
                // One statement: every row counted once per send, in one transaction.
                let stmt = client
                    .prepare_cached(
                        "UPDATE outbox o SET attempts = o.attempts + s.sends, last_outcome = $2
                         FROM (SELECT id, count(*) AS sends FROM unnest($1::text[]) AS id GROUP BY id) s
                         WHERE o.event_id = s.id",
                    )
                    .await?;
                client.execute(&stmt, &[&event_ids, &NO_ANSWER]).await?;
                Ok(())
            }
        })
        .await
    }

    /// Compaction on PostgreSQL: each batch is ONE transaction whose one statement locks up
    /// to `batch` compactable rows, oldest accepted first (`SKIP LOCKED`: rows a relay is
    /// marking are taken by a later pass) and drops their bodies in place, keeping the
    /// digest the database computes from the same bytes. Autovacuum reclaims the old
    /// versions (see [`UPGRADE_TO_3`]).
    ///
    /// First it takes the rows relays compacted as they recorded their acceptance since the
    /// last pass (see [`UPGRADE_TO_6`]) into the report; with `on_accept` (a producer serving
    /// at retention 0) it also asks the relays to go on doing so for the next
    /// [`COMPACT_ON_ACCEPT_LEASE_US`].
    pub(super) async fn compact(
        &self,
        cutoff_us: i64,
        batch: usize,
        on_accept: bool,
    ) -> Result<CompactReport, StoreError> {
        let what = "compact outbox rows";
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let mut report = CompactReport::default();
        {
            let client = self.client().await?;
            let stmt =
                client.prepare_cached(COLLECT_SQL).await.map_err(|e| StoreError::from(e).during(what))?;
            let params: Params<'_, 2> = [&on_accept, &COMPACT_ON_ACCEPT_LEASE_US];
            let row = client.query_one(&stmt, &params).await.map_err(|e| StoreError::from(e).during(what))?;
            report.compacted = unsigned(&row, 0, "rows compacted on acceptance")?;
            report.body_bytes = unsigned(&row, 1, "bytes compacted on acceptance")?;
            report.when_finished = report.compacted;
            if on_accept && !ON_ACCEPT_ASKED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::info!(
                    lease_ms = COMPACT_ON_ACCEPT_LEASE_US / 1000,
                    "retention 0: relays compact each outbox row as they record its acceptance"
                );
            }
        }
        loop {
            let client = self.client().await?;
            // Plain awaits, no retry closure: this future is spawned by the background loop,
            // and must be provably `Send`. A failed batch is rolled back; the next pass
            // tries again (a connection that cannot roll back is dropped, not reused).
            let done = compact_batch(&client, cutoff_us, limit, self.crash).await;
            let (rows, bytes) = match done {
                Ok(done) => done,
                Err(e) => {
                    if client.batch_execute("ROLLBACK").await.is_err() {
                        drop(Object::take(client));
                    }
                    return Err(e.during(what));
                }
            };
            if rows == 0 {
                break;
            }
            self.crash.reach(CrashPoint::ProducerCompactAfterCommit);
            report.compacted += rows;
            report.body_bytes += bytes;
            report.batches += 1;
            if rows < batch as u64 {
                break;
            }
        }
        Ok(report)
    }

    /// `partitions`: only rows of these (a relay under leases judges only the rows it alone
    /// marks; another relay may mark its own rows while this one asks its consumer).
    /// `accept`: an operator accepted the loss of the compacted lost rows (see
    /// [`super::ProducerStore::accept_lost`]); otherwise they make it unmark nothing.
    pub(super) async fn resolve_lost(
        &self,
        consumer_db: String,
        lost: Lost,
        partitions: Option<Vec<u16>>,
        accept: bool,
    ) -> Result<LostRows, StoreError> {
        let client = self.client().await?;
        let partitions: Option<Vec<i16>> = partitions.map(|ps| ps.iter().map(|&p| p as i16).collect());
        // Probes judge this database's rows: no row is lost for being above a position.
        let (highest, probed) = match lost {
            Lost::Beyond(highest) => (seq_param(highest)?, Vec::new()),
            Lost::Probed(pairs) => (i64::MAX, pairs),
        };
        // A probed position past BIGINT names no row.
        let probed: Vec<(i64, String)> =
            probed.into_iter().filter_map(|(p, id)| Some((i64::try_from(p).ok()?, id))).collect();
        let probed_positions: Vec<i64> = probed.iter().map(|(p, _)| *p).collect();
        let probed_ids: Vec<String> = probed.into_iter().map(|(_, id)| id).collect();
        // The database's key, added now if no row names it yet: a relay that marks rows
        // for it meanwhile writes this key, so they are never judged another database's.
        let key: i64 = client
            .query_one("SELECT consumer_key($1)", &[&consumer_db])
            .await
            .map_err(|e| StoreError::from(e).during("key the consumer database"))?
            .try_get(0)?;
        retrying(client, "unmark rows the consumer lost", async |client: &Conn| {
            {
                let other = client.prepare_cached(OTHER_DATABASES_SQL).await?;
                let beyond = client
                    .prepare_cached(
                        "SELECT count(*) FROM outbox
                         WHERE accepted = 1 AND accepted_by = $1 AND accepted_position > $2
                           AND ($3::smallint[] IS NULL OR partition = ANY($3))",
                    )
                    .await?;
                let highest_recorded = client
                    .prepare_cached(
                        "SELECT coalesce(max(accepted_position), 0) FROM outbox
                         WHERE accepted = 1 AND accepted_by = $1
                           AND ($2::smallint[] IS NULL OR partition = ANY($2))",
                    )
                    .await?;
                let sample = client
                    .prepare_cached(
                        "SELECT event_id FROM outbox
                         WHERE accepted = 1 AND accepted_by IS NOT NULL
                           AND (accepted_by <> $1 OR accepted_position > $2)
                           AND ($3::smallint[] IS NULL OR partition = ANY($3))
                         ORDER BY flow_id, seq LIMIT 5",
                    )
                    .await?;
                // The lost rows compaction already reduced to tombstones: a count and the first
                // few ids in one row.
                let compacted = client
                    .prepare_cached(
                        "SELECT count(*), coalesce((array_agg(event_id ORDER BY flow_id, seq))[1:5], '{}')
                         FROM outbox
                         WHERE accepted = 1 AND accepted_by IS NOT NULL AND body IS NULL
                           AND (accepted_by <> $1 OR accepted_position > $2)
                           AND ($3::smallint[] IS NULL OR partition = ANY($3))",
                    )
                    .await?;
                // The probed rows still recorded as accepted by this database at the position
                // probed (none when judging by the highest position).
                let still_recorded = client
                    .prepare_cached(
                        "SELECT o.event_id, o.flow_id, o.seq, o.body IS NULL FROM outbox o
                         JOIN unnest($2::text[], $3::bigint[]) AS p(event_id, position)
                           ON o.event_id = p.event_id
                         WHERE o.accepted = 1 AND o.accepted_by = $1 AND o.accepted_position = p.position
                           AND ($4::smallint[] IS NULL OR o.partition = ANY($4))",
                    )
                    .await?;
                // BEGIN and the range reads in one round trip, one transaction with the unmark.
                let by: Params<'_, 2> = [&key, &partitions];
                let by_beyond: Params<'_, 3> = [&key, &highest, &partitions];
                let by_probe: Params<'_, 4> = [&key, &probed_ids, &probed_positions, &partitions];
                let (begun, other, beyond, recorded, probed) = futures::join!(
                    client.batch_execute("BEGIN"),
                    client.query_one(&other, &by),
                    client.query_one(&beyond, &by_beyond),
                    client.query_one(&highest_recorded, &by),
                    client.query(&still_recorded, &by_probe),
                );
                begun?;
                let count = |row: Row| -> Result<u64, StoreError> {
                    let n: i64 = row.try_get(0)?;
                    u64::try_from(n).map_err(|_| StoreError::Corrupt(format!("negative count {n}")))
                };
                let mut lost = LostRows {
                    other_database: count(other?)?,
                    beyond_history: count(beyond?)?,
                    highest_recorded: count(recorded?)?,
                    ..LostRows::default()
                };
                // The first ids and the tombstones among the lost rows are read only when rows
                // are lost: those reads visit every accepted row (a relay checks an unchanged
                // consumer at each session and every second while idle).
                if lost.other_database + lost.beyond_history > 0 {
                    let (sample, compacted) = futures::join!(
                        client.query(&sample, &by_beyond),
                        client.query_one(&compacted, &by_beyond),
                    );
                    let compacted = compacted?;
                    lost.sample = sample?.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>()?;
                    lost.compacted = unsigned(&compacted, 0, "compacted lost rows")?;
                    lost.compacted_sample = compacted.try_get(1)?;
                }
                let probed: Vec<ProbedRow> = probed?
                    .iter()
                    .map(|r| {
                        Ok(ProbedRow {
                            event_id: r.try_get(0)?,
                            flow_id: r.try_get(1)?,
                            seq: unsigned(r, 2, "seq")?,
                            compacted: r.try_get(3)?,
                        })
                    })
                    .collect::<Result<_, StoreError>>()?;
                add_probed(&mut lost, &probed);
                // Rows compacted to tombstones cannot be sent again: unmark nothing, the caller
                // stops, unless an operator accepted their loss.
                if lost.other_database + lost.beyond_history == 0 || (lost.compacted > 0 && !accept) {
                    client.batch_execute("ROLLBACK").await?;
                    return Ok(lost);
                }
                if lost.compacted > 0 {
                    // They stay accepted and name no consumer database any more, so no relay
                    // judges them lost again; the rest is unmarked below as always.
                    let accept_lost = client
                        .prepare_cached(
                            "UPDATE outbox SET accepted_by = NULL, accepted_position = NULL, last_outcome = $3
                             WHERE accepted = 1 AND accepted_by IS NOT NULL AND body IS NULL
                               AND (accepted_by <> $1 OR accepted_position > $2)
                               AND ($4::smallint[] IS NULL OR partition = ANY($4))",
                        )
                        .await?;
                    let accept_probed = client
                        .prepare_cached(
                            "UPDATE outbox o SET accepted_by = NULL, accepted_position = NULL, last_outcome = $4
                             FROM unnest($2::text[], $3::bigint[]) AS p(event_id, position)
                             WHERE o.event_id = p.event_id AND o.accepted = 1 AND o.accepted_by = $1
                               AND o.accepted_position = p.position AND o.body IS NULL
                               AND ($5::smallint[] IS NULL OR o.partition = ANY($5))",
                        )
                        .await?;
                    let mut accepted =
                        client.execute(&accept_lost, &[&key, &highest, &LOST_ACCEPTED, &partitions]).await?;
                    if !probed_ids.is_empty() {
                        let params: Params<'_, 5> =
                            [&key, &probed_ids, &probed_positions, &LOST_ACCEPTED, &partitions];
                        accepted += client.execute(&accept_probed, &params).await?;
                    }
                    lost.loss_accepted = accepted;
                }
                // Each unmark answers one row (see `unmarked_summary!`), however many rows it
                // changed: a replaced consumer database can lack the whole history.
                let unmark = client
                    .prepare_cached(unmarked_summary!(
                        "UPDATE outbox SET accepted = 0, accepted_at_us = NULL, accepted_by = NULL,
                             accepted_position = NULL, last_outcome = $3
                         WHERE accepted = 1 AND accepted_by IS NOT NULL
                           AND (accepted_by <> $1 OR accepted_position > $2)
                           AND ($4::smallint[] IS NULL OR partition = ANY($4))
                         RETURNING event_id, body IS NULL AS gone"
                    ))
                    .await?;
                let unmark_probed = client
                    .prepare_cached(unmarked_summary!(
                        "UPDATE outbox o SET accepted = 0, accepted_at_us = NULL, accepted_by = NULL,
                             accepted_position = NULL, last_outcome = $4
                         FROM unnest($2::text[], $3::bigint[]) AS p(event_id, position)
                         WHERE o.event_id = p.event_id AND o.accepted = 1 AND o.accepted_by = $1
                           AND o.accepted_position = p.position
                           AND ($5::smallint[] IS NULL OR o.partition = ANY($5))
                         RETURNING o.event_id, o.body IS NULL AS gone"
                    ))
                    .await?;
                let summary = |row: Row| -> Result<(u64, u64, Vec<String>), StoreError> {
                    Ok((unsigned(&row, 0, "unmarked rows")?, unsigned(&row, 1, "compacted rows")?, row.try_get(2)?))
                };
                let (mut unmarked, mut compacted, mut first) = summary(
                    client.query_one(&unmark, &[&key, &highest, &LOST_BY_CONSUMER, &partitions]).await?,
                )?;
                if !probed_ids.is_empty() {
                    let probed_params: Params<'_, 5> =
                        [&key, &probed_ids, &probed_positions, &LOST_BY_CONSUMER, &partitions];
                    let (rows, gone, ids) = summary(client.query_one(&unmark_probed, &probed_params).await?)?;
                    unmarked += rows;
                    compacted += gone;
                    first.extend(ids);
                }
                // The reads above ran before the rows were locked: a compaction that
                // committed in between shows here, on each row's newest version. Then
                // nothing is unmarked (nor any loss accepted), as when the reads saw it.
                if compacted > 0 {
                    client.batch_execute("ROLLBACK").await?;
                    first.sort();
                    first.truncate(5);
                    return Ok(LostRows { compacted, compacted_sample: first, loss_accepted: 0, ..lost });
                }
                commit_with_backlog(client, i64::try_from(unmarked).unwrap_or(i64::MAX)).await?;
                Ok(lost)
            }
        })
        .await
    }
}

/// An unmark statement (`$update`, returning each changed row's `event_id` and whether its
/// body is `gone`) as one row: the rows changed, how many of them were compacted meanwhile,
/// and the first five of those by id. The relay's process never holds the ids of a whole
/// lost history (it held every one, ~40 bytes each and a row's overhead, to find those few).
macro_rules! unmarked_summary {
    ($update:literal) => {
        concat!(
            "WITH u AS (",
            $update,
            ") SELECT count(*), count(*) FILTER (WHERE gone),
                      coalesce((array_agg(event_id ORDER BY event_id) FILTER (WHERE gone))[1:5], '{}')
               FROM u"
        )
    };
}
use unmarked_summary;

/// How many accepted rows name a consumer database other than `$1` (of the partitions `$2`,
/// or all): two range reads of `outbox_accepted_by`, the keys below and above `$1`, so a relay
/// judging an unchanged consumer visits no row of its history (`accepted_by <> $1` is no
/// range: it read every accepted row, 170 ms at 900 000 rows, at each judgement).
pub(super) const OTHER_DATABASES_SQL: &str = "
SELECT (SELECT count(*) FROM outbox WHERE accepted = 1 AND accepted_by < $1
          AND ($2::smallint[] IS NULL OR partition = ANY($2)))
     + (SELECT count(*) FROM outbox WHERE accepted = 1 AND accepted_by > $1
          AND ($2::smallint[] IS NULL OR partition = ANY($2)))";

/// The statement of one compaction batch (see [`compact_batch`]): `$1` the cutoff, `$2` the
/// most rows. The rows are taken in acceptance order, the order of `outbox_compactable`, so
/// the plan is a walk of that index that stops after `$2` rows, whatever the statistics and
/// whether the server runs a custom or a generic plan. Without the order the planner could
/// walk `outbox_accepted_by` past every compacted row for each batch (a pass over 300 000 rows
/// with 600 000 compacted before them: 95 s and 469 million index entries read, against 5.6 s
/// with the order, on two copies of one database), or build a bitmap of every row still to
/// compact for each batch.
pub(super) const COMPACT_SQL: &str = "WITH c AS (
         SELECT event_id, octet_length(convert_to(body, 'UTF8')) AS n FROM outbox
         WHERE accepted = 1 AND body IS NOT NULL AND accepted_at_us <= $1
         ORDER BY accepted_at_us LIMIT $2 FOR UPDATE SKIP LOCKED
     ),
     u AS (
         UPDATE outbox o SET body_sha256 = sha256(convert_to(o.body, 'UTF8')), body = NULL
         FROM c WHERE o.event_id = c.event_id
         RETURNING c.n
     )
     SELECT count(*), coalesce(sum(n), 0)::bigint FROM u";

/// How far ahead of the database's clock a producer at retention 0 asks relays to compact
/// rows as they record their acceptance (10 s; renewed by every pass, once a second at 0).
const COMPACT_ON_ACCEPT_LEASE_US: i64 = 10_000_000;

/// Set once this process has first asked relays to compact on acceptance (logged once).
static ON_ACCEPT_ASKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A pass's first statement: the rows (and body bytes) relays compacted on acceptance since
/// the last pass, set back to 0 (the row is locked, so two passes never take the same
/// count); with `$1` the request to go on for `$2` µs more. Nothing is written when there
/// is nothing to take or renew.
const COLLECT_SQL: &str = concat!(
    "WITH old AS (
         SELECT compacted_rows, compacted_bytes FROM backlog WHERE id = 1 FOR UPDATE
     ),
     taken AS (
         UPDATE backlog b SET compacted_rows = 0, compacted_bytes = 0,
             compact_on_accept_until_us = CASE WHEN $1 THEN ",
    db_now_us!(),
    " + $2 ELSE b.compact_on_accept_until_us END
         FROM old WHERE b.id = 1 AND ($1 OR old.compacted_rows > 0)
     )
     SELECT compacted_rows, compacted_bytes FROM old"
);

/// One compaction batch, ONE transaction: its one statement locks up to `limit` accepted
/// rows with a body accepted at or before `cutoff_us`, oldest first (see [`COMPACT_SQL`];
/// `SKIP LOCKED`: rows a relay is marking are left to a later pass) and drops their bodies
/// in place, keeping the digest the database computes from the same UTF-8 bytes. Reaches
/// `producer.compact.after_batch` before the commit. Returns the rows and body bytes.
async fn compact_batch(
    client: &Conn,
    cutoff_us: i64,
    limit: i64,
    crash: CrashSwitch,
) -> Result<(u64, u64), StoreError> {
    let stmt = client.prepare_cached(COMPACT_SQL).await?;
    let params: Params<'_, 2> = [&cutoff_us, &limit];
    let (begun, row) = futures::join!(client.batch_execute("BEGIN"), client.query_one(&stmt, &params));
    begun?;
    let row = row?;
    let rows = unsigned(&row, 0, "compacted rows")?;
    let bytes = unsigned(&row, 1, "compacted bytes")?;
    if rows == 0 {
        client.batch_execute("ROLLBACK").await?;
        return Ok((0, 0));
    }
    crash.reach(CrashPoint::ProducerCompactAfterBatch);
    client.batch_execute("COMMIT").await?;
    Ok((rows, bytes))
}

/// Records a run of answers in ONE statement. `t`: the answers in order; `a`: one line per
/// event (its sends counted, the last answer's word, accepted when any answer holds it, the
/// last holding answer's consumer and position); `k`: the key of each consumer database
/// named (`consumer_key`, added the first time); `fence`: the lease rows that still name
/// this owner, share-locked, so a takeover waits for this statement and a takeover that
/// committed first leaves them out; `c`: whether a producer at `--retention 0` asks for
/// compaction as acceptance is recorded ([`UPGRADE_TO_6`]); `ok`: the outbox rows to record,
/// locked and read at their newest version (an unfenced answer needs no lease), with the
/// body's size of each newly accepted row to compact; `u` records them (and drops those
/// bodies, keeping their digests); `b` moves the backlog counter by the rows newly accepted
/// and counts the rows compacted. Returns per partition how many rows landed, with the
/// backlog update's row count and the newly accepted rows.
const RECORD_SQL: &str = concat!(
    "
WITH t AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::boolean[], $4::text[], $5::bigint[],
                         $6::smallint[], $7::bigint[])
        WITH ORDINALITY AS t(id, word, holds, by, pos, part, epoch, n)
),
a AS (
    SELECT id, count(*) AS sends, (array_agg(word ORDER BY n DESC))[1] AS word, bool_or(holds) AS holds,
           (array_agg(by ORDER BY n DESC) FILTER (WHERE holds AND by IS NOT NULL))[1] AS by,
           (array_agg(pos ORDER BY n DESC) FILTER (WHERE holds AND by IS NOT NULL))[1] AS pos,
           min(part) AS part, min(epoch) AS epoch
    FROM t GROUP BY id
),
k AS MATERIALIZED (
    SELECT db, consumer_key(db) AS key FROM (SELECT DISTINCT by AS db FROM a WHERE by IS NOT NULL) d
),
fence AS (
    SELECT l.partition, l.epoch FROM relay_lease l
    WHERE l.owner = $8 AND l.partition IN (SELECT part FROM a WHERE epoch IS NOT NULL)
    FOR SHARE
),
c AS (
    SELECT compact_on_accept_until_us > ",
    db_now_us!(),
    " AS now FROM backlog WHERE id = 1
),
ok AS (
    SELECT o.event_id, o.accepted AS was, a.sends, a.word, a.holds, a.by, a.pos, a.part, a.epoch,
           CASE WHEN a.holds AND o.accepted = 0 AND o.body IS NOT NULL AND (SELECT now FROM c)
                THEN octet_length(convert_to(o.body, 'UTF8')) END AS compact_bytes
    FROM outbox o JOIN a ON o.event_id = a.id
    WHERE a.epoch IS NULL OR EXISTS (SELECT 1 FROM fence f WHERE f.partition = a.part AND f.epoch = a.epoch)
    FOR UPDATE OF o
),
u AS (
    UPDATE outbox o SET attempts = o.attempts + ok.sends, last_outcome = ok.word,
        accepted_at_us = CASE WHEN ok.holds AND ok.was = 0 THEN $9 ELSE o.accepted_at_us END,
        accepted = CASE WHEN ok.holds THEN 1 ELSE o.accepted END,
        accepted_by = CASE WHEN ok.by IS NOT NULL THEN (SELECT k.key FROM k WHERE k.db = ok.by)
                           ELSE o.accepted_by END,
        accepted_position = CASE WHEN ok.by IS NOT NULL THEN ok.pos ELSE o.accepted_position END,
        marked_by = CASE WHEN ok.holds THEN $8 ELSE o.marked_by END,
        marked_epoch = CASE WHEN ok.holds THEN ok.epoch ELSE o.marked_epoch END,
        body_sha256 = CASE WHEN ok.compact_bytes IS NOT NULL THEN sha256(convert_to(o.body, 'UTF8'))
                           ELSE o.body_sha256 END,
        body = CASE WHEN ok.compact_bytes IS NOT NULL THEN NULL ELSE o.body END
    FROM ok WHERE o.event_id = ok.event_id
    RETURNING ok.part, ok.holds AND ok.was = 0 AS newly, ok.compact_bytes
),
b AS (
    UPDATE backlog SET unaccepted = unaccepted - (SELECT count(*) FROM u WHERE newly),
        compacted_rows = compacted_rows + (SELECT count(compact_bytes) FROM u),
        compacted_bytes = compacted_bytes + (SELECT coalesce(sum(compact_bytes), 0) FROM u)
    WHERE id = 1 AND EXISTS (SELECT 1 FROM u WHERE newly)
    RETURNING 1
)
SELECT part, count(*), (SELECT count(*) FROM u WHERE newly), (SELECT count(*) FROM b) FROM u GROUP BY part"
);

/// `(partition, epoch)` of a lease row's first two columns.
fn lease_key(row: &Row) -> Result<(u16, u64), StoreError> {
    let partition: i16 = row.try_get(0).map_err(corrupt)?;
    let partition =
        u16::try_from(partition).map_err(|_| StoreError::Corrupt(format!("partition {partition}")))?;
    Ok((partition, unsigned(row, 1, "lease epoch")?))
}

/// Adds `delta` to the backlog counter and commits, in one round trip. The counter's update
/// is checked before the commit's answer is trusted: PostgreSQL answers `COMMIT` on a failed
/// transaction with a rollback, not an error.
async fn commit_with_backlog(client: &Conn, delta: i64) -> Result<(), StoreError> {
    if delta == 0 {
        client.batch_execute("COMMIT").await?;
        return Ok(());
    }
    let stmt = client.prepare_cached("UPDATE backlog SET unaccepted = unaccepted + $1 WHERE id = 1").await?;
    let params: Params<'_, 1> = [&delta];
    let (counted, committed) = futures::join!(client.execute(&stmt, &params), client.batch_execute("COMMIT"));
    match counted {
        Ok(1) => {}
        Ok(n) => return Err(StoreError::Corrupt(format!("the backlog row is missing ({n} rows updated)"))),
        Err(e) => return Err(e.into()),
    }
    committed?;
    Ok(())
}

/// An `Advance` batch's counter update and commit. With `cap` (a batch decided without it,
/// see [`CapCheck::AtCommit`]) the update returns the count after every transaction that
/// committed before it (it waits for their row lock, then reads the newest count), and a
/// count over the cap rolls the batch back instead: `false`, nothing committed.
async fn commit_within(client: &Conn, delta: i64, cap: Option<u64>) -> Result<bool, StoreError> {
    let Some(cap) = cap else {
        commit_with_backlog(client, delta).await?;
        return Ok(true);
    };
    let stmt = client
        .prepare_cached("UPDATE backlog SET unaccepted = unaccepted + $1 WHERE id = 1 RETURNING unaccepted")
        .await?;
    let params: Params<'_, 1> = [&delta];
    let Some(row) = client.query_opt(&stmt, &params).await? else {
        return Err(StoreError::Corrupt("the backlog row is missing (0 rows updated)".into()));
    };
    if unsigned(&row, 0, "backlog.unaccepted")? > cap {
        client.batch_execute("ROLLBACK").await?;
        return Ok(false);
    }
    client.batch_execute("COMMIT").await?;
    Ok(true)
}

/// Runs `work` (a whole transaction, from `BEGIN` to `COMMIT`) and runs it again when it
/// lost a serialization race or a deadlock, up to [`SERIALIZATION_RETRIES`] times: safe,
/// since nothing of a failed attempt committed and nothing was answered. After any failure
/// the transaction is rolled back; a connection that cannot even do that is taken out of the
/// pool.
async fn retrying<T>(
    client: Object,
    what: &'static str,
    work: impl AsyncFn(&Conn) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut guard = Detach(Some(client));
    let mut attempt = 0;
    loop {
        let Some(client) = guard.0.as_ref() else {
            return Err(StoreError::Unavailable { what, detail: "the connection was dropped".into() });
        };
        let e = match work(client).await {
            Ok(value) => {
                guard.0.take();
                return Ok(value);
            }
            Err(e) => e,
        };
        if client.batch_execute("ROLLBACK").await.is_err() {
            // Broken or stuck: the guard drops it instead of handing it to the next user.
            return Err(e.during(what));
        }
        attempt += 1;
        if !is_serialization(&e) || attempt > SERIALIZATION_RETRIES {
            guard.0.take();
            return Err(e.during(what));
        }
        tracing::debug!(attempt, error = %e, "{what}: serialization failure or deadlock, running it again");
    }
}

/// Holds a pooled connection while a transaction may be open on it. Dropped holding one (the
/// caller's future was cancelled mid-transaction, or the rollback failed), it closes the
/// connection, so the server rolls back and the pool never hands out an open transaction.
struct Detach(Option<Object>);

impl Drop for Detach {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(Object::take(client));
        }
    }
}

/// A serialization failure or deadlock ([`proto::pg::describe`] starts with the SQLSTATE).
fn is_serialization(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable { detail, .. } if detail.starts_with("40001") || detail.starts_with("40P01"))
}

/// A statement refused because the session is read-only ([`proto::pg::READ_ONLY`]).
fn is_read_only(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable { detail, .. } if detail.starts_with("25006"))
}

fn corrupt(e: tokio_postgres::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// The partition of a flow as PostgreSQL's SMALLINT (below 64, so it fits).
fn partition_param(flow_id: &str) -> i16 {
    proto::partition::flow_partition(flow_id) as i16
}

/// A seq or position as PostgreSQL's BIGINT (every seq is at most 2^53).
fn seq_param(n: u64) -> Result<i64, StoreError> {
    i64::try_from(n).map_err(|_| StoreError::storage("postgres", format!("{n} exceeds BIGINT")))
}

fn unsigned(row: &Row, i: usize, what: &str) -> Result<u64, StoreError> {
    let n: i64 = row.try_get(i).map_err(corrupt)?;
    u64::try_from(n).map_err(|_| StoreError::Corrupt(format!("{what}: negative value {n}")))
}

/// The flow of `row` from column `at` on (`seq, state, amount`).
fn flow_from_row(row: &Row, at: usize, flow_id: &str) -> Result<FlowRecord, StoreError> {
    let seq = unsigned(row, at, "flow.seq")?;
    let state: String = row.try_get(at + 1).map_err(corrupt)?;
    let amount: i64 = row.try_get(at + 2).map_err(corrupt)?;
    let state = FlowState::parse(&state)
        .ok_or_else(|| StoreError::Corrupt(format!("flow {flow_id}: unknown state {state:?}")))?;
    Ok(FlowRecord { seq, state, amount })
}

/// The outbox row of `row` from column `at` on (`event_id, flow_id, seq, kind, schema, body,
/// accepted, attempts, last_outcome, committed_at_us, body_sha256`). A row without a body is a
/// tombstone (compacted).
fn outbox_from_row(row: &Row, at: usize) -> Result<OutboxRecord, StoreError> {
    let schema: i32 = row.try_get(at + 4).map_err(corrupt)?;
    let accepted: i32 = row.try_get(at + 6).map_err(corrupt)?;
    let body: Option<String> = row.try_get(at + 5).map_err(corrupt)?;
    let digest: Option<Vec<u8>> = row.try_get(at + 10).map_err(corrupt)?;
    let body_sha256 = match digest {
        None => None,
        Some(d) => Some(
            <[u8; 32]>::try_from(d.as_slice())
                .map_err(|_| StoreError::Corrupt(format!("outbox.body_sha256 of {} bytes", d.len())))?,
        ),
    };
    Ok(OutboxRecord {
        event_id: row.try_get(at).map_err(corrupt)?,
        flow_id: row.try_get(at + 1).map_err(corrupt)?,
        seq: unsigned(row, at + 2, "outbox.seq")?,
        kind: row.try_get(at + 3).map_err(corrupt)?,
        schema: u32::try_from(schema).map_err(|_| StoreError::Corrupt(format!("outbox.schema {schema}")))?,
        compacted: body.is_none(),
        body: body.unwrap_or_default(),
        body_sha256,
        accepted: accepted != 0,
        attempts: unsigned(row, at + 7, "outbox.attempts")?,
        last_outcome: row.try_get(at + 8).map_err(corrupt)?,
        committed_at_us: row.try_get(at + 9).map_err(corrupt)?,
        row_id: None,
    })
}

const EVENT_SQL: &str = "SELECT event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome,
                committed_at_us, body_sha256
     FROM outbox WHERE event_id = $1";
const FLOW_SQL: &str = "SELECT seq, state, amount FROM flow WHERE flow_id = $1";

async fn read_event(client: &Conn, event_id: &str) -> Result<Option<OutboxRecord>, StoreError> {
    let stmt = client.prepare_cached(EVENT_SQL).await?;
    let row = client.query_opt(&stmt, &[&event_id]).await?;
    row.map(|r| outbox_from_row(&r, 0)).transpose()
}

// ---------------------------------------------------------------------------------------
// The writer: group commit of `Advance`.

/// Takes every call queued (up to `max_batch`) into one transaction on the writer's own
/// connection, answers each after the commit, until every sender is gone.
async fn run_writer(
    pool: Pool,
    queue: Arc<tokio::sync::Mutex<mpsc::Receiver<AdvanceJob>>>,
    crash: CrashSwitch,
    max_batch: usize,
    max_unaccepted: Option<u64>,
    health: Arc<ServerHealth>,
) {
    let mut conn: Option<Object> = None;
    loop {
        let mut jobs = Vec::with_capacity(max_batch.min(1024));
        {
            // The queue is this writer's while it waits for a first call and takes what else
            // is queued; the other writer waits for the queue meanwhile.
            let mut queue = queue.lock().await;
            let Some(first) = queue.recv().await else { return };
            jobs.push(first);
            while jobs.len() < max_batch {
                match queue.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
        }
        let (cmds, replies): (Vec<_>, Vec<_>) = jobs.into_iter().map(|j| (j.cmd, j.reply)).unzip();
        let started = Instant::now();
        let results = advance_batch_on(&pool, &mut conn, &cmds, &crash, max_unaccepted, &health).await;
        ADVANCE_BATCHES.record_timed(cmds.len(), started);
        tracing::debug!(calls = cmds.len(), us = started.elapsed().as_micros() as u64, "advance batch");
        for (reply, result) in replies.into_iter().zip(results) {
            // The caller may have gone away (deadline, disconnect); its answer is moot.
            let _ = reply.send(result);
        }
    }
}

/// One batch on the writer's connection (taken from the pool when there is none), run again
/// whole after a serialization failure or deadlock. A failed batch is rolled back; a
/// connection that cannot roll back is dropped, so the next batch starts on a new one. No
/// connection, or a lost one, is reported to `health`; a batch that ran, too.
async fn advance_batch_on(
    pool: &Pool,
    conn: &mut Option<Object>,
    cmds: &[AdvanceCommand],
    crash: &CrashSwitch,
    max_unaccepted: Option<u64>,
    health: &ServerHealth,
) -> Vec<Result<AdvanceReply, StoreError>> {
    let mut attempt = 0;
    let mut check = CapCheck::AtCommit;
    loop {
        // A connection the server closed since the last batch (a restart, an outage) is not
        // used for this one.
        if conn.as_ref().is_some_and(|client| client.is_closed())
            && let Some(closed) = conn.take()
        {
            drop(Object::take(closed));
        }
        let client = match conn {
            Some(client) => client,
            None => match pool.get().await {
                Ok(client) => conn.insert(client),
                Err(e) => {
                    health.failed(&proto::pg::pool_error(&e));
                    return all_failed(cmds, pool_error(e).during("advance"));
                }
            },
        };
        match advance_batch(client, cmds, crash, max_unaccepted, check).await {
            Ok(Some(results)) => {
                health.succeeded();
                return results;
            }
            Ok(None) => {
                // The batch did not fit under the cap by the unlocked read or at commit:
                // nothing of it committed; run it again deciding on the exact count.
                check = CapCheck::Locked;
            }
            Err(e) => {
                // A connection that cannot even roll back is lost (the server went away, or
                // ended the session); a read-only one stays read-only (a standby's).
                let read_only = is_read_only(&e);
                let lost = read_only || client.batch_execute("ROLLBACK").await.is_err();
                if lost {
                    if let Some(broken) = conn.take() {
                        drop(Object::take(broken));
                    }
                }
                attempt += 1;
                let again = is_serialization(&e);
                if !again || attempt > SERIALIZATION_RETRIES {
                    tracing::warn!(error = %e, calls = cmds.len(), "advance batch rolled back whole");
                    if read_only {
                        health.failed(proto::pg::READ_ONLY);
                    } else if lost {
                        health.failed(&e.to_string());
                    }
                    return all_failed(cmds, e.during("advance"));
                }
            }
        }
    }
}

fn all_failed(cmds: &[AdvanceCommand], e: StoreError) -> Vec<Result<AdvanceReply, StoreError>> {
    cmds.iter().map(|_| Err(e.clone())).collect()
}

/// How one call's writes ended.
enum StepEnd {
    /// Flow written and event inserted (within the call's savepoint, released).
    Written,
    /// A concurrent writer changed what the call read: rolled back to the savepoint; decide
    /// again on fresh reads.
    Raced,
    /// The call failed alone (e.g. a trigger raised); rolled back to its savepoint.
    Failed(StoreError),
}

/// SPEC §5 for a batch of calls in ONE transaction (see [`run_writer`]). `Err` means the
/// transaction is lost (connection, deadlock): no call of it committed.
async fn advance_batch(
    client: &Conn,
    cmds: &[AdvanceCommand],
    crash: &CrashSwitch,
    max_unaccepted: Option<u64>,
    check: CapCheck,
) -> Result<Option<Vec<Result<AdvanceReply, StoreError>>>, StoreError> {
    let lock = client
        .prepare_cached(match check {
            CapCheck::AtCommit => "SELECT unaccepted FROM backlog WHERE id = 1",
            CapCheck::Locked => "SELECT unaccepted FROM backlog WHERE id = 1 FOR UPDATE",
        })
        .await?;
    let flows_stmt =
        client.prepare_cached("SELECT flow_id, seq, state, amount FROM flow WHERE flow_id = ANY($1)").await?;
    let events_stmt = client
        .prepare_cached(
            "SELECT event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome,
                committed_at_us, body_sha256
             FROM outbox WHERE event_id = ANY($1)",
        )
        .await?;
    let flow_ids: Vec<&str> = cmds.iter().map(|c| c.flow_id.as_str()).collect();
    let event_ids: Vec<&str> = cmds.iter().map(|c| c.event_id.as_str()).collect();
    // One round trip: BEGIN, the backlog row locked (this batch and every relay mark now take
    // turns, so the cap below is exact), then every flow and event id the batch names, read
    // after the lock was granted.
    let flow_params: Params<'_, 1> = [&flow_ids];
    let event_params: Params<'_, 1> = [&event_ids];
    let (begun, locked, flow_rows, event_rows) = futures::join!(
        client.batch_execute("BEGIN"),
        client.query_one(&lock, &[]),
        client.query(&flows_stmt, &flow_params),
        client.query(&events_stmt, &event_params),
    );
    begun?;
    let mut unaccepted = unsigned(&locked?, 0, "backlog.unaccepted")?;
    // `AtCommit`: decided without the cap when the whole batch fits by this read, the cap
    // checked at commit; otherwise the batch runs `Locked`.
    let (max_unaccepted, commit_cap) = match (check, max_unaccepted) {
        (CapCheck::AtCommit, Some(cap)) if unaccepted.saturating_add(cmds.len() as u64) <= cap => {
            (None, Some(cap))
        }
        (CapCheck::AtCommit, Some(_)) => {
            client.batch_execute("ROLLBACK").await?;
            return Ok(None);
        }
        (_, cap) => (cap, None),
    };
    let mut flows: HashMap<String, FlowRecord> = HashMap::new();
    for row in flow_rows? {
        let flow_id: String = row.try_get(0).map_err(corrupt)?;
        let flow = flow_from_row(&row, 1, &flow_id)?;
        flows.insert(flow_id, flow);
    }
    let mut events: HashMap<String, OutboxRecord> = HashMap::new();
    for row in event_rows? {
        let event = outbox_from_row(&row, 0)?;
        events.insert(event.event_id.clone(), event);
    }
    let pipelined = !crash.is_armed_at(CrashPoint::ProducerAfterFlowUpdate)
        && !crash.is_armed_at(CrashPoint::ProducerAfterOutboxInsert);
    if pipelined {
        if let Some((results, written)) =
            advance_pipelined(client, cmds, &flows, &events, unaccepted, max_unaccepted).await?
        {
            if written == 0 {
                client.batch_execute("ROLLBACK").await?;
                return Ok(Some(results));
            }
            if !commit_within(client, written, commit_cap).await? {
                return Ok(None);
            }
            crash.reach(CrashPoint::ProducerAfterCommit);
            return Ok(Some(results));
        }
        // Some write failed or raced: everything of the fast path was rolled back; decide
        // the batch again call by call.
    }
    let mut results = Vec::with_capacity(cmds.len());
    let mut written: i64 = 0;
    for cmd in cmds {
        let mut races = 0;
        let result = loop {
            let flow = flows.get(&cmd.flow_id).cloned().unwrap_or(FlowRecord::NEW);
            let backlog = max_unaccepted.map(|cap| (unaccepted, cap));
            let decision = decide(&flow, events.get(&cmd.event_id), cmd, backlog);
            let Decision::Write { flow: next, event } = &decision else { break Ok(decision.into_reply()) };
            match write_step(client, flow.seq, next, event, crash).await? {
                StepEnd::Written => {
                    flows.insert(cmd.flow_id.clone(), next.clone());
                    events.insert(cmd.event_id.clone(), event.clone());
                    unaccepted += 1;
                    written += 1;
                    break Ok(decision.into_reply());
                }
                StepEnd::Failed(e) => break Err(e.during("advance")),
                StepEnd::Raced if races < RACE_RETRIES => {
                    races += 1;
                    // What another writer committed since the batch read: read it again.
                    let fresh_flow = client.prepare_cached(FLOW_SQL).await?;
                    let fresh_event = client.prepare_cached(EVENT_SQL).await?;
                    let (flow_param, event_param): (Params<'_, 1>, Params<'_, 1>) =
                        ([&cmd.flow_id], [&cmd.event_id]);
                    let (f, e) = futures::join!(
                        client.query_opt(&fresh_flow, &flow_param),
                        client.query_opt(&fresh_event, &event_param),
                    );
                    match f? {
                        Some(row) => flows.insert(cmd.flow_id.clone(), flow_from_row(&row, 0, &cmd.flow_id)?),
                        None => flows.remove(&cmd.flow_id),
                    };
                    match e? {
                        Some(row) => events.insert(cmd.event_id.clone(), outbox_from_row(&row, 0)?),
                        None => events.remove(&cmd.event_id),
                    };
                }
                StepEnd::Raced => {
                    break Err(StoreError::Unavailable {
                        what: "advance",
                        detail: "other writers kept changing this flow; retry".into(),
                    });
                }
            }
        };
        results.push(result);
    }
    if written == 0 {
        // Nothing was written: no commit, no crash point.
        client.batch_execute("ROLLBACK").await?;
        return Ok(Some(results));
    }
    if !commit_within(client, written, commit_cap).await? {
        return Ok(None);
    }
    crash.reach(CrashPoint::ProducerAfterCommit);
    Ok(Some(results))
}

/// The fast path of a batch: every call decided in queue order on what the batch read (each
/// write applied to that view, as it would be after its commit), then every write sent at
/// once in ONE round trip, inside a savepoint of the whole batch: three multi-row
/// statements, each flow moved once by compare-and-set from the seq read, every event
/// inserted, and each statement's row count checked against the plan. `None`
/// when any write failed (a trigger, a unique violation) or found its flow moved: the
/// savepoint is rolled back and the caller runs the batch call by call, so a failing call
/// still fails alone. Used only when neither pre-commit crash point is armed, since it
/// reaches no point between the flow write and the insert; the call-by-call path does.
async fn advance_pipelined(
    client: &Conn,
    cmds: &[AdvanceCommand],
    flows: &HashMap<String, FlowRecord>,
    events: &HashMap<String, OutboxRecord>,
    unaccepted: u64,
    max_unaccepted: Option<u64>,
) -> Result<Option<(Vec<Result<AdvanceReply, StoreError>>, i64)>, StoreError> {
    let mut flows = flows.clone();
    let mut events = events.clone();
    let mut unaccepted = unaccepted;
    let mut results = Vec::with_capacity(cmds.len());
    // (from seq, flow after, event) of each write, in queue order.
    let mut writes: Vec<(i64, FlowRecord, OutboxRecord)> = Vec::new();
    for cmd in cmds {
        let flow = flows.get(&cmd.flow_id).cloned().unwrap_or(FlowRecord::NEW);
        let decision =
            decide(&flow, events.get(&cmd.event_id), cmd, max_unaccepted.map(|cap| (unaccepted, cap)));
        if let Decision::Write { flow: next, event } = &decision {
            flows.insert(cmd.flow_id.clone(), next.clone());
            events.insert(cmd.event_id.clone(), event.clone());
            unaccepted += 1;
            writes.push((seq_param(flow.seq)?, next.clone(), event.clone()));
        }
        results.push(Ok(decision.into_reply()));
    }
    if writes.is_empty() {
        return Ok(Some((results, 0)));
    }
    // Each flow moves once, from the seq the batch read to its last write's state; a new
    // flow is inserted (a concurrent insert makes it skip), a known one moved by
    // compare-and-set. Then every event in one insert, in queue order.
    let mut moves: Vec<(&str, i64, &FlowRecord)> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for (from, flow, event) in &writes {
        match at.get(event.flow_id.as_str()) {
            Some(&k) => moves[k].2 = flow,
            None => {
                at.insert(event.flow_id.as_str(), moves.len());
                moves.push((event.flow_id.as_str(), *from, flow));
            }
        }
    }
    let (new, old): (Vec<&(&str, i64, &FlowRecord)>, Vec<_>) = moves.iter().partition(|m| m.1 == 0);
    let n_flows: Vec<&str> = new.iter().map(|m| m.0).collect();
    let n_seqs: Vec<i64> = new.iter().map(|m| seq_param(m.2.seq)).collect::<Result<_, _>>()?;
    let n_states: Vec<&str> = new.iter().map(|m| m.2.state.as_str()).collect();
    let n_amounts: Vec<i64> = new.iter().map(|m| m.2.amount).collect();
    let o_flows: Vec<&str> = old.iter().map(|m| m.0).collect();
    let o_seqs: Vec<i64> = old.iter().map(|m| seq_param(m.2.seq)).collect::<Result<_, _>>()?;
    let o_states: Vec<&str> = old.iter().map(|m| m.2.state.as_str()).collect();
    let o_from: Vec<i64> = old.iter().map(|m| m.1).collect();
    let e_ids: Vec<&str> = writes.iter().map(|w| w.2.event_id.as_str()).collect();
    let e_flows: Vec<&str> = writes.iter().map(|w| w.2.flow_id.as_str()).collect();
    let e_seqs: Vec<i64> = writes.iter().map(|w| seq_param(w.2.seq)).collect::<Result<_, _>>()?;
    let e_kinds: Vec<&str> = writes.iter().map(|w| w.2.kind.as_str()).collect();
    let e_schemas: Vec<i32> = writes.iter().map(|w| i32::try_from(w.2.schema).unwrap_or(i32::MAX)).collect();
    let e_bodies: Vec<&str> = writes.iter().map(|w| w.2.body.as_str()).collect();
    let now = runtime::now_us();
    let insert_flows = client
        .prepare_cached(
            "INSERT INTO flow(flow_id, seq, state, amount)
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[])
             ON CONFLICT (flow_id) DO NOTHING",
        )
        .await?;
    let move_flows = client
        .prepare_cached(
            "UPDATE flow f SET seq = u.s, state = u.st
             FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[]) AS u(id, s, st, fs)
             WHERE f.flow_id = u.id AND f.seq = u.fs",
        )
        .await?;
    let insert_events = client
        .prepare_cached(
            "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us, partition)
             SELECT e, f, s, k, sc, b, $7, p
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::integer[], $6::text[],
                         $8::smallint[])
                  WITH ORDINALITY AS t(e, f, s, k, sc, b, p, n)
             ORDER BY n",
        )
        .await?;
    let p_new: Params<'_, 4> = [&n_flows, &n_seqs, &n_states, &n_amounts];
    let p_old: Params<'_, 4> = [&o_flows, &o_seqs, &o_states, &o_from];
    let e_partitions: Vec<i16> = writes.iter().map(|w| partition_param(&w.2.flow_id)).collect();
    let p_events: Params<'_, 8> =
        [&e_ids, &e_flows, &e_seqs, &e_kinds, &e_schemas, &e_bodies, &now, &e_partitions];
    // In this order on the connection, one round trip: the savepoint, the flows, the events.
    let (saved, inserted, moved, events_in) = futures::join!(
        client.batch_execute("SAVEPOINT batch"),
        client.execute(&insert_flows, &p_new),
        client.execute(&move_flows, &p_old),
        client.execute(&insert_events, &p_events),
    );
    saved?;
    let mut all_written = true;
    for (outcome, expected) in [(inserted, new.len()), (moved, old.len()), (events_in, writes.len())] {
        match outcome {
            Ok(n) if n == expected as u64 => {}
            Ok(_) => all_written = false,
            Err(e) if is_retryable(&e) || is_serialization_failure(&e) => return Err(e.into()),
            Err(_) => all_written = false,
        }
    }
    if !all_written {
        client.batch_execute("ROLLBACK TO SAVEPOINT batch; RELEASE SAVEPOINT batch").await?;
        return Ok(None);
    }
    // The savepoint stays open: the commit takes it with the transaction (no round trip).
    Ok(Some((results, writes.len() as i64)))
}

/// One call's writes in its own savepoint: the flow moved from `from_seq` (a compare-and-set:
/// a flow another writer moved is [`StepEnd::Raced`]), `producer.after_flow_update`, the
/// outbox insert (a duplicate id or `(flow_id, seq)` is a race too),
/// `producer.after_outbox_insert`. Two round trips. `Err`: the transaction is lost.
async fn write_step(
    client: &Conn,
    from_seq: u64,
    flow: &FlowRecord,
    event: &OutboxRecord,
    crash: &CrashSwitch,
) -> Result<StepEnd, StoreError> {
    let flow_stmt = client
        .prepare_cached(
            "INSERT INTO flow(flow_id, seq, state, amount) VALUES ($1, $2, $3, $4)
             ON CONFLICT (flow_id) DO UPDATE SET seq = excluded.seq, state = excluded.state
             WHERE flow.seq = $5",
        )
        .await?;
    let insert_stmt = client
        .prepare_cached(
            "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us, partition)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .await?;
    let seq = seq_param(flow.seq)?;
    let from = seq_param(from_seq)?;
    let state = flow.state.as_str();
    let flow_params: Params<'_, 5> = [&event.flow_id, &seq, &state, &flow.amount, &from];
    let (saved, moved) =
        futures::join!(client.batch_execute("SAVEPOINT step"), client.execute(&flow_stmt, &flow_params));
    saved?;
    match moved {
        Ok(1) => {}
        Ok(_) => {
            undo_step(client).await?;
            return Ok(StepEnd::Raced);
        }
        Err(e) => return failed_step(client, e).await,
    }
    crash.reach(CrashPoint::ProducerAfterFlowUpdate);
    let schema = i32::try_from(event.schema).unwrap_or(i32::MAX);
    let now = runtime::now_us();
    let partition = partition_param(&event.flow_id);
    let insert_params: Params<'_, 8> =
        [&event.event_id, &event.flow_id, &seq, &event.kind, &schema, &event.body, &now, &partition];
    let (inserted, released) = futures::join!(
        client.execute(&insert_stmt, &insert_params),
        client.batch_execute("RELEASE SAVEPOINT step"),
    );
    if let Err(e) = inserted {
        return failed_step(client, e).await;
    }
    released?;
    crash.reach(CrashPoint::ProducerAfterOutboxInsert);
    Ok(StepEnd::Written)
}

/// A statement of the call failed: its savepoint is rolled back. A unique violation means
/// another writer committed the same event id or step first (decide again); a connection
/// loss, deadlock or serialization failure loses the transaction; anything else (a trigger,
/// a constraint) fails the call alone.
async fn failed_step(client: &Conn, e: tokio_postgres::Error) -> Result<StepEnd, StoreError> {
    if is_retryable(&e) || is_serialization_failure(&e) {
        return Err(e.into());
    }
    undo_step(client).await?;
    if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
        return Ok(StepEnd::Raced);
    }
    Ok(StepEnd::Failed(e.into()))
}

async fn undo_step(client: &Conn) -> Result<(), StoreError> {
    client.batch_execute("ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step").await?;
    Ok(())
}
