//! Before a relay sends anything on a new session, it asks the consumer which database it
//! is and whether its inbox still holds the highest rows producer.db recorded as accepted by
//! it (`Consumer.Identify` with probes: position and event id): rows a recreated consumer
//! database (another id) or one restored from an older copy (a probed position that holds
//! another event, or none) no longer holds are marked unaccepted again, said in one loud
//! line, and sent again (the consumer answers `DUPLICATE` where it still holds one). No
//! accepted event is lost silently.
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
use crate::ledger::{Ledger, Lost};
use crate::stop::Stop;

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

/// How many recorded rows one `Identify` probes: the highest ones first, then, while a page
/// held any row the consumer lacks, the next page down. A restore keeps a prefix of the
/// inbox, so the first page that the consumer holds entirely ends the search; a page covers
/// the few positions PostgreSQL may commit out of order. Well under the consumer's limit.
pub const PROBE_PAGE: usize = 256;

/// Logs the fallback to the highest-position comparison once per process (the idle recheck
/// asks every second).
static NO_PROBES_WARNED: std::sync::Once = std::sync::Once::new();

/// Asks the consumer who it is and whether it holds `probes`. `None`: it does not implement
/// `Identify` (an older build).
async fn ask(
    client: &mut ConsumerClient<tonic::service::interceptor::InterceptedService<Channel, SendToken>>,
    link: &Link,
    producer_database_id: &str,
    probes: &[(u64, String)],
) -> Result<Option<pb::IdentifyResponse>, RelayError> {
    let request = pb::IdentifyRequest {
        producer_database_id: producer_database_id.to_owned(),
        probes: probes
            .iter()
            .map(|(position, event_id)| pb::InboxProbe { position: *position, event_id: event_id.clone() })
            .collect(),
    };
    // A stopped consumer must fail the check, not hang it: the same bound as opening a stream.
    let answer = tokio::time::timeout(link.answer_timeout, client.identify(request))
        .await
        .map_err(|_| RelayError::Unresponsive(link.answer_timeout))?;
    match answer {
        Ok(identity) => Ok(Some(identity.into_inner())),
        Err(status) if status.code() == tonic::Code::Unimplemented => Ok(None),
        Err(status) => Err(RelayError::Stream(format!("identify: {status}"))),
    }
}

/// A further ask in the same judgement: the consumer must answer it (it answered the first),
/// from the same database `database_id`.
async fn ask_again(
    client: &mut ConsumerClient<tonic::service::interceptor::InterceptedService<Channel, SendToken>>,
    link: &Link,
    producer_database_id: &str,
    probes: &[(u64, String)],
    database_id: &str,
) -> Result<pb::IdentifyResponse, RelayError> {
    let again = ask(client, link, producer_database_id, probes)
        .await?
        .ok_or_else(|| RelayError::Stream("identify: the consumer stopped answering Identify".into()))?;
    if again.database_id != database_id {
        return Err(RelayError::Stream(format!(
            "identify: the consumer's database changed while it was asked ({database_id} then {})",
            again.database_id
        )));
    }
    Ok(again)
}

/// The probed rows the consumer said it does not hold. An answer for as many probes as were
/// sent is required; an empty one (a consumer built before probes) is `None`.
fn not_held(probes: &[(u64, String)], held: &[bool]) -> Result<Option<Vec<(u64, String)>>, RelayError> {
    if held.is_empty() && !probes.is_empty() {
        return Ok(None);
    }
    if held.len() != probes.len() {
        return Err(RelayError::Stream(format!(
            "identify: the consumer answered {} probes of {}",
            held.len(),
            probes.len()
        )));
    }
    Ok(Some(probes.iter().zip(held).filter(|(_, held)| !**held).map(|(p, _)| p.clone()).collect()))
}

