//! The consumer's Prometheus metrics: `Receive` answers by outcome and `Apply` stops by why
//! (bumped where they are decided: one atomic add each), and, per scrape, the inbox backlog
//! read from the store's trigger-kept `backlog.unapplied` counter through a connection of
//! the scrape's own (never a `COUNT(*)`, never the writer's lock).

use std::sync::Arc;

use runtime::metrics::{Counters, Expose, Exposition, GaugeSample};

use crate::store::UnappliedReader;

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

static FAMILIES: [&dyn Expose; 3] = [&RECEIVE_OUTCOMES, &APPLY_STOPS, &runtime::batches::FAMILIES];

/// What `/metrics` serves for a consumer whose backlog counter `unapplied` reads (from the
/// store's `unapplied_reader`) and whose backlog cap is `cap` (`None`: none).
pub fn exposition(unapplied: UnappliedReader, cap: Option<u64>) -> Exposition {
    let read = move || -> Result<Vec<GaugeSample>, String> {
        let unapplied = unapplied()?;
        let mut gauges = vec![GaugeSample {
            name: "ordered_events_consumer_inbox_unapplied",
            help: "Inbox rows stored and not yet applied (pending and blocked).",
            labels: Vec::new(),
            value: unapplied as f64,
        }];
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
        Ok(gauges)
    };
    Exposition::new(&FAMILIES, Some(Arc::new(read)))
}
