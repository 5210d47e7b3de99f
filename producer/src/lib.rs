//! The producer: commits a flow's state change and its outbox event in ONE transaction
//! (`store`: SQLite or PostgreSQL, group-committing concurrent calls), served over gRPC as
//! `ordered_events.v1.Producer` (`service`).

pub mod compaction;
pub mod metrics;
pub mod request;
pub mod service;
pub mod store;

pub use service::{Config, ProducerService, run};

/// Default cap of `Advance` calls per transaction (`--max-batch`).
pub const DEFAULT_MAX_BATCH: usize = 256;
