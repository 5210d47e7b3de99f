//! What a user meets on the command line: `--version`, `--help` naming every flag and its
//! environment twin, JSON logs, and one clear line with a non-zero exit for every error a
//! user can cause (bad flag, wrong or unreadable database file, port in use, bad crash point).

use std::time::Duration;

use harness::proc::{Finished, run_to_exit};
use harness::{Consumer, Producer, Workdir};

const DEADLINE: Duration = Duration::from_secs(30);

fn run(bin: &str, args: &[&str]) -> Finished {
    run_to_exit(bin, args, &[], DEADLINE)
}

/// Exit 1 and exactly one line that says `<bin>: error: …` containing `needle`.
fn one_clear_error(bin: &str, out: &Finished, needle: &str) {
    assert_eq!(out.code, Some(1), "{bin}: {out:?}");
    let errors: Vec<&str> = out.stderr.lines().filter(|l| l.to_lowercase().contains("error")).collect();
    assert_eq!(errors.len(), 1, "{bin}: expected one error line:\n{}", out.stderr);
    assert!(errors[0].starts_with(&format!("{bin}: error: ")), "{}", errors[0]);
    assert!(errors[0].contains(needle), "{bin}: {:?} lacks {needle:?}", errors[0]);
    assert!(!out.stderr.contains("panicked") && !out.stderr.contains("backtrace"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "nothing on stdout when start-up fails: {:?}", out.stdout);
}

#[test]
fn version_and_help() {
    for (bin, flags) in [
        (
            "producer",
            &[
                "--db",
                "ORDERED_EVENTS_PRODUCER_DB",
                "--listen",
                "ORDERED_EVENTS_PRODUCER_LISTEN",
                "--token-file",
                "--tls-cert",
                "--max-message-bytes",
                "--shutdown-grace-ms",
                "--log-format",
            ][..],
        ),
        (
            "consumer",
            &[
                "--db",
                "ORDERED_EVENTS_CONSUMER_DB",
                "--listen",
                "ORDERED_EVENTS_CONSUMER_LISTEN",
                "--support-v2",
                "ORDERED_EVENTS_SUPPORT_V2",
                "--token-file",
                "--log-format",
            ][..],
        ),
        (
            "relay",
            &[
                "--producer-db",
                "ORDERED_EVENTS_PRODUCER_DB",
                "--consumer",
                "ORDERED_EVENTS_CONSUMER_URL",
                "once",
                "send",
                "drain",
                "run",
                "--token-file",
                "--tls-ca",
                "Exit codes",
            ][..],
        ),
    ] {
        let version = run(bin, &["--version"]);
        assert_eq!(version.code, Some(0));
        assert_eq!(version.stdout.trim(), format!("{bin} {}", env!("CARGO_PKG_VERSION")));
        let help = run(bin, &["--help"]);
        assert_eq!(help.code, Some(0));
        for flag in flags {
            assert!(help.stdout.contains(flag), "{bin} --help does not mention {flag}:\n{}", help.stdout);
        }
        let bad = run(bin, &["--no-such-flag"]);
        assert_eq!(bad.code, Some(2), "{bin}: usage errors exit 2");
        assert!(bad.stderr.contains("--no-such-flag"), "{}", bad.stderr);
    }
    let run_help = run("relay", &["run", "--help"]);
    assert!(run_help.stdout.contains("--max-backoff-ms") && run_help.stdout.contains("--poll-ms"));
}

#[test]
fn database_errors_are_one_line() {
    harness::sqlite_only!(
        "files of the wrong kind: a consumer.db given to the producer, a text file, a missing directory (PostgreSQL's kind and version refusals are proto::pg's tests)"
    );
    let Some(work) = Workdir::for_test() else { return };
    let consumer_db = work.consumer_db().arg();
    // A consumer database is created by a consumer that then stops.
    drop(Consumer::start(&work, false, &[]));
    one_clear_error(
        "producer",
        &run("producer", &["--db", &consumer_db, "--listen", "127.0.0.1:0"]),
        "not a producer database",
    );
    let text = work.path("notes.txt");
    std::fs::write(&text, "not a database, just some words that are long enough to matter").expect("write");
    let text = text.display().to_string();
    one_clear_error(
        "consumer",
        &run("consumer", &["--db", &text, "--listen", "127.0.0.1:0"]),
        "file is not a database",
    );
    one_clear_error(
        "producer",
        &run("producer", &["--db", "/nonexistent-dir/p.db", "--listen", "127.0.0.1:0"]),
        "unable to open",
    );
    let relay = run("relay", &["--producer-db", &consumer_db, "--consumer", "http://127.0.0.1:1", "drain"]);
    one_clear_error("relay", &relay, "not a producer database");
}

#[test]
fn port_in_use_and_bad_crash_point() {
    let Some(mut work) = Workdir::for_test() else { return };
    let producer = Producer::start(&work, &[]);
    let db = work.other_db("second.db").arg();
    one_clear_error(
        "producer",
        &run("producer", &["--db", &db, "--listen", &producer.process.addr]),
        "cannot listen on",
    );
    let crash = run_to_exit(
        "consumer",
        &["--db", &db, "--listen", "127.0.0.1:0"],
        &[("ORDERED_EVENTS_CRASH_AT", "consumer.nowhere")],
        DEADLINE,
    );
    one_clear_error("consumer", &crash, "is not a crash point");
}

#[test]
fn json_logs_for_collectors() {
    let Some(work) = Workdir::for_test() else { return };
    let mut producer = Producer::start(&work, &[("ORDERED_EVENTS_LOG_FORMAT", "json")]);
    // SIGTERM right after the readiness line: handlers are already installed, so it is a
    // clean shutdown (exit 0), not death by signal.
    let status = producer.process.terminate(DEADLINE);
    assert_eq!(status.code(), Some(0), "{status:?}");
    let log = producer.process.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    // The durability settings in effect, as fields a collector can alert on.
    let durable = |l: &serde_json::Value| match work.backend() {
        harness::Backend::Sqlite => {
            l["fields"]["synchronous"] == "FULL" && l["fields"]["journal_mode"] == "wal"
        }
        harness::Backend::Postgres => {
            l["fields"]["synchronous_commit"] == "on" && l["fields"]["backend"] == "postgres"
        }
    };
    assert!(lines.iter().any(durable), "{log}");
    assert!(
        lines.iter().any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.contains("NOT_SERVING"))),
        "{log}"
    );
}
