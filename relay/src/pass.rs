//! Delivery passes over one `Receive` stream: a window of envelopes in flight, answers
//! matched in order, and runs of answers (up to `mark_batch`, or whatever arrived within
//! `mark_delay` of the oldest) recorded in ONE producer.db transaction; the pass ends only
//! after every answer is recorded. A flow answered with a conflict or rejection gets no new
//! rows in that pass from that answer on; rows of it already in flight are recorded by their
//! own answers; a refused row is never marked.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::time::{Duration, Instant};

use producer::store::OutboxRecord;
use proto::body::Event;
use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use runtime::auth::SendToken;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::ledger::{Ledger, Recorded};
use crate::output::{Report, is_accepted, is_refusal, word};
use crate::{Config, Mode};

/// Rows read from producer.db per query.
const PAGE: usize = 256;
/// First pause before rows deferred by a full consumer backlog are offered again, and the
/// cap of that pause in `drain`.
const BACKLOG_RETRY: Duration = Duration::from_millis(50);
const BACKLOG_RETRY_CAP: Duration = Duration::from_secs(2);
/// `run`: first pause before a refused flow's row is offered again, and its cap.
const REFUSED_RETRY: Duration = Duration::from_millis(500);
const REFUSED_RETRY_CAP: Duration = Duration::from_secs(60);

/// Why a relay run stopped with an operational error (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("{0}")]
    Db(#[from] proto::db::DbError),
    #[error("producer database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("consumer unreachable at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("consumer stream failed: {0}")]
    Stream(String),
    #[error(
        "consumer backlog full: {rows} rows still deferred after retrying without progress; apply, then run the relay again"
    )]
    BacklogFull { rows: usize },
    #[error("no outbox row has event_id {0:?}")]
    UnknownEvent(String),
}

/// One open `Receive` stream.
struct Session {
    outbound: mpsc::Sender<pb::EventEnvelope>,
    answers: tonic::Streaming<pb::ReceiveResult>,
}

impl Session {
    async fn open(channel: Channel, window: usize, config: &Config) -> Result<Session, RelayError> {
        let (outbound, rx) = mpsc::channel(window.max(1));
        let answers = ConsumerClient::with_interceptor(channel, SendToken::new(config.token.as_deref()))
            .receive(ReceiverStream::new(rx))
            .await
            .map_err(|s| RelayError::Stream(s.to_string()))?
            .into_inner();
        Ok(Session { outbound, answers })
    }

    async fn send(&self, envelope: pb::EventEnvelope) -> Result<(), RelayError> {
        self.outbound.send(envelope).await.map_err(|_| RelayError::Stream("the stream closed".into()))
    }

    async fn answer(&mut self) -> Result<pb::ReceiveResult, RelayError> {
        Self::read(self.answers.message().await)
    }

    /// The next answer if it has already arrived, without waiting (`Streaming::message` is
    /// cancel-safe: an answer not yet complete stays buffered in the stream).
    fn answer_now(&mut self) -> Option<Result<pb::ReceiveResult, RelayError>> {
        futures::FutureExt::now_or_never(self.answers.message()).map(Self::read)
    }

    fn read(
        message: Result<Option<pb::ReceiveResult>, tonic::Status>,
    ) -> Result<pb::ReceiveResult, RelayError> {
        match message {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(RelayError::Stream("the consumer ended the stream early".into())),
            Err(status) => Err(RelayError::Stream(status.to_string())),
        }
    }
}

/// Where a pass takes its rows from.
enum Source {
    /// These rows, in this order.
    Rows(VecDeque<OutboxRecord>),
    /// Every unaccepted row, paged in `(flow_id, seq)` order.
    Unaccepted,
}

