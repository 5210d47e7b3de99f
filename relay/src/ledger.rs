//! The relay's side of the producer database, through `producer::store` only (SQLite or
//! PostgreSQL alike): short reads of unaccepted rows (no read transaction is held between
//! polls) and one transaction per run of recorded answers (group commit of the marks, with
//! the relay's crash points), plus which consumer database the open session talks to.

use std::sync::{Arc, Mutex};

use producer::store::{LostRows, OutboxRecord, ProducerStore, Role, StoreError};
use proto::crash::CrashSwitch;
use proto::target::DbTarget;
use runtime::OpenError;

pub use producer::store::Recorded;

/// The store the relay opened, for the metrics scrape's pool gauges.
pub(crate) static LEDGER_STORE: std::sync::OnceLock<ProducerStore> = std::sync::OnceLock::new();

/// The relay's handle on the producer database.
#[derive(Clone)]
pub struct Ledger {
    store: ProducerStore,
    /// The consumer database the open session talks to (set by `identity` when the session
    /// opens; `None` for a consumer that cannot say), recorded on every accepted row.
    consumer_db: Arc<Mutex<Option<String>>>,
}

impl Ledger {
    /// Opens an existing producer database (the relay never creates one: a file or schema
    /// the producer has not created is refused in one line).
    pub async fn open(target: &DbTarget, crash: CrashSwitch) -> Result<Ledger, OpenError> {
        let store = ProducerStore::open(target, Role::Relay, crash).await?;
        // The metrics scrape reads the pool's state (the first ledger's: a relay opens one).
        let _ = LEDGER_STORE.set(store.clone());
        Ok(Ledger { store, consumer_db: Arc::new(Mutex::new(None)) })
    }

    /// Up to `limit` unaccepted rows after `cursor`, in `(flow_id, seq)` order.
    pub async fn unaccepted_after(
        &self,
        cursor: (String, u64),
        limit: usize,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        self.store.unaccepted_after(cursor, limit).await
    }

    /// The outbox row of `event_id`, accepted or not.
    pub async fn row(&self, event_id: String) -> Result<Option<OutboxRecord>, StoreError> {
        self.store.outbox_row(event_id).await
    }

    /// Records the consumer's answers for a run of rows in ONE transaction (each counts one
    /// send); marks a row accepted when its answer holds the event. Crash points
    /// `relay.after_mark` (written, not committed) and `relay.after_mark_commit` sit on the
    /// marking path only: a run with no accepted answer reaches neither.
    pub async fn record(&self, answers: Vec<Recorded>) -> Result<(), StoreError> {
        let consumer_db = runtime::blocking::lock(&self.consumer_db).clone();
        self.store.record_deliveries(answers, consumer_db).await
    }

    /// Counts one send of each of `event_ids` that got no answer, in ONE transaction: the
    /// rows stay unaccepted and are sent again.
    pub async fn record_unanswered(&self, event_ids: Vec<String>) -> Result<(), StoreError> {
        self.store.record_unanswered(event_ids).await
    }

    /// This producer database's identity.
    pub async fn producer_id(&self) -> Result<String, StoreError> {
        self.store.database_id().await
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
    ) -> Result<LostRows, StoreError> {
        self.store.resend_lost(consumer_db, highest_position).await
    }
}
