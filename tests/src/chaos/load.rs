//! The chaos run's load and observers: Advance clients (each flow's three steps plus seeded
//! decoys the producer must refuse, every call and answer recorded, ambiguous failures
//! retried with the same event id), the applier (`ApplyAll` in a loop until the consumer
//! applies by itself), the injector (early, reordered and duplicate deliveries of committed
//! events, and forged conflicting ones), and the monitor that reads progress from the files.
//! Everything waits on progress (counts, a new address), never on a guessed duration.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use proto::pb::producer_client::ProducerClient;
use tokio::sync::{Notify, watch};
use tonic::transport::Channel;

use crate::backend::Target;
use crate::checker::{AdvanceRecord, Answer, ForgedRecord, History, Intent};
use crate::db::Session;
use crate::rng::Rng;
use crate::{canon, db};

use super::cluster::Endpoint;

/// Counters shared by the load, the observers and the fault schedule.
#[derive(Debug, Default)]
pub struct Progress {
    /// Steps acknowledged committed (COMMITTED, or EXISTING after an ambiguous failure).
    pub committed: AtomicU64,
    /// Flows a client started.
    pub flows_started: AtomicU64,
    /// Flows that reached `released`.
    pub flows_done: AtomicU64,
    /// Flows started and not yet done.
    pub in_progress: AtomicU64,
    /// The most flows in progress at once.
    pub max_in_progress: AtomicU64,
    /// Advance calls that failed ambiguously.
    pub unknown: AtomicU64,
    /// Effect rows and the highest inbox rowid, as the monitor last read them.
    pub applied: AtomicU64,
    /// The highest inbox rowid seen.
    pub inbox_rows: AtomicU64,
    /// Injected real envelopes, and how the consumer answered them.
    pub injected: AtomicU64,
    /// Deliveries the injector sent twice.
    pub injected_duplicates: AtomicU64,
    /// Forged deliveries sent.
    pub forged: AtomicU64,
    /// `ApplyAll` calls and the steps they applied.
    pub apply_calls: AtomicU64,
    /// Steps the driver's applier applied.
    pub applied_by_applier: AtomicU64,
    /// Set when the fault schedule has run out (the load may then end).
    pub faults_done: AtomicBool,
    /// Set to end the load: no new flows, the injector stops.
    pub stop_load: AtomicBool,
    /// Set when the applier and the monitor may stop (after the drain).
    pub stop_all: AtomicBool,
    /// Woken whenever a counter moves.
    pub changed: Notify,
    /// Every Advance call and answer, and every forged delivery.
    pub history: Mutex<History>,
    /// The first fatal problem (a hang), which ends the run.
    pub fatal: Mutex<Option<String>>,
}

impl Progress {
    /// Records a fatal problem (the first one wins) and stops the load.
    pub fn fail(&self, why: String) {
        let mut fatal = self.fatal.lock().unwrap_or_else(|p| p.into_inner());
        if fatal.is_none() {
            eprintln!("chaos: FATAL: {why}");
            *fatal = Some(why);
        }
        self.stop_load.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// True once a fatal problem was recorded.
    pub fn failed(&self) -> bool {
        self.fatal.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    fn record(&self, r: AdvanceRecord) {
        self.history.lock().unwrap_or_else(|p| p.into_inner()).advances.push(r);
    }

    /// Waits until `pred` holds (re-checked whenever a counter moves) or `deadline` passes;
    /// returns whether it holds.
    pub async fn wait_until(&self, deadline: Duration, mut pred: impl FnMut(&Progress) -> bool) -> bool {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if pred(self) {
                return true;
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return pred(self);
            }
        }
    }
}

/// What the load does, from the run's configuration.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The seed of every client's choices.
    pub seed: u64,
    /// Flows to run (`None`: until the load is stopped).
    pub flows: Option<u64>,
    /// Committed-but-unapplied events beyond which no new flow starts.
    pub max_backlog: u64,
    /// Percent of steps preceded by a decoy request.
    pub decoy_percent: u64,
    /// Percent of steps sent with schema 2.
    pub schema2_percent: u64,
    /// The injector sends one batch per this many newly committed events.
    pub inject_every: u64,
    /// How long one call, or one wait for progress, may take before it counts as a hang.
    pub hang: Duration,
}