/// What one pass did.
#[derive(Debug, Default)]
struct PassResult {
    sent: u64,
    /// Flows whose row was refused in this pass, with the refused row's answer.
    refused: Vec<(String, &'static str)>,
    /// Flows whose row met a full consumer backlog: not refused, only later.
    deferred: Vec<String>,
    /// Answers that mean the consumer holds the event (`ACCEPTED`, `DUPLICATE`).
    accepted: u64,
}

/// How many envelopes a pass keeps in flight and how many answers one mark transaction holds.
#[derive(Clone, Copy, Debug)]
struct Caps {
    window: usize,
    mark_batch: usize,
    /// How long an arrived answer may wait for others to share its transaction.
    mark_delay: Duration,
}

/// Sends the rows of `source` (minus the flows in `skip`) with up to `caps.window` in flight,
/// recording every answer (runs of up to `caps.mark_batch` answers per transaction). Stops
/// taking new rows when `stopping` says so.
async fn pass(
    session: &mut Session,
    ledger: &Ledger,
    mut source: Source,
    skip: &HashSet<String>,
    caps: Caps,
    report: &mut Report,
    stopping: &dyn Fn() -> bool,
) -> Result<PassResult, RelayError> {
    let window = caps.window.max(1);
    let mut result = PassResult::default();
    let mut refused_now: HashSet<String> = HashSet::new();
    let mut in_flight: VecDeque<OutboxRecord> = VecDeque::new();
    let mut page: VecDeque<OutboxRecord> = VecDeque::new();
    let mut cursor = (String::new(), 0u64);
    let mut exhausted = false;
    // Answers arrived and not yet recorded in producer.db, in stream order.
    let mut answered: Vec<Answered> = Vec::new();
    loop {
        while in_flight.len() < window && !stopping() {
            if page.is_empty() {
                match &mut source {
                    Source::Rows(rows) => page.extend(rows.drain(..)),
                    Source::Unaccepted if !exhausted => {
                        page.extend(ledger.unaccepted_after(cursor.clone(), PAGE).await?);
                        exhausted = page.len() < PAGE;
                    }
                    Source::Unaccepted => {}
                }
            }
            let Some(row) = page.pop_front() else { break };
            cursor = (row.flow_id.clone(), row.seq);
            if skip.contains(&row.flow_id) || refused_now.contains(&row.flow_id) {
                report.skipped(&row.flow_id);
                continue;
            }
            let envelope = match Event::from_canonical_body(&row.body) {
                Ok(event) => event.to_envelope(),
                Err(e) => {
                    // Only a hand-edited file gets here; never send what we cannot read.
                    tracing::error!(event_id = %row.event_id, error = %e, "unreadable outbox body; flow skipped");
                    refused_now.insert(row.flow_id.clone());
                    report.skipped(&row.flow_id);
                    continue;
                }
            };
            session.send(envelope).await?;
            in_flight.push_back(row);
        }
        if in_flight.is_empty() {
            break;
        }
        // Wait for the next answer, but not past the moment the oldest unrecorded answer has
        // waited `mark_delay`; then take every answer already arrived.
        let mut next = match answered.first() {
            None => Some(session.answer().await),
            Some(first) => {
                let due = first.at + caps.mark_delay;
                tokio::time::timeout_at(due.into(), session.answer()).await.ok()
            }
        };
        let mut broken = None;
        while let Some(arrived) = next.take() {
            let answer = match arrived {
                Ok(answer) => answer,
                Err(e) => {
                    broken = Some(e);
                    break;
                }
            };
            let Some(row) = in_flight.pop_front() else {
                broken = Some(RelayError::Stream("an answer arrived for nothing in flight".into()));
                break;
            };
            if answer.event_id != row.event_id {
                broken = Some(RelayError::Stream(format!(
                    "answer for {:?} arrived where {:?} was expected",
                    answer.event_id, row.event_id
                )));
                break;
            }
            let outcome =
                pb::ReceiveOutcome::try_from(answer.outcome).unwrap_or(pb::ReceiveOutcome::Unspecified);
            if outcome == pb::ReceiveOutcome::BacklogFull {
                // Not a refusal: the consumer asks for this flow again later. Its later rows
                // wait too, so they cannot overtake it in this pass.
                if refused_now.insert(row.flow_id.clone()) {
                    tracing::debug!(flow_id = %row.flow_id, event_id = %row.event_id, "consumer backlog full; flow deferred");
                }
                result.deferred.push(row.flow_id.clone());
            } else if is_refusal(outcome) || !is_accepted(outcome) {
                // Decided on the answer itself: no new row of this flow is sent from now on.
                if refused_now.insert(row.flow_id.clone()) {
                    tracing::warn!(
                        flow_id = %row.flow_id, event_id = %row.event_id, outcome = word(outcome), detail = %answer.detail,
                        "flow held back: its row was not accepted; it stays unaccepted for an operator"
                    );
                }
                result.refused.push((row.flow_id.clone(), word(outcome)));
            }
            result.accepted += u64::from(is_accepted(outcome));
            answered.push(Answered { row, outcome, detail: answer.detail, at: Instant::now() });
            if answered.len() < caps.mark_batch.max(1) && !in_flight.is_empty() {
                next = session.answer_now();
            }
        }
        // Record when the cap is reached, when the oldest answer has waited long enough, when
        // nothing is in flight any more, and before a stream failure ends the pass.
        let due = answered.first().is_some_and(|first| first.at + caps.mark_delay <= Instant::now());
        if broken.is_some() || in_flight.is_empty() || answered.len() >= caps.mark_batch.max(1) || due {
            record(ledger, &mut answered, report, &mut result).await?;
        }
        if let Some(e) = broken {
            return Err(e);
        }
    }
    record(ledger, &mut answered, report, &mut result).await?;
    Ok(result)
}

/// An answer waiting to be recorded.
struct Answered {
    row: OutboxRecord,
    outcome: pb::ReceiveOutcome,
    detail: String,
    /// When it arrived.
    at: Instant,
}

/// Records `answered` in ONE producer.db transaction (marking the accepted rows), then
/// writes their delivery lines.
async fn record(
    ledger: &Ledger,
    answered: &mut Vec<Answered>,
    report: &mut Report,
    result: &mut PassResult,
) -> Result<(), RelayError> {
    if answered.is_empty() {
        return Ok(());
    }
    let recorded = answered
        .iter()
        .map(|a| Recorded {
            event_id: a.row.event_id.clone(),
            outcome: word(a.outcome),
            accepted: is_accepted(a.outcome),
        })
        .collect();
    ledger.record(recorded).await?;
    for a in answered.drain(..) {
        report.delivery(&a.row.event_id, &a.row.flow_id, a.row.seq, a.outcome, &a.detail);
        result.sent += 1;
    }
    report.flush();
    Ok(())
}

fn caps(config: &Config) -> Caps {
    Caps { window: config.window, mark_batch: config.mark_batch, mark_delay: config.mark_delay }
}

async fn connect(config: &Config, deadline: Duration) -> Result<Channel, RelayError> {
    let url = config.consumer_url.as_str();
    let unreachable = |reason: String| RelayError::Unreachable { url: url.to_owned(), reason };
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| unreachable(format!("invalid URL: {e}")))?
        .connect_timeout(Duration::from_secs(2));
    if let Some(ca) = &config.tls_ca {
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| unreachable(format!("TLS settings: {}", source_chain(&e))))?;
    }
    let until = Instant::now() + deadline;
    let mut backoff = Duration::from_millis(100);
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(channel),
            Err(e) if Instant::now() + backoff >= until => return Err(unreachable(source_chain(&e))),
            Err(e) => {
                tracing::debug!(error = %source_chain(&e), "consumer not reachable yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

/// Runs the relay in `config.mode` and returns its exit code (0 or 3); operational
/// failures are errors (exit code 1). `shutdown` ends `run` mode.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<i32, RelayError> {
    let ledger = Ledger::open(&config.producer_db, config.crash)?;
    let mut report = Report::default();
    let never = || false;
    let mode_name = match &config.mode {
        Mode::Once => "once",
        Mode::Send { .. } => "send",
        Mode::Drain => "drain",
        Mode::Run => "run",
    };
    match &config.mode {
        Mode::Once | Mode::Send { .. } => {
            let row = match &config.mode {
                Mode::Send { event_id } => Some(
                    ledger
                        .row(event_id.clone())
                        .await?
                        .ok_or_else(|| RelayError::UnknownEvent(event_id.clone()))?,
                ),
                _ => ledger.unaccepted_after((String::new(), 0), 1).await?.into_iter().next(),
            };
            if let Some(row) = row {
                let channel = connect(&config, config.connect_deadline).await?;
                let mut session = Session::open(channel, 1, &config).await?;
                let source = Source::Rows(VecDeque::from([row]));
                let caps = Caps { window: 1, mark_batch: 1, mark_delay: Duration::ZERO };
                pass(&mut session, &ledger, source, &HashSet::new(), caps, &mut report, &never).await?;
            }
        }
        Mode::Drain => {
            if !ledger.unaccepted_after((String::new(), 0), 1).await?.is_empty() {
                let channel = connect(&config, config.connect_deadline).await?;
                let mut session = Session::open(channel, config.window, &config).await?;
                let mut skip = HashSet::new();
                let mut backoff = BACKLOG_RETRY;
                let mut stalled_since: Option<Instant> = None;
                // Repeat until a pass sends nothing: rows committed behind the cursor during
                // a pass are found by the next one. Rows deferred by a full consumer backlog are
                // offered again after a backoff while the consumer makes progress.
                loop {
                    let result = pass(
                        &mut session,
                        &ledger,
                        Source::Unaccepted,
                        &skip,
                        caps(&config),
                        &mut report,
                        &never,
                    )
                    .await?;
                    skip.extend(result.refused.into_iter().map(|(flow, _)| flow));
                    if !result.deferred.is_empty() {
                        if result.accepted > 0 {
                            stalled_since = None;
                            backoff = BACKLOG_RETRY;
                        }
                        let since = *stalled_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= config.connect_deadline {
                            return Err(RelayError::BacklogFull { rows: result.deferred.len() });
                        }
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BACKLOG_RETRY_CAP);
                        continue;
                    }
                    if result.sent == 0 {
                        break;
                    }
                }
            }
        }
        Mode::Run => run_forever(&config, &ledger, &mut report, shutdown).await?,
    }
    Ok(report.finish(mode_name))
}

