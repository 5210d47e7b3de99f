//! Recording answers: a run of arrived answers goes into producer.db in ONE transaction
//! (marking the accepted rows), and only then are their delivery lines written, so stdout
//! never claims more than the ledger holds.

use std::sync::Arc;
use std::time::Instant;

use producer::store::{DeliveryAnswer, Fence, OutboxRecord};

use crate::error::RelayError;
use crate::ledger::{Ledger, Recorded};
use crate::output::Report;

/// An answer waiting to be recorded.
pub struct Answered {
    /// The row it answers.
    pub row: OutboxRecord,
    /// The answer.
    pub answer: DeliveryAnswer,
    /// The consumer's detail text.
    pub detail: String,
    /// The consumer's inbox position of the event (0 when it did not say).
    pub position: u64,
    /// When it arrived.
    pub at: Instant,
    /// The lease the row was sent under (`run` on PostgreSQL).
    pub fence: Option<Fence>,
    /// The consumer database of the stream that answered (`None`: it could not say).
    pub consumer_db: Option<Arc<str>>,
}

/// Records `answered` in one transaction (one per consumer database, should streams of one
/// pass answer for different ones), then queues and writes their delivery lines; returns how
/// many were recorded. `answered` is empty afterwards. Answers the lease fence kept out are
/// neither counted nor written (stdout never claims more than the ledger).
pub async fn record(
    ledger: &Ledger,
    answered: &mut Vec<Answered>,
    report: &mut Report,
) -> Result<u64, RelayError> {
    if answered.is_empty() {
        return Ok(0);
    }
    let mut databases: Vec<&Option<Arc<str>>> = Vec::new();
    for a in answered.iter() {
        if !databases.contains(&&a.consumer_db) {
            databases.push(&a.consumer_db);
        }
    }
    let mut not_recorded = Vec::new();
    for db in databases {
        let (indexes, recorded): (Vec<usize>, Vec<Recorded>) = answered
            .iter()
            .enumerate()
            .filter(|(_, a)| &a.consumer_db == db)
            .map(|(i, a)| {
                let recorded = Recorded {
                    event_id: a.row.event_id.clone(),
                    row_id: a.row.row_id,
                    answer: a.answer,
                    position: a.position,
                    fence: a.fence.clone(),
                };
                (i, recorded)
            })
            .unzip();
        let left = ledger.record(recorded, db.as_deref().map(str::to_owned)).await?;
        not_recorded.extend(left.into_iter().map(|j| indexes[j]));
    }
    let n = (answered.len() - not_recorded.len()) as u64;
    for (i, a) in answered.drain(..).enumerate() {
        if !not_recorded.contains(&i) {
            report.delivery(&a.row.event_id, &a.row.flow_id, a.row.seq, a.answer, &a.detail);
        }
    }
    report.flush();
    Ok(n)
}
