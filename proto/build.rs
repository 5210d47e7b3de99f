//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed, and keeps the
//! encoded descriptor set for the servers' reflection services.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/ordered_events/v1/common.proto",
        "proto/ordered_events/v1/producer.proto",
        "proto/ordered_events/v1/consumer.proto",
    ];
    let fds = protox::compile(files, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("ordered_events_descriptor.bin"), fds.encode_to_vec())?;
    // Our codec answers a message that does not decode INVALID_ARGUMENT (the sender's fault),
    // where tonic_prost's says INTERNAL, which this project keeps for storage failures.
    tonic_prost_build::configure().codec_path("crate::codec::WireCodec").compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
