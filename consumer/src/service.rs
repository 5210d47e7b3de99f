//! The `ordered_events.v1.Consumer` gRPC service: checks transport limits and requests, calls
//! the store (Receive through the group-committing writer, `receive`), answers each envelope
//! in order and only after its commit, and maps domain outcomes to the wire here and store
//! failures in one place (`StoreError::status`).

use std::future::Future;
use std::sync::Arc;

use proto::body::Event;
use proto::crash::CrashSwitch;
use proto::pb;
use proto::target::DbTarget;
use runtime::OpenError;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::apply::{self, ApplyFailure, ApplyOptions, ApplyReport, Stop};
use crate::receive::{self, ReceiveJob, Received, StreamState, WriterOptions};
use crate::request;
use crate::rules::{BlockReason, Waiting, why_waiting};
use crate::storage::StorageWatch;
use crate::store::{self, ConsumerStore, EffectRecord, InboxRecord, ReceiveOutcome};

/// What the consumer needs to run (validated flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// consumer.db or a PostgreSQL database; created with its schema if missing.
    pub db: DbTarget,
    /// Decode schema 2 (`{"units": n}`).
    pub support_v2: bool,
    /// The crash point this process is armed with, if any.
    pub crash: CrashSwitch,
    /// Envelopes per Receive transaction (one durable commit); 1 commits each alone.
    pub max_batch: usize,
    /// Applied steps per Apply transaction; 1 commits each step alone.
    pub apply_batch: usize,
    /// Apply the flows of every committed Receive batch without waiting for an Apply call.
    pub auto_apply: bool,
    /// The backlog cap on unapplied inbox rows.
    pub admission: store::Admission,
    /// How long an applied inbox row keeps its body before compaction (a background pass
    /// every `retention.pass_interval()`; none when off).
    pub retention: runtime::retention::Retention,
}

/// Answers buffered per `Receive` stream before the reader waits for the client.
const RECEIVE_BUFFER: usize = 64;
/// Envelopes of one `Receive` stream read and queued for the writer but not yet answered:
/// enough for a relay's whole window to share a commit.
const STREAM_IN_FLIGHT: usize = 4096;

/// The service state: the store, the Receive writer's queue, and the stop signal that ends
/// open `Receive` streams at shutdown.
#[derive(Clone)]
pub struct ConsumerService {
    store: ConsumerStore,
    opts: ApplyOptions,
    writer: mpsc::Sender<ReceiveJob>,
    stopping: Arc<watch::Sender<bool>>,
    storage: &'static StorageWatch,
    /// How this process describes itself to ListStuck callers.
    instance: pb::ConsumerInstance,
}

/// One envelope of a stream, in read order: answered already, or waiting for its commit.
enum Pending {
    Ready(Answer),
    Waiting { event: EventRef, answer: oneshot::Receiver<Result<Received, Status>> },
}

/// What an answer says about its envelope.
struct EventRef {
    event_id: String,
    flow_id: String,
    seq: u64,
}

impl ConsumerService {
    /// Opens (creating if needed) the database, logs the effective settings and starts the
    /// Receive writer task (call it on the runtime that will serve).
    pub async fn open(config: &Config) -> Result<ConsumerService, OpenError> {
        let store = ConsumerStore::open(&config.db).await?;
        let instance = pb::ConsumerInstance {
            instance_id: format!("consumer-{}-{:x}", std::process::id(), runtime::now_us()),
            support_v2: config.support_v2,
            auto_apply: config.auto_apply,
        };
        tracing::info!(
            instance = %instance.instance_id,
            v2_decoder = if config.support_v2 { "enabled" } else { "disabled" },
            max_batch = config.max_batch,
            apply_batch = config.apply_batch,
            auto_apply = config.auto_apply,
            admission = ?config.admission,
            "consumer writer and applier"
        );
        let identity = store.identity().await.map_err(|e| OpenError::Identity(e.to_string()))?;
        tracing::info!(
            database_id = %identity.database_id,
            highest_inbox_position = identity.highest_position,
            "consumer database identity"
        );
        let storage = StorageWatch::new(&config.db).leak();
        let opts = ApplyOptions {
            support_v2: config.support_v2,
            crash: config.crash,
            max_batch: config.apply_batch,
            storage: Some(storage),
            compact_applied: config.retention.age_us() == Some(0),
        };
        storage.spawn_recovery(store.clone(), config.auto_apply.then_some(opts));
        crate::compaction::spawn(store.clone(), config.retention, config.crash);
        let writer = receive::spawn(
            store.clone(),
            WriterOptions {
                max_batch: config.max_batch,
                auto_apply: config.auto_apply,
                apply: opts,
                admission: config.admission,
            },
        );
        Ok(ConsumerService {
            store,
            opts,
            writer,
            stopping: Arc::new(watch::channel(false).0),
            storage,
            instance,
        })
    }

