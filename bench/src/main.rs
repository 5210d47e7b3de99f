//! `bench`: the throughput benchmark (a command, not a test). It starts the real producer,
//! consumer (`--auto-apply`) and relay (`run`) on fresh files with `synchronous=FULL`,
//! drives N flows × 3 steps through `Advance` (closed loop from C clients, or open loop at a
//! rate), waits until the last event is applied, and reports what the processes' own tables
//! and `/proc` say, as JSON and as a table. With `--callgrind` it runs the three under
//! callgrind instead and reports instructions per event. Build first:
//! `cargo build --release --bins`.

mod callgrind;
mod lean;
mod load;
mod measure;
mod measure_pg;
mod pipeline;
mod report;
mod scrape;
mod storage;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use serde_json::{Value, json};

use crate::load::Load;
use crate::pipeline::{Caps, Databases, Launcher, Pipeline};

/// Measures the pipeline end to end: Advance → committed → relayed → accepted → applied.
///
/// Each run gets fresh database files in its own directory and its own three processes.
/// The main run is closed loop (or open loop with --rate); --half-rate adds an open-loop run
/// at half the main run's end-to-end rate (latency at that rate); --compare-batch-1 adds the
/// same pipeline with every batch cap set to 1 and prints the ratio. --callgrind runs the
/// main run only, each process under `valgrind --tool=callgrind`, and reports instructions
/// per event per process and in total, with the batch sizes the writers had.
/// --compare-metrics adds rounds of two runs of the same pipeline, one without metrics and
/// one with `--metrics-listen` on all three processes, each scraped every second, and reports
/// the end-to-end rate of each side and the difference in %.
#[derive(Debug, Parser)]
#[command(name = "bench", version)]
struct Args {
    /// Flows to drive, each through its three steps (reserved, confirmed, released)
    /// [default: 10000, or 2000 with --callgrind].
    #[arg(long)]
    flows: Option<usize>,
    /// Concurrent Advance callers in a closed-loop run (each waits for its answer).
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// gRPC connections the callers share.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// The callers' gRPC client: `lean` (one HTTP/2 stream per call on an `h2` connection,
    /// the least CPU taken from the services sharing the machine) or `tonic` (the generated
    /// client, as runs before 2026-12-07 used).
    #[arg(long, value_enum, default_value_t = load::Client::Lean)]
    client: load::Client,
    /// Open loop for the main run: start flows so that Advance calls arrive at this many per
    /// second on average, whatever their latency.
    #[arg(long, value_name = "CALLS_PER_S")]
    rate: Option<f64>,
    /// After the main run, an open-loop run at half its end-to-end rate.
    #[arg(long)]
    half_rate: bool,
    /// Also run the pipeline with every batch cap set to 1 (the reference: one event per
    /// transaction) and report the ratio.
    #[arg(long)]
    compare_batch_1: bool,
    /// Also run the pipeline with metrics on (`--metrics-listen` on all three processes, a
    /// scraper polling each `/metrics` every second), alternating with runs with metrics off,
    /// and report both end-to-end rates and the difference in %.
    #[arg(long)]
    compare_metrics: bool,
    /// Rounds of --compare-metrics (each one run with metrics off, then one with them on).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=20))]
    metrics_rounds: u32,
    /// Flows of the batch-1 run (default: --flows).
    #[arg(long)]
    batch_1_flows: Option<usize>,
    /// `producer --max-batch` of the grouped runs.
    #[arg(long, default_value_t = 256)]
    producer_max_batch: usize,
    /// `consumer --max-batch` of the grouped runs.
    #[arg(long, default_value_t = 256)]
    consumer_max_batch: usize,
    /// `consumer --apply-batch` of the grouped runs.
    #[arg(long, default_value_t = 256)]
    apply_batch: usize,
    /// `relay --mark-batch` of the grouped runs.
    #[arg(long, default_value_t = 256)]
    mark_batch: usize,
    /// `relay --mark-delay-ms` of the grouped runs.
    #[arg(long, default_value_t = 5)]
    mark_delay_ms: u64,
    /// `relay --window` (all runs: it is pipelining, not a transaction cap).
    #[arg(long, default_value_t = 512)]
    window: usize,
    /// `relay run --poll-ms` (all runs).
    #[arg(long, default_value_t = 2)]
    poll_ms: u64,
    /// Directory for each run's files and logs (default: the system temp dir). Use a real
    /// disk: on tmpfs an fsync costs nothing and the figures mean little.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep each run's files and logs (their paths are in the report).
    #[arg(long)]
    keep: bool,
    /// Write the JSON report to this file ("-": stdout, and the table goes to stderr).
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// Give up waiting for a run to finish after this many seconds.
    #[arg(long, default_value_t = 900)]
    timeout_s: u64,
    /// Run producer, consumer and relay each under `valgrind --tool=callgrind` (one run, the
    /// main one) and report instructions per event: the figure to compare across commits.
    #[arg(long, conflicts_with_all = ["half_rate", "compare_batch_1", "compare_metrics"])]
    callgrind: bool,
    /// Where the services store: `sqlite` (fresh files per run) or `postgres` (a fresh
    /// database per run on the server --pg-url names, dropped after the run).
    #[arg(long, value_enum, default_value_t = Backend::Sqlite)]
    backend: Backend,
    /// The PostgreSQL server for `--backend postgres`: a URL allowed to create databases.
    #[arg(long, env = proto::pg::testing::URL_ENV, default_value = proto::pg::testing::DEFAULT_URL, value_name = "URL")]
    pg_url: String,
    /// Take `producer`, `consumer` and `relay` from this directory (e.g. another checkout's
    /// `target/release`) instead of this checkout's `target/release`.
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// Run N producers, N consumers and N relays on the one database (PostgreSQL only): the
    /// load is spread over the producers, each relay talks to its own consumer, and the
    /// processes' CPU is summed per kind.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    instances: u32,
    /// `--retention` of the producer and the consumer in every run (e.g. 0, 7d, off; unset:
    /// their default).
    #[arg(long, value_name = "DURATION")]
    retention: Option<String>,
    /// The retention soak (issue 16): after the main run, one run with `--retention off` and
    /// one with `--retention 0`, each reading the databases' sizes when a tenth, half and all
    /// of the events are applied, after the processes stop, and after one `--compact-once`
    /// pass; the report gives bytes per finished event and throughput side by side. Use with
    /// e.g. `--flows 333334` (a million events).
    #[arg(long, conflicts_with_all = ["callgrind", "half_rate", "compare_batch_1", "compare_metrics"])]
    soak: bool,
}

