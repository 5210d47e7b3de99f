//! Before a relay sends anything on a new session, it asks the consumer which database it
//! is and how far that database's history reaches (`Consumer.Identify`), and compares it with
//! what producer.db recorded as accepted: rows a recreated consumer database (another id)
//! or one restored from an older copy (a highest inbox position below one it answered)
//! no longer holds are marked unaccepted again, said in one loud line, and sent again (the
//! consumer answers `DUPLICATE` where it still holds one). No accepted event is lost silently.
//! `run` repeats the check while idle, since a dead stream only shows on the next send.
//! Rows compaction already reduced to tombstones cannot be sent again: when any lost row is
//! one, nothing is unmarked and the relay stops with [`RelayError::HistoryCompacted`].

use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use runtime::auth::SendToken;
use std::time::Duration;

use tonic::transport::Channel;

use crate::Link;
use crate::error::RelayError;
use crate::ledger::Ledger;

/// Identifies the consumer on `channel`, re-sends what its database lacks of what producer.db
/// recorded as accepted, and records from now on which database accepts each row. A
/// consumer that does not implement `Identify` (an older build) is relayed to as before,
/// with a warning: nothing is recorded, so nothing can be checked.
pub async fn check_consumer_history(
    channel: Channel,
    ledger: &Ledger,
    link: &Link,
) -> Result<(), RelayError> {
    let producer_database_id = ledger.producer_id().await?;
    let judged = ledger.judged_partitions();
    let mut client = ConsumerClient::with_interceptor(channel, SendToken::new(link.token.as_deref()));
    // A stopped consumer must fail the check, not hang it: the same bound as opening a stream.
    let asked = client.identify(pb::IdentifyRequest { producer_database_id: producer_database_id.clone() });
    let answer = tokio::time::timeout(link.answer_timeout, asked)
        .await
        .map_err(|_| RelayError::Unresponsive(link.answer_timeout))?;
    let identity = match answer {
        Ok(identity) => identity.into_inner(),
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            tracing::warn!(
                url = %link.url,
                "the consumer cannot identify its database (an older build): a deleted or restored consumer \
                 database cannot be detected by this relay"
            );
            ledger.set_consumer(None);
            return Ok(());
        }
        Err(status) => return Err(RelayError::Stream(format!("identify: {status}"))),
    };
    let lost =
        ledger.resend_lost(identity.database_id.clone(), identity.highest_inbox_position, judged).await?;
    if lost.compacted > 0 {
        // Nothing was unmarked (see `ProducerStore::resend_lost`): say so loudly and stop.
        let e = RelayError::HistoryCompacted {
            consumer_db: identity.database_id.clone(),
            lost: lost.other_database + lost.beyond_history,
            compacted: lost.compacted,
            first: lost.compacted_sample.clone(),
        };
        tracing::error!(
            consumer_database_id = %identity.database_id,
            highest_inbox_position = identity.highest_inbox_position,
            rows = lost.other_database + lost.beyond_history,
            compacted = lost.compacted,
            first = ?lost.compacted_sample,
            "CONSUMER HISTORY LOST BEYOND RETENTION: {e}"
        );
        return Err(e);
    }
    if lost.other_database > 0 {
        tracing::error!(
            consumer_database_id = %identity.database_id,
            rows = lost.other_database,
            first = ?lost.sample,
            "CONSUMER DATABASE REPLACED: the consumer answers with a database other than the one that \
             accepted these rows (deleted and recreated, or another file); they are unaccepted again and \
             sent again"
        );
    }
    if lost.beyond_history > 0 {
        tracing::error!(
            consumer_database_id = %identity.database_id,
            highest_inbox_position = identity.highest_inbox_position,
            highest_recorded = lost.highest_recorded,
            rows = lost.beyond_history,
            first = ?lost.sample,
            "CONSUMER DATABASE RESTORED FROM AN OLDER COPY: its history ends before rows it had accepted; \
             they are unaccepted again and sent again (DUPLICATE where it still holds them)"
        );
    }
    tracing::debug!(
        producer_database_id = %producer_database_id,
        consumer_database_id = %identity.database_id,
        highest_inbox_position = identity.highest_inbox_position,
        "consumer identified"
    );
    ledger.set_consumer(Some(identity.database_id));
    Ok(())
}

/// How often `run` checks the consumer's identity again while it has nothing to send.
pub const IDLE_RECHECK: Duration = Duration::from_secs(1);