/// What one judgement found: who answered, and which of the rows the outbox recorded as
/// accepted by it (or by another database) it lacks.
struct Assessment {
    producer_database_id: String,
    database_id: String,
    highest_inbox_position: u64,
    lost: Lost,
    /// The leases judged (under leases; see [`Ledger::unjudged`]).
    scope: Option<Vec<(u16, u64)>>,
    probes: usize,
    asks: usize,
}

/// Asks the consumer on `channel` who it is and which recorded rows it lacks (see [`judge`]).
/// `None`: it cannot identify its database (an older build); then `scope` was judged as is.
async fn assess(
    channel: Channel,
    ledger: &Ledger,
    link: &Link,
    judged: &mut Judged,
) -> Result<Option<Assessment>, RelayError> {
    let producer_database_id = ledger.producer_id().await?;
    // Taken before the consumer is asked (see `Ledger::resend_lost`).
    let scope = ledger.unjudged(judged);
    let mut client = ConsumerClient::with_interceptor(channel, SendToken::new(link.token.as_deref()));
    // The probes are read before asking, for the database the accepted rows name (normally
    // the one that answers: one Identify). Rows marked later were accepted by the database
    // that answers them; they are not judged now and need not be.
    let expected = ledger.recorded_consumer_db().await?;
    let mut page = match &expected {
        Some(db) => ledger.accepted_page(db.clone(), None, PROBE_PAGE, &scope).await?,
        None => Vec::new(),
    };
    let Some(mut identity) = ask(&mut client, link, &producer_database_id, &page).await? else {
        tracing::warn!(
            url = %link.url,
            "the consumer cannot identify its database (an older build): a deleted or restored consumer \
             database cannot be detected by this relay"
        );
        judged.extend(scope.unwrap_or_default());
        return Ok(None);
    };
    let mut asks = 1;
    if expected.as_deref() != Some(identity.database_id.as_str()) {
        // Another database answered (a replaced one, or the outbox names several): its own
        // rows, if the outbox recorded any, are probed in a second ask.
        page = ledger.accepted_page(identity.database_id.clone(), None, PROBE_PAGE, &scope).await?;
        // The answers were about the other database's rows: they say nothing here.
        identity.probes_held.clear();
        if !page.is_empty() {
            identity =
                ask_again(&mut client, link, &producer_database_id, &page, &identity.database_id).await?;
            asks += 1;
        }
    }
    let mut probes = page.len();
    let lost = match not_held(&page, &identity.probes_held)? {
        None => {
            NO_PROBES_WARNED.call_once(|| {
                tracing::warn!(
                    url = %link.url,
                    "the consumer does not answer inbox probes (an older build): rows it lost are judged by its \
                     highest inbox position only, which misses rows whose positions a consumer restored from an \
                     older copy gave to new events since"
                )
            });
            Lost::Beyond(identity.highest_inbox_position)
        }
        Some(mut missing) => {
            let mut lost = Vec::new();
            // Down the recorded positions while a page held a row the consumer lacks.
            while !missing.is_empty() {
                lost.append(&mut missing);
                let below = page.last().cloned();
                page = ledger.accepted_page(identity.database_id.clone(), below, PROBE_PAGE, &scope).await?;
                if page.is_empty() {
                    break;
                }
                let next =
                    ask_again(&mut client, link, &producer_database_id, &page, &identity.database_id).await?;
                probes += page.len();
                asks += 1;
                missing = not_held(&page, &next.probes_held)?.ok_or_else(|| {
                    RelayError::Stream("identify: the consumer stopped answering probes".into())
                })?;
            }
            Lost::Probed(lost)
        }
    };
    Ok(Some(Assessment {
        producer_database_id,
        database_id: identity.database_id,
        highest_inbox_position: identity.highest_inbox_position,
        lost,
        scope,
        probes,
        asks,
    }))
}

