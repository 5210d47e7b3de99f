//! The relay: crosses the two commit domains. It reads unaccepted outbox rows from
//! the producer database (SQLite or PostgreSQL, only through `producer::store`), streams them into the consumer's
//! `Receive`, and marks a row accepted only after the consumer answered that it durably
//! holds it (`ACCEPTED` or `DUPLICATE`). Everything else leaves the row unaccepted.
//!
//! Parts: [`session`] opens one `Receive` stream (over [`connect`]), [`pass`] sends windows
//! of rows over one or several streams (each flow on one) and [`record`]s the answers, [`decision`] holds the pure rules (what an
//! answer does to its row, the exit code, the backoff), [`oneshot`] runs `once`, `send` and
//! `drain`, [`daemon`] runs `run`, and [`stop`] carries SIGTERM/SIGINT into every wait.

pub mod backoff;
pub mod connect;
pub mod daemon;
pub mod decision;
pub mod error;
pub mod identity;
pub mod lease;
pub mod ledger;
pub mod oneshot;
pub mod output;
pub mod pass;
pub mod record;
pub mod session;
pub mod stop;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use proto::crash::CrashSwitch;

pub use error::RelayError;

/// Default cap of answers recorded per producer.db transaction (`--mark-batch`).
pub const DEFAULT_MARK_BATCH: usize = 256;
/// Default wait of an answer for others to share its mark transaction (`--mark-delay-ms`).
pub const DEFAULT_MARK_DELAY_MS: u64 = 5;
/// Default deadline for the oldest unanswered envelope (`--answer-timeout-ms`).
pub const DEFAULT_ANSWER_TIMEOUT_MS: u64 = 10_000;
/// Default time in-flight answers may still arrive after SIGTERM/SIGINT (`--shutdown-grace-ms`).
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 5_000;
/// Default time `drain` waits on a full consumer backlog that makes no progress (`--max-stall-ms`).
pub const DEFAULT_MAX_STALL_MS: u64 = 300_000;
/// `once`, `send` and `drain` give up on a consumer they cannot connect to after this long.
pub const ONE_SHOT_CONNECT_DEADLINE: Duration = Duration::from_secs(10);

/// What the relay does in this run, with the settings only that mode uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Deliver the first unaccepted row by `(flow_id, seq)` (the reference's default; it
    /// starves later flows while that row keeps conflicting, by design).
    Once,
    /// Deliver this event, accepted or not.
    Send {
        /// The outbox row's event id.
        event_id: String,
    },
    /// Deliver every deliverable unaccepted row, skipping the rest of a flow whose row was
    /// answered with a conflict or rejection; exit when nothing deliverable is left.
    Drain(DrainSettings),
    /// Like drain, continuously, until SIGTERM/SIGINT.
    Run(RunSettings),
    /// An operator accepts that this consumer database lost, for good, rows the producer
    /// compacted ([`identity::accept_lost`]); sends nothing.
    AcceptLost {
        /// The consumer database id the consumer must answer with.
        consumer_database_id: String,
    },
}

impl Mode {
    /// The mode's subcommand name, as the summary line reports it.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Once => "once",
            Mode::Send { .. } => "send",
            Mode::Drain(_) => "drain",
            Mode::Run(_) => "run",
            Mode::AcceptLost { .. } => "accept-lost",
        }
    }
}

/// Settings of `drain` only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainSettings {
    /// How long rows deferred by a full consumer backlog may go without any progress (see
    /// [`decision::backlog_progressed`]) before drain gives up with exit 1.
    pub max_stall: Duration,
}

/// Settings of `run` only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunSettings {
    /// Pause between polls when nothing was deliverable.
    pub poll_interval: Duration,
    /// The cap of the reconnect (and deferred-flow retry) backoff.
    pub max_backoff: Duration,
    /// Write a `delivery` line per answer (otherwise only periodic `progress` lines).
    pub delivery_lines: bool,
    /// How often a `progress` line is written when something was delivered since the last.
    pub summary_interval: Duration,
    /// On PostgreSQL: how long a partition lease lasts unrenewed (the heartbeat renews it
    /// every third of it); a dead relay's partitions are taken over within about 4/3 of it.
    pub lease_ttl: Duration,
}

