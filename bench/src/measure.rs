//! What the run's own tables say, read from the database files after the run (read-only,
//! one short statement at a time): each stage's rate from its timestamps
//! (`outbox.committed_at_us`, `inbox.received_at_us`, `outbox.accepted_at_us`,
//! `effect.applied_at_us`), commit→applied latency per event, the journal mode stored in each
//! file, and a check that every flow ended released with exactly three effects. Like the
//! test harness, it reads the files with its own queries, independently of the services'
//! store modules (which own every write), and only on blocking threads.

use std::path::Path;
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};
use serde::Serialize;

fn open_ro(path: &Path) -> anyhow::Result<Connection> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    Ok(conn)
}

/// The statement counting consumer.db's effects without a scan. Since schema 10 the store
/// keeps the count in `backlog.effects`; in schemas 8 and 9 the apply-order keys of
/// `effect_log` were its dense ids (effects are never deleted or compacted), so the highest
/// one counts them (`effect` is a view that joins the inbox, whose max would walk every
/// effect); an older build's file (`--bin-dir`) has the table `effect`, whose rowid is dense.
pub fn effects_count_sql(consumer: &Connection) -> anyhow::Result<&'static str> {
    let has = |sql: &str| -> anyhow::Result<bool> { Ok(consumer.query_row(sql, [], |r| r.get(0))?) };
    Ok(if has("SELECT count(*) > 0 FROM pragma_table_info('backlog') WHERE name = 'effects'")? {
        "SELECT effects FROM backlog WHERE id = 1"
    } else if has("SELECT count(*) > 0 FROM sqlite_schema WHERE type = 'table' AND name = 'effect_log'")? {
        "SELECT coalesce(max(id), 0) FROM effect_log"
    } else {
        "SELECT coalesce(max(rowid), 0) FROM effect"
    })
}

/// Waits until `events` effects exist and no outbox row is unaccepted: the last event is
/// applied and the relay recorded every answer. Polls short reads with a deadline.
pub fn wait_until_applied(
    producer_db: &Path,
    consumer_db: &Path,
    events: u64,
    deadline: Duration,
) -> anyhow::Result<()> {
    let consumer = open_ro(consumer_db)?;
    let producer = open_ro(producer_db)?;
    let until = Instant::now() + deadline;
    let mut pause = Duration::from_millis(1);
    // The consumer created its tables when it opened the file, before it printed its address.
    let count_effects = effects_count_sql(&consumer)?;
    loop {
        let applied: u64 = consumer.query_row(count_effects, [], |r| r.get(0))?;
        // Counting the unaccepted rows costs more; it only matters once everything is applied.
        let unaccepted: Option<u64> = if applied >= events {
            Some(producer.query_row("SELECT count(*) FROM outbox WHERE accepted = 0", [], |r| r.get(0))?)
        } else {
            None
        };
        if unaccepted == Some(0) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < until,
            "the pipeline did not finish within {deadline:?}: {applied} of {events} applied, {unaccepted:?} outbox rows unaccepted"
        );
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// A stage's count and the span of its timestamps.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stage {
    pub events: u64,
    pub first_us: i64,
    pub last_us: i64,
    /// events / (last − first).
    pub events_per_s: f64,
}

/// Latency distribution, milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Percentiles {
    pub samples: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Percentiles of `values_us` (sorted here).
pub fn percentiles(mut values_us: Vec<i64>) -> Percentiles {
    values_us.sort_unstable();
    let at = |q: f64| -> f64 {
        if values_us.is_empty() {
            return 0.0;
        }
        let i = ((values_us.len() as f64 * q).ceil() as usize).clamp(1, values_us.len()) - 1;
        values_us[i] as f64 / 1e3
    };
    Percentiles {
        samples: values_us.len(),
        p50_ms: at(0.50),
        p90_ms: at(0.90),
        p99_ms: at(0.99),
        max_ms: at(1.0),
    }
}

/// What the tables of one run say.
#[derive(Debug, Serialize)]
pub struct Tables {
    /// producer.db `outbox.committed_at_us`.
    pub committed: Stage,
    /// consumer.db `inbox.received_at_us` (accepted at the consumer).
    pub received: Stage,
    /// producer.db `outbox.accepted_at_us` (the relay recorded the answer).
    pub marked_accepted: Stage,
    /// consumer.db `effect.applied_at_us` (every build's consumer.db has the `effect` table
    /// or view with each applied event's time).
    pub applied: Stage,
    /// Per event: `effect.applied_at_us − outbox.committed_at_us`.
    pub commit_to_applied: Percentiles,
    /// Per event: `inbox.received_at_us − outbox.committed_at_us`.
    pub commit_to_received: Percentiles,
    pub verified: Verified,
}

