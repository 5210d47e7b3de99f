//! `consumer`: the gRPC server that accepts events into its inbox and applies them in order.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgAction, Parser};
use proto::serve::LogFormat;

/// Stores every well-formed event durably in its inbox (accepted) and applies each flow's
/// events strictly in seq order (applied), serving `ordered_events.v1.Consumer` (Receive,
/// Apply, ApplyAll, GetFlow, ListStuck) with gRPC health and reflection.
///
/// The first stdout line is the bound address; logs go to stderr (filter with RUST_LOG).
#[derive(Debug, Parser)]
#[command(name = "consumer", version)]
struct Args {
    /// consumer.db path; created with its schema on first start.
    #[arg(long, env = "ORDERED_EVENTS_CONSUMER_DB", value_name = "FILE")]
    db: PathBuf,
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
    /// Log format on stderr.
    #[arg(long, env = "ORDERED_EVENTS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(flatten)]
    serve: proto::serve::ServeOptions,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    proto::serve::init_tracing(args.log_format);
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The top-level message already names the file and the cause; the chain would repeat it.
            eprintln!("consumer: error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let crash = proto::crash::CrashSwitch::from_env()?;
    let config = consumer::Config { db: args.db, support_v2: args.support_v2, crash };
    let service = consumer::ConsumerService::open(&config)?;
    let settings = args.serve.load()?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    let shutdown = proto::serve::shutdown_signal();
    proto::serve::announce(addr);
    tracing::info!(%addr, "consumer serving");
    consumer::run(service, listener, shutdown, &settings).await?;
    tracing::info!("consumer stopped");
    Ok(())
}