/// Identifies the consumer on `channel`, re-sends what its database lacks of what producer.db
/// recorded as accepted (under leases: of the leases `judged` lacks, which are then added to
/// it). Returns the consumer's database id, recorded on the rows it accepts from now on. A
/// consumer that does not implement `Identify` (an older build) is relayed to as before,
/// with a warning: `None`, nothing is recorded, so nothing can be checked.
///
/// What it lacks: rows another consumer database accepted, and rows this one accepted that
/// its inbox no longer holds at the position it answered (probed, [`PROBE_PAGE`] at a time
/// from the highest position down). Positions alone cannot tell: a database restored from
/// an older copy gives the positions above its restore point to new events (another
/// producer's, another relay's), and its highest position soon passes the lost ones. A
/// consumer that answers no probes (an older build) is judged by its highest position, with
/// a warning.
///
/// A `stop` ends the questions (they wait on the consumer; nothing is written yet) with
/// [`RelayError::Interrupted`], never what follows them: the rows it lacks are marked in one
/// producer.db transaction and said in a loud line, and once that began it runs to its end
/// (bounded by the rows it changes), so no stop leaves rows changed without their line. No
/// later judgement could say it: the rows are no longer recorded as accepted by then.
pub async fn judge(
    channel: Channel,
    ledger: &Ledger,
    link: &Link,
    judged: &mut Judged,
    stop: &Stop,
) -> Result<Option<String>, RelayError> {
    let assessed = tokio::select! {
        biased;
        () = stop.asked() => return Err(RelayError::Interrupted("judging the consumer")),
        assessed = assess(channel, ledger, link, judged) => assessed?,
    };
    let Some(found) = assessed else { return Ok(None) };
    let Assessment { producer_database_id, database_id, highest_inbox_position, lost, scope, probes, asks } =
        found;
    let (lost, judged_now) = ledger.resend_lost(database_id.clone(), lost, scope).await?;
    if lost.compacted > 0 {
        // Nothing was unmarked (see `ProducerStore::resend_lost`): say so loudly and stop.
        let e = RelayError::HistoryCompacted {
            consumer_db: database_id.clone(),
            lost: lost.other_database + lost.beyond_history,
            compacted: lost.compacted,
            first: lost.compacted_sample.clone(),
        };
        tracing::error!(
            consumer_database_id = %database_id,
            highest_inbox_position = highest_inbox_position,
            rows = lost.other_database + lost.beyond_history,
            compacted = lost.compacted,
            first = ?lost.compacted_sample,
            "CONSUMER HISTORY LOST BEYOND RETENTION: {e}"
        );
        return Err(e);
    }
    if lost.other_database > 0 {
        tracing::error!(
            consumer_database_id = %database_id,
            rows = lost.other_database,
            first = ?lost.sample,
            "CONSUMER DATABASE REPLACED: the consumer answers with a database other than the one that \
             accepted these rows (deleted and recreated, or another file); they are unaccepted again and \
             sent again"
        );
    }
    if lost.beyond_history > 0 {
        tracing::error!(
            consumer_database_id = %database_id,
            highest_inbox_position = highest_inbox_position,
            highest_recorded = lost.highest_recorded,
            rows = lost.beyond_history,
            first = ?lost.sample,
            "CONSUMER DATABASE RESTORED FROM AN OLDER COPY: its inbox no longer holds rows it had accepted; \
             they are unaccepted again and sent again (DUPLICATE where it still holds them)"
        );
    }
    tracing::debug!(
        producer_database_id = %producer_database_id,
        consumer_database_id = %database_id,
        highest_inbox_position = highest_inbox_position,
        partitions_judged = judged_now.len(),
        probes,
        asks,
        "consumer identified"
    );
    judged.extend(judged_now);
    Ok(Some(database_id))
}

/// What `relay accept-lost` changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LossAccepted {
    /// The consumer database whose loss was accepted.
    pub consumer_db: String,
    /// Accepted rows the outbox recorded that it lacks (other databases' rows included).
    pub lost: u64,
    /// Of those, compacted rows now marked `LOST_ACCEPTED` (never sent again).
    pub loss_accepted: u64,
    /// The first of them, by `(flow_id, seq)`.
    pub first: Vec<String>,
    /// The rest: marked unaccepted again, so the next relay run sends them again.
    pub unmarked: u64,
}