impl Args {
    fn flows(&self) -> usize {
        self.flows.unwrap_or(if self.callgrind { 2_000 } else { 10_000 })
    }

    fn launcher(&self) -> Launcher {
        Launcher { bin_dir: self.bin_dir.clone(), callgrind: self.callgrind }
    }
}

/// The store backend of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
enum Backend {
    /// SQLite files (the embedded default).
    Sqlite,
    /// A PostgreSQL database.
    Postgres,
}

/// One run to do.
struct RunSpec {
    label: &'static str,
    flows: usize,
    load: Load,
    caps: Caps,
    /// Read the databases' sizes during and after the run (`--soak`).
    sizes: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match bench(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn bench(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.flows() > 0 && args.clients > 0, "--flows and --clients must be at least 1");
    anyhow::ensure!(
        args.instances == 1 || args.backend == Backend::Postgres,
        "--instances above 1 needs --backend postgres (on SQLite one relay serves an outbox)"
    );
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base)?;
    let caps = Caps {
        producer_max_batch: args.producer_max_batch,
        consumer_max_batch: args.consumer_max_batch,
        apply_batch: args.apply_batch,
        mark_batch: args.mark_batch,
        mark_delay_ms: args.mark_delay_ms,
        window: args.window,
        poll_ms: args.poll_ms,
        metrics: false,
        retention: args.retention.clone(),
    };
    let main_load = match args.rate {
        Some(rate) => Load::Open { calls_per_s: rate },
        None => Load::Closed { clients: args.clients },
    };
    let started = report::machine(&base);
    let mut runs: Vec<Value> = Vec::new();
    let main =
        RunSpec { label: "grouped", flows: args.flows(), load: main_load, caps: caps.clone(), sizes: false };
    let main_result = run_one(&args, &base, &main).await?;
    let main_e2e = main_result["end_to_end"]["events_per_s"].as_f64().unwrap_or(0.0);
    runs.push(main_result);
    if args.half_rate {
        let half = RunSpec {
            label: "grouped-half-rate",
            flows: args.flows(),
            load: Load::Open { calls_per_s: (main_e2e / 2.0).max(1.0) },
            caps: caps.clone(),
            sizes: false,
        };
        runs.push(run_one(&args, &base, &half).await?);
    }
    if args.compare_batch_1 {
        let one = RunSpec {
            label: "batch-1",
            flows: args.batch_1_flows.unwrap_or(args.flows()),
            load: main_load,
            caps: caps.batch_1(),
            sizes: false,
        };
        runs.push(run_one(&args, &base, &one).await?);
    }
    if args.compare_metrics {
        // After the main run (a warm-up for this comparison, not part of it), rounds of one
        // run without metrics and one with, alternating, so a drift of the machine over the
        // sitting (a warming disk, another tenant) falls on both sides.
        for _ in 0..args.metrics_rounds {
            let spec = RunSpec {
                label: "metrics-off",
                flows: args.flows(),
                load: main_load,
                caps: caps.clone(),
                sizes: false,
            };
            runs.push(run_one(&args, &base, &spec).await?);
            let on = Caps { metrics: true, ..caps.clone() };
            let spec =
                RunSpec { label: "metrics-on", flows: args.flows(), load: main_load, caps: on, sizes: false };
            runs.push(run_one(&args, &base, &spec).await?);
        }
    }
    if args.soak {
        // After the main run (a warm-up), the two retentions side by side in this sitting.
        for (label, retention) in [("retention-off", "off"), ("retention-0", "0")] {
            let caps = Caps { retention: Some(retention.to_owned()), ..caps.clone() };
            let spec = RunSpec { label, flows: args.flows(), load: main_load, caps, sizes: true };
            runs.push(run_one(&args, &base, &spec).await?);
        }
    }
    let doc = report::document(started, &args_json(&args), runs);
    let table = if args.callgrind { callgrind::table(&doc) } else { report::table(&doc) };
    match args.output.as_deref() {
        Some(p) if p.as_os_str() == "-" => {
            println!("{}", serde_json::to_string_pretty(&doc)?);
            eprint!("{table}");
        }
        Some(p) => {
            std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")?;
            print!("{table}");
            println!("JSON report: {}", p.display());
        }
        None => print!("{table}"),
    }
    let verified =
        doc["runs"].as_array().is_some_and(|runs| runs.iter().all(|r| r["verified"]["ok"] == true));
    Ok(if verified { ExitCode::SUCCESS } else { ExitCode::from(3) })
}