const KINDS: [&str; 3] = ["reserved", "confirmed", "released"];

/// A client's connection to the current producer, re-made after every restart.
struct ProducerConn {
    ep: watch::Receiver<Endpoint>,
    generation: u64,
    client: Option<ProducerClient<Channel>>,
}

impl ProducerConn {
    fn client(&mut self) -> Result<ProducerClient<Channel>, String> {
        let ep = self.ep.borrow_and_update().clone();
        if self.client.is_none() || ep.generation != self.generation {
            let channel = Channel::from_shared(ep.url.clone())
                .map_err(|e| format!("bad producer url {}: {e}", ep.url))?
                .connect_timeout(Duration::from_secs(2))
                .connect_lazy();
            self.client = Some(ProducerClient::new(channel));
            self.generation = ep.generation;
        }
        self.client.clone().ok_or_else(|| "no producer client".to_owned())
    }

    /// After a failed call: wait for the next restart's address, or a short while if the
    /// process we talked to may still be up (the failure was then transient).
    async fn after_failure(&mut self) {
        if self.ep.borrow().generation == self.generation {
            let _ = tokio::time::timeout(Duration::from_millis(250), self.ep.changed()).await;
        }
    }
}

fn answer_of(resp: &pb::AdvanceResponse) -> Answer {
    let body = resp.event.as_ref().map(|e| e.body.clone()).unwrap_or_default();
    match pb::AdvanceOutcome::try_from(resp.outcome) {
        Ok(pb::AdvanceOutcome::Committed) => Answer::Committed { body },
        Ok(pb::AdvanceOutcome::Existing) => Answer::Existing { body },
        Ok(pb::AdvanceOutcome::Conflict) => Answer::Conflict { body },
        Ok(pb::AdvanceOutcome::Stale) => Answer::Stale,
        Ok(pb::AdvanceOutcome::InvalidTransition) => Answer::InvalidTransition,
        other => Answer::Other { what: format!("outcome {other:?}: {}", resp.detail) },
    }
}

/// Sends `req` until it gets an answer (an ambiguous failure is recorded as `Unknown` and
/// retried with the same event id); records every attempt. `None` when it hangs.
async fn advance(
    conn: &mut ProducerConn,
    progress: &Progress,
    req: &pb::AdvanceRequest,
    intent: Intent,
    hang: Duration,
) -> Option<Answer> {
    let started = Instant::now();
    let record = |answer: Answer| AdvanceRecord {
        flow_id: req.flow_id.clone(),
        event_id: req.event_id.clone(),
        expected_seq: req.expected_seq,
        kind: req.kind.clone(),
        schema: req.schema,
        amount: req.amount,
        intent,
        answer,
    };
    loop {
        let call = match conn.client() {
            Ok(mut client) => tokio::time::timeout(hang, client.advance(req.clone())).await,
            Err(e) => {
                progress.fail(e);
                return None;
            }
        };
        let failure = match call {
            Ok(Ok(resp)) => {
                let answer = answer_of(resp.get_ref());
                progress.record(record(answer.clone()));
                return Some(answer);
            }
            Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                let answer = Answer::Other { what: format!("INVALID_ARGUMENT: {}", status.message()) };
                progress.record(record(answer.clone()));
                return Some(answer);
            }
            Ok(Err(status)) => format!("{:?}: {}", status.code(), status.message()),
            Err(_) => format!("no answer within {hang:?}"),
        };
        progress.record(record(Answer::Unknown { error: failure.clone() }));
        progress.unknown.fetch_add(1, Ordering::Relaxed);
        if started.elapsed() > hang || progress.failed() {
            progress.fail(format!("Advance {} kept failing for {hang:?}: {failure}", req.event_id));
            return None;
        }
        conn.after_failure().await;
    }
}

fn request(
    flow: &str,
    event_id: String,
    expected_seq: u64,
    kind: &str,
    schema: u32,
    amount: i64,
) -> pb::AdvanceRequest {
    pb::AdvanceRequest { flow_id: flow.into(), event_id, expected_seq, kind: kind.into(), schema, amount }
}

