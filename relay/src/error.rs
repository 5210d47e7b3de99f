//! Why a relay run stopped with an operational error (exit code 1, one line on stderr).

use std::time::Duration;

/// An operational failure; answers (conflicts, rejections) are never errors.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The producer database could not be opened (missing, foreign, too new, not created
    /// by the producer yet, unreachable).
    #[error("{0}")]
    Open(#[from] runtime::OpenError),
    /// A read or a mark transaction on the producer database failed.
    #[error("producer database: {0}")]
    Store(#[from] producer::store::StoreError),
    /// No connection to the consumer.
    #[error("consumer unreachable at {url}: {reason}")]
    Unreachable {
        /// The consumer URL.
        url: String,
        /// The transport's reason.
        reason: String,
    },
    /// The `Receive` stream failed or broke the protocol.
    #[error("consumer stream failed: {0}")]
    Stream(String),
    /// The consumer stopped answering: no answer to the oldest envelope in flight (or no
    /// response to opening a stream) within the answer timeout.
    #[error(
        "consumer stopped answering: nothing came back within {0:?} (--answer-timeout-ms); unanswered rows stay unaccepted"
    )]
    Unresponsive(Duration),
    /// `drain`: rows deferred by a full consumer backlog with no progress for too long.
    #[error(
        "consumer backlog full: {rows} rows still deferred after {waited:?} without progress (--max-stall-ms); apply, then run the relay again"
    )]
    BacklogStalled {
        /// Rows deferred in the last pass.
        rows: usize,
        /// How long nothing moved.
        waited: Duration,
    },
    /// `send` named an event the outbox does not have.
    #[error("no outbox row has event_id {0:?}")]
    UnknownEvent(String),
    /// The consumer lost history (its database was replaced or restored from an older copy)
    /// and some of the rows it lacks were compacted by the producer's retention: their bodies
    /// are gone, so they cannot be sent again, and sending only the rest would leave gaps in
    /// their flows. Nothing was marked; the relay stops (exit code 1, `run` included).
    #[error(
        "consumer history lost beyond the producer's retention: {lost} accepted rows are missing from \
         consumer database {consumer_db}, {compacted} of them compacted to tombstones (first: {first:?}), so \
         they cannot be sent again and nothing was re-sent or unmarked. Restore a newer copy of the consumer \
         database (one that holds these rows) and run the relay again, or accept the loss explicitly \
         (an operator's decision: `relay accept-lost --consumer-database-id {consumer_db}` marks them \
         LOST_ACCEPTED and sends the rest again); the relay never skips them by itself"
    )]
    HistoryCompacted {
        /// The consumer database that answered.
        consumer_db: String,
        /// Rows it lacks of what the outbox recorded as accepted.
        lost: u64,
        /// Of those, rows compacted to tombstones.
        compacted: u64,
        /// The first compacted rows' event ids.
        first: Vec<String>,
    },
    /// `accept-lost` refused: the consumer is not the one named, cannot say exactly what it
    /// lacks, or compaction changed the rows meanwhile. Nothing was changed.
    #[error("accept-lost refused: {0}")]
    AcceptLost(String),
    /// SIGTERM/SIGINT ended `once`, `send` or `drain` before it finished.
    #[error("stopped by a signal before {0} finished; unanswered rows stay unaccepted")]
    Interrupted(&'static str),
}

impl RelayError {
    /// True for failures of the link to the consumer, after which `run` reconnects (with
    /// backoff) instead of exiting.
    pub fn is_link_failure(&self) -> bool {
        matches!(self, RelayError::Unreachable { .. } | RelayError::Stream(_) | RelayError::Unresponsive(_))
    }

    /// True for what `run` retries (with backoff) instead of exiting: a link failure, or a
    /// producer database that cannot be reached or written for now (the server restarted, a
    /// connection was cut, its disk is full). The rows whose marks were lost stay unaccepted
    /// and are sent again; the consumer answers DUPLICATE and they are marked then.
    pub fn is_retried_by_run(&self) -> bool {
        self.is_link_failure()
            || matches!(self, RelayError::Store(e) if e.is_retryable() || e.is_storage_outage())
    }
}
