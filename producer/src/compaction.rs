//! Retention on the producer: the pass that reduces accepted outbox rows older than the
//! retention to tombstones (through [`ProducerStore::compact`], bounded batches), and the
//! background loop that runs it. The loop, the log line, the `--compact-once` line and the
//! metrics are the consumer's too ([`runtime::retention`]).

use runtime::retention::{COMPACT_BATCH, CompactReport, CompactionMetrics, KEEP_FREE_PAGES, Retention};

use crate::store::{ProducerStore, StoreError};

/// The table this service compacts, as logged and labelled.
const TABLE: &str = "outbox";

/// `ordered_events_producer_compacted_rows_total`, `…_compacted_body_bytes_total` and
/// `…_compaction_failures_total`, labelled `table="outbox"`. Each row is counted by the one
/// pass (of one instance) that compacted it.
pub static METRICS: CompactionMetrics = CompactionMetrics::new(
    [
        "ordered_events_producer_compacted_rows",
        "ordered_events_producer_compacted_body_bytes",
        "ordered_events_producer_compaction_failures",
    ],
    TABLE,
);

/// One full pass at `retention`, counted and logged (`None` when it is `off`: nothing is
/// compacted), leaving `keep_free_pages` free pages in a SQLite file for new rows (see
/// [`KEEP_FREE_PAGES`]; 0 gives every free page back).
pub async fn pass(
    store: &ProducerStore,
    retention: Retention,
    keep_free_pages: u64,
) -> Result<Option<CompactReport>, StoreError> {
    runtime::retention::run_pass(TABLE, retention, &METRICS, |cutoff_us| {
        store.compact(cutoff_us, COMPACT_BATCH, keep_free_pages, false)
    })
    .await
}

/// Starts the background loop (nothing when `retention` is `off`; see
/// [`runtime::retention::spawn_passes`]). At retention 0 on PostgreSQL each pass also asks
/// the relays to compact rows as they record their acceptance (one row version per row
/// instead of two); the passes then only report them and compact what older relays left.
pub fn spawn(store: ProducerStore, retention: Retention) -> Option<tokio::task::JoinHandle<()>> {
    let on_accept = retention.age_us() == Some(0);
    runtime::retention::spawn_passes(TABLE, retention, &METRICS, move |cutoff_us| {
        let store = store.clone();
        async move { store.compact(cutoff_us, COMPACT_BATCH, KEEP_FREE_PAGES, on_accept).await }
    })
}
