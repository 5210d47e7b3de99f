//! The process runtime the producer, consumer and relay share: start-up and exit
//! (`process`), logging, serving with health and reflection, and shutdown (`serve`),
//! authentication (`auth`), the group-commit writer thread (`group`), blocking work beside
//! the async runtime (`blocking`), allocation settings (`alloc`), Prometheus metrics
//! (`metrics`) and how long finished rows keep their bodies (`retention`). Nothing here
//! crosses the wire; that is `proto`.

pub mod alloc;
pub mod auth;
pub mod batches;
pub mod blocking;
pub mod group;
pub mod health;
pub mod metrics;
pub mod process;
pub mod retention;
pub mod serve;
pub mod server_limits;

pub use process::{
    OpenError, ServeError, ServerFlags, Shutdown, process_main, run_server, serve_authenticated,
};
pub use serve::LogFormat;

/// Microseconds since the Unix epoch, for the `*_at_us` columns (0 if the clock is before
/// it, which no ordering decision depends on: the columns are for people and the benchmark).
pub fn now_us() -> i64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}
