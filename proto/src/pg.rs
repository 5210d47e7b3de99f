//! PostgreSQL settings every process shares, the counterpart of [`crate::db`] for SQLite:
//! `synchronous_commit=on` on every session, one schema per kind of store
//! (`ordered_events_producer`, `ordered_events_consumer`; both may live in one database),
//! a `meta` row naming the kind, the schema version and the database's random identity, and
//! a refusal, in one line, of a schema of another kind, a newer version, or (the relay) a
//! schema its owner has not created.
//!
//! Schema creation and upgrades run in one transaction under a transaction-level advisory
//! lock, so several processes starting at once on one empty database create it once.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

use crate::db::OpenMode;
use crate::target::PgUrl;

/// How long connecting to the server may take before the process gives up with an error.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The advisory lock key every ordered-events process takes while creating or upgrading a
/// schema (`hashtext` of this text).
const SCHEMA_LOCK: &str = "ordered_events.schema";

/// What a PostgreSQL schema is: its name, its version and the DDL a new one gets.
#[derive(Clone, Copy, Debug)]
pub struct PgKind {
    /// Human name for messages ("producer", "consumer"), stored in `meta.kind`.
    pub name: &'static str,
    /// The PostgreSQL schema holding the tables, e.g. `ordered_events_producer`.
    pub schema: &'static str,
    /// The schema version this build writes and reads.
    pub version: i32,
    /// DDL of the current version, run once inside the creating transaction with
    /// `search_path` set to [`PgKind::schema`].
    pub ddl: &'static str,
    /// `upgrades[i]` moves version `i + 1` to `i + 2`, inside one transaction.
    pub upgrades: &'static [&'static str],
}

/// Why a PostgreSQL store could not be opened. Every message names the database (password
/// hidden) and, where it matters, the schema.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// The server refused, failed or could not be reached.
    #[error("{target}: {what}: {source}")]
    Client {
        /// The database URL, password hidden.
        target: String,
        /// What was being done.
        what: &'static str,
        /// The client's error.
        source: tokio_postgres::Error,
    },
    /// No connection could be had from the pool.
    #[error("{target}: cannot connect: {reason}")]
    Connect {
        /// The database URL, password hidden.
        target: String,
        /// Why.
        reason: String,
    },
    /// The schema must exist and does not.
    #[error("{target}: schema {schema} has not been created by the {kind} yet (start the {kind} once first)")]
    NotInitialised {
        /// The database URL, password hidden.
        target: String,
        /// The schema looked for.
        schema: &'static str,
        /// The expected kind.
        kind: &'static str,
    },
    /// The schema belongs to something else.
    #[error("{target}: schema {schema} is not a {kind} schema ({what})")]
    WrongKind {
        /// The database URL, password hidden.
        target: String,
        /// The schema.
        schema: &'static str,
        /// The expected kind.
        kind: &'static str,
        /// What it is instead.
        what: String,
    },
    /// The schema was written by a newer build.
    #[error(
        "{target}: {kind} schema {schema} version {found} is newer than this build supports ({supported}); upgrade the binary"
    )]
    Newer {
        /// The database URL, password hidden.
        target: String,
        /// The schema.
        schema: &'static str,
        /// The expected kind.
        kind: &'static str,
        /// The schema's version.
        found: i32,
        /// The newest version this build reads.
        supported: i32,
    },
    /// The session does not commit durably.
    #[error(
        "{target}: synchronous_commit is {value} for this session; ordered-events needs on (or remote_write, remote_apply) so an answered commit survives a crash"
    )]
    NotDurable {
        /// The database URL, password hidden.
        target: String,
        /// The effective setting.
        value: String,
    },
}

