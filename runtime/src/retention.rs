//! Retention: how long a finished row (an accepted outbox row, an applied inbox row) keeps
//! its body before compaction reduces it to a tombstone (event id, flow id, seq and the
//! SHA-256 digest of the canonical body), and the loop that compacts in bounded batches.
//!
//! Both services take `--retention DURATION` (`ORDERED_EVENTS_RETENTION`): `7d`, `12h`,
//! `30m`, `45s`, `0` (compact as soon as a row is finished) or `off` (keep every body).

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use prometheus_client::encoding::DescriptorEncoder;

use crate::metrics::{Counters, Expose};

/// The SHA-256 digest of a canonical body: what a tombstone keeps to tell a redelivered
/// event (same digest: `DUPLICATE`/`EXISTING`) from a changed one (`ID_CONFLICT`/`CONFLICT`).
pub fn body_digest(body: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(body).into()
}

/// How long a finished row keeps its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retention {
    /// Never compact: every body is kept, as before retention existed.
    Off,
    /// Compact a row once it has been finished for at least this long (zero: at once).
    After(Duration),
}

/// The default: a week, long enough to inspect any recent event with `GetFlow`, short
/// enough that a busy database stops growing by its bodies.
pub const DEFAULT_RETENTION: Retention = Retention::After(Duration::from_secs(7 * 24 * 3600));

/// The longest retention accepted: 100 years (beyond it, say `off`).
const MAX_SECS: u64 = 100 * 365 * 24 * 3600;

/// Free pages a background pass leaves in a SQLite file for new rows instead of giving them
/// back (16 MiB of 4 KiB pages): at a steady load the next rows fill them anyway, and giving
/// pages back only to grow the file again moves pages and holds the write lock for nothing
/// (measured: at retention 0 it tripled the p99 commit→applied latency). `--compact-once`
/// gives back every free page.
pub const KEEP_FREE_PAGES: u64 = 4096;

/// Pages one `PRAGMA incremental_vacuum` transaction gives back at most (1 MiB of 4 KiB
/// pages), so a writer waits for one short step, not for the whole give-back.
pub const VACUUM_STEP_PAGES: u64 = 256;

/// The pages to give back in the next step: the free pages beyond `keep`, at most one step
/// (0: stop).
pub fn vacuum_step(free_pages: u64, keep: u64) -> u64 {
    free_pages.saturating_sub(keep).min(VACUUM_STEP_PAGES)
}

/// The most rows one compaction transaction rewrites, so a pass never holds the write lock
/// for long: the pipeline's writers wait at most one batch (see [`COMPACT_PAUSE`]).
pub const COMPACT_BATCH: usize = 500;

/// Rows one SQLite compaction transaction looks at, at most: rows not finished yet (not
/// accepted, not applied, or finished after the cutoff) are passed over, so however many of
/// them wait, a transaction that holds the write lock stays short.
pub const COMPACT_EXAMINE: usize = 4 * COMPACT_BATCH;

/// A row one SQLite compaction transaction examined, in the order of the table that holds
/// the bodies.
pub enum Examined {
    /// Not finished at the cutoff: passed over.
    Unfinished,
    /// Finished, with its body's digest and length: compacted by this transaction.
    Compact([u8; 32], u64),
    /// Finished, beyond what one transaction compacts: left to the next one.
    NextBatch,
}

impl Examined {
    /// What a compaction transaction does with `row` of its walk: column `finished` says
    /// whether the row is finished at the cutoff, column `body` holds its body (read, and
    /// digested where SQLite holds it, only when the row is compacted); `to_compact` counts
    /// the rows the transaction compacts, at most `batch`.
    pub fn of(
        row: &rusqlite::Row<'_>,
        finished: usize,
        body: usize,
        to_compact: &mut usize,
        batch: usize,
    ) -> rusqlite::Result<Examined> {
        Ok(if !row.get::<_, bool>(finished)? {
            Examined::Unfinished
        } else if *to_compact == batch {
            Examined::NextBatch
        } else {
            *to_compact += 1;
            let body = row.get_ref(body)?.as_bytes()?;
            Examined::Compact(body_digest(body), body.len() as u64)
        })
    }
}

/// How long a SQLite compaction pass rests after each transaction (and each give-back step)
/// before it takes the write lock again. Without it the next batch could take the lock back
/// at once (the consumer's writer waits for the same connection's mutex, which a thread that
/// has just let go of it can take again before the waiter runs; the producer's writer and the
/// relay poll the lock every 50 µs at first), so a pass could hold the pipeline for all its
/// batches: at retention 0 and full load the p99 commit→applied latency was 62–78 ms, with
/// the pause 25–32 (`bench --flows 333334 --retention 0`, README). A waiting writer takes the
/// lock within the pause, and the next batch waits for it.
pub const COMPACT_PAUSE: Duration = Duration::from_millis(1);

