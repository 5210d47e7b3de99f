//! Long-running relay processes (`relay run`): started in the background with their stdout
//! and stderr in files, stopped with SIGTERM, their JSON lines read back.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::backend::Target;
use crate::proc::{RelayRun, bin_path, wait_with_deadline};

/// A `relay run` child. Killed on drop if still running.
pub struct RelayDaemon {
    child: Option<Child>,
    /// Where its stdout goes.
    pub stdout: PathBuf,
    /// Where its stderr goes.
    pub stderr: PathBuf,
}

impl RelayDaemon {
    /// Starts `relay --producer-db DB --consumer URL run --delivery-lines <extra…>` (with its
    /// line per delivery, which the tests and the chaos checker read).
    pub fn start(
        dir: &Path,
        name: &str,
        producer_db: &Target,
        consumer_url: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> RelayDaemon {
        let mut args = vec!["run", "--delivery-lines"];
        args.extend_from_slice(extra);
        Self::start_mode(dir, name, producer_db, consumer_url, &args, env)
    }

    /// Starts `relay --producer-db DB --consumer URL <args…>` in the background, whatever the
    /// mode (`args` starts with it), for tests that signal or watch a one-shot run too.
    pub fn start_mode(
        dir: &Path,
        name: &str,
        producer_db: &Target,
        consumer_url: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> RelayDaemon {
        Self::start_command(Command::new(bin_path("relay")), dir, name, producer_db, consumer_url, args, env)
    }

    /// [`RelayDaemon::start_mode`] of a command the caller built (the program and its leading
    /// arguments, e.g. the relay run under `valgrind`).
    pub fn start_command(
        mut cmd: Command,
        dir: &Path,
        name: &str,
        producer_db: &Target,
        consumer_url: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> RelayDaemon {
        let stdout = dir.join(format!("{name}.out"));
        let stderr = dir.join(format!("{name}.err"));
        cmd.arg("--producer-db").arg(producer_db.arg()).arg("--consumer").arg(consumer_url).args(args);
        crate::proc::strip_ours(&mut cmd);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("relay stdout file"))
            .stderr(std::fs::File::create(&stderr).expect("relay stderr file"));
        let child = cmd.spawn().expect("spawn relay run");
        RelayDaemon { child: Some(child), stdout, stderr }
    }

    /// The process id while the process is owned (not yet reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What the relay logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL, now, and reap it; its stdout file keeps every complete line it wrote.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, wait for the exit, and read its lines.
    pub fn terminate(self, deadline: Duration) -> RelayRun {
        let child = self.child.as_ref().expect("running relay");
        crate::proc::signal(child.id(), libc::SIGTERM);
        self.wait(deadline)
    }

    /// Waits for the relay to exit on its own (a one-shot mode), and reads its lines; kills
    /// it and panics with its log if it is still running after `deadline`.
    pub fn wait(mut self, deadline: Duration) -> RelayRun {
        let mut child = self.child.take().expect("running relay");
        let status = wait_with_deadline(&mut child, deadline);
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let stderr = self.log_text();
        let status =
            status.unwrap_or_else(|| panic!("relay did not exit within {deadline:?}; log:\n{stderr}"));
        let out = std::fs::read_to_string(&self.stdout).unwrap_or_default();
        let lines = out
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("relay stdout is not JSON ({e}): {l:?}"))
            })
            .collect();
        RelayRun { code: status.code(), lines, stderr }
    }
}

impl Drop for RelayDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `check` until it returns `Some` or `deadline` passes; panics with `describe()` (the
/// last state seen) on time-out.
pub fn wait_for<T>(deadline: Duration, check: impl FnMut() -> Option<T>, describe: impl Fn() -> String) -> T {
    poll(deadline, check)
        .unwrap_or_else(|| panic!("condition not met within {deadline:?}; last state: {}", describe()))
}

/// Polls `check` until it returns `Some` or `deadline` passes (then `None`): the non-panicking
/// form of [`wait_for`], for callers that report a hang themselves.
pub fn poll<T>(deadline: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let until = Instant::now() + deadline;
    let mut pause = Duration::from_millis(2);
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if Instant::now() >= until {
            return None;
        }
        // A pause between polls of a predicate, not a guess at how long something takes.
        std::thread::park_timeout(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// The async form of [`poll`], for predicates that make RPCs: awaits `check` until it returns
/// `Some` or `deadline` passes (then `None`).
pub async fn poll_async<T>(deadline: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let until = tokio::time::Instant::now() + deadline;
    let mut pause = Duration::from_millis(2);
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        let now = tokio::time::Instant::now();
        if now >= until {
            return None;
        }
        // A pause between polls of a predicate, not a guess at how long something takes.
        tokio::time::sleep_until((now + pause).min(until)).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}