/// The durability settings a session actually runs with, for the start-up log and the
/// benchmark report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effective {
    /// `synchronous_commit` (forced `on` by this module for its sessions).
    pub synchronous_commit: String,
    /// The server's `fsync`.
    pub fsync: String,
    /// The server's `full_page_writes`.
    pub full_page_writes: String,
    /// `server_version`.
    pub server_version: String,
    /// Whether the session is encrypted, from `pg_stat_ssl`: `off`, or the TLS version.
    pub tls: String,
    /// The server's `autovacuum`: without it, the space of updated and compacted rows is
    /// reused only after someone runs `VACUUM`.
    pub autovacuum: String,
}

/// An opened PostgreSQL store: a pool whose sessions all run with `synchronous_commit=on`
/// and `search_path` set to the kind's schema, and what was found at start-up.
#[derive(Clone)]
pub struct Opened {
    /// Connections to the database.
    pub pool: Pool,
    /// The database's random identity (`meta.database_id`), kept by a restored backup and
    /// new in a recreated schema.
    pub database_id: String,
    /// The settings the sessions run with.
    pub effective: Effective,
}

/// Opens the `kind` schema on `url` with a pool of up to `pool_size` connections: in
/// `Create` mode the schema is created (or upgraded) as needed; in `Existing` mode it must
/// have been created by its owner. Refuses another kind, a newer version and a session that
/// would not commit durably; logs the `<kind> database open` line with the settings.
pub async fn open(url: &PgUrl, kind: &PgKind, mode: OpenMode, pool_size: usize) -> Result<Opened, PgError> {
    let target = url.to_string();
    let pool = pool(url, kind, pool_size)?;
    let mut client =
        pool.get().await.map_err(|e| PgError::Connect { target: target.clone(), reason: pool_error(&e) })?;
    let client_err = |what| {
        let target = target.clone();
        move |source| PgError::Client { target, what, source }
    };
    let tx = client.transaction().await.map_err(client_err("begin"))?;
    tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&SCHEMA_LOCK])
        .await
        .map_err(client_err("lock the schema"))?;
    let meta_table = format!("{}.meta", kind.schema);
    let exists: bool = tx
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&meta_table])
        .await
        .map_err(client_err("look for the schema"))?
        .get(0);
    if !exists {
        if mode == OpenMode::Existing {
            return Err(PgError::NotInitialised { target, schema: kind.schema, kind: kind.name });
        }
        let create = format!(
            "CREATE SCHEMA IF NOT EXISTS {schema};
             SET LOCAL search_path = {schema};
             {ddl}
             CREATE TABLE meta(
                 id INTEGER PRIMARY KEY CHECK(id = 1),
                 kind TEXT NOT NULL,
                 schema_version INTEGER NOT NULL,
                 database_id TEXT NOT NULL,
                 created_at_us BIGINT NOT NULL
             );
             INSERT INTO meta(id, kind, schema_version, database_id, created_at_us)
             VALUES (1, '{name}', {version}, replace(gen_random_uuid()::text, '-', ''),
                     (extract(epoch FROM clock_timestamp()) * 1000000)::bigint);",
            schema = kind.schema,
            ddl = kind.ddl,
            name = kind.name,
            version = kind.version,
        );
        tx.batch_execute(&create).await.map_err(client_err("create the schema"))?;
    } else {
        let row = tx
            .query_opt(&format!("SELECT kind, schema_version FROM {meta_table} WHERE id = 1"), &[])
            .await
            .map_err(client_err("read the schema version"))?;
        let Some(row) = row else {
            return Err(PgError::WrongKind {
                target,
                schema: kind.schema,
                kind: kind.name,
                what: "its meta table has no row".into(),
            });
        };
        let (found_kind, found): (String, i32) = (row.get(0), row.get(1));
        if found_kind != kind.name {
            return Err(PgError::WrongKind {
                target,
                schema: kind.schema,
                kind: kind.name,
                what: format!("it says it is a {found_kind} schema"),
            });
        }
        if found > kind.version {
            return Err(PgError::Newer {
                target,
                schema: kind.schema,
                kind: kind.name,
                found,
                supported: kind.version,
            });
        }
        if found < kind.version {
            if mode == OpenMode::Existing {
                return Err(PgError::WrongKind {
                    target,
                    schema: kind.schema,
                    kind: kind.name,
                    what: format!(
                        "version {found}, older than {}: start the {} once to upgrade it",
                        kind.version, kind.name
                    ),
                });
            }
            let mut sql = format!("SET LOCAL search_path = {};", kind.schema);
            for upgrade in kind.upgrades.iter().skip(found.max(1) as usize - 1) {
                sql.push_str(upgrade);
            }
            sql.push_str(&format!("UPDATE meta SET schema_version = {} WHERE id = 1;", kind.version));
            tx.batch_execute(&sql).await.map_err(client_err("upgrade the schema"))?;
            tracing::info!(
                schema = kind.schema,
                from = found,
                to = kind.version,
                "{} schema upgraded",
                kind.name
            );
        }
    }
    let database_id: String = tx
        .query_one(&format!("SELECT database_id FROM {meta_table} WHERE id = 1"), &[])
        .await
        .map_err(client_err("read the database identity"))?
        .get(0);
    tx.commit().await.map_err(client_err("commit the schema"))?;
    let effective = effective(&client).await.map_err(client_err("read the settings"))?;
    if !matches!(effective.synchronous_commit.as_str(), "on" | "remote_write" | "remote_apply") {
        return Err(PgError::NotDurable { target, value: effective.synchronous_commit });
    }
    if effective.fsync != "on" {
        tracing::warn!(
            db = %target,
            fsync = %effective.fsync,
            "the server runs with fsync off: a crash of the server's host can lose committed events"
        );
    }
    // Said by the owner of the schema (the relay only reads and marks another's).
    if mode == OpenMode::Create && effective.autovacuum != "on" {
        tracing::warn!(
            db = %target,
            schema = kind.schema,
            "the server runs with autovacuum off: the space of updated rows and of compacted \
             bodies (retention) is reused only after a VACUUM; run VACUUM on this schema's tables \
             regularly, or turn autovacuum on"
        );
    }
    tracing::info!(
        db = %target,
        backend = "postgres",
        schema = kind.schema,
        synchronous_commit = %effective.synchronous_commit,
        fsync = %effective.fsync,
        full_page_writes = %effective.full_page_writes,
        server_version = %effective.server_version,
        tls = %effective.tls,
        autovacuum = %effective.autovacuum,
        sslmode = url.tls().name(),
        "{} database open",
        kind.name
    );
    drop(client);
    Ok(Opened { pool, database_id, effective })
}

