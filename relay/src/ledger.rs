//! The relay's side of producer.db, through `producer::store` only, on blocking threads:
//! short reads of unaccepted rows (no read transaction is held between polls) and one
//! `BEGIN IMMEDIATE` transaction per recorded answer.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use producer::store::{self, OutboxRecord};
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, DbError, OpenMode};
use rusqlite::Connection;

/// The relay's connection to producer.db.
#[derive(Clone)]
pub struct Ledger {
    conn: Arc<Mutex<Connection>>,
    crash: CrashSwitch,
}

impl Ledger {
    /// Opens an existing producer.db (the relay never creates one).
    pub fn open(path: &Path, crash: CrashSwitch) -> Result<Ledger, DbError> {
        let conn = store::open(path, OpenMode::Existing)?;
        Ok(Ledger { conn: Arc::new(Mutex::new(conn)), crash })
    }

    async fn blocking<T, F>(&self, f: F) -> rusqlite::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, CrashSwitch) -> rusqlite::Result<T> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        let crash = self.crash;
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut guard, crash)
        })
        .await
        .unwrap_or_else(|e| Err(rusqlite::Error::ToSqlConversionFailure(Box::new(e))))
    }

    /// Up to `limit` unaccepted rows after `cursor`, in `(flow_id, seq)` order.
    pub async fn unaccepted_after(
        &self,
        cursor: (String, u64),
        limit: usize,
    ) -> rusqlite::Result<Vec<OutboxRecord>> {
        self.blocking(move |conn, _| store::unaccepted_after(conn, (&cursor.0, cursor.1), limit)).await
    }

    /// The outbox row of `event_id`, accepted or not.
    pub async fn row(&self, event_id: String) -> rusqlite::Result<Option<OutboxRecord>> {
        self.blocking(move |conn, _| store::outbox_row(conn, &event_id)).await
    }

    /// Records the consumer's answer for one row in its own transaction; marks the row
    /// accepted when `accepted`. Crash points `relay.after_mark` (written, not committed)
    /// and `relay.after_mark_commit` sit on the marking path only.
    pub async fn record(
        &self,
        event_id: String,
        outcome: &'static str,
        accepted: bool,
    ) -> rusqlite::Result<()> {
        self.blocking(move |conn, crash| {
            let tx = db::begin_immediate(conn)?;
            store::record_delivery(&tx, &event_id, outcome, accepted, now_us())?;
            if accepted {
                crash.reach(CrashPoint::RelayAfterMark);
            }
            tx.commit()?;
            if accepted {
                crash.reach(CrashPoint::RelayAfterMarkCommit);
            }
            Ok(())
        })
        .await
    }
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}
