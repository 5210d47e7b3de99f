//! The relay's side of the producer database, through `producer::store` only (SQLite or
//! PostgreSQL alike): short reads of unaccepted rows (no read transaction is held between
//! polls) and one transaction per run of recorded answers (group commit of the marks, with
//! the relay's crash points).

use producer::store::{Fence, LeaseView, LostRows, OutboxRecord, ProducerStore, Role, StoreError};
use proto::crash::CrashSwitch;
use proto::target::DbTarget;
use runtime::OpenError;

use crate::identity::Judged;
use crate::lease::Leases;

pub use producer::store::{Lost, Recorded};

/// The store the relay opened, for the metrics scrape's pool gauges.
pub(crate) static LEDGER_STORE: std::sync::OnceLock<ProducerStore> = std::sync::OnceLock::new();

/// An answer and its index in the run being recorded.
type Numbered = (usize, Recorded);

/// The relay's handle on the producer database.
#[derive(Clone)]
pub struct Ledger {
    store: ProducerStore,
    /// `run` on PostgreSQL: the partitions this relay holds; it reads and marks only theirs.
    leases: Option<Leases>,
}

impl Ledger {
    /// Opens an existing producer database (the relay never creates one: a file or schema
    /// the producer has not created is refused in one line).
    pub async fn open(target: &DbTarget, crash: CrashSwitch) -> Result<Ledger, OpenError> {
        let store = ProducerStore::open(target, Role::Relay, crash).await?;
        // The metrics scrape reads the pool's state (the first ledger's: a relay opens one).
        let _ = LEDGER_STORE.set(store.clone());
        Ok(Ledger { store, leases: None })
    }

    /// True when several relays can share this outbox through partition leases (PostgreSQL).
    pub fn has_leases(&self) -> bool {
        self.store.has_leases()
    }

    /// This ledger, reading and marking only the rows of the partitions `leases` holds.
    pub fn with_leases(mut self, leases: Leases) -> Ledger {
        self.leases = Some(leases);
        self
    }

    /// The next page of work: up to `limit` unaccepted rows after `cursor` in `(flow_id, seq)`
    /// order. Under leases, only rows of the partitions held now whose lease was `judged`
    /// against the session's consumer database: a row of a partition taken over since is
    /// not read before the consumer was asked what it lacks of that partition.
    pub async fn work_after(
        &self,
        cursor: (String, u64),
        limit: usize,
        judged: &Judged,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        match &self.leases {
            None => self.store.unaccepted_after(cursor, limit).await,
            Some(leases) => {
                let partitions: Vec<u16> =
                    leases.readable().into_iter().filter(|l| judged.contains(*l)).map(|(p, _)| p).collect();
                if partitions.is_empty() {
                    return Ok(Vec::new());
                }
                self.store.unaccepted_in(cursor, limit, partitions).await
            }
        }
    }

    /// The fencing token a row is sent under: `Ok(None)` without leases, `Err(())` when its
    /// partition is not (or no longer) held, or held under a lease not `judged` against the
    /// session's consumer: the row is not this session's to send now.
    #[allow(clippy::result_unit_err)]
    pub fn fence_for(&self, row: &OutboxRecord, judged: &Judged) -> Result<Option<Fence>, ()> {
        match &self.leases {
            None => Ok(None),
            Some(leases) => leases
                .fence(proto::partition::flow_partition(&row.flow_id))
                .filter(|f| judged.contains((f.partition, f.epoch)))
                .map(Some)
                .ok_or(()),
        }
    }

    /// A relay heartbeat (see [`ProducerStore::lease_heartbeat`]).
    pub async fn lease_heartbeat(
        &self,
        instance: &str,
        ttl_us: i64,
        held: Vec<(u16, u64)>,
    ) -> Result<LeaseView, StoreError> {
        self.store.lease_heartbeat(instance, ttl_us, held).await
    }

    /// Takes free leases (see [`ProducerStore::lease_acquire`]).
    pub async fn lease_acquire(
        &self,
        instance: &str,
        ttl_us: i64,
        partitions: Vec<u16>,
    ) -> Result<Vec<(u16, u64)>, StoreError> {
        self.store.lease_acquire(instance, ttl_us, partitions).await
    }