/// The pool for `url`: every session gets `synchronous_commit=on`, `enable_seqscan=off`,
/// `jit=off`, `max_parallel_workers_per_gather=0`, the kind's `search_path` and an
/// `application_name`, as start-up options (so no statement can forget them).
fn pool(url: &PgUrl, kind: &PgKind, size: usize) -> Result<Pool, PgError> {
    let mut config = url.config();
    let mut options = config.get_options().map(str::to_owned).unwrap_or_default();
    if !options.is_empty() {
        options.push(' ');
    }
    // No sequential scan where an index can answer: every statement of the stores is an
    // index lookup or an index range, and their batch statements take whole batches as
    // arrays. A generic plan made while a table was still small (a fresh schema, and
    // nothing analyzes it before it grows) would otherwise be a sequential scan kept for
    // every batch after (measured: most of the server's CPU per event). The plan cache
    // keeps its default (`auto`): forcing a custom plan for every execution instead, as
    // before, planned each foreign-key check and trigger statement once per row, about 14 %
    // of the server's CPU (perf, `bench --backend postgres`).
    // No JIT compilation: `enable_seqscan=off` prices a sequential scan that no index can
    // replace (the relays' 64-row lease table, the heartbeat table's expiry sweep) above
    // `jit_above_cost`, so each such statement was compiled by LLVM first: 100-250 ms of the
    // server's CPU per lease renewal, for statements that run in microseconds (measured with
    // `pg_stat_statements` during `bench --backend postgres`). No statement of the stores
    // is large enough for JIT to pay.
    // No parallel query, for the same reason: a generic plan estimates a range with a
    // parameter at a third of the table, and on a large table that prices a parallel plan,
    // whose workers take ~10 ms to start for a range that holds no row. A relay judging its
    // consumer every second while idle, against 900 000 accepted rows, kept the 2-core
    // machine 25 % busy with them, and 1 to 2 % without (2026-12-07).
    options.push_str(&format!(
        "-c synchronous_commit=on -c enable_seqscan=off -c jit=off -c max_parallel_workers_per_gather=0 \
         -c search_path={}",
        kind.schema
    ));
    config.options(&options);
    if config.get_application_name().is_none() {
        config.application_name(format!("ordered-events-{}", kind.name));
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    let manager_config = || ManagerConfig { recycling_method: RecyclingMethod::Fast };
    let tls = crate::pg_tls::client_config(url.tls())
        .map_err(|reason| PgError::Connect { target: url.to_string(), reason })?;
    let manager = match tls {
        None => Manager::from_config(config, NoTls, manager_config()),
        Some(tls) => {
            Manager::from_config(config, tokio_postgres_rustls::MakeRustlsConnect::new(tls), manager_config())
        }
    };
    Pool::builder(manager)
        .pre_recycle(Hook::sync_fn(|_, metrics| match opened_before_writes_were_refused(metrics.created) {
            true => Err(HookError::message("opened before the server refused a write")),
            false => Ok(()),
        }))
        .max_size(size.max(1))
        .wait_timeout(Some(CONNECT_TIMEOUT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| PgError::Connect { target: url.to_string(), reason: e.to_string() })
}

/// The durability settings of `client`'s session.
pub async fn effective(client: &tokio_postgres::Client) -> Result<Effective, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT current_setting('synchronous_commit'), current_setting('fsync'),
                    current_setting('full_page_writes'), current_setting('server_version'),
                    coalesce((SELECT CASE WHEN ssl THEN version ELSE 'off' END
                              FROM pg_stat_ssl WHERE pid = pg_backend_pid()), 'unknown'),
                    current_setting('autovacuum')",
            &[],
        )
        .await?;
    Ok(Effective {
        synchronous_commit: row.get(0),
        fsync: row.get(1),
        full_page_writes: row.get(2),
        server_version: row.get(3),
        tls: row.get(4),
        autovacuum: row.get(5),
    })
}