impl Retention {
    /// The age a finished row must exceed, in microseconds, or `None` when off.
    pub fn age_us(self) -> Option<i64> {
        match self {
            Retention::Off => None,
            Retention::After(d) => Some(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
        }
    }

    /// Rows finished before this time (microseconds since the epoch) may be compacted now.
    pub fn cutoff_us(self, now_us: i64) -> Option<i64> {
        self.age_us().map(|age| now_us.saturating_sub(age))
    }

    /// How often the background loop looks for rows to compact: a tenth of the retention,
    /// between one second and one hour (so `0` compacts within about a second).
    pub fn pass_interval(self) -> Option<Duration> {
        match self {
            Retention::Off => None,
            Retention::After(d) => Some((d / 10).clamp(Duration::from_secs(1), Duration::from_secs(3600))),
        }
    }
}

/// A retention that could not be read: says what was given and what is accepted.
#[derive(Debug, thiserror::Error)]
#[error(
    "retention {given:?} is not a duration: give a whole number with a unit d, h, m or s \
     (e.g. 7d, 12h), 0 to compact rows as soon as they are finished, or off to keep every body \
     (at most 100 years)"
)]
pub struct BadRetention {
    given: String,
}

impl FromStr for Retention {
    type Err = BadRetention;
    fn from_str(s: &str) -> Result<Retention, BadRetention> {
        let bad = || BadRetention { given: s.to_owned() };
        let t = s.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(Retention::Off);
        }
        if t == "0" {
            return Ok(Retention::After(Duration::ZERO));
        }
        let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (number, unit) = t.split_at(split);
        let n: u64 = number.parse().map_err(|_| bad())?;
        let unit_secs = match unit {
            "d" => 24 * 3600,
            "h" => 3600,
            "m" => 60,
            "s" => 1,
            _ => return Err(bad()),
        };
        let secs = n.checked_mul(unit_secs).filter(|&s| s <= MAX_SECS).ok_or_else(bad)?;
        Ok(Retention::After(Duration::from_secs(secs)))
    }
}

impl fmt::Display for Retention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Retention::Off => f.write_str("off"),
            Retention::After(d) => {
                let s = d.as_secs();
                match s {
                    0 => f.write_str("0"),
                    s if s % 86_400 == 0 => write!(f, "{}d", s / 86_400),
                    s if s % 3600 == 0 => write!(f, "{}h", s / 3600),
                    s if s % 60 == 0 => write!(f, "{}m", s / 60),
                    s => write!(f, "{s}s"),
                }
            }
        }
    }
}

/// The flag both services take.
#[derive(Clone, Debug, clap::Args)]
pub struct RetentionFlags {
    /// How long a finished row (an accepted outbox row on the producer, an applied inbox row
    /// on the consumer) keeps its body before it is compacted to a tombstone: event id, flow
    /// id, seq and the SHA-256 digest of its canonical body, which keep every duplicate and
    /// conflict answer exact for ever. A whole number with d, h, m or s (7d, 12h, 30m), 0 to
    /// compact as soon as a row is finished (on PostgreSQL by the very statement that finishes
    /// it: the relay's mark, the Apply), or off to keep every body. Effects, projections and
    /// flow states are never compacted.
    #[arg(long, env = "ORDERED_EVENTS_RETENTION", value_name = "DURATION", default_value_t = DEFAULT_RETENTION)]
    pub retention: Retention,
}

/// What one compaction pass did, on either service and backend: the pass's log line, the
/// `--compact-once` JSON line and the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompactReport {
    /// Finished rows reduced to tombstones.
    pub compacted: u64,
    /// Of `compacted`, the rows that lost their body in the transaction that finished them
    /// (PostgreSQL at retention 0: a relay's mark, an Apply), reported by this pass.
    pub when_finished: u64,
    /// Bytes of canonical bodies dropped.
    pub body_bytes: u64,
    /// Transactions that compacted rows (each at most [`COMPACT_BATCH`] rows).
    pub batches: u64,
    /// SQLite: pages given back to the file system by `incremental_vacuum` (0 on a file
    /// created before retention, whose freed pages are only reused). `None` on PostgreSQL.
    pub pages_freed: Option<u64>,
    /// SQLite: the database's size in bytes (page count × page size: the file's size once
    /// the WAL is checkpointed) before the pass.
    pub file_bytes_before: Option<u64>,
    /// SQLite: the same after the pass.
    pub file_bytes_after: Option<u64>,
}

