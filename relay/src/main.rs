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
/// stdout carries JSON lines only: one {"type":"delivery",...} per answered envelope (`run`:
/// only with --delivery-lines; otherwise a periodic {"type":"progress",...}) and a final
/// {"type":"summary",...}. Exit codes: 0 every answer ACCEPTED/DUPLICATE (or idle);
/// 3 at least one row left unaccepted by a conflict or rejection; 4 no refusal, but a row
/// left unaccepted by an answer the relay does not understand or by a full backlog; 1
/// operational error (consumer unreachable or stopped answering, database unusable, a signal
/// ending once/send/drain); 2 usage; 73 crash point.
#[derive(Debug, Parser)]
#[command(name = "relay", version)]
struct Args {
    /// The producer database: the producer's SQLite file path, or a postgres:// (postgresql://)
    /// URL whose schema ordered_events_producer the producer created (the relay then reads and
    /// marks the outbox over the network; it never creates either).
    #[arg(long, env = "ORDERED_EVENTS_PRODUCER_DB", value_name = "FILE|URL", global = true)]
    producer_db: Option<proto::target::DbTarget>,
    /// The consumer's gRPC URL, e.g. http://127.0.0.1:50052. May be given more than once
    /// (the environment twin: comma-separated) for consumer instances on ONE database: `run`
    /// keeps one stream to each reachable one and spreads the flows over them (all rows of a
    /// flow on one stream, so its order holds); when one is unreachable or stops answering,
    /// its flows go to the others while it is retried with backoff. The one-shot modes use
    /// the first.
    #[arg(
        long,
        env = "ORDERED_EVENTS_CONSUMER_URL",
        value_name = "URL",
        value_delimiter = ',',
        global = true
    )]
    consumer: Vec<String>,
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
    /// How long, in milliseconds, the oldest envelope in flight (or the opening of a stream)
    /// may wait for the consumer's answer; then the consumer counts as stopped: `run` drops
    /// the stream and reconnects with backoff, the other modes exit 1.
    #[arg(
        long,
        env = "ORDERED_EVENTS_RELAY_ANSWER_TIMEOUT_MS",
        value_name = "MS",
        default_value_t = relay::DEFAULT_ANSWER_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(100..=3_600_000),
        global = true
    )]
    answer_timeout_ms: u64,
    /// After SIGTERM/SIGINT, how long, in milliseconds, answers to envelopes already in flight
    /// may still arrive (and be recorded) before the relay exits anyway.
    #[arg(
        long,
        env = "ORDERED_EVENTS_SHUTDOWN_GRACE_MS",
        value_name = "MS",
        default_value_t = relay::DEFAULT_SHUTDOWN_GRACE_MS,
        value_parser = clap::value_parser!(u64).range(0..=600_000),
        global = true
    )]
    shutdown_grace_ms: u64,
    /// Log format on stderr.
    #[arg(long, env = "ORDERED_EVENTS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// Serve Prometheus metrics on `GET http://ADDR/metrics` (no token; port 0 picks a free
    /// port, logged as `metrics serving`). Off when unset.
    #[arg(long, env = "ORDERED_EVENTS_METRICS_LISTEN", value_name = "ADDR", global = true)]
    metrics_listen: Option<std::net::SocketAddr>,
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
    /// in this run. Exits when nothing deliverable is left. Rows deferred by a full consumer
    /// backlog are offered again with backoff while the backlog makes progress.
    Drain {
        /// How long, in milliseconds, a full consumer backlog may make no progress at all
        /// (nothing accepted, no fewer rows deferred) before drain gives up with exit 1.
        #[arg(
            long,
            env = "ORDERED_EVENTS_RELAY_MAX_STALL_MS",
            value_name = "MS",
            default_value_t = relay::DEFAULT_MAX_STALL_MS,
            value_parser = clap::value_parser!(u64).range(1..=86_400_000)
        )]
        max_stall_ms: u64,
    },
    /// Deliver continuously until SIGTERM/SIGINT, picking up newly committed rows, reconnecting
    /// with capped, jittered backoff whenever the stream fails or the consumer stops answering.
    Run {
        /// The longest pause between polls when nothing was deliverable, in milliseconds:
        /// after a pass that delivered, the pause starts at a sixteenth of this and doubles
        /// with each idle pass up to it.
        #[arg(long, env = "ORDERED_EVENTS_RELAY_POLL_MS", default_value_t = 100)]
        poll_ms: u64,
        /// Cap of the reconnect backoff (and of a deferred flow's retry), in milliseconds.
        #[arg(long, env = "ORDERED_EVENTS_RELAY_MAX_BACKOFF_MS", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
        max_backoff_ms: u64,
        /// Write a {"type":"delivery",...} line per answered envelope, as the other modes do.
        /// Off by default: at high rates they flood whatever reads stdout; `run` then writes a
        /// periodic {"type":"progress",...} line and logs state changes on stderr.
        /// The environment twin takes true/false, 1/0, yes/no, on/off.
        #[arg(
            long,
            env = "ORDERED_EVENTS_RELAY_DELIVERY_LINES",
            action = clap::ArgAction::SetTrue,
            value_parser = clap::builder::BoolishValueParser::new()
        )]
        delivery_lines: bool,
        /// How often, in milliseconds, `run` writes its {"type":"progress",...} line (counts
        /// so far) when something was delivered since the last one.
        #[arg(
            long,
            env = "ORDERED_EVENTS_RELAY_SUMMARY_INTERVAL_MS",
            value_name = "MS",
            default_value_t = 10_000,
            value_parser = clap::value_parser!(u64).range(100..=86_400_000)
        )]
        summary_interval_ms: u64,
        /// PostgreSQL only: how long, in milliseconds, a partition lease lasts unrenewed.
        /// Several `relay run` on one outbox split its 64 partitions through leases renewed
        /// every third of this; a relay that dies (or freezes) has its partitions taken over
        /// within ttl + ttl/3 (8 s by default), and a relay that lost a lease can no longer
        /// record answers under it (fencing).
        #[arg(
            long,
            env = "ORDERED_EVENTS_RELAY_LEASE_TTL_MS",
            value_name = "MS",
            default_value_t = relay::lease::DEFAULT_LEASE_TTL_MS,
            value_parser = clap::value_parser!(u64).range(300..=600_000)
        )]
        lease_ttl_ms: u64,
    },
    /// An operator's decision, for a consumer database restored from a copy older than the
    /// producer's retention when no newer copy exists (the relay then stops with CONSUMER
    /// HISTORY LOST BEYOND RETENTION). Judges the consumer as a relay does before sending;
    /// only if it answers for the database named here, and tells exactly which rows it lacks,
    /// the compacted rows among them stay accepted for good (last outcome LOST_ACCEPTED, never
    /// sent again: their flows wait at a gap on the consumer) and the other lost rows are
    /// marked unaccepted, so the next relay run sends them again. One transaction; sends
    /// nothing; one {"type":"accept_lost",...} line on stdout. Run it with the relays stopped.
    /// Exit 0 done (also when nothing compacted was lost), 1 refused or failed (nothing
    /// changed).
    AcceptLost {
        /// The id of the consumer database whose loss is accepted: the consumer's start-up log
        /// line `consumer database identity` and the relay's error name it.
        #[arg(long, value_name = "ID", value_parser = clap::builder::NonEmptyStringValueParser::new())]
        consumer_database_id: String,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    runtime::serve::init_tracing(args.log_format);
    runtime::alloc::tune_allocation();
    let shutdown = runtime::serve::shutdown_signal();
    let metrics = runtime::metrics::MetricsFlags { metrics_listen: args.metrics_listen };
    let ended = match config(args) {
        Ok(config) => match runtime::metrics::serve_if_asked(&metrics, relay::metrics_exposition()).await {
            Ok(_) => {
                relay::run(config, shutdown).await.map_err(|e| Failure { code: 1, message: e.to_string() })
            }
            Err(e) => Err(Failure::operational(e)),
        },
        Err(failure) => Err(failure),
    };
    runtime::batches::log_all();
    // The one exit path: a code, or one `relay: error:` line and its code.
    match ended {
        Ok(code) => ExitCode::from(code),
        Err(Failure { code, message }) => {
            eprintln!("relay: error: {message}");
            ExitCode::from(code)
        }
    }
}