/// What [`describe`] says for SQLSTATE 25006 (`read_only_sql_transaction`), whatever the
/// statement: one cause, so a process logs a read-only server once, not once per statement.
pub const READ_ONLY: &str = "25006: the server takes no writes (its sessions are read-only: a standby, \
     e.g. after a failover, or default_transaction_read_only is on)";

/// When a session was last found read-only (nanoseconds after [`refusals_epoch`]; 0: never).
static WRITES_REFUSED_AT: AtomicU64 = AtomicU64::new(0);

fn refusals_epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Records that a session of this process was found read-only. A read-only session stays
/// read-only (a standby's, or one opened while `default_transaction_read_only` was on), so
/// every pooled session opened before now is closed at its next checkout instead of being
/// handed out again (the pools' `pre_recycle` hook): once the server, or the one the address
/// now leads to, takes writes again, new sessions reach it.
pub fn note_writes_refused() {
    let at = refusals_epoch().elapsed().as_nanos().max(1);
    WRITES_REFUSED_AT.fetch_max(u64::try_from(at).unwrap_or(u64::MAX), Ordering::Relaxed);
}

fn opened_before_writes_were_refused(created: Instant) -> bool {
    match WRITES_REFUSED_AT.load(Ordering::Relaxed) {
        0 => false,
        at => created <= refusals_epoch() + Duration::from_nanos(at),
    }
}

