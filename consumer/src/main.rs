//! `consumer`: the gRPC server that accepts events into its inbox and applies them in order.

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{ArgAction, Parser};

/// Stores every well-formed event durably in its inbox (accepted) and applies each flow's
/// events strictly in seq order (applied), serving `ordered_events.v1.Consumer` (Receive,
/// Apply, ApplyAll, GetFlow, ListStuck) with gRPC health and reflection.
///
/// The first stdout line is the bound address; logs go to stderr (filter with RUST_LOG).
#[derive(Debug, Parser)]
#[command(name = "consumer", version)]
struct Args {
    /// Where the inbox lives: a SQLite file path (consumer.db, the embedded default) or a
    /// PostgreSQL URL (postgres://USER[:PASSWORD]@HOST[:PORT]/DBNAME, tables in the schema
    /// ordered_events_consumer). Created with its schema on first start.
    #[arg(long, env = "ORDERED_EVENTS_CONSUMER_DB", value_name = "FILE|URL")]
    db: proto::target::DbTarget,
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(
        long,
        env = "ORDERED_EVENTS_CONSUMER_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:50052"
    )]
    listen: SocketAddr,
    /// Enable the schema 2 decoder ({"units": n}). Without it, schema 2 events are stored
    /// but stay blocked (unsupported_schema) until a consumer with it applies them.
    /// The environment twin takes true/false, 1/0, yes/no, on/off.
    #[arg(
        long,
        env = "ORDERED_EVENTS_SUPPORT_V2",
        action = ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    support_v2: bool,
    /// The most envelopes (from all Receive streams) one transaction, one durable commit, may
    /// hold. Each is still answered only after that commit; 1 commits every envelope alone.
    #[arg(
        long,
        env = "ORDERED_EVENTS_CONSUMER_MAX_BATCH",
        value_name = "N",
        default_value_t = consumer::receive::DEFAULT_MAX_BATCH,
        value_parser = runtime::group::parse_cap
    )]
    max_batch: usize,
    /// Backlog cap: while the inbox holds this many unapplied (pending + blocked) rows, a new
    /// envelope is answered BACKLOG_FULL and nothing is stored, except the exact next seq of a
    /// flow already waiting in the inbox, which is always admitted. 0: no cap.
    #[arg(long, env = "ORDERED_EVENTS_MAX_PENDING", value_name = "N", default_value_t = 1_000_000)]
    max_pending: u64,
    /// The most applied steps (of one or many flows) one Apply transaction may hold; each
    /// step is still projection + effect + inbox mark together. 1 commits every step alone.
    #[arg(
        long,
        env = "ORDERED_EVENTS_APPLY_MAX_BATCH",
        value_name = "N",
        default_value_t = consumer::apply::DEFAULT_APPLY_BATCH,
        value_parser = runtime::group::parse_cap
    )]
    apply_batch: usize,
    /// Apply automatically: after each committed Receive batch, apply the flows it touched
    /// (and, at start-up, every flow with unapplied rows), so no one needs to call Apply.
    /// With --support-v2 it also applies, every 2 s, flows stopped on a row blocked as
    /// unsupported_schema (left by a v1-only instance on the same database, say).
    /// Off by default: events then stay accepted until Apply or ApplyAll is called.
    /// The environment twin takes true/false, 1/0, yes/no, on/off.
    #[arg(
        long,
        env = "ORDERED_EVENTS_AUTO_APPLY",
        action = ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    auto_apply: bool,
    #[command(flatten)]
    retention: runtime::retention::RetentionFlags,
    /// Run one compaction pass now with the given --retention and exit: open the database
    /// (creating or upgrading its schema like a start), reduce every applied inbox row
    /// applied longer ago than the retention to its tombstone, print one JSON line on stdout
    /// ({"compacted":N,"body_bytes":B,"batches":T,"retention":R}, on SQLite also pages_freed,
    /// file_bytes_before and file_bytes_after) and exit 0, without serving. Safe while servers run on the
    /// same database.
    #[arg(long, env = "ORDERED_EVENTS_COMPACT_ONCE", action = ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    compact_once: bool,
    #[command(flatten)]
    server: runtime::ServerFlags,
    #[command(flatten)]
    metrics: runtime::metrics::MetricsFlags,
}

fn main() -> ExitCode {
    let args = Args::parse();
    runtime::process_main("consumer", args.server.log_format, run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let crash = proto::crash::CrashSwitch::from_env()?;
    if args.compact_once {
        let store = consumer::store::ConsumerStore::open(&args.db).await?;
        let retention = args.retention.retention;
        let report = consumer::compaction::pass(&store, retention, crash, 0).await?.unwrap_or_default();
        println!("{}", report.json_line(retention));
        return Ok(());
    }
    let service = consumer::ConsumerService::open(&consumer::Config {
        db: args.db,
        support_v2: args.support_v2,
        crash,
        max_batch: args.max_batch,
        admission: match args.max_pending {
            0 => consumer::store::Admission::Unlimited,
            cap => consumer::store::Admission::Cap(cap),
        },
        apply_batch: args.apply_batch,
        auto_apply: args.auto_apply,
        retention: args.retention.retention,
    })
    .await?;
    let exposition =
        consumer::metrics::exposition(service.store(), (args.max_pending > 0).then_some(args.max_pending));
    let settings = args.server.serve.load()?;
    runtime::metrics::serve_if_asked(&args.metrics, exposition).await?;
    runtime::run_server("consumer", args.listen, |listener, shutdown| {
        consumer::run(service, listener, shutdown, &settings)
    })
    .await?;
    runtime::batches::log_all();
    Ok(())
}
