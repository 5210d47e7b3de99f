//! Child processes: the servers (killed on drop, logs kept for failure messages) and relay
//! runs (waited on with a deadline). Binaries come from `target/release` (or
//! `ORDERED_EVENTS_BIN_DIR`); build them first with `cargo build --release --bins`.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use proto::crash::{self, CrashPoint};
use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use proto::pb::producer_client::ProducerClient;
use proto::pg::testing::TestDb;
use tonic::transport::Channel;

use crate::backend::{Backend, Target};

/// How long a server may take to print its address.
pub const START_DEADLINE: Duration = Duration::from_secs(30);
/// How long a one-shot relay run may take.
pub const RELAY_DEADLINE: Duration = Duration::from_secs(60);

/// The path of a built binary; panics with the command to run when it is missing.
pub fn bin_path(name: &str) -> PathBuf {
    let dir = match std::env::var_os("ORDERED_EVENTS_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release"),
    };
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: build the binaries first with `cargo build --release --bins` \
         (or point ORDERED_EVENTS_BIN_DIR at them)",
        path.display()
    );
    path
}

/// A temp directory for one test or scenario (logs, tokens, certificates; on SQLite the
/// database files too) and, on PostgreSQL, a fresh database made for it on the server named
/// by `ORDERED_EVENTS_TEST_PG_URL`, holding both stores in their own schemas and dropped
/// (`WITH (FORCE)`) when the `Workdir` drops.
pub struct Workdir {
    /// The directory, removed on drop.
    pub dir: tempfile::TempDir,
    /// The test's PostgreSQL databases (the main one first), on that backend.
    pg: Vec<TestDb>,
    backend: Backend,
}

impl Workdir {
    /// A fresh workdir on the selected backend ([`Backend::current`]); panics when its
    /// PostgreSQL server cannot be used (for the experiment runner and the chaos driver,
    /// which check [`crate::backend::ready`] first). Tests use [`Workdir::for_test`].
    pub fn new() -> Workdir {
        Self::try_new().unwrap_or_else(|| panic!("PostgreSQL is unreachable (see the SKIPPED line above)"))
    }

    /// A fresh workdir for a test, or `None` after one loud `SKIPPED (PostgreSQL unreachable
    /// at …)` line when the suite runs on PostgreSQL and no server answers; then the test
    /// returns: `let Some(work) = Workdir::for_test() else { return };`. With
    /// `ORDERED_EVENTS_REQUIRE_PG=1` an unreachable server fails the test instead.
    pub fn for_test() -> Option<Workdir> {
        Self::try_new()
    }

    fn try_new() -> Option<Workdir> {
        let dir = tempfile::Builder::new().prefix("oe-test-").tempdir().expect("temp dir");
        let backend = Backend::current();
        let mut work = Workdir { dir, pg: Vec::new(), backend };
        if backend == Backend::Postgres {
            work.pg.push(TestDb::create(&test_label())?);
        }
        Some(work)
    }

    /// The backend the services of this workdir run on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// A file name inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The producer's database: `producer.db`, or the test's PostgreSQL database.
    pub fn producer_db(&self) -> Target {
        match self.pg.first() {
            Some(db) => Target::Postgres(db.url().to_owned()),
            None => Target::Sqlite(self.path("producer.db")),
        }
    }

    /// The consumer's database: `consumer.db`, or the test's PostgreSQL database (the same
    /// one as the producer's: their schemas differ).
    pub fn consumer_db(&self) -> Target {
        match self.pg.first() {
            Some(db) => Target::Postgres(db.url().to_owned()),
            None => Target::Sqlite(self.path("consumer.db")),
        }
    }

    /// Another, empty database beside the main one: the file `name` on SQLite, a second
    /// fresh database on PostgreSQL (dropped with the workdir).
    pub fn other_db(&mut self, name: &str) -> Target {
        match self.backend {
            Backend::Sqlite => Target::Sqlite(self.path(name)),
            Backend::Postgres => {
                let db = TestDb::create(&format!("{}_{name}", test_label()))
                    .unwrap_or_else(|| panic!("the PostgreSQL server went away during the test"));
                let url = db.url().to_owned();
                self.pg.push(db);
                Target::Postgres(url)
            }
        }
    }
}

impl Default for Workdir {
    fn default() -> Self {
        Workdir::new()
    }
}

