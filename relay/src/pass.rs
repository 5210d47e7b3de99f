//! Delivery passes over one or several `Receive` streams (consumer instances on one
//! database): each flow's rows go on one stream for the whole pass (picked from its
//! partition), so its rows arrive in seq order; on each stream a window of envelopes is in
//! flight and answers are matched in order; runs of answers (up to `mark_batch`, or whatever arrived within
//! `mark_delay` of the oldest) recorded in ONE producer.db transaction; the pass ends only
//! after every answer that came is recorded. A flow whose answer holds it back (see
//! [`Disposition::holds_flow`]) gets no new rows in that pass; rows of it already in flight
//! are recorded by their own answers; only an answer that holds the event marks a row.
//! The oldest envelope in flight must be answered within the answer timeout; after a stop is
//! asked, no row is sent and answers in flight may arrive for the shutdown grace only. A send
//! that got no answer is counted on its row, which stays unaccepted. A stream that fails ends
//! the pass early (no new row on any stream; the others' answers still come): the next pass
//! spreads the flows over the streams left.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use producer::store::{DeliveryAnswer, Fence, OutboxRecord};
use proto::body::Event;
use proto::pb;

use crate::Config;
use crate::decision::{Disposition, disposition};
use crate::error::RelayError;
use crate::identity::Judged;
use crate::ledger::Ledger;
use crate::output::Report;
use crate::record::{Answered, record};
use crate::session::Session;
use crate::stop::Stop;

/// Rows read from producer.db per query.
const PAGE: usize = 256;

/// Where a pass takes its rows from.
pub enum Source {
    /// These rows, in this order.
    Rows(VecDeque<OutboxRecord>),
    /// Every unaccepted row, paged in `(flow_id, seq)` order.
    Unaccepted,
}

/// A row whose answer held its flow back (a refusal or an answer not understood).
#[derive(Clone, Debug)]
pub struct HeldBack {
    /// The row's flow.
    pub flow_id: String,
    /// The row.
    pub event_id: String,
    /// The answer's word.
    pub outcome: String,
    /// The consumer's detail text.
    pub detail: String,
}

/// What one pass did.
#[derive(Debug, Default)]
pub struct PassResult {
    /// Answers recorded.
    pub sent: u64,
    /// Rows whose answer held their flow back, in answer order.
    pub held_back: Vec<HeldBack>,
    /// Flows whose row met a full consumer backlog (one entry per such answer).
    pub deferred: Vec<String>,
    /// Answers that mean the consumer holds the event (`ACCEPTED`, `DUPLICATE`).
    pub accepted: u64,
    /// Rows sent whose answer did not come within the shutdown grace.
    pub unanswered: usize,
    /// The streams that failed in this pass (their index in the pass's streams) and why;
    /// their unanswered rows stay unaccepted.
    pub broken: Vec<(usize, RelayError)>,
}

/// How a pass paces itself.
#[derive(Clone, Copy, Debug)]
pub struct Caps {
    /// Envelopes in flight at most.
    pub window: usize,
    /// Answers per mark transaction at most.
    pub mark_batch: usize,
    /// How long an arrived answer may wait for others to share its transaction.
    pub mark_delay: Duration,
    /// How long the oldest envelope in flight may wait for its answer.
    pub answer_timeout: Duration,
    /// After a stop is asked, how long answers in flight may still arrive.
    pub shutdown_grace: Duration,
}

impl Caps {
    /// The caps `config` asks for.
    pub fn of(config: &Config) -> Caps {
        Caps {
            window: config.window.max(1),
            mark_batch: config.mark_batch.max(1),
            mark_delay: config.mark_delay,
            answer_timeout: config.link.answer_timeout,
            shutdown_grace: config.shutdown_grace,
        }
    }

    /// One envelope at a time, each answer recorded alone (`once`, `send`).
    pub fn single(config: &Config) -> Caps {
        Caps { window: 1, mark_batch: 1, mark_delay: Duration::ZERO, ..Caps::of(config) }
    }
}

struct InFlight {
    row: OutboxRecord,
    sent_at: Instant,
    fence: Option<Fence>,
}

