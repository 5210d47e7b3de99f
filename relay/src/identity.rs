//! Before a relay sends anything on a new session, it asks the consumer which database it
//! is and how far that database's history reaches (`Consumer.Identify`), and compares it with
//! what producer.db recorded as accepted: rows a recreated consumer database (another id)
//! or one restored from an older copy (a highest inbox position below one it answered)
//! no longer holds are marked unaccepted again, said in one loud line, and sent again (the
//! consumer answers `DUPLICATE` where it still holds one). No accepted event is lost silently.
//! `run` repeats the check while idle, since a dead stream only shows on the next send.
//! Under partition leases a session judges the partitions it holds, lease by lease
//! ([`Judged`]): a partition taken over later (from a dead relay, or by rebalancing) is not
//! read for that session before it was judged in turn, between two passes.
//! Rows compaction already reduced to tombstones cannot be sent again: when any lost row is
//! one, nothing is unmarked and the relay stops with [`RelayError::HistoryCompacted`].

use std::collections::BTreeSet;
use std::time::Duration;

use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use runtime::auth::SendToken;

use tonic::transport::Channel;

use crate::Link;
use crate::error::RelayError;
use crate::ledger::Ledger;

/// The leases `(partition, epoch)` whose accepted rows one session checked against its
/// consumer's database while holding them: only their rows are read for that session. A
/// lease lost and taken again (a new epoch) is judged again; a new session starts with none.
/// Unused without leases (the whole outbox is judged when the session opens).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Judged(BTreeSet<(u16, u64)>);

impl Judged {
    /// True when `lease` was judged.
    pub fn contains(&self, lease: (u16, u64)) -> bool {
        self.0.contains(&lease)
    }

    /// The leases every one of `all` judged (none when `all` is empty).
    pub fn common<'a>(mut all: impl Iterator<Item = &'a Judged>) -> Judged {
        let Some(first) = all.next() else { return Judged::default() };
        let mut common = first.clone();
        for judged in all {
            common.0.retain(|l| judged.0.contains(l));
        }
        common
    }

    /// Forgets the leases not in `held` (lost or handed back).
    pub fn keep_only(&mut self, held: &[(u16, u64)]) {
        self.0.retain(|l| held.contains(l));
    }

    fn extend(&mut self, leases: Vec<(u16, u64)>) {
        self.0.extend(leases);
    }
}

/// Identifies the consumer on `channel`, re-sends what its database lacks of what producer.db
/// recorded as accepted (under leases: of the leases `judged` lacks, which are then added to
/// it). Returns the consumer's database id, recorded on the rows it accepts from now on. A
/// consumer that does not implement `Identify` (an older build) is relayed to as before,
/// with a warning: `None`, nothing is recorded, so nothing can be checked.
pub async fn judge(
    channel: Channel,
    ledger: &Ledger,
    link: &Link,
    judged: &mut Judged,
) -> Result<Option<String>, RelayError> {
    let producer_database_id = ledger.producer_id().await?;
    // Taken before the consumer is asked (see `Ledger::resend_lost`).
    let scope = ledger.unjudged(judged);
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
            judged.extend(scope.unwrap_or_default());
            return Ok(None);
        }
        Err(status) => return Err(RelayError::Stream(format!("identify: {status}"))),
    };
    let (lost, judged_now) =
        ledger.resend_lost(identity.database_id.clone(), identity.highest_inbox_position, scope).await?;
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
        partitions_judged = judged_now.len(),
        "consumer identified"
    );
    judged.extend(judged_now);
    Ok(Some(identity.database_id))
}

/// How often `run` checks the consumer's identity again while it has nothing to send.
pub const IDLE_RECHECK: Duration = Duration::from_secs(1);