/// The running test's name (cargo names each test's thread after it), for database names.
fn test_label() -> String {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or("work");
    name.rsplit("::").next().unwrap_or(name).to_owned()
}

/// A running server process. Killed (SIGKILL) and reaped on drop.
pub struct ServerProcess {
    child: Option<Child>,
    /// The address the server printed (`HOST:PORT`).
    pub addr: String,
    /// Its stderr log file.
    pub log: PathBuf,
}

impl ServerProcess {
    /// Starts `bin args…` with `env`, stderr to `log`, and waits for the first stdout line
    /// (the bound address). Panics with the log when the process dies or the line is late.
    pub fn start(bin: &str, args: &[String], env: &[(&str, &str)], log: PathBuf) -> ServerProcess {
        Self::try_start(bin, args, env, log, START_DEADLINE).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`ServerProcess::start`] that reports a process that died or stayed silent for
    /// `deadline` as an error (with its log) instead of panicking: for callers that expect a
    /// start to fail sometimes (an address still taken after a kill, say).
    pub fn try_start(
        bin: &str,
        args: &[String],
        env: &[(&str, &str)],
        log: PathBuf,
        deadline: Duration,
    ) -> Result<ServerProcess, String> {
        Self::try_start_command(Command::new(bin_path(bin)), bin, args, env, log, deadline)
    }

    /// [`ServerProcess::try_start`] of a command the caller built (`program` and its leading
    /// arguments, e.g. a binary run under `valgrind`); `bin` names it in messages.
    pub fn try_start_command(
        mut cmd: Command,
        bin: &str,
        args: &[String],
        env: &[(&str, &str)],
        log: PathBuf,
        deadline: Duration,
    ) -> Result<ServerProcess, String> {
        let err = std::fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(err);
        strip_ours(&mut cmd);
        cmd.env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().map_err(|e| format!("spawn {bin}: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let first = reader.read_line(&mut line).map(|_| line.trim().to_owned());
            let _ = tx.send(first);
            // Keep draining so the child never blocks on a full pipe, and catch stray output.
            let mut rest = String::new();
            let _ = reader.read_to_string(&mut rest);
            if !rest.is_empty() {
                eprintln!("unexpected extra stdout from a server: {rest:?}");
            }
        });
        let mut server = ServerProcess { child: Some(child), addr: String::new(), log };
        match rx.recv_timeout(deadline) {
            Ok(Ok(addr)) if !addr.is_empty() => {
                server.addr = addr;
                Ok(server)
            }
            other => Err(format!(
                "{bin} did not print its address within {deadline:?} ({other:?}); log:\n{}",
                server.log_text()
            )),
        }
    }

    /// The process id while the process is owned (not yet reaped), e.g. to read
    /// `/proc/PID/status`.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `http://ADDR`, for clients and the relay.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything the process wrote to stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit on its own (after a crash point, say).
    pub fn wait_exit(&mut self, deadline: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("process still owned");
        let status = wait_with_deadline(child, deadline)
            .unwrap_or_else(|| panic!("process did not exit within {deadline:?}; log:\n{}", self.log_text()));
        self.child = None;
        status
    }

    /// Waits for a process armed at `point` to die there: exit code 73 and the
    /// `crash_point=<name>` marker in its log. An error names what happened instead.
    pub fn wait_crash(&mut self, point: CrashPoint) -> Result<(), String> {
        let status = self.wait_exit(START_DEADLINE);
        let log = self.log_text();
        if status.code() == Some(crash::EXIT_CODE) && log.contains(&point.marker()) {
            Ok(())
        } else {
            Err(format!("expected a crash at {point}, got exit {status:?}; log:\n{log}"))
        }
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(&mut self, deadline: Duration) -> ExitStatus {
        let child = self.child.as_mut().expect("process still owned");
        signal(child.id(), libc::SIGTERM);
        self.wait_exit(deadline)
    }

    /// SIGKILL, now.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A server stopped with SIGSTOP (a frozen peer). It borrows the process, so it is resumed
/// (SIGCONT) before the process can be dropped: no test leaves a frozen process behind.
pub struct Frozen<'a> {
    process: &'a ServerProcess,
}

impl ServerProcess {
    /// Stops the process (SIGSTOP) until the guard is dropped or [`Frozen::resume`]d.
    pub fn freeze(&self) -> Frozen<'_> {
        let pid = self.pid().expect("process still owned");
        signal(pid, libc::SIGSTOP);
        Frozen { process: self }
    }
}

