//! The `ordered_events.v1` wire contract and everything the producer, relay and consumer
//! must agree on byte for byte: canonical body, transport limits, the flow state machine,
//! payload decoders, crash-point names and SQLite connection settings.

pub mod auth;
pub mod batches;
pub mod body;
pub mod crash;
pub mod db;
pub mod flow;
pub mod group;
pub mod limits;
pub mod serve;

/// Generated protobuf and gRPC code for `ordered_events.v1`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ordered_events.v1");

    /// The encoded file descriptor set, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/ordered_events_descriptor.bin"));
}