/// The end state the run must reach, read back.
#[derive(Debug, Serialize)]
pub struct Verified {
    pub flows_released: u64,
    pub effects: u64,
    pub inbox_unapplied: u64,
    pub outbox_unaccepted: u64,
    /// Every flow released with exactly its three effects, nothing left unapplied or
    /// unaccepted.
    pub ok: bool,
}

fn stage(conn: &Connection, table: &str, column: &str) -> anyhow::Result<Stage> {
    let (events, first_us, last_us): (u64, Option<i64>, Option<i64>) = conn.query_row(
        &format!("SELECT count({column}), min({column}), max({column}) FROM {table}"),
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    let (first_us, last_us) = (first_us.unwrap_or(0), last_us.unwrap_or(0));
    let span = (last_us - first_us).max(1) as f64 / 1e6;
    Ok(Stage { events, first_us, last_us, events_per_s: events as f64 / span })
}

/// Reads stages, latencies and the end state of one run.
pub fn read_tables(producer_db: &Path, consumer_db: &Path, flows: u64) -> anyhow::Result<Tables> {
    let consumer = open_ro(consumer_db)?;
    let producer = open_ro(producer_db)?;
    consumer.execute("ATTACH DATABASE ?1 AS p", [producer_db.display().to_string()])?;
    let deltas = |expr: &str| -> anyhow::Result<Vec<i64>> {
        let mut stmt = consumer.prepare(&format!(
            "SELECT {expr} FROM effect e JOIN inbox i ON i.event_id = e.event_id
             JOIN p.outbox o ON o.event_id = e.event_id"
        ))?;
        let rows = stmt.query_map([], |r| r.get::<_, i64>(0))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    };
    let commit_to_applied = percentiles(deltas("e.applied_at_us - o.committed_at_us")?);
    let commit_to_received = percentiles(deltas("i.received_at_us - o.committed_at_us")?);
    let one =
        |conn: &Connection, sql: &str| -> anyhow::Result<u64> { Ok(conn.query_row(sql, [], |r| r.get(0))?) };
    let flows_released =
        one(&consumer, "SELECT count(*) FROM projection WHERE state = 'released' AND last_seq = 3")?;
    let effects = one(&consumer, "SELECT count(*) FROM effect")?;
    let inbox_unapplied = one(&consumer, "SELECT count(*) FROM inbox WHERE state <> 'applied'")?;
    let outbox_unaccepted = one(&producer, "SELECT count(*) FROM outbox WHERE accepted = 0")?;
    let per_flow_ok = one(
        &consumer,
        "SELECT count(*) FROM (
             SELECT flow_id, group_concat(kind, ',') AS kinds, count(*) AS n
             FROM (SELECT flow_id, kind FROM effect ORDER BY flow_id, seq) GROUP BY flow_id)
         WHERE n = 3 AND kinds = 'reserved,confirmed,released'",
    )?;
    Ok(Tables {
        committed: stage(&producer, "outbox", "committed_at_us")?,
        received: stage(&consumer, "inbox", "received_at_us")?,
        marked_accepted: stage(&producer, "outbox", "accepted_at_us")?,
        applied: stage(&consumer, "effect", "applied_at_us")?,
        commit_to_applied,
        commit_to_received,
        verified: Verified {
            ok: flows_released == flows
                && per_flow_ok == flows
                && effects == flows * 3
                && inbox_unapplied == 0
                && outbox_unaccepted == 0,
            flows_released,
            effects,
            inbox_unapplied,
            outbox_unaccepted,
        },
    })
}

/// The journal mode stored in the file itself: byte 18 of the header is 2 for WAL (1 for a
/// rollback journal), and a fresh connection's `PRAGMA journal_mode` agrees.
pub fn journal_mode_in_file(path: &Path) -> anyhow::Result<(u8, String)> {
    use std::io::Read as _;
    let mut header = [0u8; 100];
    std::fs::File::open(path)?.read_exact(&mut header)?;
    let conn = open_ro(path)?;
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    Ok((header[18], mode))
}
