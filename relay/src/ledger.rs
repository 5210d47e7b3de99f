//! The relay's side of producer.db, through `producer::store` only, on blocking threads:
//! short reads of unaccepted rows (no read transaction is held between polls) and one
//! `BEGIN IMMEDIATE` transaction per run of recorded answers (group commit of the marks).

use std::path::Path;
use std::sync::{Arc, Mutex};

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
        let crash = self.crash;
        runtime::blocking::with_locked(&self.conn, move |conn| f(conn, crash))
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

    /// Records the consumer's answers for a run of rows in ONE transaction; marks a row
    /// accepted when its `accepted` is true. Crash points `relay.after_mark` (written, not
    /// committed) and `relay.after_mark_commit` sit on the marking path only: a run with no
    /// accepted answer reaches neither.
    pub async fn record(&self, answers: Vec<Recorded>) -> rusqlite::Result<()> {
        self.blocking(move |conn, crash| {
            let tx = db::begin_immediate(conn)?;
            let now = runtime::now_us();
            let mut marked = false;
            for answer in &answers {
                store::record_delivery(&tx, &answer.event_id, answer.outcome, answer.accepted, now)?;
                marked |= answer.accepted;
            }
            if marked {
                crash.reach(CrashPoint::RelayAfterMark);
            }
            tx.commit()?;
            tracing::debug!(answers = answers.len(), "answers recorded");
            if marked {
                crash.reach(CrashPoint::RelayAfterMarkCommit);
            }
            Ok(())
        })
        .await
    }
}

/// One answer to record on its outbox row.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub event_id: String,
    /// The answer's short word, e.g. `ACCEPTED`.
    pub outcome: &'static str,
    /// The consumer durably holds the event (`ACCEPTED` or `DUPLICATE`).
    pub accepted: bool,
}