impl CompactReport {
    /// True when the pass changed anything (rows compacted or pages given back).
    pub fn did_something(&self) -> bool {
        self.compacted > 0 || self.pages_freed.unwrap_or(0) > 0
    }

    /// The one JSON line `--compact-once` prints: `compacted`, `body_bytes`, `batches`,
    /// `retention`, and on SQLite `pages_freed`, `file_bytes_before`, `file_bytes_after`.
    pub fn json_line(&self, retention: Retention) -> String {
        let mut line = format!(
            r#"{{"compacted":{},"body_bytes":{},"batches":{},"retention":"{retention}""#,
            self.compacted, self.body_bytes, self.batches
        );
        for (name, value) in [
            ("pages_freed", self.pages_freed),
            ("file_bytes_before", self.file_bytes_before),
            ("file_bytes_after", self.file_bytes_after),
        ] {
            if let Some(value) = value {
                line.push_str(&format!(r#","{name}":{value}"#));
            }
        }
        line.push('}');
        line
    }

    /// Logs the pass: info when it did something (rows, body bytes, and on SQLite the pages
    /// given back and the database size), debug when there was nothing to do.
    pub fn log(&self, table: &'static str, retention: Retention, took: Duration) {
        let ms = took.as_millis() as u64;
        if !self.did_something() {
            tracing::debug!(table = %table, %retention, ms, "compaction pass: nothing to compact");
            return;
        }
        tracing::info!(
            table = %table,
            %retention,
            rows = self.compacted,
            when_finished = self.when_finished,
            body_bytes = self.body_bytes,
            batches = self.batches,
            pages_freed = ?self.pages_freed,
            file_bytes_before = ?self.file_bytes_before,
            file_bytes_after = ?self.file_bytes_after,
            ms,
            "compaction pass: finished rows compacted to tombstones"
        );
    }
}

/// A service's compaction counters on `/metrics`, labelled `table` (the one table it
/// compacts): rows compacted, body bytes dropped, and passes that failed.
pub struct CompactionMetrics {
    rows: Counters<1>,
    body_bytes: Counters<1>,
    failures: Counters<1>,
}

impl CompactionMetrics {
    /// The families `<prefix>_compacted_rows_total`, `<prefix>_compacted_body_bytes_total`
    /// and `<prefix>_compaction_failures_total`, each with `table="<table>"`.
    pub const fn new(names: [&'static str; 3], table: &'static str) -> CompactionMetrics {
        CompactionMetrics {
            rows: Counters::new(
                names[0],
                "Finished rows compacted to tombstones (body dropped, digest kept) by this process.",
                "table",
                [table],
            ),
            body_bytes: Counters::new(
                names[1],
                "Bytes of canonical bodies dropped by compaction in this process.",
                "table",
                [table],
            ),
            failures: Counters::new(
                names[2],
                "Compaction passes of this process that failed (nothing is lost; the next pass tries again).",
                "table",
                [table],
            ),
        }
    }

    /// Counts a pass's rows and bytes.
    pub fn record(&self, report: &CompactReport) {
        self.rows.add(0, report.compacted);
        self.body_bytes.add(0, report.body_bytes);
    }

    /// Counts a failed pass.
    pub fn failed(&self) {
        self.failures.inc(0);
    }
}

impl Expose for CompactionMetrics {
    fn expose(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        self.rows.expose(encoder)?;
        self.body_bytes.expose(encoder)?;
        self.failures.expose(encoder)
    }

    fn family(&self) -> &'static str {
        self.rows.family()
    }
}

/// One pass at `retention` through `compact` (given the cutoff: rows finished before it are
/// compacted), counted in `metrics` and logged; `Ok(None)` when retention is `off`.
pub async fn run_pass<F, Fut, E>(
    table: &'static str,
    retention: Retention,
    metrics: &CompactionMetrics,
    compact: F,
) -> Result<Option<CompactReport>, E>
where
    F: FnOnce(i64) -> Fut,
    Fut: Future<Output = Result<CompactReport, E>>,
{
    let Some(cutoff_us) = retention.cutoff_us(crate::now_us()) else { return Ok(None) };
    let started = std::time::Instant::now();
    let report = compact(cutoff_us).await?;
    metrics.record(&report);
    report.log(table, retention, started.elapsed());
    Ok(Some(report))
}

/// Starts the background loop (nothing when `retention` is `off`): a pass at once (so a
/// restarted server catches up before anything else), then one every
/// [`Retention::pass_interval`] after the previous one ended. A failed pass is counted and
/// logged (warn) and the next one runs at its time: compaction never stops the server and
/// never loses a row.
pub fn spawn_passes<F, Fut, E>(
    table: &'static str,
    retention: Retention,
    metrics: &'static CompactionMetrics,
    mut compact: F,
) -> Option<tokio::task::JoinHandle<()>>
where
    F: FnMut(i64) -> Fut + Send + 'static,
    Fut: Future<Output = Result<CompactReport, E>> + Send,
    E: fmt::Display,
{
    let Some(interval) = retention.pass_interval() else {
        tracing::info!(table = %table, "retention off: bodies are kept for ever");
        return None;
    };
    tracing::info!(
        table = %table,
        %retention,
        interval_ms = interval.as_millis() as u64,
        "compaction of finished rows older than the retention"
    );
    Some(tokio::spawn(async move {
        loop {
            if let Err(e) = run_pass(table, retention, metrics, &mut compact).await {
                metrics.failed();
                tracing::warn!(table = %table, error = %e, "compaction pass failed; nothing is lost, the next pass tries again");
            }
            tokio::time::sleep(interval).await;
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_zero_and_off() {
        assert_eq!("7d".parse::<Retention>().unwrap(), Retention::After(Duration::from_secs(604_800)));
        assert_eq!("12h".parse::<Retention>().unwrap(), Retention::After(Duration::from_secs(43_200)));
        assert_eq!("30m".parse::<Retention>().unwrap(), Retention::After(Duration::from_secs(1_800)));
        assert_eq!("45s".parse::<Retention>().unwrap(), Retention::After(Duration::from_secs(45)));
        assert_eq!("0".parse::<Retention>().unwrap(), Retention::After(Duration::ZERO));
        assert_eq!("off".parse::<Retention>().unwrap(), Retention::Off);
        assert_eq!("OFF".parse::<Retention>().unwrap(), Retention::Off);
    }

    #[test]
    fn refuses_what_is_not_a_duration_and_names_it() {
        for bad in ["", "7", "d", "-1d", "1.5h", "7w", "7 d", "99999999999999999d", "101y", "36501d"] {
            let err = bad.parse::<Retention>().unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
    }

    #[test]
    fn displays_what_it_parses() {
        for s in ["7d", "12h", "30m", "45s", "0", "off", "90s"] {
            assert_eq!(s.parse::<Retention>().unwrap().to_string(), s);
        }
        assert_eq!(DEFAULT_RETENTION.to_string(), "7d");
    }

    #[test]
    fn digest_is_sha256() {
        let d = body_digest(b"abc");
        assert_eq!(d[..4], [0xba, 0x78, 0x16, 0xbf]);
        assert_ne!(body_digest(b"abd"), d);
    }

    #[test]
    fn vacuum_steps_keep_the_reserve() {
        assert_eq!(vacuum_step(100, 4096), 0);
        assert_eq!(vacuum_step(5000, 4096), 256);
        assert_eq!(vacuum_step(4200, 4096), 104);
        assert_eq!(vacuum_step(300, 0), 256);
        assert_eq!(vacuum_step(0, 0), 0);
    }

    #[test]
    fn cutoff_and_interval() {
        let r = Retention::After(Duration::from_secs(10));
        assert_eq!(r.cutoff_us(100_000_000), Some(90_000_000));
        assert_eq!(r.pass_interval(), Some(Duration::from_secs(1)));
        assert_eq!(Retention::Off.cutoff_us(5), None);
        assert_eq!(DEFAULT_RETENTION.pass_interval(), Some(Duration::from_secs(3600)));
        assert_eq!(Retention::After(Duration::ZERO).cutoff_us(7), Some(7));
    }

    #[test]
    fn the_compact_once_line_is_json_with_the_sqlite_fields_only_when_known() {
        let pg = CompactReport { compacted: 3, body_bytes: 120, batches: 1, ..CompactReport::default() };
        let line: serde_json::Value =
            serde_json::from_str(&pg.json_line(Retention::After(Duration::ZERO))).unwrap();
        assert_eq!(
            line,
            serde_json::json!({"compacted": 3, "body_bytes": 120, "batches": 1, "retention": "0"})
        );
        let sqlite = CompactReport {
            pages_freed: Some(0),
            file_bytes_before: Some(8192),
            file_bytes_after: Some(4096),
            ..pg
        };
        let line: serde_json::Value = serde_json::from_str(&sqlite.json_line(DEFAULT_RETENTION)).unwrap();
        assert_eq!(line["retention"], "7d");
        assert_eq!((line["pages_freed"].as_u64(), line["file_bytes_after"].as_u64()), (Some(0), Some(4096)));
        assert!(!pg.did_something() || pg.compacted > 0);
        assert!(!CompactReport::default().did_something());
    }
}
