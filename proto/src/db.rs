//! SQLite connection settings every process must share (SPEC §2): WAL, `synchronous=FULL`,
//! foreign keys, a busy timeout, `BEGIN IMMEDIATE` for every write, and a file identity
//! (`application_id` + `user_version`) so a process refuses a file that is not its own.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::config::DbConfig;
use rusqlite::{Connection, OpenFlags, Transaction, TransactionBehavior};

/// How long a connection waits for another writer before answering busy.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Prepared statements kept per connection (more than any store module uses).
const STATEMENT_CACHE: usize = 64;

/// What a database file is: its identity and the schema a new one gets.
#[derive(Clone, Copy, Debug)]
pub struct DbKind {
    /// Human name for messages ("producer", "consumer").
    pub name: &'static str,
    /// `PRAGMA application_id` of this kind of file.
    pub application_id: i32,
    /// `PRAGMA user_version`: the schema version this build writes and reads.
    pub user_version: i32,
    /// DDL of schema version 1, run once, inside `BEGIN IMMEDIATE`, on a new empty file,
    /// followed there by every upgrade.
    pub schema_sql: &'static str,
    /// `upgrades[i]` moves schema version `i + 1` to `i + 2` (run inside one
    /// `BEGIN IMMEDIATE` with the rest of the upgrade).
    pub upgrades: &'static [&'static str],
}

/// The producer's database (`OEPR`).
pub const PRODUCER_APPLICATION_ID: i32 = 0x4f45_5052;
/// The consumer's database (`OECO`).
pub const CONSUMER_APPLICATION_ID: i32 = 0x4f45_434f;

impl DbKind {
    /// producer.db at schema version `user_version`, created with `schema_sql`.
    pub const fn producer(
        user_version: i32,
        schema_sql: &'static str,
        upgrades: &'static [&'static str],
    ) -> DbKind {
        DbKind {
            name: "producer",
            application_id: PRODUCER_APPLICATION_ID,
            user_version,
            schema_sql,
            upgrades,
        }
    }

    /// consumer.db at schema version `user_version`, created with `schema_sql`.
    pub const fn consumer(
        user_version: i32,
        schema_sql: &'static str,
        upgrades: &'static [&'static str],
    ) -> DbKind {
        DbKind {
            name: "consumer",
            application_id: CONSUMER_APPLICATION_ID,
            user_version,
            schema_sql,
            upgrades,
        }
    }
}

/// Whether a missing or empty file may be created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Create the file and its schema if needed (the owning server).
    Create,
    /// The file must exist and have been created by its owner (the relay on producer.db).
    Existing,
}

/// Why a database could not be opened. Every variant names the file (`path`) and, where it
/// matters, the [`DbKind::name`] that was expected (`kind`).
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// SQLite refused to open or set up the file.
    #[error("{path}: {source}")]
    Sqlite {
        /// The file.
        path: PathBuf,
        /// SQLite's error.
        source: rusqlite::Error,
    },
    /// The file must exist and does not.
    #[error("{path}: no such file (it is created by the {kind} on its first start)")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
    },
    /// The file belongs to something else, or to an older schema.
    #[error("{path}: not a {kind} database ({what})")]
    WrongKind {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// What the file is instead.
        what: String,
    },
    /// The file was written by a newer build.
    #[error(
        "{path}: {kind} database schema version {found} is newer than this build supports ({supported}); upgrade the binary"
    )]
    Newer {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// The file's schema version.
        found: i32,
        /// The newest version this build reads.
        supported: i32,
    },
    /// The file exists but its owner never created the schema.
    #[error("{path}: has not been created by the {kind} yet (start the {kind} once first)")]
    NotInitialised {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
    },
    /// Upgrading the file's schema would leave it inconsistent; it was left as it was.
    #[error(
        "{path}: the {kind} database cannot be upgraded to schema version {to}: {what}; nothing was changed"
    )]
    UpgradeRefused {
        /// The file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// The version the upgrade would have reached.
        to: i32,
        /// What would be wrong.
        what: String,
    },
    /// The file is missing but its `-wal`/`-shm` remain: it was deleted or moved.
    #[error(
        "{path}: missing, but {leftovers} of a {kind} database that was here remain: it was deleted or \
         moved, and whatever it held is lost from this side. Restore it, or remove these files to start \
         a fresh {kind} database deliberately (a relay then re-sends what the new one lacks)"
    )]
    Orphaned {
        /// The missing file.
        path: PathBuf,
        /// The expected kind.
        kind: &'static str,
        /// The sidecar files that remain.
        leftovers: String,
    },
}

