//! The transaction sizes each writer actually had, counted in memory (a few atomic adds per
//! transaction, nothing per event) and logged once when the process stops. The work per
//! event depends on them, so a measurement (the benchmark's instruction count) reports them
//! beside its figure. It owns no data: losing the counts (a crash) loses nothing.
//! The same transactions feed the Prometheus histograms of sizes and durations per writer
//! ([`FAMILIES`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use crate::metrics::{Expose, Histogram};

const SIZES_NAME: &str = "ordered_events_transaction_items";
const SIZES_HELP: &str = "Items (calls, envelopes, steps, answers) per writer transaction.";
const DURATIONS_NAME: &str = "ordered_events_transaction_duration_seconds";
const DURATIONS_HELP: &str = "Time from BEGIN to the end of COMMIT of one writer transaction.";

/// The Prometheus families of every writer that recorded a transaction in this process:
/// transaction sizes and durations, labelled `writer`.
pub static FAMILIES: WriterFamilies = WriterFamilies;

/// See [`FAMILIES`].
pub struct WriterFamilies;

impl Expose for WriterFamilies {
    fn expose(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        // Read under the registration lock, per scrape only; the writers never take it
        // after their first transaction.
        let registered = REGISTERED.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if registered.is_empty() {
            return Ok(());
        }
        {
            let mut sizes = encoder.encode_descriptor(SIZES_NAME, SIZES_HELP, None, MetricType::Histogram)?;
            for writer in &registered {
                writer.sizes.expose_samples(&mut sizes)?;
            }
        }
        let mut durations =
            encoder.encode_descriptor(DURATIONS_NAME, DURATIONS_HELP, None, MetricType::Histogram)?;
        for writer in &registered {
            writer.durations.expose_samples(&mut durations)?;
        }
        Ok(())
    }

    fn family(&self) -> &'static str {
        SIZES_NAME
    }
}

/// Buckets of the histogram: 1, 2–3, 4–7, …, 2^(B−1) and more.
const BUCKETS: usize = 13;

/// Counts of one writer's transactions and the items (calls, envelopes, steps, answers) in
/// them. Declare one as a `static` and call [`BatchSizes::record`] once per transaction.
pub struct BatchSizes {
    writer: &'static str,
    registered: Once,
    transactions: AtomicU64,
    items: AtomicU64,
    max: AtomicU64,
    by_power_of_two: [AtomicU64; BUCKETS],
    sizes: Histogram,
    durations: Histogram,
}

static REGISTERED: Mutex<Vec<&'static BatchSizes>> = Mutex::new(Vec::new());

impl BatchSizes {
    /// A counter named `writer` in the shutdown line (e.g. `"advance"`).
    pub const fn new(writer: &'static str) -> BatchSizes {
        BatchSizes {
            writer,
            registered: Once::new(),
            transactions: AtomicU64::new(0),
            items: AtomicU64::new(0),
            max: AtomicU64::new(0),
            by_power_of_two: [const { AtomicU64::new(0) }; BUCKETS],
            sizes: Histogram::items(SIZES_NAME, SIZES_HELP, Some(("writer", writer))),
            durations: Histogram::seconds(DURATIONS_NAME, DURATIONS_HELP, Some(("writer", writer))),
        }
    }

    /// Counts one transaction of `items` items.
    pub fn record(&'static self, items: usize) {
        self.registered.call_once(|| REGISTERED.lock().unwrap_or_else(|p| p.into_inner()).push(self));
        let items = items as u64;
        self.transactions.fetch_add(1, Ordering::Relaxed);
        self.items.fetch_add(items, Ordering::Relaxed);
        self.max.fetch_max(items, Ordering::Relaxed);
        let bucket = (u64::BITS - items.max(1).leading_zeros() - 1) as usize;
        self.by_power_of_two[bucket.min(BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
        self.sizes.observe(items);
    }

    /// Counts one transaction of `items` items that began at `started` and has just ended
    /// (committed or not).
    pub fn record_timed(&'static self, items: usize, started: std::time::Instant) {
        self.record(items);
        self.durations.observe_since(started);
    }

    /// `1:5 2-3:7 4-7:0 …` up to the largest non-empty bucket.
    fn histogram(&self) -> String {
        let counts: Vec<u64> = self.by_power_of_two.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let last = counts.iter().rposition(|&c| c > 0).unwrap_or(0);
        let mut out = Vec::with_capacity(last + 1);
        for (i, count) in counts.iter().enumerate().take(last + 1) {
            let low = 1u64 << i;
            let label = match (i, i + 1 == BUCKETS) {
                (0, _) => "1".to_owned(),
                (_, true) => format!("{low}+"),
                _ => format!("{low}-{}", (low << 1) - 1),
            };
            out.push(format!("{label}:{count}"));
        }
        out.join(" ")
    }
}

/// Logs one `batch sizes` line per writer that recorded a transaction in this process:
/// `writer`, `transactions`, `items`, `mean`, `max` and `histogram` (transactions per size
/// range). Call it once, when the process stops.
pub fn log_all() {
    let registered = REGISTERED.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for sizes in registered {
        let transactions = sizes.transactions.load(Ordering::Relaxed);
        let items = sizes.items.load(Ordering::Relaxed);
        tracing::info!(
            writer = sizes.writer,
            transactions,
            items,
            mean = (items as f64 / transactions.max(1) as f64 * 100.0).round() / 100.0,
            max = sizes.max.load(Ordering::Relaxed),
            histogram = ?sizes.histogram(),
            "batch sizes"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_land_in_power_of_two_buckets() {
        static SIZES: BatchSizes = BatchSizes::new("test");
        for n in [1, 2, 3, 4, 7, 8, 256, 100_000] {
            SIZES.record(n);
        }
        assert_eq!(SIZES.transactions.load(Ordering::Relaxed), 8);
        assert_eq!(SIZES.items.load(Ordering::Relaxed), 1 + 2 + 3 + 4 + 7 + 8 + 256 + 100_000);
        assert_eq!(SIZES.max.load(Ordering::Relaxed), 100_000);
        assert_eq!(
            SIZES.histogram(),
            "1:1 2-3:2 4-7:2 8-15:1 16-31:0 32-63:0 64-127:0 128-255:0 256-511:1 512-1023:0 1024-2047:0 2048-4095:0 4096+:1"
        );
        assert!(REGISTERED.lock().unwrap().iter().any(|s| s.writer == "test"));
    }
}
