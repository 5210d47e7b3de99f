//! The producer's Prometheus metrics: `Advance` outcomes and latency (bumped on the call
//! path: one atomic add each), and, per scrape, the outbox backlog read from producer.db's
//! trigger-kept `backlog.unaccepted` counter plus one lookup for the oldest unaccepted row.
//! The scrape reads through its own read-only connection, so it never waits on the writer.

use std::path::PathBuf;

use runtime::metrics::{Counters, Expose, Exposition, GaugeSample, Histogram};
use rusqlite::Connection;

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

static FAMILIES: [&dyn Expose; 3] = [&ADVANCE_OUTCOMES, &ADVANCE_LATENCY, &runtime::batches::FAMILIES];

/// What `/metrics` serves for a producer on `db` whose outbox cap is `cap` (`None`: no cap).
pub fn exposition(db: PathBuf, cap: Option<u64>) -> Exposition {
    Exposition::new(&FAMILIES, Some(outbox_gauges(db, cap)))
}

/// Reads the outbox gauges of `db` per scrape (the relay serves them too: they are its lag).
pub fn outbox_gauges(db: PathBuf, cap: Option<u64>) -> runtime::metrics::GaugeReader {
    runtime::metrics::gauges_from_db(db, move |conn| backlog_gauges(conn, cap))
}

fn backlog_gauges(conn: &Connection, cap: Option<u64>) -> rusqlite::Result<Vec<GaugeSample>> {
    let tx = conn.unchecked_transaction()?;
    let unaccepted = crate::store::unaccepted_count(&tx)?;
    // The oldest unaccepted row is the one with the smallest rowid (rows are inserted in
    // commit order and never deleted): a scan of the partial index of unaccepted rows
    // (covering, no table reads), bounded by the unaccepted count, never the history.
    let oldest_us: Option<i64> = tx
        .prepare_cached(
            "SELECT committed_at_us FROM outbox WHERE rowid =
               (SELECT min(rowid) FROM outbox INDEXED BY outbox_unaccepted WHERE accepted = 0)",
        )?
        .query_row([], |r| r.get(0))
        .or_else(|e| if e == rusqlite::Error::QueryReturnedNoRows { Ok(None) } else { Err(e) })?;
    drop(tx);
    let age = oldest_us.map_or(0.0, |at| ((runtime::now_us() - at).max(0) as f64) / 1e6);
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
    Ok(gauges)
}

fn gauge(name: &'static str, help: &'static str, value: f64) -> GaugeSample {
    GaugeSample { name, help, labels: Vec::new(), value }
}