/// One stream of a pass: the rows it is to send, those in flight on it, and whether it failed.
struct Lane<'s> {
    session: &'s mut Session,
    /// Rows of the flows this stream carries, not yet sent, in `(flow_id, seq)` order.
    queued: VecDeque<OutboxRecord>,
    in_flight: VecDeque<InFlight>,
    /// Why the stream failed in this pass; it carries nothing more.
    broken: Option<RelayError>,
}

impl Lane<'_> {
    fn waiting(&self) -> bool {
        self.broken.is_none() && !self.in_flight.is_empty()
    }
}

enum Woke {
    Answer(usize, Result<pb::ReceiveResult, RelayError>),
    StopAsked,
    MarkDue,
    Silent(usize),
    GraceOver,
}

/// The stream (of `streams`) that carries `flow_id` in a pass: all rows of one flow go on one
/// stream, so they arrive in order; flows spread over the streams by partition.
pub fn lane_of(flow_id: &str, streams: usize) -> usize {
    usize::from(proto::partition::flow_partition(flow_id)) % streams.max(1)
}

/// [`pass`] over one stream, whose failure is the pass's error (`once`, `send`, `drain`).
pub async fn pass_one(
    session: &mut Session,
    ledger: &Ledger,
    source: Source,
    skip: &HashSet<String>,
    caps: Caps,
    report: &mut Report,
    stop: &Stop,
) -> Result<PassResult, RelayError> {
    let mut result = pass(&mut [session], ledger, source, skip, caps, report, stop).await?;
    match result.broken.pop() {
        Some((_, e)) => Err(e),
        None => Ok(result),
    }
}

