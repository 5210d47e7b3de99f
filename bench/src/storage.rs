//! Storage sizes during a run (`--soak`): each database's size on disk when the applied
//! count first reaches each mark, after the processes stopped, and after one
//! `--compact-once` pass of each service. SQLite: the file and its `-wal` beside it;
//! PostgreSQL: the total size (tables, indexes, TOAST) of each service's schema.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::pipeline::Databases;

const PRODUCER: &str = "ordered_events_producer";
const CONSUMER: &str = "ordered_events_consumer";

/// One reading of both databases.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Sizes {
    /// What the reading was taken at: "applied >= N", "stopped", "after compact-once".
    pub at: String,
    /// Applied events when read.
    pub applied: u64,
    /// Producer database bytes (SQLite: file + WAL).
    pub producer_bytes: u64,
    /// Consumer database bytes (SQLite: file + WAL).
    pub consumer_bytes: u64,
    /// Of those, the SQLite WAL files' bytes (0 on PostgreSQL).
    pub wal_bytes: u64,
}

impl Sizes {
    fn total(&self) -> u64 {
        self.producer_bytes + self.consumer_bytes
    }
}

fn file_len(path: &PathBuf) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

fn wal_of(path: &std::path::Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push("-wal");
    PathBuf::from(s)
}

/// Reads both databases' sizes and the applied count now.
pub fn read(databases: &Databases, at: &str) -> anyhow::Result<Sizes> {
    match databases {
        Databases::Files { producer, consumer } => {
            let (pw, cw) = (wal_of(producer), wal_of(consumer));
            let conn =
                rusqlite::Connection::open_with_flags(consumer, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
            conn.busy_timeout(Duration::from_secs(10))?;
            let applied: i64 = conn.query_row(crate::measure::effects_count_sql(&conn)?, [], |r| r.get(0))?;
            drop(conn);
            Ok(Sizes {
                at: at.to_owned(),
                applied: applied as u64,
                producer_bytes: file_len(producer) + file_len(&pw),
                consumer_bytes: file_len(consumer) + file_len(&cw),
                wal_bytes: file_len(&pw) + file_len(&cw),
            })
        }
        Databases::Postgres { url } => {
            let mut client = postgres::Client::connect(url, postgres::NoTls)?;
            let size = |client: &mut postgres::Client, schema: &str| -> anyhow::Result<u64> {
                let row = client.query_one(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint FROM pg_class c \
                     JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relkind = 'r'",
                    &[&schema],
                )?;
                Ok(row.get::<_, i64>(0) as u64)
            };
            let (effects, order) = crate::measure_pg::apply_order(&mut client)?;
            let applied: i64 = client
                .query_one(
                    &format!("SELECT coalesce(max({order}), 0)::bigint FROM {CONSUMER}.{effects}"),
                    &[],
                )?
                .get(0);
            Ok(Sizes {
                at: at.to_owned(),
                applied: applied as u64,
                producer_bytes: size(&mut client, PRODUCER)?,
                consumer_bytes: size(&mut client, CONSUMER)?,
                wal_bytes: 0,
            })
        }
    }
}

/// Polls the applied count on a blocking thread and reads the sizes the first time it
/// reaches each of `marks` (ascending), until every mark is read or `stop` is set.
pub fn sample_marks(
    databases: Databases,
    marks: Vec<u64>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Vec<Sizes>> {
    let mut out = Vec::new();
    let mut next = 0;
    while next < marks.len() {
        // One more reading after the stop: the last mark is usually reached just before it.
        let stopping = stop.load(Ordering::Relaxed);
        let now = read(&databases, "")?;
        while next < marks.len() && now.applied >= marks[next] {
            out.push(Sizes { at: format!("applied >= {}", marks[next]), ..now.clone() });
            next += 1;
        }
        if stopping {
            break;
        }
        // A reading takes a moment; at tens of thousands of events per second a tenth of a
        // second is a few thousand events past the mark, which the reading records.
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(out)
}

/// The storage section of a run's report: every reading, and the bytes each finished
/// event added between the first and the last mark (the growth rate, which the fixed costs
/// of a database do not blur) and overall.
pub fn report(readings: &[Sizes], events: u64) -> Value {
    let marks: Vec<&Sizes> = readings.iter().filter(|s| s.at.starts_with("applied")).collect();
    let growth = match (marks.first(), marks.last()) {
        (Some(a), Some(b)) if b.applied > a.applied => {
            Some(((b.total() as f64 - a.total() as f64) / (b.applied - a.applied) as f64).round())
        }
        _ => None,
    };
    let last = readings.last();
    json!({
        "readings": readings,
        "bytes_per_event_between_marks": growth,
        "bytes_per_event_at_end": last.map(|s| (s.total() as f64 / events.max(1) as f64).round()),
        "total_bytes_at_end": last.map(Sizes::total),
    })
}
