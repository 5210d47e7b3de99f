//! The consumer's Prometheus metrics: `Receive` answers by outcome, `Apply` stops by why and
//! the commit→applied latency of each applied event (bumped where they are decided or
//! committed: a few atomic adds each), and, per scrape, the inbox backlog read from the
//! store's counters (unapplied rows, and the waiting flows by state: gap, ready and blocked
//! by reason), kept exact in the same transactions as the rows, through a connection of the
//! scrape's own (one row read: never a `COUNT(*)`, never a walk, never the writer's lock).

use std::sync::Arc;

use runtime::metrics::{Counters, Expose, Exposition, GaugeSample, Histogram};

use crate::store::{BLOCK_REASONS, ConsumerStore};

use crate::apply::Stop;
use crate::rules::BlockReason;

/// `Receive` answers by outcome (`error`: storing the envelope failed; the stream ends).
pub static RECEIVE_OUTCOMES: Counters<7> = Counters::new(
    "ordered_events_consumer_receive",
    "Receive envelopes answered, by outcome.",
    "outcome",
    ["accepted", "duplicate", "id_conflict", "sequence_conflict", "rejected", "backlog_full", "error"],
);

/// Why an apply run over one flow stopped (Apply, ApplyAll and auto-apply alike), with the
/// stored reason of a blocked row.
pub static APPLY_STOPS: Counters<7> = Counters::new(
    "ordered_events_consumer_apply_stops",
    "Apply runs over one flow, by why they stopped (blocked_* carries the stored reason).",
    "stop",
    [
        "idle",
        "limit",
        "gap",
        "blocked_unsupported_schema",
        "blocked_invalid_payload",
        "blocked_invalid_transition",
        "error",
    ],
);

/// Counts one `Receive` answer: its wire outcome, or `None` when storing it failed.
pub fn count_receive(outcome: Option<i32>) {
    // Wire values 1..=6 are accepted..backlog_full; anything else counts as `error`.
    let index = outcome.map_or(6, |o| usize::try_from(o).unwrap_or(0).wrapping_sub(1));
    RECEIVE_OUTCOMES.inc(index);
}

/// Counts one apply run's stop (`None`: it failed on storage).
pub fn count_stop(stop: Option<&Stop>) {
    let index = match stop {
        Some(Stop::Idle) => 0,
        Some(Stop::Limit) => 1,
        Some(Stop::Gap { .. }) => 2,
        Some(Stop::Blocked { reason: BlockReason::UnsupportedSchema, .. }) => 3,
        Some(Stop::Blocked { reason: BlockReason::InvalidPayload, .. }) => 4,
        Some(Stop::Blocked { reason: BlockReason::InvalidTransition, .. }) => 5,
        None => 6,
    };
    APPLY_STOPS.inc(index);
}

/// From the producer's commit of an event (the committed time its envelope carried) to the
/// consumer's apply of it, recorded when the apply commits. Events whose envelope carried no
/// committed time, and spans the two hosts' clocks make negative, are not recorded.
pub static COMMIT_TO_APPLIED: Histogram = Histogram::seconds(
    "ordered_events_consumer_commit_to_applied_seconds",
    "From the producer's commit of an event (outbox committed time) to its apply on the consumer.",
    None,
);

static FAMILIES: [&dyn Expose; 5] = [
    &RECEIVE_OUTCOMES,
    &APPLY_STOPS,
    &COMMIT_TO_APPLIED,
    &crate::compaction::METRICS,
    &runtime::batches::FAMILIES,
];

/// What `/metrics` serves for a consumer on `store` whose backlog cap is `cap` (`None`: none).
pub fn exposition(store: &ConsumerStore, cap: Option<u64>) -> Exposition {
    let counts = store.backlog_reader();
    let pool = store.clone();
    let read = move || -> Result<Vec<GaugeSample>, String> {
        // The pool first: the scrape's own connection is not yet taken.
        let pool = pool.pool_status();
        let counts = counts()?;
        let unapplied = counts.unapplied;
        let mut gauges = vec![GaugeSample {
            name: "ordered_events_consumer_inbox_unapplied",
            help: "Inbox rows stored and not yet applied (pending and blocked).",
            labels: Vec::new(),
            value: unapplied as f64,
        }];
        let waiting = "ordered_events_consumer_flows_waiting";
        let waiting_help = "Flows with unapplied rows by why they wait: gap (the next seq is missing), ready \
             (the next seq is stored and pending), blocked_* (the next seq is blocked, by the stored reason).";
        for (state, value) in [("gap", counts.gap), ("ready", counts.ready)] {
            gauges.push(GaugeSample {
                name: waiting,
                help: waiting_help,
                labels: vec![("state", state)],
                value: value as f64,
            });
        }
        for (reason, value) in BLOCK_REASONS.iter().zip(counts.blocked) {
            gauges.push(GaugeSample {
                name: waiting,
                help: waiting_help,
                labels: vec![("state", blocked_label(*reason))],
                value: value as f64,
            });
        }
        if let Some(cap) = cap {
            gauges.push(GaugeSample {
                name: "ordered_events_consumer_backlog_cap",
                help: "The backlog cap (--max-pending); absent when uncapped.",
                labels: Vec::new(),
                value: cap as f64,
            });
            gauges.push(GaugeSample {
                name: "ordered_events_consumer_backlog_fill_ratio",
                help: "Unapplied rows over the backlog cap (1 = new flows answered BACKLOG_FULL).",
                labels: Vec::new(),
                value: unapplied as f64 / cap.max(1) as f64,
            });
        }
        if let Some(pool) = pool {
            gauges.extend(pool.gauges("consumer"));
        }
        Ok(gauges)
    };
    Exposition::new(&FAMILIES, Some(Arc::new(read)))
}

/// The `state` label of flows blocked for `reason` (the apply stop's label too).
fn blocked_label(reason: BlockReason) -> &'static str {
    match reason {
        BlockReason::UnsupportedSchema => "blocked_unsupported_schema",
        BlockReason::InvalidPayload => "blocked_invalid_payload",
        BlockReason::InvalidTransition => "blocked_invalid_transition",
    }
}
