//! `bench --callgrind`: the work per event as instructions, the figure to compare across
//! commits (it does not depend on how busy the machine is). Each process ran under
//! `valgrind --tool=callgrind` and wrote its counts when SIGTERM stopped it; this reads the
//! total instructions executed (`Ir`, the `summary:`/`totals:` line) of each file and divides
//! by the run's events, beside the batch sizes the writers logged (they change the figure).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::{Value, json};

use crate::pipeline::callgrind_out;

/// The processes measured, in the order they are reported.
pub const PROCESSES: [&str; 3] = ["producer", "consumer", "relay"];

/// The total `Ir` of one callgrind output file: its `totals:` line, or else its `summary:`
/// line (the first event is `Ir`, the only one counted by default).
pub fn total_instructions(path: &Path) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{}: {e} (did the process stop cleanly?)", path.display()))?;
    let first_number = |prefix: &str| {
        text.lines()
            .rev()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    first_number("totals:")
        .or_else(|| first_number("summary:"))
        .ok_or_else(|| anyhow::anyhow!("{}: no totals: or summary: line", path.display()))
}

/// Instructions and instructions per event of each process of the run in `dir`, and in total.
pub fn counts(dir: &Path, events: u64) -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    let mut total = 0u64;
    for name in PROCESSES {
        let ir = total_instructions(&callgrind_out(dir, name))?;
        total += ir;
        out.insert(name.into(), json!({"instructions": ir, "per_event": per_event(ir, events)}));
    }
    out.insert("total".into(), json!({"instructions": total, "per_event": per_event(total, events)}));
    Ok(out.into())
}

fn per_event(ir: u64, events: u64) -> u64 {
    (ir as f64 / events.max(1) as f64).round() as u64
}

/// The human table of a `--callgrind` report: instructions per event by process, then the
/// batch sizes each writer had.
pub fn table(doc: &Value) -> String {
    let mut out = String::new();
    let m = &doc["machine"];
    let _ = writeln!(
        out,
        "ordered-events bench --callgrind — {} — {} CPUs ({}), binaries {}",
        m["date_utc"].as_str().unwrap_or(""),
        m["cpus"],
        m["cpu_model"].as_str().unwrap_or(""),
        doc["arguments"]["bin_dir"].as_str().unwrap_or("target/release of this checkout"),
    );
    for r in doc["runs"].as_array().into_iter().flatten() {
        let c = &r["config"];
        let load = match c["load"]["kind"].as_str() {
            Some("closed") => format!("closed loop, {} clients", c["load"]["clients"]),
            _ => format!("open loop, {} calls/s", c["load"]["calls_per_s"]),
        };
        let _ = writeln!(
            out,
            "{} events ({} flows × 3), {load}, caps {}, verified={}",
            c["events"], c["flows"], c["caps"], r["verified"]["ok"]
        );
        let summary = &r["relay"]["summary"];
        let received = r["batch_sizes"]["consumer"]["receive"]["items"].as_u64();
        let _ = writeln!(
            out,
            "relay sent {} envelopes, answers {}; consumer received {} envelopes{}",
            summary["sent"],
            summary["counts"],
            received.map_or("?".into(), |n| n.to_string()),
            match (received, c["events"].as_u64()) {
                (Some(got), Some(events)) if got != events =>
                    " — NOT one per event: resends are counted as work (see the relay's log with --keep)",
                _ => "",
            }
        );
        let cg = &r["callgrind"];
        let _ = writeln!(out, "{:<10} {:>16} {:>14}", "process", "instructions", "per event");
        for name in PROCESSES.iter().chain(&["total"]) {
            let _ = writeln!(
                out,
                "{:<10} {:>16} {:>14}",
                name,
                cg[name]["instructions"].as_u64().unwrap_or(0),
                cg[name]["per_event"].as_u64().unwrap_or(0)
            );
        }
        let _ = writeln!(out, "batch sizes (items per transaction):");
        for name in PROCESSES {
            let writers = r["batch_sizes"][name].as_object();
            match writers {
                Some(writers) if !writers.is_empty() => {
                    for (writer, s) in writers {
                        let _ = writeln!(
                            out,
                            "  {name} {writer}: {} transactions, {} items, mean {}, max {}, histogram {}",
                            s["transactions"],
                            s["items"],
                            s["mean"],
                            s["max"],
                            s["histogram"].as_str().unwrap_or("")
                        );
                    }
                }
                _ => {
                    let _ = writeln!(out, "  {name}: no `batch sizes` line (this build does not log them)");
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_or_summary_give_the_instructions() {
        let dir = tempfile::tempdir().unwrap();
        let with_totals = dir.path().join("a");
        std::fs::write(&with_totals, "events: Ir\nfn=main\n1 5\nsummary: 999\ntotals: 1234\n").unwrap();
        assert_eq!(total_instructions(&with_totals).unwrap(), 1234);
        let with_summary = dir.path().join("b");
        std::fs::write(&with_summary, "events: Ir\nsummary: 777\n").unwrap();
        assert_eq!(total_instructions(&with_summary).unwrap(), 777);
        let without = dir.path().join("c");
        std::fs::write(&without, "events: Ir\n").unwrap();
        assert!(total_instructions(&without).is_err());
        assert!(total_instructions(&dir.path().join("missing")).is_err());
    }
}
