//! The producer's Prometheus metrics: `Advance` outcomes and latency (bumped on the call
//! path: one atomic add each), and, per scrape, the outbox backlog read from producer.db's
//! trigger-kept `backlog.unaccepted` counter plus one lookup for the oldest unaccepted row.
//! The scrape reads through the store's gauge reader, never the writer's connection.

use runtime::metrics::{Counters, Expose, Exposition, GaugeSample, Histogram};

use crate::store::{Backlog, ProducerStore};

/// `Advance` answers by outcome (`error`: storage or writer failure, `outbox_full`:
/// RESOURCE_EXHAUSTED; invalid arguments are not counted).
pub static ADVANCE_OUTCOMES: Counters<7> = Counters::new(
    "ordered_events_producer_advance",
    "Advance calls answered, by outcome.",
    "outcome",
    ["committed", "existing", "conflict", "stale", "invalid_transition", "outbox_full", "error"],
);

/// Index of `error` in [`ADVANCE_OUTCOMES`].
pub const ADVANCE_ERROR: usize = 6;

/// Time from a validated `Advance` call to its answer (queueing, the batch's commit).
pub static ADVANCE_LATENCY: Histogram = Histogram::seconds(
    "ordered_events_producer_advance_duration_seconds",
    "Time from a valid Advance call to its answer, commit included.",
    None,
);

static FAMILIES: [&dyn Expose; 4] =
    [&ADVANCE_OUTCOMES, &ADVANCE_LATENCY, &crate::compaction::METRICS, &runtime::batches::FAMILIES];

/// What `/metrics` serves for a producer on `store` whose outbox cap is `cap` (`None`: no cap).
pub fn exposition(store: &ProducerStore, cap: Option<u64>) -> Exposition {
    Exposition::new(&FAMILIES, Some(outbox_gauges(store, cap)))
}

/// Reads the outbox gauges of `store` per scrape, and its pool's on PostgreSQL.
pub fn outbox_gauges(store: &ProducerStore, cap: Option<u64>) -> runtime::metrics::GaugeReader {
    let backlog = store.backlog_gauges(move |backlog| backlog_gauges(backlog, cap));
    let pool = store.clone();
    std::sync::Arc::new(move || {
        // The pool first: the scrape's own connection is not yet taken.
        let pool = pool.pool_status();
        let mut gauges = backlog()?;
        if let Some(pool) = pool {
            gauges.extend(pool.gauges("producer"));
        }
        Ok(gauges)
    })
}

fn backlog_gauges(backlog: Backlog, cap: Option<u64>) -> Vec<GaugeSample> {
    let Backlog { unaccepted, oldest_committed_at_us } = backlog;
    let age = oldest_committed_at_us.map_or(0.0, |at| ((runtime::now_us() - at).max(0) as f64) / 1e6);
    let mut gauges = vec![
        gauge(
            "ordered_events_producer_outbox_unaccepted",
            "Outbox rows committed and not yet accepted by a consumer.",
            unaccepted as f64,
        ),
        gauge(
            "ordered_events_producer_outbox_oldest_unaccepted_age_seconds",
            "Age of the oldest unaccepted outbox row (0 when none): how far behind the relay is.",
            age,
        ),
    ];
    if let Some(cap) = cap {
        gauges.push(gauge(
            "ordered_events_producer_outbox_cap",
            "The outbox cap (--max-unaccepted); absent when uncapped.",
            cap as f64,
        ));
        gauges.push(gauge(
            "ordered_events_producer_outbox_fill_ratio",
            "Unaccepted rows over the outbox cap (1 = new steps refused).",
            unaccepted as f64 / cap.max(1) as f64,
        ));
    }
    gauges
}

fn gauge(name: &'static str, help: &'static str, value: f64) -> GaugeSample {
    GaugeSample { name, help, labels: Vec::new(), value }
}
