//! `relay`: moves committed outbox rows from producer.db into the consumer's inbox.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use runtime::serve::LogFormat;

/// Streams unaccepted outbox rows from producer.db into the consumer's Receive RPC and marks
/// a row accepted only after the consumer answered ACCEPTED or DUPLICATE (it durably holds
/// the event). Conflicts and rejections are never marked: they wait for an operator.
///
/// stdout carries JSON lines only: one {"type":"delivery",...} per answered envelope and a
/// final {"type":"summary",...}. Exit codes: 0 every answer ACCEPTED/DUPLICATE (or idle);
/// 3 at least one conflict or rejection; 1 operational error (consumer unreachable, database
/// unusable); 2 usage; 73 crash point.
#[derive(Debug, Parser)]
#[command(name = "relay", version)]
struct Args {
    /// producer.db path; it must already have been created by the producer.
    #[arg(long, env = "ORDERED_EVENTS_PRODUCER_DB", value_name = "FILE", global = true)]
    producer_db: Option<PathBuf>,
    /// The consumer's gRPC URL, e.g. http://127.0.0.1:50052.
    #[arg(long, env = "ORDERED_EVENTS_CONSUMER_URL", value_name = "URL", global = true)]
    consumer: Option<String>,
    /// Envelopes in flight on the stream before waiting for an answer.
    #[arg(long, env = "ORDERED_EVENTS_RELAY_WINDOW", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096), global = true)]
    window: u32,
    /// Send `authorization: Bearer <token>` (the file's content) on every call.
    #[arg(long, env = "ORDERED_EVENTS_TOKEN_FILE", value_name = "FILE", global = true)]
    token_file: Option<PathBuf>,
    /// Trust this PEM CA certificate for an https:// consumer URL (TLS).
    #[arg(long, env = "ORDERED_EVENTS_TLS_CA", value_name = "FILE", global = true)]
    tls_ca: Option<PathBuf>,
    /// The most answers recorded (and rows marked accepted) in one producer.db transaction:
    /// the answers already arrived are recorded together. 1 records each answer alone.
    #[arg(
        long,
        env = "ORDERED_EVENTS_RELAY_MARK_BATCH",
        value_name = "N",
        default_value_t = relay::DEFAULT_MARK_BATCH,
        value_parser = runtime::group::parse_cap,
        global = true
    )]
    mark_batch: usize,
    /// How long, in milliseconds, an arrived answer may wait for more answers to share its
    /// producer.db transaction (up to --mark-batch). 0 records what has arrived at once.
    #[arg(
        long,
        env = "ORDERED_EVENTS_RELAY_MARK_DELAY_MS",
        value_name = "MS",
        default_value_t = relay::DEFAULT_MARK_DELAY_MS,
        value_parser = clap::value_parser!(u64).range(0..=10_000),
        global = true
    )]
    mark_delay_ms: u64,
    /// Log format on stderr.
    #[arg(long, env = "ORDERED_EVENTS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    mode: ModeArg,
}

#[derive(Debug, Subcommand)]
enum ModeArg {
    /// Deliver the first unaccepted row by (flow_id, seq): the reference's default. While that
    /// row keeps conflicting, later flows are never reached (use drain or send).
    Once,
    /// Deliver one chosen event, accepted or not.
    Send {
        /// The outbox row's event_id.
        #[arg(long, value_name = "ID")]
        event_id: String,
    },
    /// Deliver every deliverable unaccepted row; a flow whose row is refused gets no more rows
    /// in this run. Exits when nothing deliverable is left.
    Drain,
    /// Deliver continuously until SIGTERM/SIGINT, picking up newly committed rows, reconnecting
    /// with capped exponential backoff while the consumer is unreachable.
    Run {
        /// Pause between polls when nothing was deliverable, in milliseconds.
        #[arg(long, env = "ORDERED_EVENTS_RELAY_POLL_MS", default_value_t = 100)]
        poll_ms: u64,
        /// Cap of the reconnect backoff, in milliseconds.
        #[arg(long, env = "ORDERED_EVENTS_RELAY_MAX_BACKOFF_MS", default_value_t = 5000)]
        max_backoff_ms: u64,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    runtime::serve::init_tracing(args.log_format);
    runtime::alloc::tune_allocation();
    let shutdown = runtime::serve::shutdown_signal();
    let (Some(producer_db), Some(consumer_url)) = (args.producer_db, args.consumer) else {
        eprintln!(
            "relay: error: --producer-db (ORDERED_EVENTS_PRODUCER_DB) and --consumer (ORDERED_EVENTS_CONSUMER_URL) are required"
        );
        return ExitCode::from(2);
    };
    let crash = match proto::crash::CrashSwitch::from_env() {
        Ok(crash) => crash,
        Err(e) => {
            eprintln!("relay: error: {e}");
            return ExitCode::from(2);
        }
    };
    let (mode, poll_interval, max_backoff) = match args.mode {
        ModeArg::Once => (relay::Mode::Once, Duration::ZERO, Duration::ZERO),
        ModeArg::Send { event_id } => (relay::Mode::Send { event_id }, Duration::ZERO, Duration::ZERO),
        ModeArg::Drain => (relay::Mode::Drain, Duration::ZERO, Duration::ZERO),
        ModeArg::Run { poll_ms, max_backoff_ms } => {
            (relay::Mode::Run, Duration::from_millis(poll_ms), Duration::from_millis(max_backoff_ms.max(1)))
        }
    };
    let token = match args.token_file.as_deref().map(runtime::auth::read_token).transpose() {
        Ok(token) => token,
        Err(e) => {
            eprintln!("relay: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let tls_ca = match args.tls_ca.as_deref().map(std::fs::read).transpose() {
        Ok(pem) => pem,
        Err(e) => {
            eprintln!("relay: error: TLS CA file: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = relay::Config {
        producer_db,
        consumer_url,
        mode,
        window: args.window as usize,
        mark_batch: args.mark_batch,
        mark_delay: Duration::from_millis(args.mark_delay_ms),
        poll_interval,
        max_backoff,
        connect_deadline: Duration::from_secs(10),
        crash,
        token,
        tls_ca,
    };
    match relay::run(config, shutdown).await {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("relay: error: {e}");
            ExitCode::FAILURE
        }
    }
}
