//! The `ordered_events.v1.Producer` gRPC service: validates, hands each `Advance` to the
//! store (group-committed: one transaction per batch, a savepoint per call, answered after
//! the commit), and maps outcomes, and in exactly one place store errors, to the wire.

use std::future::Future;

use proto::crash::CrashSwitch;
use proto::pb;
use proto::target::DbTarget;
use runtime::OpenError;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::metrics;
use crate::request;
use crate::store::{AdvanceOutcome, AdvanceReply, OutboxRecord, ProducerStore, Role, StoreError};

/// What the producer needs to run (validated flags).
#[derive(Clone, Debug)]
pub struct Config {
    /// The producer database: a SQLite file (created with its schema if missing) or a
    /// PostgreSQL URL (the schema is created on first start).
    pub db: DbTarget,
    /// The crash point this process is armed with, if any.
    pub crash: CrashSwitch,
    /// The most `Advance` calls one transaction (one durable commit) may hold; 1 commits
    /// each call alone.
    pub max_batch: usize,
    /// Refuse new steps (RESOURCE_EXHAUSTED) while this many outbox rows wait for the relay.
    pub max_unaccepted: Option<u64>,
}

/// The service state: the producer store (its writer owns the writes).
#[derive(Clone)]
pub struct ProducerService {
    store: ProducerStore,
}

impl ProducerService {
    /// Opens (creating if needed) the producer database, logs the effective settings and
    /// starts the writer.
    pub async fn open(config: &Config) -> Result<ProducerService, OpenError> {
        let role = Role::Server { max_batch: config.max_batch, max_unaccepted: config.max_unaccepted };
        Ok(ProducerService { store: ProducerStore::open(&config.db, role, config.crash).await? })
    }

    /// The store, e.g. for the metrics' gauges.
    pub fn store(&self) -> &ProducerStore {
        &self.store
    }
}

impl From<StoreError> for Status {
    /// The one mapping of store errors to statuses: a busy or unreachable database (and a
    /// lost serialization race) is `UNAVAILABLE`, retryable; anything else is `INTERNAL`.
    /// Either way nothing of the call was committed.
    fn from(e: StoreError) -> Status {
        if e.is_retryable() { Status::unavailable(e.to_string()) } else { Status::internal(e.to_string()) }
    }
}

/// Serves the producer on `listener` until `shutdown` completes.
pub async fn run(
    service: ProducerService,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    settings: &runtime::serve::ServerSettings,
) -> Result<(), tonic::transport::Error> {
    let storage = service.store.serving();
    let svc = pb::producer_server::ProducerServer::new(service)
        .max_decoding_message_size(settings.max_message_bytes());
    runtime::serve_authenticated(listener, svc, shutdown, settings, storage).await
}

fn event_pb(row: OutboxRecord) -> pb::StoredEvent {
    pb::StoredEvent {
        body_sha256: tombstone_digest(&row),
        event_id: row.event_id,
        flow_id: row.flow_id,
        seq: row.seq,
        kind: row.kind,
        schema: row.schema,
        body: row.body,
        compacted: row.compacted,
    }
}

/// The digest a compacted row shows, in lower-case hex (empty for a row with its body).
fn tombstone_digest(row: &OutboxRecord) -> String {
    match (row.compacted, row.body_sha256) {
        (true, Some(d)) => d.iter().map(|b| format!("{b:02x}")).collect(),
        _ => String::new(),
    }
}

/// An outcome that has no `AdvanceOutcome` on the wire: a full outbox is answered with the
/// status `RESOURCE_EXHAUSTED` (see [`outbox_full`]), never with a value in the response.
#[derive(Debug, PartialEq, Eq)]
pub struct NotAnAnswer {
    /// Committed events waiting for the relay.
    pub unaccepted: u64,
}

impl TryFrom<&AdvanceOutcome> for pb::AdvanceOutcome {
    type Error = NotAnAnswer;

    fn try_from(o: &AdvanceOutcome) -> Result<Self, NotAnAnswer> {
        Ok(match o {
            AdvanceOutcome::Committed => pb::AdvanceOutcome::Committed,
            AdvanceOutcome::Existing => pb::AdvanceOutcome::Existing,
            AdvanceOutcome::Conflict => pb::AdvanceOutcome::Conflict,
            AdvanceOutcome::Stale => pb::AdvanceOutcome::Stale,
            AdvanceOutcome::InvalidTransition(_) => pb::AdvanceOutcome::InvalidTransition,
            AdvanceOutcome::OutboxFull { unaccepted } => return Err(NotAnAnswer { unaccepted: *unaccepted }),
        })
    }
}

fn detail(reply: &AdvanceReply, expected_seq: u64) -> String {
    match &reply.outcome {
        AdvanceOutcome::Committed | AdvanceOutcome::Existing => String::new(),
        AdvanceOutcome::Conflict if reply.event.as_ref().is_some_and(|e| e.compacted) => {
            "event_id is already committed with a different body (compacted: its digest differs)".into()
        }
        AdvanceOutcome::Conflict => "event_id is already committed with a different body".into(),
        AdvanceOutcome::Stale => {
            format!("expected_seq {expected_seq} but the flow is at seq {}", reply.flow.seq)
        }
        AdvanceOutcome::InvalidTransition(e) => e.to_string(),
        AdvanceOutcome::OutboxFull { unaccepted } => format!("{unaccepted} outbox rows wait for the relay"),
    }
}

