//! Which storage backend the harness runs the services on (`ORDERED_EVENTS_TEST_BACKEND`:
//! `sqlite`, the default, or `postgres`), and where one store lives ([`Target`]): a SQLite
//! file or a PostgreSQL database URL. The one place that decides the backend, so every test,
//! scenario and chaos run on one process agrees.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::OnceLock;

/// Names the backend the suite runs on: `sqlite` (default) or `postgres`.
pub const BACKEND_ENV: &str = "ORDERED_EVENTS_TEST_BACKEND";

/// A storage backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// One SQLite file per store, in the test's temp directory.
    Sqlite,
    /// One fresh PostgreSQL database per test (both stores in it, in their own schemas).
    Postgres,
}

impl Backend {
    /// `sqlite` or `postgres`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }

    /// The backend this process runs on: the one [`select`]ed (the experiment runner's and the
    /// chaos driver's `--backend`), else [`BACKEND_ENV`], else SQLite. Panics on a value that
    /// names no backend: a typo must not silently test SQLite twice.
    pub fn current() -> Backend {
        *SELECTED.get_or_init(|| match std::env::var(BACKEND_ENV) {
            Ok(value) => value.parse().unwrap_or_else(|e| panic!("{BACKEND_ENV}: {e}")),
            Err(_) => Backend::Sqlite,
        })
    }
}

impl FromStr for Backend {
    type Err = String;

    fn from_str(value: &str) -> Result<Backend, String> {
        match value {
            "sqlite" | "" => Ok(Backend::Sqlite),
            "postgres" | "postgresql" => Ok(Backend::Postgres),
            other => Err(format!("{other:?} is not a backend (sqlite or postgres)")),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

static SELECTED: OnceLock<Backend> = OnceLock::new();

/// Fixes the backend of this process before any test database is made (a binary's
/// `--backend` flag). An error when another backend was already in use.
pub fn select(backend: Backend) -> Result<(), String> {
    let chosen = *SELECTED.get_or_init(|| backend);
    if chosen == backend {
        Ok(())
    } else {
        Err(format!("the backend is already {chosen}, cannot switch to {backend}"))
    }
}

/// Where one store lives: what the harness passes as `--db` / `--producer-db` and what
/// `harness::db` reads back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL database, as a URL (test servers use trust authentication: no password).
    Postgres(String),
}

impl Target {
    /// The command-line value for the services.
    pub fn arg(&self) -> String {
        match self {
            Target::Sqlite(path) => path.display().to_string(),
            Target::Postgres(url) => url.clone(),
        }
    }

    /// Its backend.
    pub fn backend(&self) -> Backend {
        match self {
            Target::Sqlite(_) => Backend::Sqlite,
            Target::Postgres(_) => Backend::Postgres,
        }
    }

    /// The file, on SQLite.
    pub fn sqlite_path(&self) -> Option<&Path> {
        match self {
            Target::Sqlite(path) => Some(path),
            Target::Postgres(_) => None,
        }
    }

    /// The file, for a test that only runs on SQLite (guarded by [`crate::sqlite_only!`]);
    /// panics on PostgreSQL.
    pub fn file(&self) -> &Path {
        self.sqlite_path()
            .unwrap_or_else(|| panic!("{self} is not a file: guard this test with sqlite_only!"))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.arg())
    }
}

impl From<PathBuf> for Target {
    fn from(path: PathBuf) -> Target {
        Target::Sqlite(path)
    }
}

impl From<&Path> for Target {
    fn from(path: &Path) -> Target {
        Target::Sqlite(path.to_owned())
    }
}

/// True when the selected backend can be used; on PostgreSQL this makes (and drops) a probe
/// database. When it cannot, one loud `SKIPPED (PostgreSQL unreachable at …)` line is printed
/// and the answer is false, unless `ORDERED_EVENTS_REQUIRE_PG=1`, which panics instead.
pub fn ready() -> bool {
    match Backend::current() {
        Backend::Sqlite => true,
        Backend::Postgres => proto::pg::testing::TestDb::create("probe").is_some(),
    }
}

/// Returns from the calling test, after one line saying why, when the suite runs on
/// PostgreSQL: for the few tests about files (sidecars, a file replaced or deleted under a
/// process, a full file system, WAL checkpoints) that mean nothing there. Every such test
/// says so with this guard, so the list stays in one greppable form.
#[macro_export]
macro_rules! sqlite_only {
    ($why:expr) => {
        if $crate::backend::Backend::current() != $crate::backend::Backend::Sqlite {
            // Straight to the stream, not through eprintln!, which the test runner captures
            // (and hides) for a passing test: a skip must be seen.
            let _ = ::std::io::Write::write_all(
                &mut ::std::io::stderr(),
                format!("SKIPPED on {} (SQLite only): {}\n", $crate::backend::Backend::current(), $why)
                    .as_bytes(),
            );
            return;
        }
    };
}

/// Returns from the calling test, after one line saying why, when the suite runs on SQLite:
/// for the few tests about the PostgreSQL server itself (connections terminated, a database
/// refusing connections, a schema dropped under a running service). They run in the suite's
/// PostgreSQL pass.
#[macro_export]
macro_rules! postgres_only {
    ($why:expr) => {
        if $crate::backend::Backend::current() != $crate::backend::Backend::Postgres {
            let _ = ::std::io::Write::write_all(
                &mut ::std::io::stderr(),
                format!(
                    "SKIPPED on {} (PostgreSQL only; runs in the PostgreSQL pass): {}\n",
                    $crate::backend::Backend::current(),
                    $why
                )
                .as_bytes(),
            );
            return;
        }
    };
}