    /// The store this service uses.
    pub fn store(&self) -> &ConsumerStore {
        &self.store
    }

    /// Starts answering one `Receive` stream's envelopes; the answers come out of the
    /// returned stream, in order.
    pub(crate) fn receive_envelopes(&self, inbound: Envelopes) -> ReceiveAnswers {
        let (answers, stream) = mpsc::channel(RECEIVE_BUFFER);
        tokio::spawn(self.clone().answer_stream(inbound, answers));
        ReceiverStream::new(stream)
    }

    /// Answers `inbound`'s envelopes in read order until the client half-closes: a reader
    /// task queues every envelope for the writer without waiting for earlier answers (so a
    /// whole window shares a commit), and this loop sends each answer once its commit is
    /// done. Stops after the first storage failure (sent as the stream's error status, after
    /// every committed envelope before it was answered), when the client goes away, or at
    /// shutdown (after answering everything read).
    async fn answer_stream(self, inbound: Envelopes, answers: mpsc::Sender<Answer>) {
        let stream = Arc::new(StreamState::default());
        let (queue, mut pending) = mpsc::channel(STREAM_IN_FLIGHT);
        tokio::spawn(self.read_stream(inbound, queue, Arc::clone(&stream)));
        while let Some(next) = pending.recv().await {
            let answer = match next {
                Pending::Ready(answer) => answer,
                Pending::Waiting { event, answer } => match answer.await {
                    Ok(Ok(received)) => Ok(receive_result(event, &received)),
                    Ok(Err(status)) => Err(status),
                    Err(_) => Err(Status::unavailable("receive: the writer thread stopped (shutting down?)")),
                }
                // An envelope the writer failed to store is counted as `error`; a broken
                // request stream (no envelope) is not an answer and is not counted.
                .inspect_err(|_| crate::metrics::count_receive(None)),
            };
            if let Ok(result) = &answer {
                crate::metrics::count_receive(Some(result.outcome));
            }
            let failed = answer.is_err();
            if answers.send(answer).await.is_err() {
                tracing::debug!("Receive client went away");
                stream.fail();
                return;
            }
            if failed {
                stream.fail();
                return;
            }
        }
    }

