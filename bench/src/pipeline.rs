//! One pipeline under test: the real producer, consumer (`--auto-apply`) and relay (`run`)
//! on fresh files in their own directory, with the batch caps of the run, started directly
//! or each under `valgrind --tool=callgrind`, and what each process is measured by from the
//! outside (`/proc/PID`: peak RSS, CPU time) and says about itself at shutdown (the batch
//! sizes its writers had).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use harness::background::RelayDaemon;
use harness::proc::ServerProcess;
use serde::Serialize;

/// The caps and knobs of one run, exactly as passed to the processes.
#[derive(Clone, Debug, Serialize)]
pub struct Caps {
    /// `producer --max-batch`: Advance calls per transaction.
    pub producer_max_batch: usize,
    /// `consumer --max-batch`: envelopes per Receive transaction.
    pub consumer_max_batch: usize,
    /// `consumer --apply-batch`: applied steps per transaction.
    pub apply_batch: usize,
    /// `relay --mark-batch`: answers recorded per producer.db transaction.
    pub mark_batch: usize,
    /// `relay --mark-delay-ms`: how long an answer may wait for others to share its mark.
    pub mark_delay_ms: u64,
    /// `relay --window`: envelopes in flight (pipelining, not a transaction cap).
    pub window: usize,
    /// `relay run --poll-ms`: pause when a pass found nothing to send.
    pub poll_ms: u64,
    /// `--metrics-listen 127.0.0.1:0` on all three (and the run scrapes them every second).
    pub metrics: bool,
    /// `--retention` of the producer and the consumer (unset: their default).
    pub retention: Option<String>,
}

impl Caps {
    /// The same pipeline with every batch cap set to 1 and no wait for a mark to fill (the
    /// window and the poll interval, which are not transaction caps, stay as they are).
    pub fn batch_1(&self) -> Caps {
        Caps {
            producer_max_batch: 1,
            consumer_max_batch: 1,
            apply_batch: 1,
            mark_batch: 1,
            mark_delay_ms: 0,
            ..self.clone()
        }
    }
}

/// How the three processes are started: which binaries, and whether under callgrind.
#[derive(Clone, Debug)]
pub struct Launcher {
    /// Where `producer`, `consumer` and `relay` are (default: the harness's, i.e.
    /// `target/release` of this checkout).
    pub bin_dir: Option<PathBuf>,
    /// Run each process under `valgrind --tool=callgrind`, its counts in
    /// `callgrind.out.<name>` of the run's directory.
    pub callgrind: bool,
}

/// The file callgrind writes for process `name` in `dir`.
pub fn callgrind_out(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("callgrind.out.{name}"))
}

impl Launcher {
    /// How long a server may take to print its address (valgrind starts ~50× slower).
    pub fn start_deadline(&self) -> Duration {
        Duration::from_secs(if self.callgrind { 300 } else { 30 })
    }

    /// How long a process may take to exit after SIGTERM (callgrind writes its file then).
    pub fn stop_deadline(&self) -> Duration {
        Duration::from_secs(if self.callgrind { 600 } else { 60 })
    }

    /// The relay's environment: under callgrind every process runs ~50× slower, so the
    /// relay waits up to an hour for an answer instead of dropping the stream after 10 s and
    /// sending the window again (which would count resends as work per event). An
    /// environment variable, not a flag, so that builds without the setting still start.
    fn relay_env(&self) -> &'static [(&'static str, &'static str)] {
        if self.callgrind { &[("ORDERED_EVENTS_RELAY_ANSWER_TIMEOUT_MS", "3600000")] } else { &[] }
    }

    /// Runs `name --db DB --retention R --compact-once` to its end (never under callgrind)
    /// and returns its stdout line (the pass's JSON summary).
    pub fn compact_once(&self, name: &str, db: &str, retention: &str) -> anyhow::Result<String> {
        let out = Command::new(self.binary(name)?)
            .args(["--db", db, "--retention", retention, "--compact-once"])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "{name} --compact-once failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn binary(&self, name: &str) -> anyhow::Result<PathBuf> {
        match &self.bin_dir {
            None => Ok(harness::proc::bin_path(name)),
            Some(dir) => {
                let path = dir.join(name);
                anyhow::ensure!(path.is_file(), "--bin-dir: {} is missing", path.display());
                Ok(path)
            }
        }
    }

    /// The command (without the process's own arguments) that starts `name` for a run in `dir`.
    fn command(&self, dir: &Path, name: &str) -> anyhow::Result<Command> {
        let binary = self.binary(name)?;
        if !self.callgrind {
            return Ok(Command::new(binary));
        }
        let mut cmd = Command::new("valgrind");
        cmd.arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", callgrind_out(dir, name).display()))
            .arg(binary);
        Ok(cmd)
    }
}

