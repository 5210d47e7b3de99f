//! The relay's side of producer.db, through `producer::store` only, on blocking threads:
//! short reads of unaccepted rows (no read transaction is held between polls) and one
//! `BEGIN IMMEDIATE` transaction per run of recorded answers (group commit of the marks).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use producer::store::{self, DeliveryAnswer, OutboxRecord};
use proto::batches::BatchSizes;
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
        let eff = db::effective(&conn).map_err(|source| DbError::Sqlite { path: path.to_owned(), source })?;
        tracing::info!(
            db = %path.display(),
            journal_mode = %eff.journal_mode,
            synchronous = %eff.synchronous,
            "producer database open"
        );
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

    /// Records the consumer's answers for a run of rows in ONE transaction (each counts one
    /// send); marks a row accepted when its answer holds the event. Crash points
    /// `relay.after_mark` (written, not committed) and `relay.after_mark_commit` sit on the
    /// marking path only: a run with no accepted answer reaches neither.
    pub async fn record(&self, answers: Vec<Recorded>) -> rusqlite::Result<()> {
        self.blocking(move |conn, crash| {
            let tx = db::begin_immediate(conn)?;
            let now = now_us();
            let mut marked = false;
            for answer in &answers {
                store::record_delivery(&tx, &answer.event_id, answer.answer, now)?;
                marked |= answer.answer.holds_event();
            }
            if marked {
                crash.reach(CrashPoint::RelayAfterMark);
            }
            tx.commit()?;
            MARK_BATCHES.record(answers.len());
            tracing::debug!(answers = answers.len(), "answers recorded");
            if marked {
                crash.reach(CrashPoint::RelayAfterMarkCommit);
            }
            Ok(())
        })
        .await
    }

    /// Counts one send of each of `event_ids` that got no answer, in ONE transaction: the
    /// rows stay unaccepted and are sent again.
    pub async fn record_unanswered(&self, event_ids: Vec<String>) -> rusqlite::Result<()> {
        if event_ids.is_empty() {
            return Ok(());
        }
        self.blocking(move |conn, _| {
            let tx = db::begin_immediate(conn)?;
            for id in &event_ids {
                store::record_unanswered_send(&tx, id)?;
            }
            tx.commit()
        })
        .await
    }
}

/// Answers per recorded-answers (mark) transaction, logged at shutdown.
static MARK_BATCHES: BatchSizes = BatchSizes::new("mark");

/// One answer to record on its outbox row.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// The row's event id.
    pub event_id: String,
    /// The consumer's answer.
    pub answer: DeliveryAnswer,
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}
