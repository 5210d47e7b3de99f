//! The producer: commits a flow's state change and its outbox event in ONE SQLite
//! transaction (`store`), served over gRPC as `ordered_events.v1.Producer` (`service`).

pub mod request;
pub mod service;
pub mod store;

pub use service::{Config, ProducerService, run};