/// Why the relay stops before or instead of finishing: the exit code and its one line.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn usage(message: impl std::fmt::Display) -> Failure {
        Failure { code: 2, message: message.to_string() }
    }

    fn operational(message: impl std::fmt::Display) -> Failure {
        Failure { code: 1, message: message.to_string() }
    }
}

/// Validates the flags into the relay's settings.
fn config(args: Args) -> Result<relay::Config, Failure> {
    let (Some(producer_db), Some(url)) = (args.producer_db, args.consumer.first().cloned()) else {
        return Err(Failure::usage(
            "--producer-db (ORDERED_EVENTS_PRODUCER_DB) and --consumer (ORDERED_EVENTS_CONSUMER_URL) are required",
        ));
    };
    let crash = proto::crash::CrashSwitch::from_env().map_err(Failure::usage)?;
    let mode = match args.mode {
        ModeArg::Once => relay::Mode::Once,
        ModeArg::Send { event_id } => relay::Mode::Send { event_id },
        ModeArg::Drain { max_stall_ms } => {
            relay::Mode::Drain(relay::DrainSettings { max_stall: Duration::from_millis(max_stall_ms) })
        }
        ModeArg::AcceptLost { consumer_database_id } => relay::Mode::AcceptLost { consumer_database_id },
        ModeArg::Run { poll_ms, max_backoff_ms, delivery_lines, summary_interval_ms, lease_ttl_ms } => {
            relay::Mode::Run(relay::RunSettings {
                poll_interval: Duration::from_millis(poll_ms),
                max_backoff: Duration::from_millis(max_backoff_ms),
                delivery_lines,
                summary_interval: Duration::from_millis(summary_interval_ms),
                lease_ttl: Duration::from_millis(lease_ttl_ms),
            })
        }
    };
    let token = args
        .token_file
        .as_deref()
        .map(runtime::auth::read_token)
        .transpose()
        .map_err(Failure::operational)?;
    let tls_ca = args
        .tls_ca
        .as_deref()
        .map(std::fs::read)
        .transpose()
        .map_err(|e| Failure::operational(format!("TLS CA file: {e}")))?;
    Ok(relay::Config {
        producer_db,
        link: relay::Link {
            url,
            token,
            tls_ca,
            answer_timeout: Duration::from_millis(args.answer_timeout_ms),
        },
        consumers: args.consumer,
        mode,
        window: args.window as usize,
        mark_batch: args.mark_batch,
        mark_delay: Duration::from_millis(args.mark_delay_ms),
        shutdown_grace: Duration::from_millis(args.shutdown_grace_ms),
        crash,
    })
}