/// How to reach the consumer and how long it may stay silent.
#[derive(Clone, Debug)]
pub struct Link {
    /// The consumer's gRPC URL (`http://` or `https://`).
    pub url: String,
    /// Bearer token sent on every call (`--token-file`).
    pub token: Option<Arc<str>>,
    /// PEM CA certificate to trust for an `https://` consumer URL (`--tls-ca`).
    pub tls_ca: Option<Vec<u8>>,
    /// The oldest unanswered envelope (and the opening of a stream) may wait this long for
    /// its answer; then the consumer counts as stopped and the stream is dropped.
    pub answer_timeout: Duration,
}

/// Validated settings of one relay process.
#[derive(Clone, Debug)]
pub struct Config {
    /// The producer database (a SQLite file or a PostgreSQL URL), created by the producer.
    pub producer_db: proto::target::DbTarget,
    /// The consumer (the first `--consumer`: the one-shot modes use it alone).
    pub link: Link,
    /// Every `--consumer` URL, in the order given (the first is `link.url`). `run` keeps a
    /// stream to each reachable one and spreads the flows over them (every consumer instance
    /// on one database accepts any envelope); a failed one's flows go to the others.
    pub consumers: Vec<String>,
    /// The mode and its own settings.
    pub mode: Mode,
    /// Envelopes in flight on the Receive stream before waiting for an answer.
    pub window: usize,
    /// Answers recorded in one producer.db transaction (those already arrived, up to this).
    pub mark_batch: usize,
    /// How long an arrived answer may wait for more to share its transaction (fewer, larger
    /// mark transactions leave producer.db's write lock to the producer).
    pub mark_delay: Duration,
    /// After SIGTERM/SIGINT, how long answers to envelopes already in flight may still
    /// arrive (and be recorded) before the relay exits anyway.
    pub shutdown_grace: Duration,
    /// The crash point armed for this process, if any.
    pub crash: CrashSwitch,
}

/// What the relay's `/metrics` serves: deliveries by answer, its mark transactions and, on
/// PostgreSQL, its pool's connections (once the producer database is open) and, for `run`
/// sharing the outbox, the partition leases it holds.
pub fn metrics_exposition() -> runtime::metrics::Exposition {
    static FAMILIES: [&dyn runtime::metrics::Expose; 2] = [&output::DELIVERIES, &runtime::batches::FAMILIES];
    let pool = || -> Result<Vec<runtime::metrics::GaugeSample>, String> {
        let status = ledger::LEDGER_STORE.get().and_then(|store| store.pool_status());
        let mut gauges = status.map(|s| s.gauges("relay")).unwrap_or_default();
        if let Some(leases) = lease::CURRENT.get() {
            gauges.push(runtime::metrics::GaugeSample {
                name: "ordered_events_relay_partitions_held",
                help: "Outbox partitions this relay instance holds a lease on (of 64; absent without leases).",
                labels: Vec::new(),
                value: leases.held() as f64,
            });
        }
        Ok(gauges)
    };
    runtime::metrics::Exposition::new(&FAMILIES, Some(std::sync::Arc::new(pool)))
}

/// Runs the relay in `config.mode` and returns its exit code (see [`decision::exit_code`]);
/// operational failures are errors (exit code 1). `shutdown` ends every mode: `run` exits
/// normally, the others with [`RelayError::Interrupted`].
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<u8, RelayError> {
    let stop = stop::Stop::on(shutdown);
    let ledger = ledger::Ledger::open(&config.producer_db, config.crash).await?;
    let per_delivery = !matches!(&config.mode, Mode::Run(settings) if !settings.delivery_lines);
    let mut report = output::Report::new(per_delivery);
    match &config.mode {
        Mode::Once => oneshot::once(&config, &ledger, &mut report, &stop).await?,
        Mode::Send { event_id } => oneshot::send(&config, &ledger, event_id, &mut report, &stop).await?,
        Mode::Drain(settings) => oneshot::drain(&config, *settings, &ledger, &mut report, &stop).await?,
        Mode::Run(settings) => daemon::run(&config, *settings, &ledger, &mut report, &stop).await?,
        Mode::AcceptLost { consumer_database_id } => {
            // Its own one line, no summary: it sends nothing.
            let channel = connect::channel(&config.link, ONE_SHOT_CONNECT_DEADLINE).await?;
            let done = identity::accept_lost(channel, &ledger, &config.link, consumer_database_id).await?;
            output::accept_lost_line(&done);
            return Ok(decision::EXIT_DELIVERED);
        }
    }
    Ok(report.finish(config.mode.name()))
}
