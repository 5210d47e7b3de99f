//! The relay: crosses the two commit domains. It reads unaccepted outbox rows from
//! producer.db (only through `producer::store`), streams them into the consumer's
//! `Receive`, and marks a row accepted only after the consumer answered that it durably
//! holds it (`ACCEPTED` or `DUPLICATE`). Everything else leaves the row unaccepted.

pub mod identity;
pub mod ledger;
pub mod output;
pub mod pass;

use std::path::PathBuf;
use std::time::Duration;

use proto::crash::CrashSwitch;

pub use pass::{RelayError, run};

/// Default cap of answers recorded per producer.db transaction (`--mark-batch`).
pub const DEFAULT_MARK_BATCH: usize = 256;
/// Default wait of an answer for others to share its mark transaction (`--mark-delay-ms`).
pub const DEFAULT_MARK_DELAY_MS: u64 = 5;

/// What the relay does in this run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Deliver the first unaccepted row by `(flow_id, seq)` (the reference's default; it
    /// starves later flows while that row keeps conflicting, by design).
    Once,
    /// Deliver this event, accepted or not.
    Send { event_id: String },
    /// Deliver every deliverable unaccepted row, skipping the rest of a flow whose row was
    /// answered with a conflict or rejection; exit when nothing deliverable is left.
    Drain,
    /// Like drain, continuously, until SIGTERM.
    Run,
}

/// Validated settings of one relay process.
#[derive(Clone, Debug)]
pub struct Config {
    pub producer_db: PathBuf,
    pub consumer_url: String,
    pub mode: Mode,
    /// Envelopes in flight on the Receive stream before waiting for an answer.
    pub window: usize,
    /// Answers recorded in one producer.db transaction (those already arrived, up to this).
    pub mark_batch: usize,
    /// How long an arrived answer may wait for more to share its transaction (fewer, larger
    /// mark transactions leave producer.db's write lock to the producer).
    pub mark_delay: Duration,
    /// `run`: pause between polls when nothing was deliverable.
    pub poll_interval: Duration,
    /// `run`: the cap of the reconnect (and conflicted-flow retry) backoff.
    pub max_backoff: Duration,
    /// `once`, `send`, `drain`: give up connecting after this long.
    pub connect_deadline: Duration,
    pub crash: CrashSwitch,
    /// Bearer token sent on every call (`--token-file`).
    pub token: Option<std::sync::Arc<str>>,
    /// PEM CA certificate to trust for an `https://` consumer URL (`--tls-ca`).
    pub tls_ca: Option<Vec<u8>>,
}