/// The settings a connection actually runs with, for the start-up log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effective {
    /// `PRAGMA journal_mode`, e.g. `wal`.
    pub journal_mode: String,
    /// `PRAGMA synchronous` as a name: OFF, NORMAL, FULL or EXTRA.
    pub synchronous: String,
    /// `PRAGMA auto_vacuum` as a name: NONE (a file created before retention: pages that
    /// compaction frees are reused, the file does not shrink), FULL or INCREMENTAL (a file
    /// created since: compaction returns freed pages to the file system).
    pub auto_vacuum: String,
}

/// Opens `path` as a database of `kind` with the shared settings, creating the schema on a
/// new file in `Create` mode, and refusing a file of another kind or a newer version.
pub fn open(path: &Path, kind: &DbKind, mode: OpenMode) -> Result<Connection, DbError> {
    let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
    if mode == OpenMode::Existing && !path.exists() {
        return Err(DbError::Missing { path: path.to_owned(), kind: kind.name });
    }
    let orphans = orphan_sidecars(path);
    if mode == OpenMode::Create && !orphans.is_empty() {
        // SQLite would read the old WAL into the new file; and a fresh database where one
        // was expected must be the operator's decision, not a silent side effect.
        return Err(DbError::Orphaned {
            path: path.to_owned(),
            kind: kind.name,
            leftovers: orphans.join(", "),
        });
    }
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if mode == OpenMode::Create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let mut conn = Connection::open_with_flags(path, flags).map_err(sqlite)?;
    install_busy_handler(&mut conn).map_err(sqlite)?;
    // Every store statement stays prepared: a group-committed batch runs the same dozen or so
    // statements per step, and re-parsing them would cost more than the writes.
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // Plans never depend on a bound value (the query planner stability guarantee). Without
    // it, SQLite reads the value bound to `LIMIT ?` when it plans, and any new binding of it
    // expires the statement: every relay page and compaction batch was prepared afresh,
    // ~160k instructions each (`sqlite3Reprepare`: 4.5 % of the relay's instructions and
    // 2 % of the consumer's, `bench --callgrind`). Our statements are written for one plan,
    // which the plan tests check.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true).map_err(sqlite)?;
    // The identity is read before anything is set: WAL is a property of the file, and a
    // process must not change a file it is about to refuse. Reading a file that is not a
    // database at all fails here with SQLite's own "file is not a database".
    let found = refuse_foreign(&conn, path, kind, mode)?;
    if mode == OpenMode::Create && matches!(found, Found::Empty) {
        // Only possible while the file has no page yet (before WAL is set and the first
        // table exists): a new file can give back the pages compaction frees
        // (`PRAGMA incremental_vacuum`) instead of only reusing them.
        conn.pragma_update(None, "auto_vacuum", "INCREMENTAL").map_err(sqlite)?;
    }
    conn.pragma_update(None, "journal_mode", "WAL").map_err(sqlite)?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(sqlite)?;
    conn.pragma_update(None, "foreign_keys", "ON").map_err(sqlite)?;
    match found {
        Found::Empty => create_schema(&mut conn, path, kind)?,
        Found::Older => upgrade_schema(&mut conn, path, kind)?,
        Found::Current => {}
    }
    check_identity(&conn, path, kind)?;
    Ok(conn)
}

/// Test hook, armed only through the environment like crash points: while the file this
/// variable names exists, every commit of the process's own database fails as a full disk
/// does (the consumer on either backend, the producer on SQLite). Used where the machine
/// cannot mount a small filesystem to fill for real.
pub const COMMIT_FAULT_ENV: &str = "ORDERED_EVENTS_FAULT_COMMIT_FAILS_WHILE";

/// The [`COMMIT_FAULT_ENV`] hook as this process read it at start (`None`: not armed).
#[derive(Clone, Debug, Default)]
pub struct CommitFault(Option<PathBuf>);