impl Frozen<'_> {
    /// SIGCONT, now.
    pub fn resume(self) {}
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if let Some(pid) = self.process.pid() {
            signal(pid, libc::SIGCONT);
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The environment entry that arms `point` in a child: crash points are armed only through
/// the child's environment, and only by their enum (a misspelt name cannot compile).
pub fn arming(point: CrashPoint) -> (&'static str, &'static str) {
    (crash::ENV, point.name())
}

/// Polls `child` until it exits or `deadline` passes.
pub fn wait_with_deadline(child: &mut Child, deadline: Duration) -> Option<ExitStatus> {
    let until = Instant::now() + deadline;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= until {
            return None;
        }
        // Backoff between polls of the child's state, not a wait for a guessed duration.
        std::thread::park_timeout(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Keeps every `ORDERED_EVENTS_*` variable of the test's own environment away from a child,
/// so only what a test passes explicitly configures it.
pub fn strip_ours(cmd: &mut Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("ORDERED_EVENTS_") {
            cmd.env_remove(name);
        }
    }
}

/// A running producer and a way to call it.
pub struct Producer {
    /// The server process.
    pub process: ServerProcess,
    /// Its database.
    pub db: Target,
}

impl Producer {
    /// Starts a producer on the workdir's file, with `env` added to its environment.
    pub fn start(work: &Workdir, env: &[(&str, &str)]) -> Producer {
        Self::start_on(work.producer_db(), work.path("producer.log"), env)
    }

    /// Starts a producer on `db`, logging to `log`, with `env` added to its environment.
    pub fn start_on(db: Target, log: PathBuf, env: &[(&str, &str)]) -> Producer {
        let args = server_args(&db, &[]);
        Producer { process: ServerProcess::start("producer", &args, env, log), db }
    }

    /// Starts a producer on `db` armed at `point` (it dies when a write reaches it).
    pub fn start_armed(db: Target, log: PathBuf, point: CrashPoint) -> Producer {
        Self::start_on(db, log, &[arming(point)])
    }

    /// Starts a producer on the workdir's file with extra flags (limits, token, TLS).
    pub fn start_with(work: &Workdir, extra: &[&str]) -> Producer {
        let db = work.producer_db();
        let process =
            ServerProcess::start("producer", &server_args(&db, extra), &[], work.path("producer.log"));
        Producer { process, db }
    }

    /// A new client connected to it.
    pub async fn client(&self) -> ProducerClient<Channel> {
        ProducerClient::new(connect(&self.process.url()).await)
    }

    /// Advances `flow` through the steps after `done` (seq `done+1`, …), one per entry of
    /// `schemas`, with event ids `<flow><seq>` and amount 3; returns the answers in order.
    pub async fn advance_steps(&self, flow: &str, done: usize, schemas: &[u32]) -> Vec<pb::AdvanceResponse> {
        const KINDS: [&str; 3] = ["reserved", "confirmed", "released"];
        let mut answers = Vec::new();
        for (i, schema) in schemas.iter().enumerate() {
            let seq = done + i + 1;
            let kind = KINDS.get(seq - 1).copied().unwrap_or("released");
            answers.push(
                self.advance(crate::advance(flow, &format!("{flow}{seq}"), seq as u64 - 1, kind, *schema))
                    .await,
            );
        }
        answers
    }

    /// One `Advance`, unwrapping the transport (the answer is what tests look at).
    pub async fn advance(&self, req: pb::AdvanceRequest) -> pb::AdvanceResponse {
        self.client().await.advance(req).await.expect("Advance call").into_inner()
    }
}

/// A running consumer and a way to call it.
pub struct Consumer {
    /// The server process.
    pub process: ServerProcess,
    /// Its database.
    pub db: Target,
}

impl Consumer {
    /// Starts a consumer on the workdir's file, with `env` added to its environment.
    pub fn start(work: &Workdir, support_v2: bool, env: &[(&str, &str)]) -> Consumer {
        Self::start_on(work.consumer_db(), work.path("consumer.log"), support_v2, env)
    }

    /// Starts a consumer on `db`, logging to `log`, with `env` added to its environment.
    pub fn start_on(db: Target, log: PathBuf, support_v2: bool, env: &[(&str, &str)]) -> Consumer {
        let mut args = server_args(&db, &[]);
        if support_v2 {
            args.push("--support-v2".into());
        }
        Consumer { process: ServerProcess::start("consumer", &args, env, log), db }
    }

    /// Starts a consumer on `db` armed at `point` (it dies when a write reaches it).
    pub fn start_armed(db: Target, log: PathBuf, support_v2: bool, point: CrashPoint) -> Consumer {
        Self::start_on(db, log, support_v2, &[arming(point)])
    }

    /// Starts a consumer on the workdir's file with extra flags (limits, token, TLS, v2).
    pub fn start_with(work: &Workdir, extra: &[&str]) -> Consumer {
        Self::start_on_with(work.consumer_db(), work.path("consumer.log"), extra)
    }

    /// Starts a consumer on `db`, logging to `log`, with extra flags.
    pub fn start_on_with(db: Target, log: PathBuf, extra: &[&str]) -> Consumer {
        let process = ServerProcess::start("consumer", &server_args(&db, extra), &[], log);
        Consumer { process, db }
    }

    /// A new client connected to it.
    pub async fn client(&self) -> ConsumerClient<Channel> {
        ConsumerClient::new(connect(&self.process.url()).await)
    }

    /// Sends `envelopes` over one `Receive` stream and returns every answer, in order.
    pub async fn receive(&self, envelopes: Vec<pb::EventEnvelope>) -> Vec<pb::ReceiveResult> {
        let mut client = self.client().await;
        let mut stream =
            client.receive(tokio_stream::iter(envelopes)).await.expect("Receive call").into_inner();
        let mut out = Vec::new();
        while let Some(result) = stream.message().await.expect("Receive stream") {
            out.push(result);
        }
        out
    }

    /// One `Apply` with the default step limit.
    pub async fn apply(&self, flow: &str) -> pb::ApplyResult {
        self.client()
            .await
            .apply(pb::ApplyRequest { flow_id: flow.into(), max_steps: 0 })
            .await
            .expect("Apply call")
            .into_inner()
    }

    /// One `GetFlow`.
    pub async fn get_flow(&self, flow: &str) -> pb::ConsumerFlow {
        self.client()
            .await
            .get_flow(pb::GetFlowRequest { flow_id: flow.into() })
            .await
            .expect("GetFlow call")
            .into_inner()
    }

    /// One `ApplyAll` (`max_steps` 0 is the default).
    pub async fn apply_all(&self, max_steps: u32) -> pb::ApplyAllResponse {
        self.client()
            .await
            .apply_all(pb::ApplyAllRequest { max_steps })
            .await
            .expect("ApplyAll call")
            .into_inner()
    }

    /// One `ListStuck` (`limit` 0 is the default).
    pub async fn list_stuck(&self, limit: u32) -> pb::ListStuckResponse {
        self.client()
            .await
            .list_stuck(pb::ListStuckRequest { limit })
            .await
            .expect("ListStuck call")
            .into_inner()
    }
}

/// A process run to completion.
#[derive(Debug)]
pub struct Finished {
    /// The exit code (None when killed by a signal).
    pub code: Option<i32>,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

/// Runs `bin args…` with `env` (and none of the `ORDERED_EVENTS_*` variables of the test's
/// own environment) until it exits, for start-up errors and `--help`; panics after `deadline`.
pub fn run_to_exit(bin: &str, args: &[&str], env: &[(&str, &str)], deadline: Duration) -> Finished {
    let mut cmd = Command::new(bin_path(bin));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    strip_ours(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = wait_with_deadline(&mut child, deadline);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    let status = status
        .unwrap_or_else(|| panic!("{bin} {args:?} did not exit within {deadline:?}; stderr:\n{stderr}"));
    Finished { code: status.code(), stdout, stderr }
}

/// `--db DB --listen 127.0.0.1:0` followed by `extra`.
pub fn server_args(db: &Target, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["--db".to_owned(), db.arg(), "--listen".to_owned(), "127.0.0.1:0".to_owned()];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args
}

/// Connects to a server that already printed its address.
pub async fn connect(url: &str) -> Channel {
    Channel::from_shared(url.to_owned())
        .expect("valid url")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"))
}

/// The outcome of one relay run.
#[derive(Debug)]
pub struct RelayRun {
    /// The exit code (None when killed by a signal).
    pub code: Option<i32>,
    /// Parsed stdout JSON lines.
    pub lines: Vec<serde_json::Value>,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl RelayRun {
    /// The `delivery` lines' outcomes, in order.
    pub fn outcomes(&self) -> Vec<String> {
        self.deliveries().map(|d| d["outcome"].as_str().unwrap_or_default().to_owned()).collect()
    }

    /// The `delivery` lines.
    pub fn deliveries(&self) -> impl Iterator<Item = &serde_json::Value> {
        self.lines.iter().filter(|l| l["type"] == "delivery")
    }

    /// True when the run died at `point`: exit code 73 and the marker on stderr.
    pub fn crashed_at(&self, point: CrashPoint) -> bool {
        self.code == Some(crash::EXIT_CODE) && self.stderr.contains(&point.marker())
    }

    /// The final `summary` line.
    pub fn summary(&self) -> &serde_json::Value {
        self.lines
            .iter()
            .rev()
            .find(|l| l["type"] == "summary")
            .unwrap_or_else(|| panic!("relay printed no summary line; stderr:\n{}", self.stderr))
    }
}

/// Runs `relay --producer-db DB --consumer URL <args…>` to completion (with a deadline).
pub fn relay(producer_db: &Target, consumer_url: &str, args: &[&str], env: &[(&str, &str)]) -> RelayRun {
    let db = producer_db.arg();
    let mut all = vec!["--producer-db", db.as_str(), "--consumer", consumer_url];
    all.extend_from_slice(args);
    let Finished { code, stdout, stderr } = run_to_exit("relay", &all, env, RELAY_DEADLINE);
    let lines = stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("relay stdout line is not JSON ({e}): {l:?}\nstderr:\n{stderr}"))
        })
        .collect();
    RelayRun { code, lines, stderr }
}

/// [`relay`] armed at `point` (it dies when its write path reaches it).
pub fn relay_armed(producer_db: &Target, consumer_url: &str, args: &[&str], point: CrashPoint) -> RelayRun {
    relay(producer_db, consumer_url, args, &[arming(point)])
}

/// Sends `sig` to the child process `pid` (one we spawned and have not reaped yet, so the
/// pid cannot name another process). The one place the harness calls kill(2).
pub fn signal(pid: u32, sig: libc::c_int) {
    // kill(2) has no safe wrapper in libc; the workspace denies unsafe code elsewhere.
    #[allow(unsafe_code)]
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database_exists(name: &str) -> bool {
        let admin = std::env::var(proto::pg::testing::URL_ENV)
            .unwrap_or_else(|_| proto::pg::testing::DEFAULT_URL.to_owned());
        let session = crate::db::PgSession::connect(&admin, true).expect("admin connection");
        let name = name.to_owned();
        session
            .run(move |c| c.query_one("SELECT count(*) FROM pg_database WHERE datname = $1", &[&name]))
            .expect("thread")
            .map(|r| r.get::<_, i64>(0) == 1)
            .expect("pg_database")
    }

    /// A workdir's databases follow the backend: two files on SQLite; on PostgreSQL one fresh
    /// database shared by both stores (plus any `other_db`), all dropped with the workdir.
    #[test]
    fn a_workdir_makes_and_drops_its_databases() {
        let Some(mut work) = Workdir::for_test() else { return };
        assert_eq!(work.backend(), Backend::current());
        let other = work.other_db("second.db");
        match work.backend() {
            Backend::Sqlite => {
                assert_eq!(work.producer_db(), Target::Sqlite(work.path("producer.db")));
                assert_eq!(work.consumer_db(), Target::Sqlite(work.path("consumer.db")));
                assert_eq!(other, Target::Sqlite(work.path("second.db")));
            }
            Backend::Postgres => {
                assert_eq!(work.producer_db(), work.consumer_db());
                assert_ne!(work.producer_db(), other);
                let names: Vec<String> = work.pg.iter().map(|db| db.name().to_owned()).collect();
                assert!(names[0].contains("a_workdir_makes_and_drops"), "named after the test: {names:?}");
                assert!(names.iter().all(|n| database_exists(n)));
                drop(work);
                assert!(names.iter().all(|n| !database_exists(n)), "dropped with the workdir: {names:?}");
            }
        }
    }
}
