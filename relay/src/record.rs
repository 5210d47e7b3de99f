//! Recording answers: a run of arrived answers goes into producer.db in ONE transaction
//! (marking the accepted rows), and only then are their delivery lines written, so stdout
//! never claims more than the ledger holds.

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
}

/// Records `answered` in one transaction, then queues and writes their delivery lines;
/// returns how many were recorded. `answered` is empty afterwards. Answers the lease fence
/// kept out are neither counted nor written (stdout never claims more than the ledger).
pub async fn record(
    ledger: &Ledger,
    answered: &mut Vec<Answered>,
    report: &mut Report,
) -> Result<u64, RelayError> {
    if answered.is_empty() {
        return Ok(0);
    }
    let recorded = answered
        .iter()
        .map(|a| Recorded {
            event_id: a.row.event_id.clone(),
            answer: a.answer,
            position: a.position,
            fence: a.fence.clone(),
        })
        .collect();
    let not_recorded = ledger.record(recorded).await?;
    let n = (answered.len() - not_recorded.len()) as u64;
    for (i, a) in answered.drain(..).enumerate() {
        if !not_recorded.contains(&i) {
            report.delivery(&a.row.event_id, &a.row.flow_id, a.row.seq, a.answer, &a.detail);
        }
    }
    report.flush();
    Ok(n)
}
