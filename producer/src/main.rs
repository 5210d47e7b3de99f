//! `producer`: the gRPC server that commits flow steps with their outbox events.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use proto::serve::LogFormat;

/// Commits each flow step and its outbox event in one SQLite transaction, and serves
/// `ordered_events.v1.Producer` (Advance, GetFlow) with gRPC health and reflection.
///
/// The first stdout line is the bound address; logs go to stderr (filter with RUST_LOG).
#[derive(Debug, Parser)]
#[command(name = "producer", version)]
struct Args {
    /// producer.db path; created with its schema on first start. The relay reads the same file.
    #[arg(long, env = "ORDERED_EVENTS_PRODUCER_DB", value_name = "FILE")]
    db: PathBuf,
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
        value_parser = proto::group::parse_cap
    )]
    max_batch: usize,
    /// Refuse new Advance steps with RESOURCE_EXHAUSTED while this many committed events wait
    /// for the relay (retries, conflicts and stale calls are still answered). 0: no cap.
    #[arg(long, env = "ORDERED_EVENTS_MAX_UNACCEPTED", value_name = "N", default_value_t = 1_000_000)]
    max_unaccepted: u64,
    /// Log format on stderr.
    #[arg(long, env = "ORDERED_EVENTS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(flatten)]
    serve: proto::serve::ServeOptions,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    proto::serve::init_tracing(args.log_format);
    proto::serve::exit_code("producer", run(args).await)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let crash = proto::crash::CrashSwitch::from_env()?;
    let service = producer::ProducerService::open(&producer::Config {
        db: args.db,
        crash,
        max_batch: args.max_batch,
        max_unaccepted: (args.max_unaccepted > 0).then_some(args.max_unaccepted),
    })?;
    let settings = args.serve.load()?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    let shutdown = proto::serve::shutdown_signal();
    proto::serve::announce(addr);
    tracing::info!(%addr, "producer serving");
    producer::run(service, listener, shutdown, &settings).await?;
    tracing::info!("producer stopped");
    proto::batches::log_all();
    Ok(())
}
