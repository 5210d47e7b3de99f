//! Delivery passes over one `Receive` stream: a window of envelopes in flight, answers
//! matched in order, and runs of answers (up to `mark_batch`, or whatever arrived within
//! `mark_delay` of the oldest) recorded in ONE producer.db transaction; the pass ends only
//! after every answer that came is recorded. A flow whose answer holds it back (see
//! [`Disposition::holds_flow`]) gets no new rows in that pass; rows of it already in flight
//! are recorded by their own answers; only an answer that holds the event marks a row.
//! The oldest envelope in flight must be answered within the answer timeout; after a stop is
//! asked, no row is sent and answers in flight may arrive for the shutdown grace only. A send
//! that got no answer is counted on its row, which stays unaccepted.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use producer::store::{DeliveryAnswer, Fence, OutboxRecord};
use proto::body::Event;
use proto::pb;

use crate::Config;
use crate::decision::{Disposition, disposition};
use crate::error::RelayError;
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

enum Woke {
    Answer(Result<pb::ReceiveResult, RelayError>),
    StopAsked,
    MarkDue,
    Silent,
    GraceOver,
}

/// Sends the rows of `source` (minus the flows in `skip`) with up to `caps.window` in flight,
/// recording every answer. Stops taking new rows once `stop` is asked.
pub async fn pass(
    session: &mut Session,
    ledger: &Ledger,
    mut source: Source,
    skip: &HashSet<String>,
    caps: Caps,
    report: &mut Report,
    stop: &Stop,
) -> Result<PassResult, RelayError> {
    let mut result = PassResult::default();
    let mut held_now: HashSet<String> = HashSet::new();
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut page: VecDeque<OutboxRecord> = VecDeque::new();
    let mut cursor = (String::new(), 0u64);
    let mut exhausted = false;
    let mut stopped_at: Option<Instant> = None;
    // Judging happens between passes only, so this holds for the whole pass.
    let judged = session.judged().clone();
    // Answers arrived and not yet recorded in producer.db, in stream order.
    let mut answered: Vec<Answered> = Vec::new();
    loop {
        if stopped_at.is_none() && stop.requested() {
            stopped_at = Some(Instant::now());
        }
        while in_flight.len() < caps.window && stopped_at.is_none() {
            if page.is_empty() {
                match &mut source {
                    Source::Rows(rows) => page.extend(rows.drain(..)),
                    Source::Unaccepted if !exhausted => {
                        page.extend(ledger.work_after(cursor.clone(), PAGE, &judged).await?);
                        exhausted = page.len() < PAGE;
                    }
                    Source::Unaccepted => {}
                }
            }
            let Some(row) = page.pop_front() else { break };
            cursor = (row.flow_id.clone(), row.seq);
            if skip.contains(&row.flow_id) || held_now.contains(&row.flow_id) {
                report.skipped(&row.flow_id);
                continue;
            }
            // Under leases: a row of a partition lost since the page was read is not ours.
            let Ok(fence) = ledger.fence_for(&row, &judged) else { continue };
            let envelope = match Event::from_canonical_body(&row.body) {
                // The committed time rides beside the event (never in its body), so the
                // consumer can measure commit→applied.
                Ok(event) => {
                    pb::EventEnvelope { committed_at_us: row.committed_at_us, ..event.to_envelope() }
                }
                Err(e) => {
                    // Only a hand-edited file gets here; never send what we cannot read.
                    tracing::error!(event_id = %row.event_id, error = %e, "unreadable outbox body; flow skipped");
                    held_now.insert(row.flow_id.clone());
                    report.skipped(&row.flow_id);
                    continue;
                }
            };
            session.send(envelope).await?;
            tracing::debug!(event_id = %row.event_id, "sent");
            in_flight.push_back(InFlight { row, sent_at: Instant::now(), fence });
        }
        let Some(oldest) = in_flight.front() else { break };
        let silent_at = oldest.sent_at + caps.answer_timeout;
        let mark_due = answered.first().map(|first| first.at + caps.mark_delay);
        let grace_over = stopped_at.map(|at| at + caps.shutdown_grace);
        let woke = tokio::select! {
            biased;
            answer = session.answer() => Woke::Answer(answer),
            () = stop.asked(), if stopped_at.is_none() => Woke::StopAsked,
            () = sleep_until(mark_due) => Woke::MarkDue,
            () = tokio::time::sleep_until(silent_at.into()) => Woke::Silent,
            () = sleep_until(grace_over) => Woke::GraceOver,
        };
        let mut broken = None;
        let mut grace_spent = false;
        match woke {
            Woke::Answer(first) => {
                let mut next = Some(first);
                while let Some(arrived) = next.take() {
                    if let Err(e) = arrived.and_then(|answer| {
                        take_answer(answer, &mut in_flight, &mut held_now, &mut result, &mut answered)
                    }) {
                        broken = Some(e);
                        break;
                    }
                    if answered.len() < caps.mark_batch && !in_flight.is_empty() {
                        next = session.answer_now();
                    }
                }
            }
            Woke::StopAsked => {
                tracing::info!(in_flight = in_flight.len(), grace = ?caps.shutdown_grace, "stop asked: sending nothing more, waiting for the answers in flight");
                stopped_at = Some(Instant::now());
            }
            Woke::MarkDue => {}
            Woke::Silent => broken = Some(RelayError::Unresponsive(caps.answer_timeout)),
            Woke::GraceOver => grace_spent = true,
        }
        // Record when the cap is reached, when the oldest answer has waited long enough, when
        // nothing is in flight any more, and before the pass ends early.
        let due = answered.first().is_some_and(|first| first.at + caps.mark_delay <= Instant::now());
        let ending = broken.is_some() || grace_spent;
        if ending || in_flight.is_empty() || answered.len() >= caps.mark_batch || due {
            result.sent += record(ledger, &mut answered, report).await?;
        }
        if ending {
            let unanswered: Vec<String> = in_flight.drain(..).map(|f| f.row.event_id).collect();
            result.unanswered = unanswered.len();
            ledger.record_unanswered(unanswered).await?;
            return match broken {
                Some(e) => Err(e),
                None => {
                    tracing::warn!(
                        unanswered = result.unanswered,
                        "shutdown grace over: rows still in flight stay unaccepted"
                    );
                    Ok(result)
                }
            };
        }
    }
    result.sent += record(ledger, &mut answered, report).await?;
    Ok(result)
}

/// Matches one answer to the oldest row in flight and notes what it does to the flow.
fn take_answer(
    answer: pb::ReceiveResult,
    in_flight: &mut VecDeque<InFlight>,
    held_now: &mut HashSet<String>,
    result: &mut PassResult,
    answered: &mut Vec<Answered>,
) -> Result<(), RelayError> {
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
    });
    Ok(())
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