    /// Hands leases back (see [`ProducerStore::lease_release`]).
    pub async fn lease_release(
        &self,
        instance: &str,
        leases: Vec<(u16, u64)>,
        retire: bool,
    ) -> Result<Vec<u16>, StoreError> {
        self.store.lease_release(instance, leases, retire).await
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
    /// send); marks a row accepted when its answer holds the event, noting `consumer_db` (the
    /// answering stream's consumer database) where it lives. Crash points
    /// `relay.after_mark` (written, not committed) and `relay.after_mark_commit` sit on the
    /// marking path only: a run with no accepted answer reaches neither.
    ///
    /// Under leases, answers of partitions no longer held are not recorded, and a mark the
    /// fence refused drops its partitions ([`Leases::drop_fenced`]). Returns the indexes of
    /// `answers` that were not recorded.
    pub async fn record(
        &self,
        answers: Vec<Recorded>,
        consumer_db: Option<String>,
    ) -> Result<Vec<usize>, StoreError> {
        let Some(leases) = &self.leases else {
            self.store.record_deliveries(answers, consumer_db).await?;
            return Ok(Vec::new());
        };
        let (current, stale): (Vec<Numbered>, Vec<Numbered>) = answers
            .into_iter()
            .enumerate()
            .partition(|(_, a)| a.fence.as_ref().is_none_or(|f| leases.is_current(f)));
        if !stale.is_empty() {
            tracing::info!(
                answers = stale.len(),
                "answers for partitions this relay no longer holds are not recorded (their new owner sends the rows again)"
            );
        }
        let mut not_recorded: Vec<usize> = stale.iter().map(|(i, _)| *i).collect();
        let fences: Vec<Option<Fence>> = current.iter().map(|(_, a)| a.fence.clone()).collect();
        let indexes: Vec<usize> = current.iter().map(|(i, _)| *i).collect();
        let fenced =
            self.store.record_deliveries(current.into_iter().map(|(_, a)| a).collect(), consumer_db).await?;
        if !fenced.is_empty() {
            let refused: Vec<Fence> =
                fences.iter().flatten().filter(|f| fenced.contains(&f.partition)).cloned().collect();
            leases.drop_fenced(&refused);
            for (i, fence) in indexes.iter().zip(&fences) {
                if fence.as_ref().is_some_and(|f| fenced.contains(&f.partition)) {
                    not_recorded.push(*i);
                }
            }
        }
        Ok(not_recorded)
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

    /// Under leases: the leases held now that `judged` lacks (not yet checked against the
    /// session's consumer database), after `judged` forgot the ones no longer held; taken
    /// before asking the consumer who it is, and passed to [`Ledger::resend_lost`]. `None`
    /// without leases: the whole outbox is judged at once.
    pub fn unjudged(&self, judged: &mut Judged) -> Option<Vec<(u16, u64)>> {
        let leases = self.leases.as_ref()?;
        let held = leases.held_leases();
        judged.keep_only(&held);
        Some(held.into_iter().filter(|l| !judged.contains(*l)).collect())
    }

    /// The consumer database the accepted rows name (see
    /// [`ProducerStore::recorded_consumer_db`]): whose rows to probe before asking.
    pub async fn recorded_consumer_db(&self) -> Result<Option<String>, StoreError> {
        self.store.recorded_consumer_db().await
    }

    /// Up to `limit` rows `consumer_db` accepted, `(position, event_id)`, highest first,
    /// below `below` (see [`ProducerStore::accepted_page`]); under leases only the rows of
    /// the partitions of `scope` (the leases being judged).
    pub async fn accepted_page(
        &self,
        consumer_db: String,
        below: Option<(u64, String)>,
        limit: usize,
        scope: &Option<Vec<(u16, u64)>>,
    ) -> Result<Vec<(u64, String)>, StoreError> {
        let partitions = match (&self.leases, scope) {
            (Some(_), Some(leases)) => {
                if leases.is_empty() {
                    return Ok(Vec::new());
                }
                Some(leases.iter().map(|(p, _)| *p).collect())
            }
            _ => None,
        };
        self.store.accepted_page(consumer_db, below, limit, partitions).await
    }

    /// `relay accept-lost`, in ONE transaction over the whole outbox: see
    /// [`producer::store::ProducerStore::accept_lost`].
    pub async fn accept_lost(&self, consumer_db: String, lost: Lost) -> Result<LostRows, StoreError> {
        self.store.accept_lost(consumer_db, lost).await
    }

    /// In ONE transaction: what `consumer_db` lacks of what the outbox recorded as accepted
    /// (rows of other consumer databases, and the rows `lost` names), marked unaccepted
    /// again so it is sent again. Returns what was found (and unmarked) and the leases
    /// judged. Under leases, only the rows of `scope` (held before the consumer was asked)
    /// still held at the same epoch are judged: another relay's rows may be marked, at
    /// higher positions, between the consumer's answer and this read, which would look like
    /// a restored consumer; only this relay marks the rows of a partition it held throughout.
    pub async fn resend_lost(
        &self,
        consumer_db: String,
        lost: Lost,
        scope: Option<Vec<(u16, u64)>>,
    ) -> Result<(LostRows, Vec<(u16, u64)>), StoreError> {
        match (&self.leases, scope) {
            (Some(leases), Some(before)) => {
                let now = leases.held_leases();
                let held: Vec<(u16, u64)> = before.into_iter().filter(|l| now.contains(l)).collect();
                if held.is_empty() {
                    return Ok((LostRows::default(), held));
                }
                let partitions = held.iter().map(|(p, _)| *p).collect();
                let lost = self.store.resend_lost_in(consumer_db, lost, partitions).await?;
                Ok((lost, held))
            }
            _ => Ok((self.store.resend_lost(consumer_db, lost).await?, Vec::new())),
        }
    }
}