/// One flow's three steps, each maybe preceded by a seeded decoy. `false` on a hang.
async fn run_flow(n: u64, conn: &mut ProducerConn, progress: &Progress, opts: &LoadOptions) -> bool {
    let mut rng = Rng::derive(opts.seed, n);
    let flow = format!("f{n:06}");
    let amount = rng.between(1, 9) as i64;
    let mut previous: Option<pb::AdvanceRequest> = None;
    for s in 1..=3u64 {
        let schema = if rng.percent(opts.schema2_percent) { 2 } else { 1 };
        if rng.percent(opts.decoy_percent) {
            let choices: &[Intent] = if s == 1 {
                &[Intent::Stale, Intent::Invalid]
            } else {
                &[Intent::Stale, Intent::Invalid, Intent::Conflict, Intent::Existing]
            };
            let intent = *rng.pick(choices);
            // Conflict and Existing are drawn only from step 2 on, when `previous` exists.
            let decoy = match (intent, &previous) {
                (Intent::Stale, _) => {
                    request(&flow, format!("{flow}.s{s}"), s, KINDS[s as usize - 1], schema, amount)
                }
                (Intent::Conflict, Some(prev)) => {
                    pb::AdvanceRequest { amount: prev.amount + 1, ..prev.clone() }
                }
                (Intent::Existing, Some(prev)) => prev.clone(),
                // An illegal kind for the flow's state (new→confirmed, reserved→released,
                // confirmed→reserved).
                _ => request(&flow, format!("{flow}.x{s}"), s - 1, KINDS[s as usize % 3], schema, amount),
            };
            if advance(conn, progress, &decoy, intent, opts.hang).await.is_none() {
                return false;
            }
        }
        let req = request(&flow, format!("{flow}.{s}"), s - 1, KINDS[s as usize - 1], schema, amount);
        match advance(conn, progress, &req, Intent::Step, opts.hang).await {
            None => return false,
            Some(Answer::Committed { .. } | Answer::Existing { .. }) => {
                progress.committed.fetch_add(1, Ordering::SeqCst);
                progress.changed.notify_waiters();
            }
            // A wrong answer is kept in the history for the checker; the flow cannot go on.
            Some(_) => return true,
        }
        previous = Some(req);
    }
    true
}

/// One Advance client: runs flows (claimed from a shared counter) until the load stops or
/// the flows run out, never letting the committed-but-unapplied backlog pass the cap.
pub async fn client(
    next_flow: &AtomicU64,
    ep: watch::Receiver<Endpoint>,
    progress: &Progress,
    opts: &LoadOptions,
    more_flows: impl Fn(u64) -> bool,
) {
    let mut conn = ProducerConn { ep, generation: 0, client: None };
    loop {
        let backlog_ok = progress
            .wait_until(opts.hang, |p| {
                p.stop_load.load(Ordering::SeqCst)
                    || p.committed.load(Ordering::SeqCst)
                        <= p.applied.load(Ordering::SeqCst) + opts.max_backlog
            })
            .await;
        if !backlog_ok {
            progress
                .fail(format!("the applied count did not follow the committed count for {:?}", opts.hang));
            return;
        }
        if progress.stop_load.load(Ordering::SeqCst) {
            return;
        }
        let n = next_flow.fetch_add(1, Ordering::SeqCst);
        if !more_flows(n) {
            return;
        }
        progress.flows_started.fetch_add(1, Ordering::SeqCst);
        let now = progress.in_progress.fetch_add(1, Ordering::SeqCst) + 1;
        progress.max_in_progress.fetch_max(now, Ordering::SeqCst);
        let ok = run_flow(n, &mut conn, progress, opts).await;
        progress.in_progress.fetch_sub(1, Ordering::SeqCst);
        progress.flows_done.fetch_add(1, Ordering::SeqCst);
        if !ok {
            return;
        }
    }
}

/// A connection to the current consumer, re-made after every restart.
struct ConsumerConn {
    ep: watch::Receiver<Endpoint>,
    generation: u64,
    client: Option<ConsumerClient<Channel>>,
}

impl ConsumerConn {
    fn client(&mut self) -> Option<ConsumerClient<Channel>> {
        let ep = self.ep.borrow_and_update().clone();
        if self.client.is_none() || ep.generation != self.generation {
            let channel = Channel::from_shared(ep.url.clone())
                .ok()?
                .connect_timeout(Duration::from_secs(2))
                .connect_lazy();
            self.client = Some(ConsumerClient::new(channel));
            self.generation = ep.generation;
        }
        self.client.clone()
    }

