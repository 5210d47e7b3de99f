//! The consumer: stores every well-formed event durably (accepted, `store::insert_pending`,
//! group-committed by `receive`) and applies each flow's events strictly in seq order
//! (applied, `apply`), served over gRPC as `ordered_events.v1.Consumer` (`service`).

pub mod apply;
pub mod compaction;
pub mod metrics;
pub mod receive;
pub mod request;
pub mod routes;
pub mod rules;
pub mod service;
pub mod storage;
pub mod store;
pub mod waiting;

pub use service::{Config, ConsumerService, run};