/// Sends the rows of `source` (minus the flows in `skip`) over `sessions`, each flow on one
/// stream ([`lane_of`]), with up to `caps.window` in flight per stream, recording every
/// answer. Stops taking new rows once `stop` is asked or a stream fails; a stream's failure
/// is in [`PassResult::broken`], a failure of producer.db is the error.
pub async fn pass(
    sessions: &mut [&mut Session],
    ledger: &Ledger,
    mut source: Source,
    skip: &HashSet<String>,
    caps: Caps,
    report: &mut Report,
    stop: &Stop,
) -> Result<PassResult, RelayError> {
    let mut result = PassResult::default();
    let mut held_now: HashSet<String> = HashSet::new();
    // Judging happens between passes only, so this holds for the whole pass: the leases
    // every stream judged (each flow may go on any of them).
    let judged = Judged::common(sessions.iter().map(|s| s.judged()));
    let mut lanes: Vec<Lane<'_>> = sessions
        .iter_mut()
        .map(|session| Lane { session, queued: VecDeque::new(), in_flight: VecDeque::new(), broken: None })
        .collect();
    let mut cursor = (String::new(), 0u64);
    let mut exhausted = false;
    let mut stopped_at: Option<Instant> = None;
    // Answers arrived and not yet recorded in producer.db, in arrival order.
    let mut answered: Vec<Answered> = Vec::new();
    loop {
        if stopped_at.is_none() && stop.requested() {
            stopped_at = Some(Instant::now());
        }
        let taking = stopped_at.is_none() && lanes.iter().all(|l| l.broken.is_none());
        if taking {
            loop {
                for lane in lanes.iter_mut() {
                    send_queued(lane, ledger, &judged, skip, &mut held_now, caps.window, report).await;
                }
                if lanes.iter().any(|l| l.broken.is_some()) {
                    break;
                }
                // Read on while a stream has room and nothing queued, with a bounded read-ahead.
                let hungry = lanes.iter().any(|l| l.in_flight.len() < caps.window && l.queued.is_empty());
                let queued: usize = lanes.iter().map(|l| l.queued.len()).sum();
                if !hungry || exhausted || queued >= PAGE * lanes.len() {
                    break;
                }
                let page = match &mut source {
                    Source::Rows(rows) => {
                        exhausted = true;
                        rows.drain(..).collect()
                    }
                    Source::Unaccepted => {
                        let page = ledger.work_after(cursor.clone(), PAGE, &judged).await?;
                        exhausted = page.len() < PAGE;
                        page
                    }
                };
                if let Some(last) = page.last() {
                    cursor = (last.flow_id.clone(), last.seq);
                }
                let streams = lanes.len();
                for row in page {
                    lanes[lane_of(&row.flow_id, streams)].queued.push_back(row);
                }
            }
        }
        let failed = lanes.iter().enumerate().filter(|(_, l)| l.broken.is_some() && !l.in_flight.is_empty());
        let failed: Vec<usize> = failed.map(|(i, _)| i).collect();
        for i in failed {
            // A failed send: what is in flight on that stream gets no answer.
            result.sent += record(ledger, &mut answered, report).await?;
            unanswered(ledger, &mut lanes[i]).await?;
        }
        // The stream whose oldest envelope has waited longest.
        let Some((oldest_lane, oldest)) = lanes
            .iter()
            .enumerate()
            .filter(|(_, l)| l.waiting())
            .filter_map(|(i, l)| l.in_flight.front().map(|f| (i, f.sent_at)))
            .min_by_key(|(_, at)| *at)
        else {
            break;
        };
        let silent_at = oldest + caps.answer_timeout;
        let mark_due = answered.first().map(|first| first.at + caps.mark_delay);
        let grace_over = stopped_at.map(|at| at + caps.shutdown_grace);
        let woke = tokio::select! {
            biased;
            (i, answer) = next_answer(&mut lanes) => Woke::Answer(i, answer),
            () = stop.asked(), if stopped_at.is_none() => Woke::StopAsked,
            () = sleep_until(mark_due) => Woke::MarkDue,
            () = tokio::time::sleep_until(silent_at.into()) => Woke::Silent(oldest_lane),
            () = sleep_until(grace_over) => Woke::GraceOver,
        };
        let mut grace_spent = false;
        match woke {
            Woke::Answer(i, first) => {
                let lane = &mut lanes[i];
                let consumer_db = lane.session.consumer_db();
                let mut next = Some(first);
                while let Some(arrived) = next.take() {
                    if let Err(e) = arrived.and_then(|answer| {
                        take_answer(answer, lane, &consumer_db, &mut held_now, &mut result, &mut answered)
                    }) {
                        lane.broken = Some(e);
                        break;
                    }
                    if answered.len() < caps.mark_batch && !lane.in_flight.is_empty() {
                        next = lane.session.answer_now();
                    }
                }
            }
            Woke::StopAsked => {
                let in_flight: usize = lanes.iter().map(|l| l.in_flight.len()).sum();
                tracing::info!(in_flight, grace = ?caps.shutdown_grace, "stop asked: sending nothing more, waiting for the answers in flight");
                stopped_at = Some(Instant::now());
            }
            Woke::MarkDue => {}
            Woke::Silent(i) => lanes[i].broken = Some(RelayError::Unresponsive(caps.answer_timeout)),
            Woke::GraceOver => grace_spent = true,
        }
        // Record when the cap is reached, when the oldest answer has waited long enough, when
        // nothing is in flight any more, and before a stream's rows are given up.
        let due = answered.first().is_some_and(|first| first.at + caps.mark_delay <= Instant::now());
        let idle = lanes.iter().all(|l| !l.waiting());
        let giving_up = grace_spent || lanes.iter().any(|l| l.broken.is_some() && !l.in_flight.is_empty());
        if giving_up || idle || answered.len() >= caps.mark_batch || due {
            result.sent += record(ledger, &mut answered, report).await?;
        }
        for lane in lanes.iter_mut().filter(|l| grace_spent || l.broken.is_some()) {
            let given_up = unanswered(ledger, lane).await?;
            if grace_spent {
                result.unanswered += given_up;
            }
        }
        if grace_spent {
            tracing::warn!(
                unanswered = result.unanswered,
                "shutdown grace over: rows still in flight stay unaccepted"
            );
            break;
        }
    }
    result.sent += record(ledger, &mut answered, report).await?;
    result.broken =
        lanes.iter_mut().enumerate().filter_map(|(i, l)| l.broken.take().map(|e| (i, e))).collect();
    Ok(result)
}