/// The status for an Advance refused because the outbox is at its cap: the caller retries
/// later (nothing was dropped or changed).
fn outbox_full(unaccepted: u64) -> Status {
    Status::resource_exhausted(format!(
        "outbox full: {unaccepted} committed events wait for the relay (--max-unaccepted); nothing changed, retry later"
    ))
}

#[tonic::async_trait]
impl pb::producer_server::Producer for ProducerService {
    async fn advance(
        &self,
        request: Request<pb::AdvanceRequest>,
    ) -> Result<Response<pb::AdvanceResponse>, Status> {
        let req = request.into_inner();
        let expected_seq = req.expected_seq;
        // The ids move into the command; the debug line below gets copies only when it is on.
        let ids =
            tracing::enabled!(tracing::Level::DEBUG).then(|| (req.flow_id.clone(), req.event_id.clone()));
        let cmd = request::validate(req).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let started = std::time::Instant::now();
        let counted = |index: usize| {
            metrics::ADVANCE_OUTCOMES.inc(index);
            metrics::ADVANCE_LATENCY.observe_since(started);
        };
        let reply = self.store.advance(cmd).await.inspect_err(|_| counted(metrics::ADVANCE_ERROR))?;
        let outcome =
            pb::AdvanceOutcome::try_from(&reply.outcome).map_err(|NotAnAnswer { unaccepted }| {
                counted(5);
                outbox_full(unaccepted)
            })?;
        counted(outcome_index(outcome));
        if let Some((flow_id, event_id)) = ids {
            tracing::debug!(%flow_id, %event_id, outcome = ?reply.outcome, "advance");
        }
        let detail = detail(&reply, expected_seq);
        Ok(Response::new(pb::AdvanceResponse {
            outcome: outcome as i32,
            seq: reply.flow.seq,
            state: reply.flow.state.as_str().to_owned(),
            event: reply.event.map(event_pb),
            detail,
        }))
    }

    async fn get_flow(
        &self,
        request: Request<pb::GetFlowRequest>,
    ) -> Result<Response<pb::ProducerFlow>, Status> {
        let flow_id = request.into_inner().flow_id;
        proto::limits::check_token("flow_id", &flow_id, proto::limits::MAX_ID_BYTES)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let (flow, rows) = self.store.flow(flow_id.clone()).await?;
        let lease = self.store.flow_lease(&flow_id).await?;
        Ok(Response::new(pb::ProducerFlow {
            partition: lease.as_ref().map(|l| u32::from(l.partition)),
            lease_owner: lease.as_ref().and_then(|l| l.owner.clone()).unwrap_or_default(),
            lease_epoch: lease.as_ref().filter(|l| l.owner.is_some()).map_or(0, |l| l.epoch),
            flow_id,
            seq: flow.seq,
            state: flow.state.as_str().to_owned(),
            amount: flow.amount,
            outbox: rows
                .into_iter()
                .map(|r| pb::OutboxRow {
                    compacted: r.compacted,
                    body_sha256: tombstone_digest(&r),
                    event_id: r.event_id,
                    seq: r.seq,
                    kind: r.kind,
                    schema: r.schema,
                    body: r.body,
                    accepted: r.accepted,
                    attempts: r.attempts,
                    last_outcome: r.last_outcome.unwrap_or_default(),
                })
                .collect(),
        }))
    }
}

/// The [`metrics::ADVANCE_OUTCOMES`] label of an answered outcome.
fn outcome_index(outcome: pb::AdvanceOutcome) -> usize {
    match outcome {
        pb::AdvanceOutcome::Committed => 0,
        pb::AdvanceOutcome::Existing => 1,
        pb::AdvanceOutcome::Conflict => 2,
        pb::AdvanceOutcome::Stale => 3,
        pb::AdvanceOutcome::InvalidTransition => 4,
        _ => metrics::ADVANCE_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::flow::TransitionError;

    #[test]
    fn each_advance_outcome_has_one_wire_answer_and_a_full_outbox_has_none() {
        let invalid = AdvanceOutcome::InvalidTransition(TransitionError::AmountChanged { fixed: 3, got: 5 });
        let table = [
            (AdvanceOutcome::Committed, pb::AdvanceOutcome::Committed),
            (AdvanceOutcome::Existing, pb::AdvanceOutcome::Existing),
            (AdvanceOutcome::Conflict, pb::AdvanceOutcome::Conflict),
            (AdvanceOutcome::Stale, pb::AdvanceOutcome::Stale),
            (invalid, pb::AdvanceOutcome::InvalidTransition),
        ];
        for (outcome, wire) in &table {
            assert_eq!(pb::AdvanceOutcome::try_from(outcome), Ok(*wire), "{outcome:?}");
        }
        // Never UNSPECIFIED in a response: the handler turns it into RESOURCE_EXHAUSTED.
        let full = AdvanceOutcome::OutboxFull { unaccepted: 7 };
        assert_eq!(pb::AdvanceOutcome::try_from(&full), Err(NotAnAnswer { unaccepted: 7 }));
        assert_eq!(outbox_full(7).code(), tonic::Code::ResourceExhausted);
    }
}
