//! `chaos`: the chaos run over the real binaries. Starts producer, consumer and
//! two `relay run`s (profile `multi`: three producers, three consumers and three relays, on
//! PostgreSQL only) on fresh databases (files, or with `--backend postgres` a fresh database on
//! the server named by `ORDERED_EVENTS_TEST_PG_URL`, dropped afterwards), loads them with concurrent Advance clients, SIGKILLs and
//! restarts them on a seeded schedule, then checks invariants I1–I7 and the coverage floors.
//! Exits 0 only when every invariant held and every floor was reached. Build the binaries
//! first: `cargo build --release --bins`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use harness::Backend;
use harness::chaos::{ChaosConfig, run};
use harness::checker::Files;
use proto::pg::testing::TestDb;

/// Kills the services at random under load and checks that nothing was lost or doubled.
#[derive(Debug, Parser)]
#[command(name = "chaos", version)]
struct Args {
    /// `ci` (the floors in about 5 minutes), `multi` (the same floors with three producers,
    /// three consumers and three relays on one database; needs `--backend postgres`), `soak`
    /// (10 minutes of faults per seed) or `smoke` (a few seconds).
    #[arg(long, default_value = "ci", value_parser = ["ci", "multi", "soak", "smoke"])]
    profile: String,
    /// The schedule's seed (printed; the same seed replays the same schedule). Default: from
    /// the clock.
    #[arg(long)]
    seed: Option<u64>,
    /// For `soak`: minutes of load and faults instead of 10.
    #[arg(long, value_name = "MINUTES")]
    minutes: Option<u64>,
    /// Work in this directory (created; kept) instead of a temp directory that is removed
    /// after a passing run.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Keep the temp directory (files, logs, history) even when the run passes.
    #[arg(long)]
    keep: bool,
    /// Also write the full report (every kill included) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// `sqlite` or `postgres` (default: `ORDERED_EVENTS_TEST_BACKEND`, else sqlite). An
    /// unreachable PostgreSQL server is skipped with one SKIPPED line (exit 0), or fails the
    /// run when `ORDERED_EVENTS_REQUIRE_PG=1`.
    #[arg(long, value_name = "BACKEND")]
    backend: Option<Backend>,
    /// `--retention` of the producers and consumers (the profiles use 0: rows are compacted
    /// as soon as they are finished, under the kills); `off` keeps every body.
    #[arg(long, value_name = "DURATION")]
    retention: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(harness::rng::seed_from_clock);
    let Some(mut cfg) = ChaosConfig::profile(&args.profile, seed) else {
        eprintln!("chaos: error: unknown profile {:?}", args.profile);
        return ExitCode::from(2);
    };
    if let Some(r) = &args.retention {
        cfg.retention = Some(r.clone());
    }
    if let Some(m) = args.minutes {
        let d = std::time::Duration::from_secs(m * 60);
        cfg.duration = Some(d);
        cfg.budget = d + std::time::Duration::from_secs(60);
    }
    println!(
        "chaos: profile {} seed {seed} retention {} (replay: chaos --profile {} --seed {seed})",
        cfg.profile,
        cfg.retention.as_deref().unwrap_or("default"),
        cfg.profile
    );
    let (temp, dir) = match &args.dir {
        Some(d) => {
            if let Err(e) = std::fs::create_dir_all(d) {
                eprintln!("chaos: error: cannot create {}: {e}", d.display());
                return ExitCode::FAILURE;
            }
            (None, d.clone())
        }
        None => match tempfile::Builder::new().prefix("oe-chaos-").tempdir() {
            Ok(t) => {
                let p = t.path().to_owned();
                (Some(t), p)
            }
            Err(e) => {
                eprintln!("chaos: error: no temp dir: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    if let Some(backend) = args.backend {
        if let Err(e) = harness::backend::select(backend) {
            eprintln!("chaos: error: {e}");
            return ExitCode::from(2);
        }
    }
    if cfg.quota.instances > 1 && Backend::current() != Backend::Postgres {
        eprintln!(
            "chaos: error: profile {} runs several instances on one database: it needs --backend postgres",
            cfg.profile
        );
        return ExitCode::from(2);
    }
    // Dropped (the database with it) after the run.
    let mut _pg: Option<TestDb> = None;
    let files = match Backend::current() {
        Backend::Sqlite => {
            Files { producer_db: dir.join("producer.db").into(), consumer_db: dir.join("consumer.db").into() }
        }
        Backend::Postgres => {
            // Skipped loudly (the SKIPPED line) when no server answers, like every PostgreSQL
            // test; TestDb::create fails instead when ORDERED_EVENTS_REQUIRE_PG=1.
            let Some(db) = TestDb::create("chaos") else {
                eprintln!("chaos: nothing run: PostgreSQL is unreachable");
                return ExitCode::SUCCESS;
            };
            let target = harness::Target::Postgres(db.url().to_owned());
            _pg = Some(db);
            Files { producer_db: target.clone(), consumer_db: target }
        }
    };
    println!("chaos: working in {} on {} ({})", dir.display(), Backend::current(), files.producer_db);
    let report = run(&cfg, &dir, files);
    println!("{}", report.summary());
    if let Some(path) = &args.report {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => {
                if let Err(e) = std::fs::write(path, text) {
                    eprintln!("chaos: error: cannot write {}: {e}", path.display());
                }
            }
            Err(e) => eprintln!("chaos: error: report: {e}"),
        }
    }
    let passed = report.passed();
    if let Some(t) = temp {
        if passed && !args.keep {
            drop(t);
        } else {
            let kept = t.keep();
            println!("chaos: files, logs and history kept in {}", kept.display());
        }
    }
    if passed { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