/// Sends `lane`'s queued rows while its window has room. A flow in `skip` or held back in this
/// pass gets none; a row of a lease lost (or not judged for this stream) is not sent; a send
/// that fails marks the stream failed.
async fn send_queued(
    lane: &mut Lane<'_>,
    ledger: &Ledger,
    judged: &Judged,
    skip: &HashSet<String>,
    held_now: &mut HashSet<String>,
    window: usize,
    report: &mut Report,
) {
    while lane.broken.is_none() && lane.in_flight.len() < window {
        let Some(row) = lane.queued.pop_front() else { return };
        if skip.contains(&row.flow_id) || held_now.contains(&row.flow_id) {
            report.skipped(&row.flow_id);
            continue;
        }
        // Under leases: a row of a partition lost since the page was read is not ours.
        let Ok(fence) = ledger.fence_for(&row, judged) else { continue };
        let envelope = match Event::envelope_from_canonical_body(&row.body) {
            // The committed time rides beside the event (never in its body), so the
            // consumer can measure commit→applied.
            Ok(envelope) => pb::EventEnvelope { committed_at_us: row.committed_at_us, ..envelope },
            Err(e) => {
                // Only a hand-edited file gets here; never send what we cannot read.
                tracing::error!(event_id = %row.event_id, error = %e, "unreadable outbox body; flow skipped");
                held_now.insert(row.flow_id.clone());
                report.skipped(&row.flow_id);
                continue;
            }
        };
        if let Err(e) = lane.session.send(envelope).await {
            lane.broken = Some(e);
            return;
        }
        tracing::debug!(event_id = %row.event_id, "sent");
        lane.in_flight.push_back(InFlight { row, sent_at: Instant::now(), fence });
    }
}

/// Counts one send on each row in flight on `lane` that will get no answer (one transaction);
/// they stay unaccepted. Returns how many there were.
async fn unanswered(ledger: &Ledger, lane: &mut Lane<'_>) -> Result<usize, RelayError> {
    let rows: Vec<String> = lane.in_flight.drain(..).map(|f| f.row.event_id).collect();
    let n = rows.len();
    ledger.record_unanswered(rows).await?;
    Ok(n)
}

/// The next answer on any stream waiting for one (pending while none is).
async fn next_answer(lanes: &mut [Lane<'_>]) -> (usize, Result<pb::ReceiveResult, RelayError>) {
    let waiting: Vec<_> = lanes
        .iter_mut()
        .enumerate()
        .filter(|(_, l)| l.waiting())
        .map(|(i, l)| Box::pin(async move { (i, l.session.answer().await) }))
        .collect();
    if waiting.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(waiting).await.0
}

/// Matches one answer to the oldest row in flight on its stream and notes what it does to the
/// flow.
fn take_answer(
    answer: pb::ReceiveResult,
    lane: &mut Lane<'_>,
    consumer_db: &Option<Arc<str>>,
    held_now: &mut HashSet<String>,
    result: &mut PassResult,
    answered: &mut Vec<Answered>,
) -> Result<(), RelayError> {
    let in_flight = &mut lane.in_flight;
    let Some(InFlight { row, fence, .. }) = in_flight.pop_front() else {
        return Err(RelayError::Stream("an answer arrived for nothing in flight".into()));
    };
    if answer.event_id != row.event_id {
        let e = format!("answer for {:?} arrived where {:?} was expected", answer.event_id, row.event_id);
        // The row was sent; its answer is lost in the mismatch.
        in_flight.push_front(InFlight { row, sent_at: Instant::now(), fence });
        return Err(RelayError::Stream(e));
    }
    let delivery = DeliveryAnswer::from_wire(answer.outcome);
    let d = disposition(delivery);
    if d.holds_flow() {
        // Decided on the answer itself: no new row of this flow is sent from now on.
        held_now.insert(row.flow_id.clone());
    }
    match d {
        Disposition::Mark => result.accepted += 1,
        Disposition::Defer => result.deferred.push(row.flow_id.clone()),
        Disposition::Refuse | Disposition::NotUnderstood => result.held_back.push(HeldBack {
            flow_id: row.flow_id.clone(),
            event_id: row.event_id.clone(),
            outcome: delivery.word().into_owned(),
            detail: answer.detail.clone(),
        }),
    }
    let position = answer.inbox_position;
    answered.push(Answered {
        row,
        answer: delivery,
        detail: answer.detail,
        position,
        at: Instant::now(),
        fence,
        consumer_db: consumer_db.clone(),
    });
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
