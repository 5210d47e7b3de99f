//! The relay's side of producer.db, through `producer::store` only, on blocking threads:
//! short reads of unaccepted rows (no read transaction is held between polls) and one
//! `BEGIN IMMEDIATE` transaction per run of recorded answers (group commit of the marks).

use std::path::Path;
use std::sync::{Arc, Mutex};

use producer::store::{self, DeliveryAnswer, OutboxRecord};
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{self, DbError, OpenMode};
use runtime::batches::BatchSizes;
use rusqlite::Connection;

/// The relay's connection to producer.db.
#[derive(Clone)]
pub struct Ledger {
    conn: Arc<Mutex<Connection>>,
    crash: CrashSwitch,
    /// The consumer database the open session talks to (set by `identity` when the session
    /// opens; `None` for a consumer that cannot say), recorded on every accepted row.
    consumer_db: Arc<Mutex<Option<String>>>,
}

impl Ledger {
    /// Opens an existing producer.db (the relay never creates one).
    pub fn open(path: &Path, crash: CrashSwitch) -> Result<Ledger, DbError> {
        let conn = store::open(path, OpenMode::Existing)?;
        Ok(Ledger { conn: Arc::new(Mutex::new(conn)), crash, consumer_db: Arc::new(Mutex::new(None)) })
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

    /// Records the consumer's answers for a run of rows in ONE transaction (each counts one
    /// send); marks a row accepted when its answer holds the event. Crash points
    /// `relay.after_mark` (written, not committed) and `relay.after_mark_commit` sit on the
    /// marking path only: a run with no accepted answer reaches neither.
    pub async fn record(&self, answers: Vec<Recorded>) -> rusqlite::Result<()> {
        let consumer_db = runtime::blocking::lock(&self.consumer_db).clone();
        self.blocking(move |conn, crash| {
            let started = std::time::Instant::now();
            let tx = db::begin_immediate(conn)?;
            let now = runtime::now_us();
            let mut marked = false;
            for answer in &answers {
                let accepted_by = match &consumer_db {
                    Some(consumer) if answer.position > 0 => {
                        Some(store::AcceptedBy { consumer_db: consumer, position: answer.position })
                    }
                    _ => None,
                };
                store::record_delivery(&tx, &answer.event_id, answer.answer, now, accepted_by)?;
                marked |= answer.answer.holds_event();
            }
            if marked {
                crash.reach(CrashPoint::RelayAfterMark);
            }
            tx.commit()?;
            MARK_BATCHES.record_timed(answers.len(), started);
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

impl Ledger {
    /// This producer database's identity.
    pub async fn producer_id(&self) -> rusqlite::Result<String> {
        self.blocking(|conn, _| store::database_id(conn)).await
    }

    /// Sets the consumer database the open session talks to.
    pub fn set_consumer(&self, consumer_db: Option<String>) {
        *runtime::blocking::lock(&self.consumer_db) = consumer_db;
    }

    /// In ONE transaction: what `consumer_db` (whose history reaches `highest_position`)
    /// lacks of what the outbox recorded as accepted, marked unaccepted again so it is sent
    /// again. Returns what was found (and unmarked).
    pub async fn resend_lost(
        &self,
        consumer_db: String,
        highest_position: u64,
    ) -> rusqlite::Result<store::LostRows> {
        self.blocking(move |conn, _| {
            let tx = db::begin_immediate(conn)?;
            let lost = store::lost_rows(&tx, &consumer_db, highest_position)?;
            if lost.other_database + lost.beyond_history > 0 {
                store::unmark_lost(&tx, &consumer_db, highest_position)?;
                tx.commit()?;
            }
            Ok(lost)
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
    /// Where the consumer holds it (its inbox position; 0 when it did not say).
    pub position: u64,
}