    async fn after_failure(&mut self) {
        if self.ep.borrow().generation == self.generation {
            let _ = tokio::time::timeout(Duration::from_millis(250), self.ep.changed()).await;
        }
    }
}

/// Stands in for `consumer --auto-apply` until it exists: `ApplyAll` in a loop, across
/// consumer restarts; when a call applied nothing, waits for new inbox rows.
pub async fn applier(ep: watch::Receiver<Endpoint>, progress: &Progress) {
    let mut conn = ConsumerConn { ep, generation: 0, client: None };
    while !progress.stop_all.load(Ordering::SeqCst) {
        let seen = progress.inbox_rows.load(Ordering::SeqCst);
        let generation = conn.ep.borrow().generation;
        let Some(mut client) = conn.client() else { return };
        match client.apply_all(pb::ApplyAllRequest { max_steps: 0 }).await {
            Ok(resp) => {
                progress.apply_calls.fetch_add(1, Ordering::Relaxed);
                let applied: u64 = resp.get_ref().results.iter().map(|r| u64::from(r.applied)).sum();
                progress.applied_by_applier.fetch_add(applied, Ordering::Relaxed);
                if applied == 0 {
                    // Nothing to do until something new arrives (or the consumer restarts).
                    progress
                        .wait_until(Duration::from_secs(1), |p| {
                            p.stop_all.load(Ordering::SeqCst)
                                || p.inbox_rows.load(Ordering::SeqCst) != seen
                                || conn.ep.borrow().generation != generation
                        })
                        .await;
                }
            }
            Err(_) => conn.after_failure().await,
        }
    }
}

/// One row read back for injection: (event_id, flow_id, seq, kind, schema, payload JSON).
type Row = (String, String, u64, String, u32, serde_json::Value);

/// Reads bodies from the file at `path` with `read` and parses them (none when the file is
/// busy or unreadable: injection is best effort).
fn read_rows(path: &Target, read: impl FnOnce(&Session) -> Result<Vec<String>, String>) -> Vec<Row> {
    let bodies = db::try_open_ro(path).and_then(|conn| read(&conn)).unwrap_or_default();
    bodies.iter().filter_map(|b| canon::parse_body(b)).collect()
}

fn envelope(row: &Row, payload: &serde_json::Value) -> pb::EventEnvelope {
    pb::EventEnvelope {
        event_id: row.0.clone(),
        flow_id: row.1.clone(),
        seq: row.2,
        kind: row.3.clone(),
        schema: row.4,
        payload_json: payload.to_string(),
        committed_at_us: None,
    }
}

