//! The `ordered_events.v1` wire contract and everything the producer, relay and consumer
//! must agree on byte for byte: canonical body, transport limits, the flow state machine,
//! payload decoders, crash-point names, the database argument (SQLite file or PostgreSQL URL) and each backend's
//! connection settings. The process runtime
//! the binaries share (serving, authentication, logging) is the `runtime` crate.

pub mod body;
pub mod codec;
pub mod crash;
pub mod db;
pub mod flow;
pub mod limits;
pub mod partition;
pub mod pg;
pub mod pg_tls;
pub mod target;

/// Generated protobuf and gRPC code for `ordered_events.v1`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ordered_events.v1");

    /// The encoded file descriptor set, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/ordered_events_descriptor.bin"));
}
