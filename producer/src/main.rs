//! `producer`: the gRPC server that commits flow steps with their outbox events.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Parser;

/// Commits each flow step and its outbox event in one transaction (SQLite or PostgreSQL), and serves
/// `ordered_events.v1.Producer` (Advance, GetFlow) with gRPC health and reflection.
///
/// Retention: an outbox row the consumer accepted more than --retention ago keeps only its
/// tombstone (event id, flow id, seq, kind, schema and the SHA-256 digest of its body); flow
/// states and rows not yet accepted are never compacted, and Advance answers (EXISTING,
/// CONFLICT) stay exact against tombstones. A background pass runs every tenth of the
/// retention (1 s to 1 h) in transactions of at most 500 rows; --compact-once runs one now.
///
/// The first stdout line is the bound address; logs go to stderr (filter with RUST_LOG).
#[derive(Debug, Parser)]
#[command(name = "producer", version)]
struct Args {
    /// The producer database: a SQLite file path (created with its schema on first start), or a
    /// postgres:// (postgresql://) URL, whose schema ordered_events_producer is created on first
    /// start (nothing is written on disk). The relay reads and marks the same database.
    #[arg(long, env = "ORDERED_EVENTS_PRODUCER_DB", value_name = "FILE|URL")]
    db: proto::target::DbTarget,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(
        long,
        env = "ORDERED_EVENTS_PRODUCER_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:50051"
    )]
    listen: SocketAddr,
    /// The most concurrent Advance calls one transaction (one durable commit) may hold.
    /// Each call is still answered only after that commit; 1 commits every call alone.
    #[arg(
        long,
        env = "ORDERED_EVENTS_PRODUCER_MAX_BATCH",
        value_name = "N",
        default_value_t = producer::DEFAULT_MAX_BATCH,
        value_parser = runtime::group::parse_cap
    )]
    max_batch: usize,
    /// Refuse new Advance steps with RESOURCE_EXHAUSTED while this many committed events wait
    /// for the relay (retries, conflicts and stale calls are still answered). 0: no cap.
    #[arg(long, env = "ORDERED_EVENTS_MAX_UNACCEPTED", value_name = "N", default_value_t = 1_000_000)]
    max_unaccepted: u64,
    #[command(flatten)]
    retention: runtime::retention::RetentionFlags,
    /// Open the database, run one compaction pass at --retention now, print one JSON line
    /// ({"compacted":N,"body_bytes":B,...}) on stdout and exit, without serving. Safe while a
    /// producer and relays run on the same database (batches of at most 500 rows, each its own
    /// transaction; only accepted rows are compacted). The environment twin takes
    /// true/false, 1/0, yes/no, on/off.
    #[arg(
        long,
        env = "ORDERED_EVENTS_COMPACT_ONCE",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    compact_once: bool,
    #[command(flatten)]
    server: runtime::ServerFlags,
    #[command(flatten)]
    metrics: runtime::metrics::MetricsFlags,
}

fn main() -> ExitCode {
    let args = Args::parse();
    runtime::process_main("producer", args.server.log_format, run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let max_unaccepted = (args.max_unaccepted > 0).then_some(args.max_unaccepted);
    let retention = args.retention.retention;
    let service = producer::ProducerService::open(&producer::Config {
        db: args.db,
        crash: proto::crash::CrashSwitch::from_env()?,
        max_batch: args.max_batch,
        max_unaccepted,
    })
    .await?;
    if args.compact_once {
        let report = producer::compaction::pass(service.store(), retention, 0).await?.unwrap_or_default();
        println!("{}", report.json_line(retention));
        return Ok(());
    }
    let _compaction = producer::compaction::spawn(service.store().clone(), retention);
    let exposition = producer::metrics::exposition(service.store(), max_unaccepted);
    let settings = args.server.serve.load()?;
    runtime::metrics::serve_if_asked(&args.metrics, exposition).await?;
    runtime::run_server("producer", args.listen, |listener, shutdown| {
        producer::run(service, listener, shutdown, &settings)
    })
    .await?;
    runtime::batches::log_all();
    Ok(())
}
