//! Retention on the consumer (issue 16): the background pass that reduces applied inbox rows
//! older than `--retention` to tombstones (event id, flow id, seq, kind, schema and the
//! SHA-256 digest of the body), and `--compact-once`. Only applied rows are ever compacted,
//! so Apply, ApplyAll, auto-apply and ListStuck never meet a tombstone; a failing pass is
//! logged and the loop goes on, never stopping the server.

use proto::crash::CrashSwitch;
use runtime::retention::Retention;

use crate::store::{CompactReport, ConsumerStore, Result};

/// One pass over `store` with `retention` (nothing to do when it is `off`), logged: info
/// when it compacted anything, debug when there was nothing to do. The caller logs a failure.
pub async fn compact_once(
    store: &ConsumerStore,
    retention: Retention,
    crash: CrashSwitch,
    keep_free_pages: u64,
) -> Result<CompactReport> {
    let Some(cutoff_us) = retention.cutoff_us(runtime::now_us()) else { return Ok(CompactReport::default()) };
    let started = std::time::Instant::now();
    let report = store.compact(cutoff_us, crash, keep_free_pages).await?;
    crate::metrics::COMPACTED.add(0, report.compacted);
    crate::metrics::COMPACTED_BYTES.add(0, report.body_bytes);
    if report.compacted > 0 || report.pages_freed > 0 {
        tracing::info!(
            retention = %retention,
            rows = report.compacted,
            body_bytes = report.body_bytes,
            batches = report.batches,
            pages_freed = report.pages_freed,
            size_before = report.size_before,
            size_after = report.size_after,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "compacted applied inbox rows to tombstones"
        );
    } else {
        tracing::debug!(retention = %retention, "compaction: nothing to compact");
    }
    Ok(report)
}

/// Starts the background compaction loop: a pass every `retention.pass_interval()` (none
/// when `off`). Each pass runs in transactions of at most `COMPACT_BATCH` rows; a failed pass
/// is logged (warn) and the next one runs at its time.
pub fn spawn(store: ConsumerStore, retention: Retention, crash: CrashSwitch) {
    let Some(every) = retention.pass_interval() else {
        tracing::info!("retention off: inbox bodies are kept for ever");
        return;
    };
    tracing::info!(
        retention = %retention,
        pass_every_s = every.as_secs(),
        "compaction of applied inbox rows older than the retention"
    );
    tokio::spawn(async move {
        // The first pass at once, so a restarted server catches up before anything else
        // (a consumer restarted often, as under chaos, would otherwise never compact).
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = compact_once(&store, retention, crash, runtime::retention::KEEP_FREE_PAGES).await
            {
                tracing::warn!(error = %e, "compaction pass failed; nothing is lost, the next pass tries again");
            }
        }
    });
}