impl CommitFault {
    /// Reads the hook from the environment; when armed, says so loudly (`who`: the process).
    pub fn from_env(who: &str) -> CommitFault {
        let fault = std::env::var_os(COMMIT_FAULT_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
        if let Some(fault) = &fault {
            tracing::warn!(
                env = COMMIT_FAULT_ENV,
                while_exists = %fault.display(),
                "FAULT INJECTION ARMED: {who} database commits fail while this file exists"
            );
        }
        CommitFault(fault)
    }

    /// `Err` with a full disk's words (naming the hook) while the armed hook's file exists.
    pub fn check(&self) -> Result<(), String> {
        match &self.0 {
            Some(fault) if fault.exists() => {
                Err(format!("database or disk is full (injected: {} exists)", fault.display()))
            }
            _ => Ok(()),
        }
    }
}

/// A database file and its WAL as a process opened them (device and inode), to tell before a
/// commit whether the path still names them. A file deleted or replaced under a running
/// process is otherwise written through its unlinked inode, and whatever the process commits
/// then is gone with it, though every commit succeeded.
#[derive(Clone, Debug, Default)]
pub struct OpenedFiles(Vec<(PathBuf, Option<(u64, u64)>)>);

impl OpenedFiles {
    /// `path` and its `-wal` as they are now (call right after opening the connection).
    pub fn of(path: &Path) -> OpenedFiles {
        let wal = sidecar(path, "-wal");
        let wal_id = file_id(&wal);
        OpenedFiles(vec![(path.to_owned(), file_id(path)), (wal, wal_id)])
    }

    /// `Err("<path> was deleted")` (or `was replaced by another file`) when a path no longer
    /// names the file opened; a WAL that did not exist at open is not checked. Two `stat`s.
    pub fn check(&self) -> Result<(), String> {
        for (path, opened) in &self.0 {
            let now = file_id(path);
            if opened.is_some() && now != *opened {
                let what = if now.is_none() { "was deleted" } else { "was replaced by another file" };
                return Err(format!("{} {what}", path.display()));
            }
        }
        Ok(())
    }
}

/// One file's identity on disk (device, inode); `None` when nothing is at `path`.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// `path` with `suffix` appended to its file name (`-wal`, `-shm`).
fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The `-wal`/`-shm` files beside `path` when `path` itself is missing: the traces of a
/// database deleted while its sidecars stayed.
fn orphan_sidecars(path: &Path) -> Vec<String> {
    if path.exists() {
        return Vec::new();
    }
    ["-wal", "-shm"]
        .iter()
        .map(|suffix| sidecar(path, suffix))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect()
}

/// What [`refuse_foreign`] found in a file it does not refuse.
enum Found {
    /// No identity and no tables: the schema may be created.
    Empty,
    /// This kind at an older schema version this build knows how to upgrade.
    Older,
    /// This kind at this build's version.
    Current,
}

/// Reads the file's identity without writing anything: refuses a file of another kind, a
/// newer schema or one older than this build can upgrade, or (in `Create` mode) a file with
/// tables and no identity.
fn refuse_foreign(conn: &Connection, path: &Path, kind: &DbKind, mode: OpenMode) -> Result<Found, DbError> {
    let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
    let (app_id, version) = identity(conn).map_err(sqlite)?;
    if app_id != 0 {
        if app_id == kind.application_id && upgradable(kind, version) {
            return Ok(Found::Older);
        }
        return check_known(app_id, version, path, kind).map(|()| Found::Current);
    }
    if mode == OpenMode::Existing {
        return Err(DbError::NotInitialised { path: path.to_owned(), kind: kind.name });
    }
    let tables: i64 =
        conn.query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0)).map_err(sqlite)?;
    if tables > 0 {
        return Err(DbError::WrongKind {
            path: path.to_owned(),
            kind: kind.name,
            what: format!("it already has {tables} schema objects and no application_id"),
        });
    }
    Ok(Found::Empty)
}

/// Whether `version` is older than `kind`'s and every step from it is in `kind.upgrades`.
fn upgradable(kind: &DbKind, version: i32) -> bool {
    version >= 1 && version < kind.user_version && kind.user_version - 1 <= kind.upgrades.len() as i32
}

/// Upgrades an older schema step by step in ONE `BEGIN IMMEDIATE` transaction (the version
/// is read again under the write lock: another process may have upgraded it meanwhile).
///
/// Foreign keys are off during the upgrade and checked whole before it commits (SQLite's
/// own procedure for rebuilding a table): a step may rebuild a table others refer to (drop it
/// and rename its copy), which with the checks on would count every referring row as
/// orphaned the moment the old table goes.
fn upgrade_schema(conn: &mut Connection, path: &Path, kind: &DbKind) -> Result<(), DbError> {
    let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
    // Only takes effect outside a transaction, hence here and not in it.
    conn.pragma_update(None, "foreign_keys", "OFF").map_err(sqlite)?;
    let upgraded = upgrade_steps(conn, path, kind);
    conn.pragma_update(None, "foreign_keys", "ON").map_err(sqlite)?;
    upgraded
}