/// `run` mode: passes for ever, reconnecting with capped backoff, retrying refused flows
/// with their own capped backoff, until `shutdown`; in-flight answers are recorded first.
async fn run_forever(
    config: &Config,
    ledger: &Ledger,
    report: &mut Report,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RelayError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopping = move || *stop_rx.borrow();
    // Fused: once the signal came, the watcher stays pending instead of being polled again
    // after completion by the next `select!` (the loop ends on `stopping()` anyway).
    let watcher = futures::FutureExt::fuse(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    tokio::pin!(watcher);
    let mut held_back: HashMap<String, (Instant, Duration)> = HashMap::new();
    let mut reconnect_backoff = Duration::from_millis(100);
    let mut connected = None::<bool>;
    let mut session: Option<Session> = None;
    while !stopping() {
        if session.is_none() {
            let attempt = async {
                let channel = connect(config, Duration::ZERO).await?;
                Session::open(channel, config.window, config).await
            };
            let opened = tokio::select! {
                opened = attempt => opened,
                () = &mut watcher => continue,
            };
            match opened {
                Ok(s) => {
                    if connected != Some(true) {
                        tracing::info!(url = %config.consumer_url, "consumer reachable; delivering");
                    }
                    connected = Some(true);
                    reconnect_backoff = Duration::from_millis(100);
                    session = Some(s);
                }
                Err(e) => {
                    if connected != Some(false) {
                        tracing::warn!(error = %e, max_backoff = ?config.max_backoff, "consumer unreachable; retrying with backoff");
                    }
                    connected = Some(false);
                    tokio::select! {
                        () = tokio::time::sleep(reconnect_backoff) => {}
                        () = &mut watcher => {}
                    }
                    reconnect_backoff = (reconnect_backoff * 2).min(config.max_backoff);
                    continue;
                }
            }
        }
        let now = Instant::now();
        let skip: HashSet<String> =
            held_back.iter().filter(|(_, (until, _))| *until > now).map(|(flow, _)| flow.clone()).collect();
        let Some(active) = session.as_mut() else { continue };
        let outcome = {
            let work = pass(active, ledger, Source::Unaccepted, &skip, caps(config), report, &stopping);
            tokio::pin!(work);
            tokio::select! {
                r = &mut work => r,
                () = &mut watcher => work.await,
            }
        };
        match outcome {
            Ok(result) => {
                // A refused flow is retried after its own backoff (doubling up to a minute), so a
                // stuck conflict costs one attempt per backoff, not one per poll.
                for (flow, _) in result.refused {
                    let backoff = held_back.get(&flow).map_or(REFUSED_RETRY, |(_, b)| *b);
                    held_back.insert(flow, (Instant::now() + backoff, (backoff * 2).min(REFUSED_RETRY_CAP)));
                }
                // A flow deferred by a full backlog is offered again after a shorter backoff,
                // capped by --max-backoff-ms.
                for flow in result.deferred {
                    let backoff = held_back.get(&flow).map_or(BACKLOG_RETRY, |(_, b)| *b);
                    held_back.insert(flow, (Instant::now() + backoff, (backoff * 2).min(config.max_backoff)));
                }
                if result.sent == 0 {
                    tokio::select! {
                        () = tokio::time::sleep(config.poll_interval) => {}
                        () = &mut watcher => {}
                    }
                }
            }
            Err(RelayError::Stream(reason)) => {
                tracing::warn!(%reason, "consumer stream lost; unanswered rows stay unaccepted and will be resent");
                connected = Some(false);
                session = None;
            }
            Err(other) => return Err(other),
        }
    }
    tracing::info!(sent = report.sent(), "relay stopped");
    Ok(())
}