    /// Reads envelopes in order: a message that does not decode or an envelope that breaks a
    /// transport limit is answered `REJECTED` at once (nothing stored), everything else goes
    /// to the writer. Stops at the client's half-close, a broken request stream, a failed
    /// stream, or shutdown.
    async fn read_stream(
        self,
        mut inbound: Envelopes,
        queue: mpsc::Sender<Pending>,
        stream: Arc<StreamState>,
    ) {
        let mut stopping = self.stopping.subscribe();
        while !stream.failed() {
            let envelope = tokio::select! {
                biased;
                // The guard `wait_for` returns must not live across an await: drop it inside.
                _ = async { drop(stopping.wait_for(|stop| *stop).await) } => {
                    tracing::info!("shutting down: ending a Receive stream; every envelope read is answered");
                    return;
                }
                message = inbound.next() => match message {
                    Some(Ok(Ok(envelope))) => envelope,
                    Some(Ok(Err(malformed))) => {
                        // The framing is intact, so the next message can still be read.
                        let rejected = pb::ReceiveResult {
                            event_id: String::new(),
                            outcome: pb::ReceiveOutcome::Rejected as i32,
                            detail: malformed.to_string(),
                            inbox_position: 0,
                        };
                        if queue.send(Pending::Ready(Ok(rejected))).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    None => return,
                    Some(Err(status)) => {
                        // The request stream is broken (reset, or a broken frame): nothing
                        // more can be read, so nothing more is answered.
                        tracing::debug!(%status, "Receive request stream failed");
                        let _ = queue.send(Pending::Ready(Err(status))).await;
                        return;
                    }
                },
            };
            let next = match proto::limits::check_envelope_payload(&envelope) {
                Err(limit) => Pending::Ready(Ok(pb::ReceiveResult {
                    event_id: envelope.event_id,
                    outcome: pb::ReceiveOutcome::Rejected as i32,
                    detail: limit.to_string(),
                    inbox_position: 0,
                })),
                Ok(payload) => {
                    let event = Event {
                        event_id: envelope.event_id,
                        flow_id: envelope.flow_id,
                        seq: envelope.seq,
                        kind: envelope.kind,
                        schema: envelope.schema,
                        payload,
                    };
                    let event_ref = EventRef {
                        event_id: event.event_id.clone(),
                        flow_id: event.flow_id.clone(),
                        seq: event.seq,
                    };
                    let (reply, answer) = oneshot::channel();
                    let job = ReceiveJob {
                        event,
                        committed_at_us: envelope.committed_at_us,
                        stream: Arc::clone(&stream),
                        reply,
                    };
                    if self.writer.send(job).await.is_err() {
                        Pending::Ready(Err(Status::unavailable(
                            "receive: the writer thread stopped (shutting down?)",
                        )))
                    } else {
                        Pending::Waiting { event: event_ref, answer }
                    }
                }
            };
            if queue.send(next).await.is_err() {
                return;
            }
        }
    }
}

/// The wire answer for a stored decision.
fn receive_result(event: EventRef, received: &Received) -> pb::ReceiveResult {
    let outcome = &received.outcome;
    tracing::debug!(event_id = %event.event_id, flow_id = %event.flow_id, seq = event.seq, ?outcome, "receive");
    let detail = match outcome {
        ReceiveOutcome::Accepted | ReceiveOutcome::Duplicate => String::new(),
        ReceiveOutcome::IdConflict => "event_id is already stored with a different body".to_owned(),
        ReceiveOutcome::SequenceConflict { held_by } => {
            format!("seq {} of flow {} is held by event {held_by}", event.seq, event.flow_id)
        }
        ReceiveOutcome::BacklogFull { unapplied } => {
            format!("backlog full: {unapplied} unapplied rows; nothing stored, send it again later")
        }
    };
    pb::ReceiveResult {
        event_id: event.event_id,
        outcome: pb::ReceiveOutcome::from(outcome) as i32,
        detail,
        inbox_position: received.position,
    }
}

type Answer = Result<pb::ReceiveResult, Status>;

/// One `Receive` stream's requests: each an envelope, or why its message did not decode;
/// an `Err` status is a broken stream.
pub(crate) type Envelopes = std::pin::Pin<
    Box<
        dyn futures::Stream<Item = Result<Result<pb::EventEnvelope, proto::codec::Malformed>, Status>> + Send,
    >,
>;

/// One `Receive` stream's answers, in envelope order.
pub type ReceiveAnswers = ReceiverStream<Answer>;

/// Serves the consumer on `listener` until `shutdown` completes; open `Receive` streams then
/// end after answering what they read, and in-flight calls drain.
pub async fn run(
    service: ConsumerService,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    settings: &runtime::serve::ServerSettings,
) -> Result<(), tonic::transport::Error> {
    let stopping = Arc::clone(&service.stopping);
    let storage = service.storage.serving();
    let shutdown = async move {
        shutdown.await;
        stopping.send_replace(true);
    };
    let svc = crate::routes::ConsumerRoutes::new(service, settings.max_message_bytes());
    runtime::serve_authenticated(listener, svc, shutdown, settings, Some(storage)).await
}

fn failure_status(flow_id: &str, f: &ApplyFailure) -> Status {
    let status = f.source.status(&format!("apply {flow_id}"));
    Status::new(
        status.code(),
        format!("{} (this call applied {} step(s) first)", status.message(), f.applied.len()),
    )
}

fn invalid(e: proto::limits::LimitError) -> Status {
    Status::invalid_argument(e.to_string())
}

impl From<&ReceiveOutcome> for pb::ReceiveOutcome {
    fn from(o: &ReceiveOutcome) -> Self {
        match o {
            ReceiveOutcome::Accepted => pb::ReceiveOutcome::Accepted,
            ReceiveOutcome::Duplicate => pb::ReceiveOutcome::Duplicate,
            ReceiveOutcome::IdConflict => pb::ReceiveOutcome::IdConflict,
            ReceiveOutcome::SequenceConflict { .. } => pb::ReceiveOutcome::SequenceConflict,
            ReceiveOutcome::BacklogFull { .. } => pb::ReceiveOutcome::BacklogFull,
        }
    }
}

/// Why a flow waits, as ListStuck reports it. A ready flow (its next row stored and not
/// blocked) is `LIMIT`: exactly what an `Apply` that ran out of steps before that row says —
/// nothing stops it except that no `Apply` has reached it yet (auto-apply off, or an apply
/// that failed and is retried once storage commits again).
impl From<Waiting> for pb::ApplyStop {
    fn from(w: Waiting) -> Self {
        match w {
            Waiting::Ready => pb::ApplyStop::Limit,
            Waiting::Gap { .. } => pb::ApplyStop::Gap,
            Waiting::Blocked(_) => pb::ApplyStop::Blocked,
        }
    }
}

impl From<BlockReason> for pb::BlockReason {
    fn from(r: BlockReason) -> Self {
        match r {
            BlockReason::UnsupportedSchema => pb::BlockReason::UnsupportedSchema,
            BlockReason::InvalidPayload => pb::BlockReason::InvalidPayload,
            BlockReason::InvalidTransition => pb::BlockReason::InvalidTransition,
        }
    }
}

fn projection_pb(p: &crate::rules::Projection) -> pb::Projection {
    pb::Projection { last_seq: p.last_seq, state: p.state.as_str().to_owned(), held: p.held }
}

fn report_pb(report: ApplyReport) -> pb::ApplyResult {
    let mut result = pb::ApplyResult {
        flow_id: report.flow_id,
        applied: report.applied.len() as u32,
        applied_event_ids: report.applied,
        projection: Some(projection_pb(&report.projection)),
        ..Default::default()
    };
    match report.stop {
        Stop::Idle => result.stop = pb::ApplyStop::Idle as i32,
        Stop::Limit => result.stop = pb::ApplyStop::Limit as i32,
        Stop::Gap { waiting_for_seq } => {
            result.stop = pb::ApplyStop::Gap as i32;
            result.waiting_for_seq = waiting_for_seq;
        }
        Stop::Blocked { event_id, reason, detail } => {
            result.stop = pb::ApplyStop::Blocked as i32;
            result.reason = pb::BlockReason::from(reason) as i32;
            result.blocked_event_id = event_id;
            result.detail = detail;
        }
    }
    result
}

fn inbox_pb(r: InboxRecord) -> pb::InboxRow {
    pb::InboxRow {
        seq: r.seq,
        event_id: r.event_id,
        kind: r.kind,
        schema: r.schema,
        state: r.state.as_str().to_owned(),
        reason: r.reason.map(|r| r.as_str().to_owned()).unwrap_or_default(),
        compacted: r.compacted.is_some(),
        body_sha256: hex(&r.compacted.unwrap_or_else(|| runtime::retention::body_digest(r.body.as_bytes()))),
        body: r.body,
    }
}

/// Lower-case hex, as the wire shows digests.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
        // Writing into a String cannot fail.
        let _ = write!(out, "{b:02x}");
        out
    })
}

