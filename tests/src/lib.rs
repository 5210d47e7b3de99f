//! The multi-process harness shared by the test suite and the experiment runner: it starts
//! the real `producer`, `consumer` and `relay` binaries on temp files, waits on readiness
//! lines, exits and predicates (never on sleeps), and reads the databases back, on either
//! backend (SQLite files or PostgreSQL, see [`backend`]).

pub mod backend;
pub mod background;
pub mod canon;
pub mod chaos;
pub mod checker;
pub mod db;
pub mod model;
pub mod proc;
pub mod race;
pub mod rng;
pub mod scenarios;
pub mod scrape;

pub use backend::{Backend, Target};
pub use proc::{Consumer, Finished, Producer, RelayRun, Workdir, bin_path, relay, run_to_exit};

use proto::pb;

/// A producer `Advance` request with the reference amount (3).
pub fn advance(flow: &str, event: &str, expected_seq: u64, kind: &str, schema: u32) -> pb::AdvanceRequest {
    pb::AdvanceRequest {
        flow_id: flow.into(),
        event_id: event.into(),
        expected_seq,
        kind: kind.into(),
        schema,
        amount: 3,
    }
}

/// The reference flow's three steps as envelopes (`<flow>1..3`, schema 1, amount 3), for
/// feeding `Receive` directly.
pub fn reference_envelopes(flow: &str) -> Vec<pb::EventEnvelope> {
    ["reserved", "confirmed", "released"]
        .iter()
        .enumerate()
        .map(|(i, kind)| envelope(flow, i as u64 + 1, kind, 1, r#"{"amount":3}"#))
        .collect()
}

/// An envelope with event id `<flow><seq>`.
pub fn envelope(flow: &str, seq: u64, kind: &str, schema: u32, payload_json: &str) -> pb::EventEnvelope {
    pb::EventEnvelope {
        event_id: format!("{flow}{seq}"),
        flow_id: flow.into(),
        seq,
        kind: kind.into(),
        schema,
        payload_json: payload_json.into(),
        committed_at_us: None,
    }
}

/// The rows a service's compaction passes reported as compacted by the transactions that
/// finished them (`when_finished=N` of each `compaction pass` line in `log`), summed.
pub fn when_finished(log: &str) -> u64 {
    log.lines()
        .filter(|line| line.contains("compaction pass"))
        .filter_map(|line| line.split_whitespace().find_map(|field| field.strip_prefix("when_finished=")))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}