fn upgrade_steps(conn: &mut Connection, path: &Path, kind: &DbKind) -> Result<(), DbError> {
    let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
    let tx = begin_immediate(conn).map_err(sqlite)?;
    let (_, from) = identity(&tx).map_err(sqlite)?;
    if !upgradable(kind, from) {
        return Ok(());
    }
    for version in from..kind.user_version {
        tx.execute_batch(kind.upgrades[(version - 1) as usize]).map_err(sqlite)?;
    }
    // An upgrade may edit a definition in place (`PRAGMA writable_schema`), which leaves the
    // schema cookie as it was: bumping it makes every other connection to the file reload
    // the schema instead of running with the definitions it read before.
    let cookie: i64 = tx.query_row("PRAGMA schema_version", [], |r| r.get(0)).map_err(sqlite)?;
    tx.pragma_update(None, "schema_version", cookie + 1).map_err(sqlite)?;
    tx.pragma_update(None, "user_version", kind.user_version).map_err(sqlite)?;
    let orphans: i64 =
        tx.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| r.get(0)).map_err(sqlite)?;
    if orphans > 0 {
        // Dropping the transaction rolls every step back: the file stays as it was.
        return Err(DbError::UpgradeRefused {
            path: path.to_owned(),
            kind: kind.name,
            to: kind.user_version,
            what: format!("it would leave {orphans} rows whose foreign key names no row"),
        });
    }
    tx.commit().map_err(sqlite)?;
    tracing::info!(path = %path.display(), kind = kind.name, from, to = kind.user_version, "upgraded database schema");
    Ok(())
}

/// Opens like [`open`], then logs the file and the settings the connection actually runs
/// with (the `<kind> database open` start-up line operators and the benchmark read).
pub fn open_logged(path: &Path, kind: &DbKind, mode: OpenMode) -> Result<Connection, DbError> {
    let conn = open(path, kind, mode)?;
    let eff = effective(&conn).map_err(|source| DbError::Sqlite { path: path.to_owned(), source })?;
    tracing::info!(
        db = %path.display(),
        journal_mode = %eff.journal_mode,
        synchronous = %eff.synchronous,
        auto_vacuum = %eff.auto_vacuum,
        "{} database open",
        kind.name
    );
    Ok(conn)
}

/// Waits for another connection's write lock for up to [`BUSY_TIMEOUT`], retrying after
/// short pauses (50 µs at first, growing to 1 ms). SQLite's own busy timeout backs off to
/// 100 ms sleeps, which a group-committing writer that takes the lock again right after each
/// commit (the producer, beside the relay on the same file) would leave waiting for hundreds
/// of milliseconds: the gaps between its transactions are far shorter than that.
fn install_busy_handler(conn: &mut Connection) -> rusqlite::Result<()> {
    let mut since = Instant::now();
    conn.busy_handler(Some(move |attempt: i32| {
        if attempt == 0 {
            since = Instant::now();
        }
        if since.elapsed() >= BUSY_TIMEOUT {
            return false;
        }
        std::thread::sleep(busy_pause(attempt));
        true
    }))
}

/// The pause before retry number `attempt` of a busy lock.
fn busy_pause(attempt: i32) -> Duration {
    match attempt {
        0..20 => Duration::from_micros(50),
        20..100 => Duration::from_micros(200),
        _ => Duration::from_millis(1),
    }
}

fn check_identity(conn: &Connection, path: &Path, kind: &DbKind) -> Result<(), DbError> {
    let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
    let (app_id, version) = identity(conn).map_err(sqlite)?;
    if app_id == 0 {
        return Err(DbError::NotInitialised { path: path.to_owned(), kind: kind.name });
    }
    check_known(app_id, version, path, kind)
}

/// Refuses an identity that is not `kind` at this build's schema version.
fn check_known(app_id: i32, version: i32, path: &Path, kind: &DbKind) -> Result<(), DbError> {
    if app_id != kind.application_id {
        let what = match app_id {
            PRODUCER_APPLICATION_ID => "it is a producer database".to_owned(),
            CONSUMER_APPLICATION_ID => "it is a consumer database".to_owned(),
            other => format!("application_id {other:#x}"),
        };
        return Err(DbError::WrongKind { path: path.to_owned(), kind: kind.name, what });
    }
    if version > kind.user_version {
        return Err(DbError::Newer {
            path: path.to_owned(),
            kind: kind.name,
            found: version,
            supported: kind.user_version,
        });
    }
    if version < kind.user_version {
        return Err(DbError::WrongKind {
            path: path.to_owned(),
            kind: kind.name,
            what: format!("schema version {version} predates this build's {}", kind.user_version),
        });
    }
    Ok(())
}