fn members(payload: &serde_json::Value) -> Vec<(String, canon::Value)> {
    payload
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let value = match v {
                        serde_json::Value::String(s) => canon::Value::Str(s.clone()),
                        serde_json::Value::Bool(b) => canon::Value::Bool(*b),
                        serde_json::Value::Number(n) => {
                            n.as_i64().map_or(canon::Value::Null, canon::Value::Int)
                        }
                        _ => canon::Value::Null,
                    };
                    (k.clone(), value)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Plays a misbehaving network between producer and consumer: every `inject_every` newly
/// committed events it sends some unaccepted outbox rows straight to the consumer, highest
/// seq first and some twice (early, reordered and duplicate arrivals), plus forged
/// deliveries of stored events (same id with another body; a new id at a held seq) that
/// the consumer must refuse. It never marks anything accepted: that stays the relays' job.
pub async fn injector(
    files: &crate::checker::Files,
    ep: watch::Receiver<Endpoint>,
    progress: &Progress,
    opts: &LoadOptions,
) {
    let mut rng = Rng::derive(opts.seed ^ 0x1A7E_C700, 0);
    let mut conn = ConsumerConn { ep, generation: 0, client: None };
    let mut forged_n = 0u64;
    loop {
        let mark = progress.committed.load(Ordering::SeqCst);
        progress
            .wait_until(opts.hang, |p| {
                p.stop_load.load(Ordering::SeqCst)
                    || p.committed.load(Ordering::SeqCst) >= mark + opts.inject_every
            })
            .await;
        if progress.stop_load.load(Ordering::SeqCst) {
            return;
        }
        // Newest unaccepted later steps whose predecessor is unaccepted too: sent now, they
        // are likely to overtake it.
        let mut rows = read_rows(&files.producer_db, |c| db::unaccepted_successor_bodies(c, 6));
        // Highest seq first within each flow: a later step overtakes the earlier ones.
        rows.sort_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)));
        let mut batch: Vec<pb::EventEnvelope> = Vec::new();
        for row in &rows {
            batch.push(envelope(row, &row.5));
            if rng.percent(30) {
                batch.push(envelope(row, &row.5));
            }
        }
        let real = batch.len();
        let stored = read_rows(&files.consumer_db, |c| db::newest_inbox_bodies(c, 4));
        let mut forged: Vec<ForgedRecord> = Vec::new();
        if let Some(row) = stored.first() {
            // Same event id, another body.
            let mut payload = row.5.clone();
            if let Some(map) = payload.as_object_mut() {
                map.insert("forged".into(), serde_json::Value::Bool(true));
            }
            batch.push(envelope(row, &payload));
            forged.push(forged_record(row, &row.0, &payload));
            // A new event id at a (flow, seq) the consumer already holds.
            forged_n += 1;
            let id = format!("forged-{forged_n}");
            let mut env = envelope(row, &row.5);
            env.event_id = id.clone();
            batch.push(env);
            forged.push(forged_record(row, &id, &row.5));
        }
        let Some(mut client) = conn.client() else { return };
        let answers = match client.receive(tokio_stream::iter(batch.clone())).await {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                let mut out = Vec::new();
                while let Ok(Some(a)) = stream.message().await {
                    out.push(a);
                }
                out
            }
            Err(_) => Vec::new(),
        };
        if answers.is_empty() {
            conn.after_failure().await;
        }
        for (i, a) in answers.iter().enumerate() {
            let word = pb::ReceiveOutcome::try_from(a.outcome)
                .map(|o| o.as_str_name().trim_start_matches("RECEIVE_OUTCOME_").to_owned())
                .unwrap_or_else(|_| format!("outcome {}", a.outcome));
            if i < real {
                progress.injected.fetch_add(1, Ordering::Relaxed);
                if word == "DUPLICATE" {
                    progress.injected_duplicates.fetch_add(1, Ordering::Relaxed);
                }
            } else if let Some(f) = forged.get_mut(i - real) {
                f.answer = word;
            }
        }
        for f in forged.iter_mut().filter(|f| f.answer.is_empty()) {
            // The stream broke first; the checker still looks for it in the inbox.
            f.answer = "UNANSWERED".into();
        }
        progress.forged.fetch_add(forged.len() as u64, Ordering::Relaxed);
        progress.history.lock().unwrap_or_else(|p| p.into_inner()).forged.extend(forged);
    }
}

fn forged_record(row: &Row, event_id: &str, payload: &serde_json::Value) -> ForgedRecord {
    ForgedRecord {
        event_id: event_id.to_owned(),
        flow_id: row.1.clone(),
        seq: row.2,
        body: canon::Body {
            event_id: event_id.to_owned(),
            flow_id: row.1.clone(),
            seq: row.2,
            kind: row.3.clone(),
            schema: row.4,
            payload: members(payload),
        }
        .canonical(),
        answer: String::new(),
    }
}

/// Reads the consumer's progress (effect rows, highest inbox rowid) from consumer.db every
/// few milliseconds and wakes whoever waits on it, until `stop_all`. Blocking: run it on
/// its own thread.
pub fn monitor(consumer_db: &Target, progress: &Progress) {
    let open = || db::try_open_ro(consumer_db);
    let read = |conn: &Session| -> Result<(u64, u64), String> {
        Ok((db::count_effects(conn)?, db::inbox_high_water(conn)?))
    };
    let mut conn: Option<Session> = None;
    while !progress.stop_all.load(Ordering::SeqCst) {
        if conn.is_none() {
            conn = open().ok();
        }
        match conn.as_ref().map(read) {
            Some(Ok((applied, rows))) => {
                progress.applied.store(applied, Ordering::SeqCst);
                progress.inbox_rows.store(rows, Ordering::SeqCst);
                progress.changed.notify_waiters();
            }
            // Reopen next time (the file may have been mid-recovery after a kill).
            _ => conn = None,
        }
        // The pause between two reads of the file: this thread is a poller by design.
        std::thread::park_timeout(Duration::from_millis(10));
    }
}