/// True when `e` is the server refusing a write because the session is read-only (SQLSTATE
/// 25006); then also [`note_writes_refused`].
pub fn refuses_writes(e: &tokio_postgres::Error) -> bool {
    let read_only = e.code() == Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION);
    if read_only {
        note_writes_refused();
    }
    read_only
}

/// SQLSTATE classes a caller may retry: the server or connection went away (08, 57P01-03),
/// a serialization failure or deadlock (40001, 40P01), too many connections (53300), a
/// session that takes no writes (25006: a standby after a failover; new sessions may reach
/// a primary, see [`note_writes_refused`]).
pub fn is_retryable(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    let Some(code) = e.code() else {
        // No SQLSTATE: an I/O error on the connection, not a statement's failure.
        return e.as_db_error().is_none();
    };
    let code = code.code();
    code.starts_with("08")
        || code.starts_with("57P")
        || code == "40001"
        || code == "40P01"
        || code == "53300"
        || code == "55P03"
        || code == "25006"
}

/// True for a serialization failure or deadlock: the transaction can be run again as is.
pub fn is_serialization_failure(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| c.code() == "40001" || c.code() == "40P01")
}

/// Why no connection could be had from a pool, with the server's own words when it refused
/// (deadpool's text alone says only "Error occurred while creating a new object: db error").
pub fn pool_error(e: &deadpool_postgres::PoolError) -> String {
    match e {
        deadpool_postgres::PoolError::Backend(e) => describe(e),
        other => other.to_string(),
    }
}

/// The error text for logs and statuses: the server's message, detail and hint when it sent
/// them (the client's own `Display` says only "db error").
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) if db.code() == &tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION => {
            READ_ONLY.to_owned()
        }
        Some(db) => {
            let mut text = format!("{}: {}", db.code().code(), db.message());
            if let Some(detail) = db.detail() {
                text.push_str(&format!(" ({detail})"));
            }
            if let Some(hint) = db.hint() {
                text.push_str(&format!("; hint: {hint}"));
            }
            text
        }
        None => {
            // The client's own text names only the step ("error performing TLS handshake");
            // the causes say why (e.g. "invalid peer certificate: NotValidForName").
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        }
    }
}

/// A fresh PostgreSQL database per test, for the unit tests of every crate and the
/// multi-process harness: created on the server named by [`testing::URL_ENV`] and dropped
/// (connections forced off) when the value drops.
pub mod testing {
    use std::sync::atomic::{AtomicU32, Ordering};

    use tokio_postgres::NoTls;

    /// The server the PostgreSQL tests use (an admin URL: it must be allowed to create
    /// databases).
    pub const URL_ENV: &str = "ORDERED_EVENTS_TEST_PG_URL";
    /// Where no `URL_ENV` is set: the development and CI machines' server.
    pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
    /// Set to `1` to make an unreachable server fail the PostgreSQL tests instead of
    /// skipping them (CI sets it).
    pub const REQUIRE_ENV: &str = "ORDERED_EVENTS_REQUIRE_PG";

    static NEXT: AtomicU32 = AtomicU32::new(0);

    /// A database made for one test.
    pub struct TestDb {
        admin: String,
        name: String,
        url: String,
    }

    impl TestDb {
        /// Creates a database named after `label`, this process and a counter. Returns `None`
        /// after printing one loud `SKIPPED (PostgreSQL …)` line when the server cannot be
        /// reached, unless [`REQUIRE_ENV`] is `1`: then it panics with the reason.
        pub fn create(label: &str) -> Option<TestDb> {
            let admin = std::env::var(URL_ENV).unwrap_or_else(|_| DEFAULT_URL.to_owned());
            match TestDb::create_on(&admin, label) {
                Ok(db) => Some(db),
                Err(reason) => {
                    if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
                        panic!("PostgreSQL is required ({REQUIRE_ENV}=1) but unusable at {admin}: {reason}");
                    }
                    // Straight to the stream, not through eprintln!, which the test runner
                    // captures (and hides) for a passing test: a skip must be seen.
                    let _ = std::io::Write::write_all(
                        &mut std::io::stderr(),
                        format!(
                            "SKIPPED (PostgreSQL unreachable at {admin}): {reason}; set {URL_ENV} to a server, or {REQUIRE_ENV}=1 to fail instead\n"
                        )
                        .as_bytes(),
                    );
                    None
                }
            }
        }