fn args_json(args: &Args) -> Value {
    json!({
        "flows": args.flows(),
        "clients": args.clients,
        "connections": args.connections,
        "client": args.client,
        "rate": args.rate,
        "half_rate": args.half_rate,
        "compare_batch_1": args.compare_batch_1,
        "compare_metrics": args.compare_metrics,
        "metrics_rounds": args.metrics_rounds,
        "batch_1_flows": args.batch_1_flows,
        "producer_max_batch": args.producer_max_batch,
        "consumer_max_batch": args.consumer_max_batch,
        "apply_batch": args.apply_batch,
        "mark_batch": args.mark_batch,
        "mark_delay_ms": args.mark_delay_ms,
        "window": args.window,
        "poll_ms": args.poll_ms,
        "dir": args.dir,
        "keep": args.keep,
        "callgrind": args.callgrind,
        "bin_dir": args.bin_dir,
        "backend": args.backend,
        "retention": args.retention,
        "soak": args.soak,
    })
}

/// Starts a fresh pipeline, drives the load, waits for the last applied event, measures,
/// stops the processes, and returns the run's JSON.
async fn run_one(args: &Args, base: &std::path::Path, spec: &RunSpec) -> anyhow::Result<Value> {
    let dir = tempfile::Builder::new().prefix(&format!("oe-bench-{}-", spec.label)).tempdir_in(base)?;
    eprintln!(
        "bench: {}: {} flows × 3 steps, {:?}, caps {:?}, in {}",
        spec.label,
        spec.flows,
        spec.load,
        spec.caps,
        dir.path().display()
    );
    // A PostgreSQL run's database lives as long as this value (dropped at the end of the run).
    let pg =
        match args.backend {
            Backend::Sqlite => None,
            Backend::Postgres => {
                let (admin, label) = (args.pg_url.clone(), format!("bench_{}", spec.label));
                let db = tokio::task::spawn_blocking(move || {
                    proto::pg::testing::TestDb::create_on(&admin, &label)
                })
                .await?
                .map_err(|e| {
                    anyhow::anyhow!("--backend postgres: cannot create a database on {}: {e}", args.pg_url)
                })?;
                Some(db)
            }
        };
    let databases = match &pg {
        None => Databases::files(dir.path()),
        Some(db) => Databases::Postgres { url: db.url().to_owned() },
    };
    let pipeline = {
        let (path, dbs, caps, launcher) =
            (dir.path().to_owned(), databases.clone(), spec.caps.clone(), args.launcher());
        let instances = args.instances as usize;
        tokio::task::spawn_blocking(move || Pipeline::start(&path, &dbs, &caps, &launcher, instances))
            .await??
    };
    let server_cpu_before = match &pg {
        None => None,
        Some(db) => {
            let (url, name) = (db.url().to_owned(), db.name().to_owned());
            Some(tokio::task::spawn_blocking(move || measure_pg::server_cpu(&url, &name)).await??)
        }
    };
    // Nothing else runs on this thread before the load starts: waiting here blocks nobody.
    let scraper = match spec.caps.metrics {
        true => Some(scrape::Scraper::start(pipeline.metrics_addrs(args.launcher().start_deadline())?)),
        false => None,
    };
    let events = spec.flows as u64 * 3;
    let stop_sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = spec.sizes.then(|| {
        let (dbs, stop) = (databases.clone(), stop_sampling.clone());
        tokio::task::spawn_blocking(move || {
            storage::sample_marks(dbs, vec![events / 10, events / 2, events], stop)
        })
    });
    let bench_cpu_before = pipeline::proc_stats("self").cpu_seconds;
    let load =
        load::drive(&pipeline.producer_urls(), "f", spec.flows, spec.load, args.connections, args.client)
            .await?;
    anyhow::ensure!(
        load.unexpected.is_empty(),
        "{}: {} Advance calls were not committed, e.g. {:?}",
        spec.label,
        load.unexpected.len(),
        &load.unexpected[..load.unexpected.len().min(3)]
    );
    let deadline = Duration::from_secs(args.timeout_s);
    {
        let dbs = databases.clone();
        tokio::task::spawn_blocking(move || match &dbs {
            Databases::Files { producer, consumer } => {
                measure::wait_until_applied(producer, consumer, events, deadline)
            }
            Databases::Postgres { url } => measure_pg::wait_until_applied(url, events, deadline),
        })
        .await??;
    }
    // This process drives every run: its CPU from the first call until the last event was
    // applied, not the reading of the tables afterwards (the services are stopped by then).
    let mut bench_clients = pipeline::proc_stats("self");
    bench_clients.cpu_seconds -= bench_cpu_before;
    let server_cpu_seconds = match (&pg, server_cpu_before) {
        (Some(db), Some(before)) => {
            let (url, name) = (db.url().to_owned(), db.name().to_owned());
            let after = tokio::task::spawn_blocking(move || measure_pg::server_cpu(&url, &name)).await??;
            Some(measure_pg::server_cpu_between(&before, &after))
        }
        _ => None,
    };
    let scrapes = match scraper {
        Some(scraper) => Some(scraper.stop().await),
        None => None,
    };
    stop_sampling.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut readings = match sampler {
        Some(sampler) => sampler.await??,
        None => Vec::new(),
    };
    let stopped = tokio::task::spawn_blocking(move || pipeline.stop()).await?;
    let storage = if spec.sizes {
        let (dbs, launcher, retention) = (databases.clone(), args.launcher(), spec.caps.retention.clone());
        let (after, compacted) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let stopped = storage::read(&dbs, "stopped")?;
            let mut compacted = Vec::new();
            if let Some(r) = retention.as_deref().filter(|r| *r != "off") {
                compacted.push(launcher.compact_once("producer", &dbs.producer_arg(), r)?);
                compacted.push(launcher.compact_once("consumer", &dbs.consumer_arg(), r)?);
            }
            let once =
                (!compacted.is_empty()).then(|| storage::read(&dbs, "after compact-once")).transpose()?;
            Ok((std::iter::once(stopped).chain(once).collect::<Vec<_>>(), compacted))
        })
        .await??;
        readings.extend(after);
        let mut section = storage::report(&readings, events);
        section["compact_once"] = json!(compacted);
        Some(section)
    } else {
        None
    };
    let flows = spec.flows as u64;
    let (tables, files) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        match &databases {
            Databases::Files { producer, consumer } => {
                let tables = measure::read_tables(producer, consumer, flows)?;
                let files = json!({
                    "producer.db": measure::journal_mode_in_file(producer)?,
                    "consumer.db": measure::journal_mode_in_file(consumer)?,
                });
                Ok((tables, files))
            }
            Databases::Postgres { url } => {
                let tables = measure_pg::read_tables(url, flows)?;
                Ok((tables, json!({"postgres": measure_pg::server_settings(url)?})))
            }
        }
    })
    .await??;
    // Read before the directory goes (unless --keep).
    let instructions = if args.callgrind { Some(callgrind::counts(dir.path(), events)?) } else { None };
    let kept = if args.keep { Some(dir.keep()) } else { None };
    let mut run = report::run_json(
        spec.label,
        spec.flows,
        &spec.load,
        &spec.caps,
        args,
        load,
        tables,
        stopped,
        files,
        kept,
        bench_clients,
    );
    if let Some(instructions) = instructions {
        run["callgrind"] = instructions;
    }
    run["config"]["backend"] = json!(args.backend);
    run["config"]["metrics"] = json!(spec.caps.metrics);
    if let Some(scrapes) = scrapes {
        run["metrics_scrapes"] = scrapes;
    }
    run["config"]["instances"] = json!(args.instances);
    run["config"]["retention"] = json!(spec.caps.retention);
    if let Some(storage) = storage {
        run["storage"] = storage;
    }
    if let Some(cpu) = server_cpu_seconds {
        run["processes"]["postgres_server"] = json!({
            "cpu_seconds": (cpu * 1000.0).round() / 1000.0,
            "cpu_us_per_event": (cpu * 1e6 / events as f64).round(),
            "counted": "the run database's backends and the server's background processes",
        });
    }
    drop(pg);
    Ok(run)
}