/// What `/proc` says about one process just before it is stopped.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcStats {
    pub pid: u32,
    /// `VmHWM`: peak resident set size.
    pub peak_rss_mib: f64,
    /// User + system CPU time over the process's life.
    pub cpu_seconds: f64,
}

/// Reads `VmHWM` and the CPU time of `pid` (`self` for this process).
pub fn proc_stats(pid: &str) -> ProcStats {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at field 3; utime and
    // stime are fields 14 and 15.
    let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // The clock-tick rate has no safe std or libc wrapper, hence the one unsafe block here.
    #[allow(unsafe_code)]
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ProcStats {
        pid: pid.parse().unwrap_or(0),
        peak_rss_mib: hwm_kib / 1024.0,
        cpu_seconds: (ticks(11) + ticks(12)) / per_second,
    }
}

/// The three processes of one run (the first instance of each with `--instances`).
pub struct Pipeline {
    pub producer: ServerProcess,
    pub consumer: ServerProcess,
    pub relay: RelayDaemon,
    /// Instances 2..N: (producer, consumer, relay) on the same database.
    pub extra: Vec<(ServerProcess, ServerProcess, RelayDaemon)>,
    stop_deadline: Duration,
}

/// The processes' measurements and the relay's final summary, after they stopped.
#[derive(Debug, Serialize)]
pub struct Stopped {
    pub producer: ProcStats,
    pub consumer: ProcStats,
    pub relay: ProcStats,
    pub relay_exit_code: Option<i32>,
    pub relay_summary: serde_json::Value,
    /// What each process logged about the database it opened (`synchronous`,
    /// `journal_mode`), from its own start-up line.
    pub producer_log_settings: Settings,
    pub consumer_log_settings: Settings,
    pub relay_log_settings: Settings,
    /// Each writer's `batch sizes` shutdown line (transactions, items, mean, max, histogram),
    /// by process then writer; empty for a build that does not log them.
    pub batch_sizes: serde_json::Value,
}

/// Effective settings a process reported for its connection.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Settings {
    /// SQLite: `PRAGMA journal_mode`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal_mode: Option<String>,
    /// SQLite: `PRAGMA synchronous`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synchronous: Option<String>,
    /// PostgreSQL: the session's `synchronous_commit`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synchronous_commit: Option<String>,
    /// PostgreSQL: the server's `fsync`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsync: Option<String>,
}

/// Where a run's two stores live.
#[derive(Clone, Debug)]
pub enum Databases {
    /// Fresh SQLite files in the run's directory.
    Files {
        /// producer.db.
        producer: PathBuf,
        /// consumer.db.
        consumer: PathBuf,
    },
    /// One fresh PostgreSQL database holding both schemas.
    Postgres {
        /// Its URL.
        url: String,
    },
}

impl Databases {
    /// Fresh files in `dir`.
    pub fn files(dir: &Path) -> Databases {
        Databases::Files { producer: dir.join("producer.db"), consumer: dir.join("consumer.db") }
    }

    /// The producer's `--db` (and the relay's `--producer-db`).
    pub fn producer_arg(&self) -> String {
        match self {
            Databases::Files { producer, .. } => producer.display().to_string(),
            Databases::Postgres { url } => url.clone(),
        }
    }

    /// The relay's `--producer-db`, as the harness starts it.
    pub fn producer_target(&self) -> harness::Target {
        match self {
            Databases::Files { producer, .. } => harness::Target::Sqlite(producer.clone()),
            Databases::Postgres { url } => harness::Target::Postgres(url.clone()),
        }
    }

    /// The consumer's `--db`.
    pub fn consumer_arg(&self) -> String {
        match self {
            Databases::Files { consumer, .. } => consumer.display().to_string(),
            Databases::Postgres { url } => url.clone(),
        }
    }
}

impl Pipeline {
    /// Starts producer, consumer and relay in `dir` on `databases` with `caps`, as
    /// `launcher` says.
    pub fn start(
        dir: &Path,
        databases: &Databases,
        caps: &Caps,
        launcher: &Launcher,
        instances: usize,
    ) -> anyhow::Result<Pipeline> {
        let first = Self::start_instance(dir, databases, caps, launcher, "")?;
        let mut extra = Vec::new();
        for i in 2..=instances {
            extra.push(Self::start_instance(dir, databases, caps, launcher, &format!("-{i}"))?);
        }
        let (producer, consumer, relay) = first;
        Ok(Pipeline { producer, consumer, relay, extra, stop_deadline: launcher.stop_deadline() })
    }