        /// Creates a database named after `label` on the server `admin` names (a URL allowed
        /// to create databases), or says why it could not.
        pub fn create_on(admin: &str, label: &str) -> Result<TestDb, String> {
            let admin = admin.to_owned();
            let label: String = label
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
                .collect();
            let name = format!(
                "oe_{}_{}_{}",
                &label[..label.len().min(30)],
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            on_own_runtime(admin.clone(), format!("CREATE DATABASE {name}"))?;
            let url = with_database(&admin, &name);
            Ok(TestDb { admin, name, url })
        }

        /// The test database's URL.
        pub fn url(&self) -> &str {
            &self.url
        }

        /// The database's name.
        pub fn name(&self) -> &str {
            &self.name
        }
    }

    impl Drop for TestDb {
        fn drop(&mut self) {
            let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
            if let Err(e) = on_own_runtime(self.admin.clone(), sql) {
                eprintln!("could not drop test database {}: {e}", self.name);
            }
        }
    }

    /// The most rows one table or index scan in `sql`'s plan read, from one run under
    /// `EXPLAIN (ANALYZE, FORMAT JSON)` in a transaction that is rolled back: the statement
    /// is prepared (its parameters' types inferred) and executed with `arguments` (SQL
    /// literals, e.g. `(100, 5)`) under `plan_cache_mode` (`force_custom_plan` or
    /// `force_generic_plan`: a prepared statement runs with either, the server picks) and the
    /// planner settings every store session has (see `pool`). A scan's rows are those it
    /// returned over all its loops and those its filter or recheck removed. Panics with the
    /// server's message when a statement fails.
    pub async fn most_rows_a_scan_read(
        client: &tokio_postgres::Client,
        sql: &str,
        arguments: &str,
        plan_cache_mode: &str,
    ) -> u64 {
        let script = format!(
            "BEGIN; SET LOCAL plan_cache_mode = {plan_cache_mode}; SET LOCAL enable_seqscan = off;
             SET LOCAL jit = off; SET LOCAL max_parallel_workers_per_gather = 0; PREPARE scanned AS {sql};
             EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE scanned{arguments}; ROLLBACK; DEALLOCATE scanned;"
        );
        let messages =
            client.simple_query(&script).await.unwrap_or_else(|e| panic!("{}", super::describe(&e)));
        let plan = messages
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            })
            .expect("EXPLAIN answers one row");
        let plan: serde_json::Value = serde_json::from_str(&plan).expect("EXPLAIN's JSON");
        fn most(node: &serde_json::Value) -> u64 {
            let number = |key: &str| node.get(key).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
            let own = if node.get("Relation Name").is_some() || node.get("Index Name").is_some() {
                (number("Actual Rows") * number("Actual Loops")
                    + number("Rows Removed by Filter")
                    + number("Rows Removed by Index Recheck")) as u64
            } else {
                0
            };
            let children = node.get("Plans").and_then(serde_json::Value::as_array);
            children.into_iter().flatten().map(most).fold(own, u64::max)
        }
        most(&plan[0]["Plan"])
    }

    /// `admin` with its database replaced by `name`.
    pub fn with_database(admin: &str, name: &str) -> String {
        let (base, query) = match admin.split_once('?') {
            Some((base, query)) => (base, format!("?{query}")),
            None => (admin, String::new()),
        };
        let scheme_end = base.find("://").map_or(0, |i| i + 3);
        let base = match base[scheme_end..].find('/') {
            Some(slash) => &base[..scheme_end + slash],
            None => base,
        };
        format!("{base}/{name}{query}")
    }

    /// Runs one statement on `url` from a thread with its own runtime, so it works from
    /// inside and outside an async test alike.
    fn on_own_runtime(url: String, sql: String) -> Result<(), String> {
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let mut config: tokio_postgres::Config = url.parse().map_err(|e| format!("{e}"))?;
                config.connect_timeout(std::time::Duration::from_secs(5));
                let (client, conn) = config.connect(NoTls).await.map_err(|e| e.to_string())?;
                let driver = tokio::spawn(conn);
                let result = client.batch_execute(&sql).await.map_err(|e| super::describe(&e));
                drop(client);
                let _ = driver.await;
                result
            })
        })
        .join()
        .unwrap_or_else(|_| Err("the statement's thread panicked".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{TestDb, with_database};
    use super::*;
    use crate::target::DbTarget;

    const KIND: PgKind = PgKind {
        name: "producer",
        schema: "oe_test_kind",
        version: 2,
        ddl: "CREATE TABLE t(x BIGINT);",
        upgrades: &[],
    };

    fn url(db: &TestDb) -> PgUrl {
        match db.url().parse::<DbTarget>() {
            Ok(DbTarget::Postgres(url)) => url,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_refused_write_retires_the_sessions_opened_before_it() {
        let before = Instant::now();
        note_writes_refused();
        let after = Instant::now() + Duration::from_millis(1);
        assert!(opened_before_writes_were_refused(before));
        assert!(!opened_before_writes_were_refused(after));
    }

    #[test]
    fn urls_name_another_database() {
        assert_eq!(with_database("postgres://u@h:5/postgres", "x"), "postgres://u@h:5/x");
        assert_eq!(
            with_database("postgres://u@h/postgres?sslmode=disable", "x"),
            "postgres://u@h/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
    }

    #[tokio::test]
    async fn a_schema_is_created_once_and_foreign_or_newer_ones_are_refused() {
        let Some(db) = TestDb::create("proto_pg_open") else { return };
        let url = url(&db);
        let err = open(&url, &KIND, OpenMode::Existing, 2).await.err().expect("not created yet");
        assert!(matches!(err, PgError::NotInitialised { .. }), "{err}");
        let first = open(&url, &KIND, OpenMode::Create, 2).await.unwrap();
        assert_eq!(first.database_id.len(), 32);
        assert_eq!(first.effective.synchronous_commit, "on");
        let again = open(&url, &KIND, OpenMode::Existing, 2).await.unwrap();
        assert_eq!(again.database_id, first.database_id, "reopening keeps the identity");
        // search_path is the kind's schema: the DDL's table is there, unqualified.
        let client = again.pool.get().await.unwrap();
        client.execute("INSERT INTO t(x) VALUES (1)", &[]).await.unwrap();
        // Every pooled session carries the planner settings the stores rely on.
        let row = client
            .query_one(
                "SELECT current_setting('enable_seqscan'), current_setting('jit'), current_setting('search_path'),
                        current_setting('max_parallel_workers_per_gather')",
                &[],
            )
            .await
            .unwrap();
        let settings: (String, String, String, String) = (row.get(0), row.get(1), row.get(2), row.get(3));
        assert_eq!(settings, ("off".into(), "off".into(), KIND.schema.into(), "0".into()));
        let older = PgKind { version: 1, ..KIND };
        let err = open(&url, &older, OpenMode::Create, 2).await.err().expect("newer");
        assert!(err.to_string().contains("newer than this build supports (1)"), "{err}");
        let consumer = PgKind { name: "consumer", ..KIND };
        let err = open(&url, &consumer, OpenMode::Create, 2).await.err().expect("other kind");
        assert!(err.to_string().contains("it says it is a producer schema"), "{err}");
        drop(client);
        drop((first, again));
    }
}
