//! The multi-process test suite: real binaries, real files, one module per topic.
//! Build the binaries first: `cargo build --release --bins`.

mod auto_apply;
mod backlog;
mod chaos;
mod cli;
mod consumer;
mod consumer_crash;
mod consumer_race;
mod hostile;
mod instances;
mod limits;
mod malformed;
mod metrics;
mod model;
mod pg_tls;
mod producer;
mod relay;
mod relay_instances;
mod relay_liveness;
mod retention_consumer;
mod retention_producer;
mod rolling_upgrade;
mod scenarios;
mod security;
mod storage_faults;
mod walkthrough;