    /// Every producer's URL (the load is spread over them).
    pub fn producer_urls(&self) -> Vec<String> {
        std::iter::once(&self.producer).chain(self.extra.iter().map(|e| &e.0)).map(|p| p.url()).collect()
    }

    /// One producer, consumer and relay; `suffix` names their logs apart.
    fn start_instance(
        dir: &Path,
        databases: &Databases,
        caps: &Caps,
        launcher: &Launcher,
        suffix: &str,
    ) -> anyhow::Result<(ServerProcess, ServerProcess, RelayDaemon)> {
        let producer_db = databases.producer_arg();
        let consumer_db = databases.consumer_arg();
        let metrics: &[&str] = if caps.metrics { &["--metrics-listen", "127.0.0.1:0"] } else { &[] };
        let retention: Vec<&str> = match &caps.retention {
            Some(r) => vec!["--retention", r],
            None => vec![],
        };
        let start_server = |name: &str, args: &[String]| -> anyhow::Result<ServerProcess> {
            ServerProcess::try_start_command(
                launcher.command(dir, name)?,
                name,
                args,
                &[],
                dir.join(format!("{name}{suffix}.log")),
                launcher.start_deadline(),
            )
            .map_err(anyhow::Error::msg)
        };
        let producer = start_server(
            "producer",
            &strings(
                &[
                    "--db",
                    &producer_db,
                    "--listen",
                    "127.0.0.1:0",
                    "--max-batch",
                    &caps.producer_max_batch.to_string(),
                ]
                .iter()
                .chain(metrics)
                .chain(&retention)
                .copied()
                .collect::<Vec<_>>(),
            ),
        )?;
        let consumer = start_server(
            "consumer",
            &strings(
                &[
                    "--db",
                    &consumer_db,
                    "--listen",
                    "127.0.0.1:0",
                    "--auto-apply",
                    "--max-batch",
                    &caps.consumer_max_batch.to_string(),
                    "--apply-batch",
                    &caps.apply_batch.to_string(),
                ]
                .iter()
                .chain(metrics)
                .chain(&retention)
                .copied()
                .collect::<Vec<_>>(),
            ),
        )?;
        let (poll_ms, window, mark_batch, mark_delay_ms) = (
            caps.poll_ms.to_string(),
            caps.window.to_string(),
            caps.mark_batch.to_string(),
            caps.mark_delay_ms.to_string(),
        );
        let mut relay_args = vec![
            "run",
            "--poll-ms",
            &poll_ms,
            "--window",
            &window,
            "--mark-batch",
            &mark_batch,
            "--mark-delay-ms",
            &mark_delay_ms,
        ];
        relay_args.extend(metrics);
        let relay = RelayDaemon::start_command(
            launcher.command(dir, "relay")?,
            dir,
            &format!("relay{suffix}"),
            &databases.producer_target(),
            &consumer.url(),
            &relay_args,
            launcher.relay_env(),
        );
        Ok((producer, consumer, relay))
    }

