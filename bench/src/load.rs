//! The load: N flows × 3 steps through `Advance`, either closed loop (C clients, each
//! waiting for its answer before its next call) or open loop (flows started on a schedule at
//! a given call rate, whatever the latency). Each call is retried with the same event id
//! after a transport error, which `Advance` allows. The calls go through [`crate::lean`]'s
//! client unless `--client tonic` asks for the generated one.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use proto::pb;
use proto::pb::producer_client::ProducerClient;
use serde::Serialize;
use tonic::transport::Channel;

/// How the calls are offered.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Load {
    /// `clients` concurrent callers, each one call at a time.
    Closed { clients: usize },
    /// Flows started so that calls arrive at `calls_per_s` on average.
    Open { calls_per_s: f64 },
}

/// Which gRPC client the callers use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Client {
    /// One HTTP/2 stream per call on a shared `h2` connection (see `lean.rs`): the least CPU
    /// taken from the services on the same machine.
    Lean,
    /// tonic's generated `ProducerClient` over a tonic `Channel`.
    Tonic,
}

/// A caller's handle on one connection.
#[derive(Clone)]
enum Caller {
    Lean(crate::lean::Connection),
    Tonic(ProducerClient<Channel>),
}

impl Caller {
    async fn advance(&mut self, req: &pb::AdvanceRequest) -> Result<pb::AdvanceResponse, String> {
        match self {
            Caller::Lean(connection) => connection.advance(req).await,
            Caller::Tonic(client) => {
                client.advance(req.clone()).await.map(tonic::Response::into_inner).map_err(|s| s.to_string())
            }
        }
    }
}

/// What the callers saw.
#[derive(Debug, Default)]
pub struct LoadResult {
    /// Wall clock (µs since the epoch) when the first call was sent.
    pub first_send_us: i64,
    /// Wall clock when the last answer arrived.
    pub last_answer_us: i64,
    pub calls: u64,
    /// Answers other than COMMITTED (or EXISTING after a retry): a broken run.
    pub unexpected: Vec<String>,
    /// Calls retried after a transport error.
    pub retries: u64,
    /// Latency of each call as its caller saw it, µs.
    pub latencies_us: Vec<u32>,
    /// Open loop: how far behind schedule the latest flow start was, ms.
    pub max_start_lag_ms: f64,
}

const KINDS: [&str; 3] = ["reserved", "confirmed", "released"];
const RETRIES: usize = 20;

/// The id of flow `k` of a run.
pub fn flow_id(prefix: &str, k: usize) -> String {
    format!("{prefix}{k:07}")
}

async fn connect(client: Client, url: &str, n: usize) -> anyhow::Result<Vec<Caller>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        out.push(match client {
            Client::Lean => Caller::Lean(crate::lean::Connection::connect(url).await?),
            Client::Tonic => {
                Caller::Tonic(ProducerClient::new(Channel::from_shared(url.to_owned())?.connect().await?))
            }
        });
    }
    Ok(out)
}

/// One flow's three steps, back to back.
async fn drive_flow(mut caller: Caller, flow: String) -> LoadResult {
    let mut r = LoadResult::default();
    for (i, kind) in KINDS.iter().enumerate() {
        let req = harness::advance(&flow, &format!("{flow}-{}", i + 1), i as u64, kind, 1);
        let started = Instant::now();
        let mut attempt = 0;
        let answer = loop {
            match caller.advance(&req).await {
                Ok(answer) => break Ok(answer),
                Err(status) if attempt >= RETRIES => break Err(status),
                Err(_) => {
                    attempt += 1;
                    r.retries += 1;
                    tokio::time::sleep(Duration::from_millis(10 << attempt.min(6))).await;
                }
            }
        };
        r.latencies_us.push(started.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
        r.calls += 1;
        match answer {
            Ok(a) => {
                let outcome =
                    pb::AdvanceOutcome::try_from(a.outcome).unwrap_or(pb::AdvanceOutcome::Unspecified);
                let ok = outcome == pb::AdvanceOutcome::Committed
                    || (attempt > 0 && outcome == pb::AdvanceOutcome::Existing);
                if !ok {
                    r.unexpected.push(format!("{flow} step {}: {outcome:?} {}", i + 1, a.detail));
                    return r;
                }
            }
            Err(status) => {
                r.unexpected.push(format!("{flow} step {}: {status}", i + 1));
                return r;
            }
        }
    }
    r
}

fn merge(into: &mut LoadResult, part: LoadResult) {
    into.calls += part.calls;
    into.retries += part.retries;
    into.unexpected.extend(part.unexpected);
    into.latencies_us.extend(part.latencies_us);
}

/// Drives `flows` flows named `prefix…` through the producer at `url`.
pub async fn drive(
    urls: &[String],
    prefix: &str,
    flows: usize,
    load: Load,
    connections: usize,
    client: Client,
) -> anyhow::Result<LoadResult> {
    // `connections` to each producer; callers take them in turn, so the load is spread.
    let mut channels = Vec::new();
    for url in urls {
        channels.extend(connect(client, url, connections).await?);
    }
    let mut total = LoadResult { first_send_us: now_us(), ..LoadResult::default() };
    match load {
        Load::Closed { clients } => {
            let next = Arc::new(AtomicUsize::new(0));
            let workers: Vec<_> = (0..clients.max(1))
                .map(|c| {
                    let caller = channels[c % channels.len()].clone();
                    let next = Arc::clone(&next);
                    let prefix = prefix.to_owned();
                    tokio::spawn(async move {
                        let mut mine = LoadResult::default();
                        loop {
                            let k = next.fetch_add(1, Ordering::Relaxed);
                            if k >= flows {
                                return mine;
                            }
                            let part = drive_flow(caller.clone(), flow_id(&prefix, k)).await;
                            merge(&mut mine, part);
                        }
                    })
                })
                .collect();
            for worker in workers {
                merge(&mut total, worker.await?);
            }
        }
        Load::Open { calls_per_s } => {
            anyhow::ensure!(calls_per_s > 0.0, "--rate must be positive");
            let between_flows = Duration::from_secs_f64(KINDS.len() as f64 / calls_per_s);
            let start = Instant::now();
            let mut tasks = Vec::with_capacity(flows);
            for k in 0..flows {
                let due = start + between_flows.mul_f64(k as f64);
                tokio::time::sleep_until(due.into()).await;
                let lag = Instant::now().saturating_duration_since(due).as_secs_f64() * 1e3;
                total.max_start_lag_ms = total.max_start_lag_ms.max(lag);
                let caller = channels[k % channels.len()].clone();
                tasks.push(tokio::spawn(drive_flow(caller, flow_id(prefix, k))));
            }
            for task in tasks {
                merge(&mut total, task.await?);
            }
        }
    }
    total.last_answer_us = now_us();
    Ok(total)
}

/// Microseconds since the Unix epoch (the clock the services stamp their rows with).
pub fn now_us() -> i64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}
