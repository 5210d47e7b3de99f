//! The consumer: stores every well-formed event durably (accepted, `store::insert_pending`,
//! group-committed by `receive`) and applies each flow's events strictly in seq order
//! (applied, `apply`), served over gRPC as `ordered_events.v1.Consumer` (`service`).

pub mod apply;
pub mod receive;
pub mod request;
pub mod routes;
pub mod rules;
pub mod service;
pub mod store;

pub use service::{Config, ConsumerService, OpenError, run};

/// Microseconds since the Unix epoch, for the `*_at_us` columns (0 if the clock is before it).
pub(crate) fn now_us() -> i64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}
