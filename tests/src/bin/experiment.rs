//! `experiment`: runs the named scenarios of SPEC §10 against freshly started processes and
//! fresh databases (temp files, or with `--backend postgres` a fresh PostgreSQL database per
//! scenario on the server named by `ORDERED_EVENTS_TEST_PG_URL`), and writes their
//! observations as JSON. Both backends must match the same results file. `--check` compares a fresh run with
//! the committed `tests/results.json` and fails, printing the differences; `--write`
//! rewrites that file (the only way it changes). Build the binaries first:
//! `cargo build --release --bins`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use harness::Backend;
use serde_json::{Map, Value};

/// Runs the reference scenarios against the real producer, consumer and relay binaries.
#[derive(Debug, Parser)]
#[command(name = "experiment", version)]
struct Args {
    /// Compare a fresh run with the committed results file; exit 1 and print the differences
    /// when anything changed.
    #[arg(long, conflicts_with_all = ["write", "output"])]
    check: bool,
    /// Rewrite the committed results file with this run's observations.
    #[arg(long)]
    write: bool,
    /// Write the results to this file instead of stdout.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Run only these scenarios (repeatable); `--check` then compares only them.
    #[arg(long = "only", value_name = "NAME")]
    only: Vec<String>,
    /// `sqlite` or `postgres` (default: `ORDERED_EVENTS_TEST_BACKEND`, else sqlite). An
    /// unreachable PostgreSQL server is skipped with one SKIPPED line (exit 0), or fails the
    /// run when `ORDERED_EVENTS_REQUIRE_PG=1`.
    #[arg(long, value_name = "BACKEND")]
    backend: Option<Backend>,
}

fn results_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results.json")
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    for name in &args.only {
        if !harness::scenarios::NAMES.contains(&name.as_str()) {
            eprintln!(
                "experiment: error: unknown scenario {name:?}; known: {}",
                harness::scenarios::NAMES.join(", ")
            );
            return ExitCode::from(2);
        }
    }
    let selected: Vec<&str> = harness::scenarios::NAMES
        .iter()
        .copied()
        .filter(|n| args.only.is_empty() || args.only.iter().any(|o| o == n))
        .collect();
    if let Some(backend) = args.backend {
        if let Err(e) = harness::backend::select(backend) {
            eprintln!("experiment: error: {e}");
            return ExitCode::from(2);
        }
    }
    let backend = Backend::current();
    // Like every PostgreSQL test: skipped loudly (the SKIPPED line) when no server answers,
    // a failure when ORDERED_EVENTS_REQUIRE_PG=1.
    if !harness::backend::ready() {
        eprintln!("experiment: nothing run: the {backend} backend is unreachable");
        return ExitCode::SUCCESS;
    }
    eprintln!("experiment: backend {backend}");
    let mut scenarios = Map::new();
    for name in &selected {
        eprintln!("experiment: running {name}");
        scenarios.insert((*name).to_owned(), harness::scenarios::run(name).await);
    }
    let fresh = Value::Object(Map::from_iter([("scenarios".to_owned(), Value::Object(scenarios))]));
    let text = serde_json::to_string_pretty(&fresh).expect("JSON values always serialize") + "\n";
    if args.check {
        return check(&fresh, &selected, backend);
    }
    let target = if args.write { Some(results_path()) } else { args.output };
    match target {
        Some(path) => {
            if let Err(e) = std::fs::write(&path, text) {
                eprintln!("experiment: error: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            eprintln!("experiment: {} scenarios written to {}", selected.len(), path.display());
        }
        None => print!("{text}"),
    }
    ExitCode::SUCCESS
}

fn check(fresh: &Value, selected: &[&str], backend: Backend) -> ExitCode {
    let path = results_path();
    let frozen: Value = match std::fs::read_to_string(&path).map(|t| serde_json::from_str(&t)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            eprintln!("experiment: error: {} is not JSON: {e}", path.display());
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("experiment: error: cannot read {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let mut differences = Vec::new();
    for name in selected {
        let pointer = format!("/scenarios/{name}");
        diff(
            &pointer,
            frozen.pointer(&pointer).unwrap_or(&Value::Null),
            fresh.pointer(&pointer).unwrap_or(&Value::Null),
            &mut differences,
        );
    }
    if let Some(names) = frozen["scenarios"].as_object() {
        if selected.len() == harness::scenarios::NAMES.len() && names.len() != selected.len() {
            differences.push(format!(
                "/scenarios: committed file has {} scenarios, this run {}",
                names.len(),
                selected.len()
            ));
        }
    }
    if differences.is_empty() {
        println!("experiment --check: {} scenarios match {} on {backend}", selected.len(), path.display());
        return ExitCode::SUCCESS;
    }
    println!("experiment --check: {} difference(s) from {} on {backend}:", differences.len(), path.display());
    for d in differences.iter().take(200) {
        println!("  {d}");
    }
    ExitCode::FAILURE
}

/// Collects the JSON pointers where `frozen` and `fresh` differ.
fn diff(at: &str, frozen: &Value, fresh: &Value, out: &mut Vec<String>) {
    match (frozen, fresh) {
        (Value::Object(a), Value::Object(b)) => {
            for key in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
                let child = format!("{at}/{key}");
                diff(&child, a.get(key).unwrap_or(&Value::Null), b.get(key).unwrap_or(&Value::Null), out);
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                diff(&format!("{at}/{i}"), x, y, out);
            }
        }
        (a, b) if a != b => out.push(format!("{at}: committed {a} but this run saw {b}")),
        _ => {}
    }
}