/// `relay accept-lost`: an operator's decision that the consumer database `expected` lost,
/// for good, rows the producer already compacted (restored from a copy older than the
/// retention, with no newer copy). It is judged as a relay judges it before sending ([`judge`],
/// over the whole outbox); only if the consumer on `channel` answers for `expected`, and tells
/// exactly which rows it lacks (probes), are its compacted lost rows marked `LOST_ACCEPTED`
/// (they stay accepted and are never sent again) and the others unaccepted again, in one
/// transaction. Their flows then wait at a gap on the consumer, visible as such.
pub async fn accept_lost(
    channel: Channel,
    ledger: &Ledger,
    link: &Link,
    expected: &str,
) -> Result<LossAccepted, RelayError> {
    let refused = |why: String| RelayError::AcceptLost(format!("{why}; nothing was changed"));
    let Some(found) = assess(channel, ledger, link, &mut Judged::default()).await? else {
        return Err(refused(format!(
            "the consumer at {} cannot identify its database (an older build)",
            link.url
        )));
    };
    if found.database_id != expected {
        return Err(refused(format!(
            "the consumer at {} answers for database {}, not {expected} (--consumer-database-id)",
            link.url, found.database_id
        )));
    }
    if matches!(found.lost, Lost::Beyond(_)) {
        return Err(refused(format!(
            "the consumer at {} does not answer inbox probes (an older build), so which rows it lost cannot \
             be told exactly",
            link.url
        )));
    }
    let lost = ledger.accept_lost(found.database_id.clone(), found.lost).await?;
    if lost.loss_accepted < lost.compacted {
        return Err(refused(
            "a compaction pass committed while the loss was judged; run accept-lost again".to_owned(),
        ));
    }
    let total = lost.other_database + lost.beyond_history;
    let accepted = LossAccepted {
        consumer_db: found.database_id,
        lost: total,
        loss_accepted: lost.loss_accepted,
        first: lost.compacted_sample,
        unmarked: total - lost.loss_accepted,
    };
    if accepted.loss_accepted > 0 {
        tracing::error!(
            consumer_database_id = %accepted.consumer_db,
            loss_accepted = accepted.loss_accepted,
            first = ?accepted.first,
            unmarked = accepted.unmarked,
            "CONSUMER HISTORY LOSS ACCEPTED BY AN OPERATOR: these compacted rows stay accepted and are never \
             sent again (last outcome LOST_ACCEPTED); their flows wait at a gap on the consumer; the other \
             lost rows are sent again"
        );
    } else {
        tracing::info!(
            consumer_database_id = %accepted.consumer_db,
            unmarked = accepted.unmarked,
            "no compacted row is lost: nothing to accept (lost rows, if any, are sent again as always)"
        );
    }
    Ok(accepted)
}

/// How often `run` checks the consumer's identity again while it has nothing to send.
pub const IDLE_RECHECK: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_held_names_the_probes_answered_false_and_refuses_a_short_answer() {
        let probes = vec![(3, "c".to_owned()), (2, "b".to_owned()), (1, "a".to_owned())];
        assert_eq!(not_held(&probes, &[true, false, true]).unwrap(), Some(vec![(2, "b".to_owned())]));
        assert_eq!(not_held(&probes, &[true, true, true]).unwrap(), Some(Vec::new()));
        // An older consumer answers nothing: judged by the highest position instead.
        assert_eq!(not_held(&probes, &[]).unwrap(), None);
        // No probes, no answers: nothing to judge here.
        assert_eq!(not_held(&[], &[]).unwrap(), Some(Vec::new()));
        let short = not_held(&probes, &[true]).unwrap_err().to_string();
        assert!(short.contains("answered 1 probes of 3"), "{short}");
        assert!(not_held(&[], &[true]).is_err());
    }
}
