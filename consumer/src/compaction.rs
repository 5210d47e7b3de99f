//! Retention on the consumer: the pass that reduces applied inbox rows older than
//! `--retention` to tombstones (event id, flow id, seq, kind, schema and the SHA-256 digest of
//! the body; through [`ConsumerStore::compact`], bounded batches), and the background loop
//! that runs it. Only applied rows are ever compacted, so Apply, ApplyAll, auto-apply and
//! ListStuck never meet a tombstone. The loop, the log line, the `--compact-once` line and the
//! metrics are the producer's too ([`runtime::retention`]).

use proto::crash::CrashSwitch;
use runtime::retention::{CompactReport, CompactionMetrics, KEEP_FREE_PAGES, Retention};

use crate::store::{ConsumerStore, Result};

/// The table this service compacts, as logged and labelled.
const TABLE: &str = "inbox";

/// `ordered_events_consumer_compacted_rows_total`, `…_compacted_body_bytes_total` and
/// `…_compaction_failures_total`, labelled `table="inbox"`. Each row is counted by the one
/// pass (of one instance) that compacted it.
pub static METRICS: CompactionMetrics = CompactionMetrics::new(
    [
        "ordered_events_consumer_compacted_rows",
        "ordered_events_consumer_compacted_body_bytes",
        "ordered_events_consumer_compaction_failures",
    ],
    TABLE,
);

/// One full pass at `retention`, counted and logged (`None` when it is `off`), leaving
/// `keep_free_pages` free pages in a SQLite file for new rows (0 gives every free page back).
pub async fn pass(
    store: &ConsumerStore,
    retention: Retention,
    crash: CrashSwitch,
    keep_free_pages: u64,
) -> Result<Option<CompactReport>> {
    runtime::retention::run_pass(TABLE, retention, &METRICS, |cutoff_us| {
        store.compact(cutoff_us, crash, keep_free_pages)
    })
    .await
}

/// Starts the background loop (nothing when `retention` is `off`; see
/// [`runtime::retention::spawn_passes`]).
pub fn spawn(store: ConsumerStore, retention: Retention, crash: CrashSwitch) {
    runtime::retention::spawn_passes(TABLE, retention, &METRICS, move |cutoff_us| {
        let store = store.clone();
        async move { store.compact(cutoff_us, crash, KEEP_FREE_PAGES).await }
    });
}