    /// The three processes' metrics addresses (from their `metrics serving` log lines),
    /// once all have logged one, or why not within `deadline`.
    pub fn metrics_addrs(&self, deadline: Duration) -> anyhow::Result<Vec<String>> {
        let until = std::time::Instant::now() + deadline;
        loop {
            let logs = [self.producer.log_text(), self.consumer.log_text(), self.relay.log_text()];
            let addrs: Vec<String> = logs.iter().filter_map(|l| harness::scrape::metrics_addr(l)).collect();
            if addrs.len() == logs.len() {
                return Ok(addrs);
            }
            anyhow::ensure!(
                std::time::Instant::now() < until,
                "only {} of the 3 processes logged a metrics address",
                addrs.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Reads every process's `/proc` figures, then stops them all (SIGTERM, relay first).
    pub fn stop(mut self) -> Stopped {
        let stats = |pid: Option<u32>| pid.map(|p| proc_stats(&p.to_string())).unwrap_or_default();
        let mut producer = stats(self.producer.pid());
        let mut consumer = stats(self.consumer.pid());
        let mut relay = stats(self.relay.pid());
        // Further instances: CPU summed per kind, the peak RSS the largest one's.
        for (p, c, r) in self.extra.drain(..) {
            for (sum, one) in [
                (&mut producer, stats(p.pid())),
                (&mut consumer, stats(c.pid())),
                (&mut relay, stats(r.pid())),
            ] {
                sum.cpu_seconds += one.cpu_seconds;
                sum.peak_rss_mib = sum.peak_rss_mib.max(one.peak_rss_mib);
            }
            let _ = r.terminate(self.stop_deadline);
            let (mut p, mut c) = (p, c);
            p.terminate(self.stop_deadline);
            c.terminate(self.stop_deadline);
        }
        let relay_log = self.relay.log_text();
        let run = self.relay.terminate(self.stop_deadline);
        let relay_summary =
            run.lines.iter().rev().find(|l| l["type"] == "summary").cloned().unwrap_or_default();
        self.producer.terminate(self.stop_deadline);
        self.consumer.terminate(self.stop_deadline);
        let (producer_log, consumer_log) = (self.producer.log_text(), self.consumer.log_text());
        // The relay's shutdown lines are in `run.stderr`: the log read above predates them.
        let batch_sizes = serde_json::json!({
            "producer": batch_sizes(&producer_log),
            "consumer": batch_sizes(&consumer_log),
            "relay": batch_sizes(&run.stderr),
        });
        Stopped {
            producer,
            consumer,
            relay,
            relay_exit_code: run.code,
            relay_summary,
            producer_log_settings: settings(&producer_log),
            consumer_log_settings: settings(&consumer_log),
            relay_log_settings: settings(&relay_log),
            batch_sizes,
        }
    }
}

fn strings(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_owned()).collect()
}

/// Finds the durability settings (`journal_mode=…`, `synchronous=…`; on PostgreSQL
/// `synchronous_commit=…`, `fsync=…`) on the "database open" start-up line.
fn settings(log: &str) -> Settings {
    let Some(line) = log.lines().find(|l| l.contains("database open")) else { return Settings::default() };
    let value = |key: &str| {
        line.split_whitespace().find_map(|w| w.strip_prefix(key)).map(|v| v.trim_matches('"').to_owned())
    };
    Settings {
        journal_mode: value("journal_mode="),
        synchronous: value("synchronous="),
        synchronous_commit: value("synchronous_commit="),
        fsync: value("fsync="),
    }
}

/// The `batch sizes` lines a process logged at shutdown, by writer:
/// `{"advance": {"transactions": 40, "items": 6000, "mean": 150.0, "max": 256, "histogram": "…"}}`.
pub fn batch_sizes(log: &str) -> serde_json::Value {
    let mut writers = serde_json::Map::new();
    for line in log.lines().filter(|l| l.contains(" batch sizes ")) {
        let fields = key_values(line.split_once(" batch sizes ").map_or("", |(_, rest)| rest));
        let Some(writer) = fields.iter().find(|(k, _)| k == "writer").map(|(_, v)| v.clone()) else {
            continue;
        };
        let entry: serde_json::Map<String, serde_json::Value> = fields
            .into_iter()
            .filter(|(k, _)| k != "writer")
            .map(|(k, v)| {
                let value = match (v.parse::<u64>(), v.parse::<f64>()) {
                    (Ok(n), _) => serde_json::json!(n),
                    (_, Ok(x)) => serde_json::json!(x),
                    _ => serde_json::Value::String(v),
                };
                (k, value)
            })
            .collect();
        writers.insert(writer, entry.into());
    }
    writers.into()
}

/// `key=value` pairs of a text log line's fields; a value may be `"quoted with spaces"`.
fn key_values(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while let Some((key, after)) = rest.split_once('=') {
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => quoted.split_once('"').unwrap_or((quoted, "")),
            None => after.split_once(' ').unwrap_or((after, "")),
        };
        out.push((key.trim().to_owned(), value.to_owned()));
        rest = next.trim_start();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_size_lines_are_read_by_writer() {
        let log = "2025-01-01T00:00:00.000000Z  INFO producer: producer stopped\n\
                   2025-01-01T00:00:00.000001Z  INFO runtime::batches: batch sizes writer=\"advance\" transactions=3 items=7 mean=2.33 max=4 histogram=\"1:1 2-3:1 4-7:1\"\n";
        let sizes = batch_sizes(log);
        assert_eq!(sizes["advance"]["transactions"], 3);
        assert_eq!(sizes["advance"]["mean"], 2.33);
        assert_eq!(sizes["advance"]["histogram"], "1:1 2-3:1 4-7:1");
        assert_eq!(batch_sizes("nothing here"), serde_json::json!({}));
    }
}
