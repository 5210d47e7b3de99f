//! One pipeline under test: the real producer, consumer (`--auto-apply`) and relay (`run`)
//! on fresh files in their own directory, with the batch caps of the run, and what each
//! process is measured by from the outside (`/proc/PID`: peak RSS, CPU time).

use std::path::{Path, PathBuf};
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

/// The three processes of one run.
pub struct Pipeline {
    pub dir: PathBuf,
    pub producer: ServerProcess,
    pub consumer: ServerProcess,
    pub relay: RelayDaemon,
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
}

/// Effective settings a process reported for its connection.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Settings {
    pub journal_mode: Option<String>,
    pub synchronous: Option<String>,
}

impl Pipeline {
    /// Starts producer, consumer and relay in `dir` with `caps`.
    pub fn start(dir: &Path, caps: &Caps) -> Pipeline {
        let producer_db = dir.join("producer.db");
        let consumer_db = dir.join("consumer.db");
        let text = |p: &Path| p.display().to_string();
        let producer = ServerProcess::start(
            "producer",
            &strings(&[
                "--db",
                &text(&producer_db),
                "--listen",
                "127.0.0.1:0",
                "--max-batch",
                &caps.producer_max_batch.to_string(),
            ]),
            &[],
            dir.join("producer.log"),
        );
        let consumer = ServerProcess::start(
            "consumer",
            &strings(&[
                "--db",
                &text(&consumer_db),
                "--listen",
                "127.0.0.1:0",
                "--auto-apply",
                "--max-batch",
                &caps.consumer_max_batch.to_string(),
                "--apply-batch",
                &caps.apply_batch.to_string(),
            ]),
            &[],
            dir.join("consumer.log"),
        );
        let relay = RelayDaemon::start(
            dir,
            "relay",
            &producer_db,
            &consumer.url(),
            &[
                "--poll-ms",
                &caps.poll_ms.to_string(),
                "--window",
                &caps.window.to_string(),
                "--mark-batch",
                &caps.mark_batch.to_string(),
                "--mark-delay-ms",
                &caps.mark_delay_ms.to_string(),
            ],
            &[],
        );
        Pipeline { dir: dir.to_owned(), producer, consumer, relay }
    }

    pub fn producer_db(&self) -> PathBuf {
        self.dir.join("producer.db")
    }

    pub fn consumer_db(&self) -> PathBuf {
        self.dir.join("consumer.db")
    }

    /// Reads every process's `/proc` figures, then stops them all (SIGTERM, relay first).
    pub fn stop(mut self) -> Stopped {
        let stats = |pid: Option<u32>| pid.map(|p| proc_stats(&p.to_string())).unwrap_or_default();
        let producer = stats(self.producer.pid());
        let consumer = stats(self.consumer.pid());
        let relay = stats(self.relay.pid());
        let relay_log = self.relay.log_text();
        let run = self.relay.terminate(Duration::from_secs(60));
        let relay_summary =
            run.lines.iter().rev().find(|l| l["type"] == "summary").cloned().unwrap_or_default();
        self.producer.terminate(Duration::from_secs(60));
        self.consumer.terminate(Duration::from_secs(60));
        Stopped {
            producer,
            consumer,
            relay,
            relay_exit_code: run.code,
            relay_summary,
            producer_log_settings: settings(&self.producer.log_text()),
            consumer_log_settings: settings(&self.consumer.log_text()),
            relay_log_settings: settings(&relay_log),
        }
    }
}

fn strings(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_owned()).collect()
}

/// Finds `journal_mode=…` and `synchronous=…` on the "database open" start-up line.
fn settings(log: &str) -> Settings {
    let Some(line) = log.lines().find(|l| l.contains("database open")) else { return Settings::default() };
    let value = |key: &str| {
        line.split_whitespace().find_map(|w| w.strip_prefix(key)).map(|v| v.trim_matches('"').to_owned())
    };
    Settings { journal_mode: value("journal_mode="), synchronous: value("synchronous=") }
}