/// Creates the schema of a new empty file under the write lock (another process may have
/// raced us here, so the identity is read again inside the transaction).
fn create_schema(conn: &mut Connection, path: &Path, kind: &DbKind) -> Result<(), DbError> {
    let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
    let tx = begin_immediate(conn).map_err(sqlite)?;
    let (app_id, _) = identity(&tx).map_err(sqlite)?;
    if app_id == 0 {
        let tables: i64 =
            tx.query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0)).map_err(sqlite)?;
        if tables > 0 {
            return Err(DbError::WrongKind {
                path: path.to_owned(),
                kind: kind.name,
                what: format!("it already has {tables} schema objects and no application_id"),
            });
        }
        tx.execute_batch(kind.schema_sql).map_err(sqlite)?;
        // A new file is built exactly as an upgraded one: one definition of each version.
        for upgrade in kind.upgrades {
            tx.execute_batch(upgrade).map_err(sqlite)?;
        }
        tx.pragma_update(None, "application_id", kind.application_id).map_err(sqlite)?;
        tx.pragma_update(None, "user_version", kind.user_version).map_err(sqlite)?;
        tx.commit().map_err(sqlite)?;
        tracing::info!(path = %path.display(), kind = kind.name, version = kind.user_version, "created database schema");
    }
    Ok(())
}

fn identity(conn: &Connection) -> rusqlite::Result<(i32, i32)> {
    let app_id = conn.query_row("PRAGMA application_id", [], |r| r.get(0))?;
    let version = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    Ok((app_id, version))
}

/// Opens a write transaction with `BEGIN IMMEDIATE`: it takes the write lock (waiting up to
/// the busy timeout) before reading, so every decision is made on what it then reads.
pub fn begin_immediate(conn: &mut Connection) -> rusqlite::Result<Transaction<'_>> {
    conn.transaction_with_behavior(TransactionBehavior::Immediate)
}

/// How a step run inside [`in_savepoint`] failed.
#[derive(Debug)]
pub enum StepFailure<E> {
    /// The step was rolled back alone (`ROLLBACK TO` its savepoint); the caller's
    /// transaction and every step before this one are intact and may still commit.
    RolledBack(E),
    /// SQLite rolled the whole transaction back (or the savepoint could not be undone): no
    /// step of it can commit any more.
    TransactionLost(E),
}

impl<E> StepFailure<E> {
    /// The error that failed the step.
    pub fn into_inner(self) -> E {
        match self {
            StepFailure::RolledBack(e) | StepFailure::TransactionLost(e) => e,
        }
    }
}

/// Statements held prepared for the length of one batch: each is taken from the connection's
/// statement cache on its first use and kept, so the steps of a batch do not look every
/// statement up again (rusqlite's cache hashes the whole SQL text on every take and every
/// return: about 1.5k instructions per statement use, several statements per event). Keyed
/// by the `&'static str` itself (address and length), never by its text. Drop it before the
/// transaction commits.
pub struct Held<'c> {
    conn: &'c Connection,
    stmts: Vec<((usize, usize), rusqlite::CachedStatement<'c>)>,
}

impl<'c> Held<'c> {
    /// Nothing held yet, on `conn` (a transaction derefs to its connection).
    pub fn new(conn: &'c Connection) -> Held<'c> {
        Held { conn, stmts: Vec::new() }
    }

    /// The connection the statements belong to.
    pub fn conn(&self) -> &'c Connection {
        self.conn
    }

    /// The prepared statement of `sql`, taken from the cache on its first use.
    pub fn get(&mut self, sql: &'static str) -> rusqlite::Result<&mut rusqlite::CachedStatement<'c>> {
        let key = (sql.as_ptr() as usize, sql.len());
        let at = match self.stmts.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                self.stmts.push((key, self.conn.prepare_cached(sql)?));
                self.stmts.len() - 1
            }
        };
        Ok(&mut self.stmts[at].1)
    }
}

/// How the steps of a group-committed transaction are kept apart.
///
/// A savepoint per step is what lets one failing step roll back alone, but it is not free:
/// besides the `SAVEPOINT`/`RELEASE` statements, SQLite copies every page a step changes for
/// the first time into the savepoint's sub-journal (a 4 KiB copy each, several per step).
/// Steps almost never fail, so a batch first runs [`Steps::Direct`]: every step straight in
/// the transaction, and the first failure abandons the transaction (rolled back, nothing
/// answered, no commit) so the caller runs the same batch again with
/// [`Steps::Savepoint`], which then decides every step exactly as before. Every decision is
/// read inside the transaction, so the second run decides what the first would have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Steps {
    /// Every step directly in the transaction; any failure means "run the batch again with
    /// savepoints".
    Direct,
    /// Every step in its own savepoint ([`in_savepoint`]).
    Savepoint,
}

