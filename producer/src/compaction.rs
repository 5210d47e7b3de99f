//! Retention on the producer: the pass that reduces accepted outbox rows older than the
//! retention to tombstones (through [`ProducerStore::compact`], bounded batches), and the
//! background loop that runs it every [`Retention::pass_interval`]. A failing pass is logged
//! and the loop goes on: compaction never stops the server and never loses a row.

use std::time::Duration;

use runtime::retention::{COMPACT_BATCH, Retention};

use crate::store::{CompactReport, ProducerStore, StoreError};

/// One full pass at `retention` (`None` when it is `off`: nothing is compacted), leaving
/// `keep_free_pages` free pages in a SQLite file for new rows (see
/// [`runtime::retention::KEEP_FREE_PAGES`]; 0 gives every free page back).
pub async fn pass(
    store: &ProducerStore,
    retention: Retention,
    keep_free_pages: u64,
) -> Result<Option<CompactReport>, StoreError> {
    let Some(cutoff_us) = retention.cutoff_us(runtime::now_us()) else { return Ok(None) };
    store.compact(cutoff_us, COMPACT_BATCH, keep_free_pages).await.map(Some)
}

/// Logs a pass: info when it compacted anything (rows, body bytes, and on SQLite the pages
/// given back and the file size), debug when there was nothing to do.
pub fn log_pass(report: &CompactReport, took: Duration) {
    if report.compacted == 0 && report.pages_freed.unwrap_or(0) == 0 {
        tracing::debug!(ms = took.as_millis() as u64, "compaction pass: nothing to compact");
        return;
    }
    tracing::info!(
        rows = report.compacted,
        body_bytes = report.body_bytes,
        batches = report.batches,
        pages_freed = ?report.pages_freed,
        file_bytes_before = ?report.file_bytes_before,
        file_bytes_after = ?report.file_bytes_after,
        ms = took.as_millis() as u64,
        "compaction pass: outbox rows compacted to tombstones, space given back"
    );
}

/// Starts the background loop (nothing when `retention` is `off`): a pass at once, then one
/// every [`Retention::pass_interval`] after the previous one ended.
pub fn spawn(store: ProducerStore, retention: Retention) -> Option<tokio::task::JoinHandle<()>> {
    let interval = retention.pass_interval()?;
    tracing::info!(%retention, interval_ms = interval.as_millis() as u64, "outbox compaction");
    Some(tokio::spawn(async move {
        loop {
            let started = std::time::Instant::now();
            match pass(&store, retention, runtime::retention::KEEP_FREE_PAGES).await {
                Ok(Some(report)) => log_pass(&report, started.elapsed()),
                Ok(None) => return,
                Err(e) => tracing::warn!(error = %e, "compaction pass failed; the next pass tries again"),
            }
            tokio::time::sleep(interval).await;
        }
    }))
}