fn effect_pb(e: EffectRecord) -> pb::EffectRow {
    pb::EffectRow { seq: e.seq, event_id: e.event_id, kind: e.kind, held: e.held }
}

#[tonic::async_trait]
impl pb::consumer_server::Consumer for ConsumerService {
    type ReceiveStream = ReceiveAnswers;

    /// Served by `routes::ConsumerRoutes` with the lenient codec; this strict form (every
    /// envelope decoded) serves whoever embeds the generated server directly.
    async fn receive(
        &self,
        request: Request<Streaming<pb::EventEnvelope>>,
    ) -> Result<Response<Self::ReceiveStream>, Status> {
        let inbound: Envelopes = Box::pin(request.into_inner().map(|message| message.map(Ok)));
        Ok(Response::new(self.receive_envelopes(inbound)))
    }

    async fn apply(&self, request: Request<pb::ApplyRequest>) -> Result<Response<pb::ApplyResult>, Status> {
        let req = request.into_inner();
        request::flow_id(&req.flow_id).map_err(invalid)?;
        let max_steps = request::max_steps(req.max_steps).map_err(invalid)?;
        let opts = self.opts;
        let flow_id = req.flow_id;
        let report = apply::apply_flow(&self.store, &flow_id, max_steps, opts)
            .await
            .map_err(|f| failure_status(&flow_id, &f))?;
        tracing::debug!(flow_id = %report.flow_id, applied = report.applied.len(), stop = ?report.stop, "apply");
        Ok(Response::new(report_pb(report)))
    }

