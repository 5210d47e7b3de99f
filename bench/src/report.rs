//! The report: one JSON document (machine, exact configuration, every run's figures, the
//! batch-1 ratio and the targets) and the same figures as a table for humans.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::Args;
use crate::load::{Load, LoadResult};
use crate::measure::{Percentiles, Tables, percentiles};
use crate::pipeline::{Caps, ProcStats, Stopped};

/// The machine and the moment, taken before the first run (the load average says how busy
/// the shared machine already was).
pub fn machine(base: &Path) -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu_model = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name").and_then(|v| v.split_once(':')).map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_default();
    let git = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .map(|commit| {
            let dirty = std::process::Command::new("git")
                .args(["status", "--porcelain", "--untracked-files=no"])
                .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
                .output()
                .is_ok_and(|o| !o.stdout.is_empty());
            if dirty { format!("{commit}-dirty") } else { commit }
        });
    json!({
        "date_utc": utc_now(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": cpu_model,
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "loadavg_at_start": read("/proc/loadavg").split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        "data_dir": base.display().to_string(),
        "data_dir_filesystem": filesystem_of(base),
        "git_commit": git,
    })
}

/// The file system type of the mount holding `dir` (longest mount-point prefix).
fn filesystem_of(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, point, fstype) = (f.next()?, f.next()?, f.next()?);
            dir.starts_with(point).then(|| (point.len(), fstype.to_owned()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fstype)| fstype)
        .unwrap_or_else(|| "unknown".into())
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock (days to civil date: H. Hinnant's algorithm).
fn utc_now() -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
            as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn rate(events: u64, from_us: i64, to_us: i64) -> f64 {
    events as f64 / ((to_us - from_us).max(1) as f64 / 1e6)
}

fn pct(p: &Percentiles) -> Value {
    json!({"samples": p.samples, "p50_ms": round(p.p50_ms), "p90_ms": round(p.p90_ms), "p99_ms": round(p.p99_ms), "max_ms": round(p.max_ms)})
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// One run's JSON.
#[allow(clippy::too_many_arguments)]
pub fn run_json(
    label: &str,
    flows: usize,
    load: &Load,
    caps: &Caps,
    args: &Args,
    driven: LoadResult,
    tables: Tables,
    stopped: Stopped,
    files: Value,
    kept: Option<PathBuf>,
    bench_clients: ProcStats,
) -> Value {
    let events = flows as u64 * 3;
    let e2e = rate(events, driven.first_send_us, tables.applied.last_us);
    let stage = |s: &crate::measure::Stage| json!({"events": s.events, "events_per_s": s.events_per_s.round(), "first_us": s.first_us, "last_us": s.last_us});
    let advance_latency = percentiles(driven.latencies_us.iter().map(|&v| i64::from(v)).collect());
    let proc = |p: &crate::pipeline::ProcStats| json!({"pid": p.pid, "peak_rss_mib": round(p.peak_rss_mib), "cpu_seconds": round(p.cpu_seconds), "cpu_us_per_event": (p.cpu_seconds * 1e6 / events as f64).round()});
    json!({
        "label": label,
        "config": {
            "flows": flows,
            "steps_per_flow": 3,
            "events": events,
            "load": load,
            "connections": args.connections,
            "client": args.client,
            "caps": caps,
            "consumer_auto_apply": true,
            "relay_mode": "run",
            "files_kept_in": kept,
        },
        "end_to_end": {
            "events_per_s": e2e.round(),
            "seconds": round((tables.applied.last_us - driven.first_send_us) as f64 / 1e6),
            "from": "first Advance sent (bench clock)",
            "to": "last effect.applied_at_us",
        },
        "advance": {
            "calls": driven.calls,
            "calls_per_s": rate(driven.calls, driven.first_send_us, driven.last_answer_us).round(),
            "retries": driven.retries,
            "latency_ms": pct(&advance_latency),
            "open_loop_max_start_lag_ms": round(driven.max_start_lag_ms),
        },
        "stages": {
            "committed": stage(&tables.committed),
            "received": stage(&tables.received),
            "marked_accepted": stage(&tables.marked_accepted),
            "applied": stage(&tables.applied),
        },
        "latency_commit_to_applied_ms": pct(&tables.commit_to_applied),
        "latency_commit_to_received_ms": pct(&tables.commit_to_received),
        "cpu_us_per_event": {
            "servers_and_relay": ((stopped.producer.cpu_seconds + stopped.consumer.cpu_seconds + stopped.relay.cpu_seconds)
                * 1e6
                / events as f64)
                .round(),
            "including_bench_clients": ((stopped.producer.cpu_seconds
                + stopped.consumer.cpu_seconds
                + stopped.relay.cpu_seconds
                + bench_clients.cpu_seconds)
                * 1e6
                / events as f64)
                .round(),
        },
        "loadavg_at_end": std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        "processes": {
            "producer": proc(&stopped.producer),
            "consumer": proc(&stopped.consumer),
            "relay": proc(&stopped.relay),
            "bench_clients": proc(&bench_clients),
        },
        "databases": {
            "producer.db": {
                "in_file": files["producer.db"],
                "producer": stopped.producer_log_settings,
                "relay": stopped.relay_log_settings,
            },
            "consumer.db": {
                "in_file": files["consumer.db"],
                "consumer": stopped.consumer_log_settings,
            },
            "postgres_server": files["postgres"],
        },
        "relay": {"exit_code": stopped.relay_exit_code, "summary": stopped.relay_summary},
        "batch_sizes": stopped.batch_sizes,
        "verified": tables.verified,
    })
}

/// The whole report: machine, arguments, runs, the batch-1 ratio and the targets.
pub fn document(machine: Value, args: &Value, runs: Vec<Value>) -> Value {
    let find = |label: &str| runs.iter().find(|r| r["label"] == label);
    let e2e = |r: Option<&Value>| r.and_then(|r| r["end_to_end"]["events_per_s"].as_f64());
    let grouped = find("grouped");
    let ratio = match (e2e(grouped), e2e(find("batch-1"))) {
        (Some(g), Some(b)) if b > 0.0 => Some(round(g / b)),
        _ => None,
    };
    let closed_64 = grouped
        .is_some_and(|g| g["config"]["load"]["kind"] == "closed" && g["config"]["load"]["clients"] == 64);
    let flows = grouped.and_then(|g| g["config"]["flows"].as_u64()).unwrap_or(0);
    let half_p99 =
        find("grouped-half-rate").and_then(|r| r["latency_commit_to_applied_ms"]["p99_ms"].as_f64());
    let consumer_rss = grouped.and_then(|g| g["processes"]["consumer"]["peak_rss_mib"].as_f64());
    let grouped_e2e = e2e(grouped).unwrap_or(0.0);
    let metrics_cost = metrics_cost(&runs);
    json!({
        "benchmark": "ordered-events throughput (bench)",
        "machine": machine,
        "arguments": args,
        "runs": runs,
        "comparison": {
            "grouped_end_to_end_per_s": e2e(grouped),
            "batch_1_end_to_end_per_s": e2e(find("batch-1")),
            "ratio": ratio,
        },
        "metrics_cost": metrics_cost,
        "targets": {
            "end_to_end_ge_25000_with_ge_10000_flows_from_64_clients": closed_64 && flows >= 10_000 && grouped_e2e >= 25_000.0,
            "p99_commit_to_applied_le_50ms_at_half_rate": half_p99.map(|p| p <= 50.0),
            "consumer_peak_rss_le_128mib": consumer_rss.map(|r| r <= 128.0),
            "floor_end_to_end_ge_10000": grouped_e2e >= 10_000.0,
            "floor_ratio_ge_10": ratio.map(|r| r >= 10.0),
        },
    })
}

/// Metrics off against on, from the runs of one sitting: the `metrics-off` runs against the
/// `metrics-on` runs (end-to-end events/s, each side's mean, the difference of the means in %
/// of off, and the median of the rounds' own differences); null without such runs.
fn metrics_cost(runs: &[Value]) -> Value {
    let rates = |labels: &[&str]| -> Vec<f64> {
        runs.iter()
            .filter(|r| labels.iter().any(|l| r["label"] == *l))
            .filter_map(|r| r["end_to_end"]["events_per_s"].as_f64())
            .collect()
    };
    let (off, on) = (rates(&["metrics-off"]), rates(&["metrics-on"]));
    if on.is_empty() || off.is_empty() {
        return Value::Null;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (off_mean, on_mean) = (mean(&off), mean(&on));
    let pct = if off_mean > 0.0 { Some(round((on_mean - off_mean) / off_mean * 100.0)) } else { None };
    let mut rounds: Vec<f64> =
        off.iter().zip(&on).filter(|(f, _)| **f > 0.0).map(|(f, n)| (n - f) / f * 100.0).collect();
    rounds.sort_by(f64::total_cmp);
    let median_round = rounds.get(rounds.len() / 2).map(|m| round(*m));
    json!({
        "off_per_s": off.iter().map(|r| r.round()).collect::<Vec<_>>(),
        "on_per_s": on.iter().map(|r| r.round()).collect::<Vec<_>>(),
        "off_mean_per_s": off_mean.round(),
        "on_mean_per_s": on_mean.round(),
        "difference_pct": pct,
        "rounds_difference_pct": rounds.iter().map(|r| round(*r)).collect::<Vec<_>>(),
        "median_round_difference_pct": median_round,
        "within_3_pct": pct.map(|p| p >= -3.0),
        "how": "rounds of one run off then one on, in one sitting after a warm-up run; on = --metrics-listen on producer, consumer and relay, each /metrics scraped every second",
    })
}

/// The human table.
pub fn table(doc: &Value) -> String {
    let mut out = String::new();
    let m = &doc["machine"];
    let _ = writeln!(
        out,
        "ordered-events bench — {} — {} CPUs ({}), kernel {}, load at start {}, data on {} ({})",
        m["date_utc"].as_str().unwrap_or(""),
        m["cpus"],
        m["cpu_model"].as_str().unwrap_or(""),
        m["kernel"].as_str().unwrap_or(""),
        m["loadavg_at_start"].as_str().unwrap_or(""),
        m["data_dir"].as_str().unwrap_or(""),
        m["data_dir_filesystem"].as_str().unwrap_or(""),
    );
    let _ = writeln!(
        out,
        "{:<24} {:>7} {:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}  {:<20} {:<24}",
        "run",
        "events",
        "load",
        "e2e/s",
        "advance/s",
        "commit/s",
        "receive/s",
        "mark/s",
        "apply/s",
        "c→a p50",
        "c→a p99",
        "adv p99",
        "peak RSS MiB p/c/r",
        "CPU µs/event p/c/r/bench"
    );
    for r in doc["runs"].as_array().into_iter().flatten() {
        let load = &r["config"]["load"];
        let load = match load["kind"].as_str() {
            Some("closed") => format!("closed {}", load["clients"]),
            _ => format!("open {:.0}/s", load["calls_per_s"].as_f64().unwrap_or(0.0)),
        };
        let n = |v: &Value| v.as_f64().unwrap_or(0.0);
        let p = &r["processes"];
        let _ = writeln!(
            out,
            "{:<24} {:>7} {:<14} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>8.1} {:>8.1} {:>8.1}  {:<20} {:<24}",
            format!(
                "{} {}",
                r["label"].as_str().unwrap_or(""),
                r["config"]["backend"].as_str().unwrap_or("")
            ),
            r["config"]["events"],
            load,
            n(&r["end_to_end"]["events_per_s"]),
            n(&r["advance"]["calls_per_s"]),
            n(&r["stages"]["committed"]["events_per_s"]),
            n(&r["stages"]["received"]["events_per_s"]),
            n(&r["stages"]["marked_accepted"]["events_per_s"]),
            n(&r["stages"]["applied"]["events_per_s"]),
            n(&r["latency_commit_to_applied_ms"]["p50_ms"]),
            n(&r["latency_commit_to_applied_ms"]["p99_ms"]),
            n(&r["advance"]["latency_ms"]["p99_ms"]),
            format!(
                "{:.0}/{:.0}/{:.0}",
                n(&p["producer"]["peak_rss_mib"]),
                n(&p["consumer"]["peak_rss_mib"]),
                n(&p["relay"]["peak_rss_mib"])
            ),
            format!(
                "{:.0}/{:.0}/{:.0}/{:.0}{}",
                n(&p["producer"]["cpu_us_per_event"]),
                n(&p["consumer"]["cpu_us_per_event"]),
                n(&p["relay"]["cpu_us_per_event"]),
                n(&p["bench_clients"]["cpu_us_per_event"]),
                match p["postgres_server"]["cpu_us_per_event"].as_f64() {
                    Some(server) => format!(" +pg {server:.0}"),
                    None => String::new(),
                }
            ),
        );
    }
    for r in doc["runs"].as_array().into_iter().flatten() {
        let dbs = &r["databases"];
        let word = |v: &Value| v.as_str().unwrap_or("?").to_owned();
        if r["config"]["backend"] == "postgres" {
            let server = &dbs["postgres_server"];
            let _ = writeln!(
                out,
                "{}: PostgreSQL {} fsync={} full_page_writes={} wal_sync_method={}; synchronous_commit={} (producer) {} (relay) {} (consumer); verified={}",
                r["label"].as_str().unwrap_or(""),
                word(&server["server_version"]),
                word(&server["fsync"]),
                word(&server["full_page_writes"]),
                word(&server["wal_sync_method"]),
                word(&dbs["producer.db"]["producer"]["synchronous_commit"]),
                word(&dbs["producer.db"]["relay"]["synchronous_commit"]),
                word(&dbs["consumer.db"]["consumer"]["synchronous_commit"]),
                r["verified"]["ok"],
            );
            continue;
        }
        let _ = writeln!(
            out,
            "{}: producer.db journal_mode={} (file) synchronous={} (producer) {} (relay); consumer.db journal_mode={} (file) synchronous={} (consumer); verified={}",
            r["label"].as_str().unwrap_or(""),
            word(&dbs["producer.db"]["in_file"][1]),
            word(&dbs["producer.db"]["producer"]["synchronous"]),
            word(&dbs["producer.db"]["relay"]["synchronous"]),
            word(&dbs["consumer.db"]["in_file"][1]),
            word(&dbs["consumer.db"]["consumer"]["synchronous"]),
            r["verified"]["ok"],
        );
    }
    if let Some(ratio) = doc["comparison"]["ratio"].as_f64() {
        let _ = writeln!(out, "end to end, grouped / batch-1: {ratio:.1}×");
    }
    let cost = &doc["metrics_cost"];
    if let Some(pct) = cost["difference_pct"].as_f64() {
        let _ = writeln!(
            out,
            "metrics: off {:.0} events/s (mean of {} runs {}), on {:.0} events/s (mean of {} runs {}): {pct:+.1} % (target within 3 %)",
            cost["off_mean_per_s"].as_f64().unwrap_or(0.0),
            cost["off_per_s"].as_array().map_or(0, Vec::len),
            cost["off_per_s"],
            cost["on_mean_per_s"].as_f64().unwrap_or(0.0),
            cost["on_per_s"].as_array().map_or(0, Vec::len),
            cost["on_per_s"],
        );
    }
    storage_table(&mut out, doc);
    let _ = writeln!(out, "targets: {}", doc["targets"]);
    out
}

/// The `--soak` readings: each database's size at each mark, and bytes per finished event,
/// for every run that read them, then the compacted run against the uncompacted one.
fn storage_table(out: &mut String, doc: &Value) {
    let mib = |v: &Value| v.as_f64().unwrap_or(0.0) / (1024.0 * 1024.0);
    let mut per_event: Vec<(String, f64, f64)> = Vec::new();
    for r in doc["runs"].as_array().into_iter().flatten() {
        let storage = &r["storage"];
        if storage.is_null() {
            continue;
        }
        let label = r["label"].as_str().unwrap_or("").to_owned();
        for reading in storage["readings"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "{label}: {:<24} applied {:>8}  producer {:>8.1} MiB  consumer {:>8.1} MiB  (WAL {:.1} MiB)",
                reading["at"].as_str().unwrap_or(""),
                reading["applied"],
                mib(&reading["producer_bytes"]),
                mib(&reading["consumer_bytes"]),
                mib(&reading["wal_bytes"]),
            );
        }
        let growth = storage["bytes_per_event_between_marks"].as_f64().unwrap_or(0.0);
        let end = storage["bytes_per_event_at_end"].as_f64().unwrap_or(0.0);
        let _ = writeln!(
            out,
            "{label}: {growth:.0} bytes per finished event between the first and last mark, {end:.0} at the end; end to end {:.0} events/s",
            r["end_to_end"]["events_per_s"].as_f64().unwrap_or(0.0)
        );
        per_event.push((label, growth, r["end_to_end"]["events_per_s"].as_f64().unwrap_or(0.0)));
    }
    let find = |l: &str| per_event.iter().find(|(label, _, _)| label == l);
    if let (Some(off), Some(zero)) = (find("retention-off"), find("retention-0")) {
        if off.1 > 0.0 && off.2 > 0.0 {
            let _ = writeln!(
                out,
                "retention 0 against off: storage growth per finished event {:.0} % (target ≤ 25 %), throughput {:+.1} % (target within 10 %)",
                100.0 * zero.1 / off.1,
                100.0 * (zero.2 / off.2 - 1.0)
            );
        }
    }
}