/// Runs one step as `steps` says: directly (a failure is [`StepFailure::TransactionLost`]:
/// the transaction must not commit, and the caller runs the batch again with savepoints) or
/// in its own savepoint ([`in_savepoint`]).
pub fn in_step<T, E>(
    tx: &Transaction<'_>,
    steps: Steps,
    step: impl FnOnce(&Transaction<'_>) -> Result<T, E>,
) -> Result<T, StepFailure<E>>
where
    E: From<rusqlite::Error>,
{
    match steps {
        Steps::Direct => step(tx).map_err(StepFailure::TransactionLost),
        Steps::Savepoint => in_savepoint(tx, step),
    }
}

/// Runs one step of a group-committed transaction inside its own `SAVEPOINT`: on success the
/// savepoint is released (the step commits with the transaction); on failure only the
/// step's writes are undone, so one failing step never fails the others sharing the commit.
/// Errors are classified after the fact: if SQLite already rolled the whole transaction
/// back (some I/O errors do), the failure is [`StepFailure::TransactionLost`].
pub fn in_savepoint<T, E>(
    tx: &Transaction<'_>,
    step: impl FnOnce(&Transaction<'_>) -> Result<T, E>,
) -> Result<T, StepFailure<E>>
where
    E: From<rusqlite::Error>,
{
    let run = |sql: &str| tx.prepare_cached(sql).and_then(|mut s| s.execute([])).map(drop);
    if let Err(e) = run("SAVEPOINT step") {
        return Err(StepFailure::TransactionLost(e.into()));
    }
    match step(tx) {
        Ok(value) => match run("RELEASE step") {
            Ok(()) => Ok(value),
            Err(e) => Err(StepFailure::TransactionLost(e.into())),
        },
        Err(e) => {
            if tx.is_autocommit() {
                return Err(StepFailure::TransactionLost(e));
            }
            match run("ROLLBACK TO step").and_then(|()| run("RELEASE step")) {
                Ok(()) => Err(StepFailure::RolledBack(e)),
                Err(_) => Err(StepFailure::TransactionLost(e)),
            }
        }
    }
}

/// A copy of a SQLite error for every caller that shared the failed transaction
/// (`rusqlite::Error` is not `Clone`): SQLite's own codes survive, so busy stays busy.
pub fn copy_error(e: &rusqlite::Error) -> rusqlite::Error {
    match e {
        rusqlite::Error::SqliteFailure(code, message) => {
            rusqlite::Error::SqliteFailure(*code, message.clone())
        }
        other => rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            Some(other.to_string()),
        ),
    }
}

/// The journal mode and synchronous level the connection actually runs with.
pub fn effective(conn: &Connection) -> rusqlite::Result<Effective> {
    let journal_mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    let level: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
    let synchronous = match level {
        0 => "OFF",
        1 => "NORMAL",
        2 => "FULL",
        3 => "EXTRA",
        _ => "UNKNOWN",
    }
    .to_owned();
    let auto_vacuum = match conn.query_row("PRAGMA auto_vacuum", [], |r| r.get::<_, i64>(0))? {
        0 => "NONE",
        1 => "FULL",
        2 => "INCREMENTAL",
        _ => "UNKNOWN",
    }
    .to_owned();
    Ok(Effective { journal_mode, synchronous, auto_vacuum })
}

/// The database's size in bytes as SQLite counts it (page count × page size): what the file
/// holds once the WAL is checkpointed into it.
pub fn database_bytes(conn: &Connection) -> rusqlite::Result<u64> {
    let pages: u64 = conn.query_row("PRAGMA page_count", [], |r| r.get(0))?;
    let page_size: u64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
    Ok(pages * page_size)
}

/// One bounded `PRAGMA incremental_vacuum` step in its own write transaction: `step` says how
/// many of the free pages to give back to the file system (0: none). Returns the pages given
/// back; 0 means the caller is done. The pragma gives back one page per `sqlite3_step`, so it
/// is stepped to its end here (`execute_batch` steps a statement once: every transaction gave
/// back a single page, and a pass took one commit per page).
pub fn give_back_free_pages(conn: &mut Connection, step: impl Fn(u64) -> u64) -> rusqlite::Result<u64> {
    let tx = begin_immediate(conn)?;
    let free = |tx: &Transaction<'_>| tx.query_row("PRAGMA freelist_count", [], |r| r.get::<_, u64>(0));
    let before = free(&tx)?;
    let pages = step(before);
    if pages == 0 {
        return Ok(0);
    }
    {
        let mut vacuum = tx.prepare(&format!("PRAGMA incremental_vacuum({pages})"))?;
        let mut rows = vacuum.query([])?;
        while rows.next()?.is_some() {}
    }
    let after = free(&tx)?;
    tx.commit()?;
    Ok(before.saturating_sub(after))
}

/// True when the error means another connection holds the lock (retry later).
pub fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// The gRPC status for a storage failure: busy or locked is `UNAVAILABLE` (retryable),
/// anything else `INTERNAL`. The message says what failed; the call changed nothing that
/// was not committed.
pub fn storage_status(what: &str, e: &rusqlite::Error) -> tonic::Status {
    if is_busy(e) {
        tonic::Status::unavailable(format!("{what}: database is busy, retry: {e}"))
    } else {
        tonic::Status::internal(format!("{what}: storage failure: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIND: DbKind = DbKind {
        name: "producer",
        application_id: PRODUCER_APPLICATION_ID,
        user_version: 1,
        schema_sql: "CREATE TABLE t(x INTEGER);",
        upgrades: &[],
    };

    #[test]
    fn settings_and_identity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        assert!(matches!(open(&path, &KIND, OpenMode::Existing), Err(DbError::Missing { .. })));
        let conn = open(&path, &KIND, OpenMode::Create).unwrap();
        let eff = effective(&conn).unwrap();
        assert_eq!(eff.journal_mode, "wal");
        assert_eq!(eff.synchronous, "FULL");
        assert_eq!(eff.auto_vacuum, "INCREMENTAL", "a new file gives back what compaction frees");
        drop(conn);
        // Reopening an existing file of the right kind works in both modes.
        open(&path, &KIND, OpenMode::Existing).unwrap();
        let other = DbKind { name: "consumer", application_id: CONSUMER_APPLICATION_ID, ..KIND };
        let err = open(&path, &other, OpenMode::Create).unwrap_err();
        assert!(err.to_string().contains("it is a producer database"), "{err}");
        let conn = Connection::open(&path).unwrap();
        conn.pragma_update(None, "user_version", 2).unwrap();
        drop(conn);
        assert!(matches!(open(&path, &KIND, OpenMode::Create), Err(DbError::Newer { found: 2, .. })));
    }

    /// The files opened pass the check while they are at the path; a deleted or replaced
    /// database (or WAL) is named with what became of it; a WAL absent at open is not checked.
    #[test]
    fn opened_files_tell_a_deleted_or_replaced_database() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let _conn = open(&path, &KIND, OpenMode::Create).unwrap();
        let opened = OpenedFiles::of(&path);
        assert_eq!(opened.check(), Ok(()));
        let copy = dir.path().join("copy.db");
        std::fs::copy(&path, &copy).unwrap();
        std::fs::rename(&copy, &path).unwrap();
        assert_eq!(opened.check(), Err(format!("{} was replaced by another file", path.display())));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(opened.check(), Err(format!("{} was deleted", path.display())));

        let fresh = dir.path().join("fresh.db");
        std::fs::write(&fresh, b"").unwrap();
        let opened = OpenedFiles::of(&fresh);
        std::fs::write(sidecar(&fresh, "-wal"), b"").unwrap();
        assert_eq!(opened.check(), Ok(()), "a WAL that appeared after the open is not another file");
    }

    /// One give-back step returns as many free pages as it is asked for, in one transaction
    /// (not one page: the pragma must be stepped to its end), and the file shrinks by them.
    #[test]
    fn one_give_back_step_returns_every_page_it_is_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let mut conn = open(&path, &KIND, OpenMode::Create).unwrap();
        conn.execute_batch(
            "CREATE TABLE big(b BLOB);
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 600)
             INSERT INTO big SELECT zeroblob(3000) FROM n;
             DELETE FROM big;",
        )
        .unwrap();
        let free =
            |conn: &Connection| conn.query_row("PRAGMA freelist_count", [], |r| r.get::<_, u64>(0)).unwrap();
        let before = free(&conn);
        assert!(before >= 600, "{before} free pages");
        let pages = database_bytes(&conn).unwrap();
        assert_eq!(give_back_free_pages(&mut conn, |_| 256).unwrap(), 256);
        assert_eq!(free(&conn), before - 256);
        assert_eq!(database_bytes(&conn).unwrap(), pages - 256 * 4096);
        assert_eq!(give_back_free_pages(&mut conn, |free| free).unwrap(), before - 256);
        assert_eq!(free(&conn), 0);
        assert_eq!(give_back_free_pages(&mut conn, |free| free).unwrap(), 0);
    }

    #[test]
    fn a_failing_step_rolls_back_alone() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = open(&dir.path().join("p.db"), &KIND, OpenMode::Create).unwrap();
        conn.execute_batch(
            "CREATE TRIGGER no_sevens BEFORE INSERT ON t WHEN NEW.x = 7 BEGIN SELECT RAISE(ABORT, 'no 7'); END;",
        )
        .unwrap();
        let tx = begin_immediate(&mut conn).unwrap();
        let insert = |x: i64| {
            in_savepoint(&tx, |tx| -> rusqlite::Result<()> {
                tx.execute("INSERT INTO t(x) VALUES (?1)", [x * 10])?;
                tx.execute("INSERT INTO t(x) VALUES (?1)", [x])?;
                Ok(())
            })
        };
        assert!(insert(1).is_ok());
        assert!(matches!(insert(7), Err(StepFailure::RolledBack(_))));
        assert!(insert(2).is_ok());
        tx.commit().unwrap();
        let xs: Vec<i64> = conn
            .prepare("SELECT x FROM t ORDER BY x")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        // 70 was written before the failing 7 in the same step, and rolled back with it.
        assert_eq!(xs, [1, 2, 10, 20]);
    }

    #[test]
    fn a_released_write_lock_is_taken_by_a_waiter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let mut holder = open(&path, &KIND, OpenMode::Create).unwrap();
        let mut waiter = open(&path, &KIND, OpenMode::Existing).unwrap();
        let tx = begin_immediate(&mut holder).unwrap();
        // Whether the waiter asks before or after the commit, it must get the lock.
        let released = std::thread::scope(|s| {
            let waiting = s.spawn(|| begin_immediate(&mut waiter).map(drop));
            tx.commit().unwrap();
            waiting.join().unwrap()
        });
        assert!(released.is_ok(), "{released:?}");
        assert_eq!(busy_pause(0), Duration::from_micros(50));
        assert_eq!(busy_pause(1000), Duration::from_millis(1));
    }

    #[test]
    fn empty_file_is_not_initialised_for_the_relay() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.db");
        std::fs::write(&path, b"").unwrap();
        assert!(matches!(open(&path, &KIND, OpenMode::Existing), Err(DbError::NotInitialised { .. })));
    }

    #[test]
    fn foreign_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello, this is not sqlite at all, not even close.......").unwrap();
        assert!(open(&text, &KIND, OpenMode::Create).is_err());
        let other = dir.path().join("other.db");
        Connection::open(&other).unwrap().execute_batch("CREATE TABLE x(y);").unwrap();
        let before = std::fs::read(&other).unwrap();
        assert!(matches!(open(&other, &KIND, OpenMode::Create), Err(DbError::WrongKind { .. })));
        // Refused before anything was set: still a rollback-journal file, byte for byte.
        assert_eq!(std::fs::read(&other).unwrap(), before, "a refused file must not be modified");
        assert!(!dir.path().join("other.db-wal").exists());
        let consumer = DbKind { name: "consumer", application_id: CONSUMER_APPLICATION_ID, ..KIND };
        let ours = dir.path().join("ours.db");
        drop(open(&ours, &consumer, OpenMode::Create).unwrap());
        let before = std::fs::read(&ours).unwrap();
        assert!(matches!(open(&ours, &KIND, OpenMode::Create), Err(DbError::WrongKind { .. })));
        assert_eq!(std::fs::read(&ours).unwrap(), before);
    }

    #[test]
    fn a_deleted_database_with_sidecars_left_is_not_recreated_silently() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        let keep = open(&path, &KIND, OpenMode::Create).unwrap();
        keep.execute("INSERT INTO t(x) VALUES (1)", []).unwrap();
        std::fs::remove_file(&path).unwrap();
        let err = open(&path, &KIND, OpenMode::Create).unwrap_err();
        assert!(matches!(err, DbError::Orphaned { .. }), "{err}");
        assert!(err.to_string().contains("p.db-wal"), "{err}");
        assert!(!path.exists(), "nothing is created");
    }

    #[test]
    fn an_older_schema_is_upgraded_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.db");
        drop(open(&path, &KIND, OpenMode::Create).unwrap());
        let v2 = DbKind { user_version: 2, upgrades: &["ALTER TABLE t ADD COLUMN y INTEGER;"], ..KIND };
        let conn = open(&path, &v2, OpenMode::Existing).unwrap();
        assert_eq!(identity(&conn).unwrap(), (PRODUCER_APPLICATION_ID, 2));
        conn.execute("INSERT INTO t(x, y) VALUES (1, 2)", []).unwrap();
        let v3 = DbKind { user_version: 3, ..v2 };
        assert!(matches!(open(&path, &v3, OpenMode::Existing), Err(DbError::WrongKind { .. })));
    }
}