    async fn apply_all(
        &self,
        request: Request<pb::ApplyAllRequest>,
    ) -> Result<Response<pb::ApplyAllResponse>, Status> {
        let max_steps = request::max_steps(request.into_inner().max_steps).map_err(invalid)?;
        let opts = self.opts;
        let results = apply::apply_all(&self.store, max_steps, opts)
            .await
            .map_err(|e| e.status("apply_all: listing flows"))?;
        let results = results
            .into_iter()
            .map(|flow| match flow.outcome {
                Ok(report) => report_pb(report),
                Err(failure) => {
                    let status = failure_status(&flow.flow_id, &failure);
                    tracing::warn!(flow_id = %flow.flow_id, error = %status.message(), "apply_all: flow failed");
                    pb::ApplyResult {
                        flow_id: flow.flow_id,
                        applied: failure.applied.len() as u32,
                        applied_event_ids: failure.applied,
                        error: status.message().to_owned(),
                        ..Default::default()
                    }
                }
            })
            .collect();
        Ok(Response::new(pb::ApplyAllResponse { results }))
    }

    async fn get_flow(
        &self,
        request: Request<pb::GetFlowRequest>,
    ) -> Result<Response<pb::ConsumerFlow>, Status> {
        let flow_id = request.into_inner().flow_id;
        request::flow_id(&flow_id).map_err(invalid)?;
        let view = self.store.flow(flow_id.clone()).await.map_err(|e| e.status("get_flow"))?;
        Ok(Response::new(pb::ConsumerFlow {
            flow_id,
            projection: Some(projection_pb(&view.projection)),
            inbox: view.inbox.into_iter().map(inbox_pb).collect(),
            effects: view.effects.into_iter().map(effect_pb).collect(),
        }))
    }

    async fn identify(
        &self,
        request: Request<pb::IdentifyRequest>,
    ) -> Result<Response<pb::IdentifyResponse>, Status> {
        let pb::IdentifyRequest { producer_database_id: producer, probes } = request.into_inner();
        let probes = request::probes(probes).map_err(invalid)?;
        let storage = self.storage;
        // A database deleted or replaced under us must not vouch for its history.
        // Reported like a failed commit: the consumer cannot accept, so it says so
        // (NOT_SERVING, one log line) even before any envelope reaches its writer.
        storage.before_commit().map_err(|e| {
            storage.commit_failed(&e);
            e.status("identify")
        })?;
        let (identity, probes_held) = self.store.identify(probes).await.map_err(|e| {
            storage.commit_failed(&e);
            e.status("identify")
        })?;
        // Debug only: an idle `relay run` asks about once a second.
        tracing::debug!(
            producer_database_id = %producer,
            database_id = %identity.database_id,
            highest_inbox_position = identity.highest_position,
            probes = probes_held.len(),
            not_held = probes_held.iter().filter(|h| !**h).count(),
            "relay identified this consumer database"
        );
        Ok(Response::new(pb::IdentifyResponse {
            database_id: identity.database_id,
            highest_inbox_position: identity.highest_position,
            probes_held,
        }))
    }

    async fn list_stuck(
        &self,
        request: Request<pb::ListStuckRequest>,
    ) -> Result<Response<pb::ListStuckResponse>, Status> {
        let limit = request::stuck_limit(request.into_inner().limit).map_err(invalid)?;
        let (flows, total) = self.store.backlog(limit as usize).await.map_err(|e| e.status("list_stuck"))?;
        let flows = flows
            .into_iter()
            .map(|b| {
                let mut stuck = pb::StuckFlow {
                    last_seq: b.projection.last_seq,
                    waiting_rows: b.waiting_rows,
                    ..Default::default()
                };
                let waiting = why_waiting(&b.projection, b.lowest.seq, b.lowest.reason);
                stuck.why = pb::ApplyStop::from(waiting) as i32;
                match waiting {
                    Waiting::Ready => {}
                    Waiting::Gap { waiting_for_seq } => stuck.waiting_for_seq = waiting_for_seq,
                    Waiting::Blocked(reason) => {
                        stuck.reason = pb::BlockReason::from(reason) as i32;
                        stuck.blocked_seq = b.lowest.seq;
                        stuck.blocked_event_id = b.lowest.event_id;
                    }
                }
                stuck.flow_id = b.flow_id;
                stuck
            })
            .collect();
        Ok(Response::new(pb::ListStuckResponse {
            flows,
            unapplied_rows: total,
            answered_by: Some(self.instance.clone()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_waiting_reason_has_its_stop() {
        assert_eq!(pb::ApplyStop::from(Waiting::Ready), pb::ApplyStop::Limit);
        assert_eq!(pb::ApplyStop::from(Waiting::Gap { waiting_for_seq: 2 }), pb::ApplyStop::Gap);
        assert_eq!(
            pb::ApplyStop::from(Waiting::Blocked(BlockReason::InvalidPayload)),
            pb::ApplyStop::Blocked
        );
    }
}
