//! The model test (issue 9): seeded random cases of Receive / Apply / ApplyAll (duplicates,
//! reorderings, conflicting bodies, sequence conflicts, unknown schemas and schema 2 with and
//! without the v2 decoder, transport-invalid envelopes), SIGKILL-and-reopen of the consumer
//! and armed crash points, and of Advance with producer crash points, run against the real
//! `consumer` and `producer` binaries over gRPC and compared after every step with the
//! in-memory spec model of `harness::model`: each answer, and each flow's projection, inbox
//! and effects (outbox, for the producer). A failing case is shrunk and printed with its
//! seed. `ORDERED_EVENTS_MODEL_SEED` replays a seed; `ORDERED_EVENTS_MODEL_CASES` scales the
//! case counts (e.g. `10` for ten times as many).

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use harness::canon::{self, Value};
use harness::model::{self, Advance, Applied, CrashWhen, Crashed, Envelope, Stop};
use harness::proc::START_DEADLINE;
use harness::rng::Rng;
use harness::{Consumer, Producer, Workdir};
use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use proto::pb::producer_client::ProducerClient;
use tonic::transport::Channel;

const CRASH_ENV: &str = "ORDERED_EVENTS_CRASH_AT";
const CRASH_EXIT: i32 = 73;
/// Cases per server process before a fresh one on fresh files (keeps ApplyAll's work small).
const CASES_PER_RIG: usize = 100;
/// Re-runs a failing case may spend on shrinking.
const SHRINK_RUNS: usize = 150;
/// Consumer rigs running side by side (the producer test uses half as many).
const RIGS: usize = 8;
/// Mixed into the seed for the producer cases, so the two tests draw different streams.
const PRODUCER_SEED: u64 = 0x00AD_7A4C;

/// Writes straight to stderr (not captured by the test harness), so CI logs show the seed.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn seed() -> u64 {
    std::env::var("ORDERED_EVENTS_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(harness::rng::seed_from_clock)
}

fn scale() -> usize {
    std::env::var("ORDERED_EVENTS_MODEL_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(1).max(1)
}

// ---------------------------------------------------------------------------------------
// Cases, independent of names (a namespace is added when a case runs, so a shrunk case can
// run again on the same files).
// ---------------------------------------------------------------------------------------

/// How an envelope breaks a transport limit (answered REJECTED, nothing stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reject {
    EmptyId,
    SeqZero,
    SpaceInKind,
    PayloadArray,
    PayloadFloat,
    PayloadNested,
}

/// One envelope of a case: flow index, seq, event-id suffix, fields and payload members.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Env {
    flow: usize,
    seq: u64,
    id: String,
    kind: String,
    schema: u32,
    payload: Vec<(String, Value)>,
    /// Payload text written in canonical order (false: reversed, with spaces).
    tidy: bool,
    reject: Option<Reject>,
}

const FLOWS: [&str; 2] = ["A", "B"];

impl Env {
    fn model(&self, ns: &str) -> Envelope {
        Envelope {
            event_id: if self.reject == Some(Reject::EmptyId) { String::new() } else { self.event_id(ns) },
            flow_id: format!("{ns}{}", FLOWS[self.flow]),
            seq: if self.reject == Some(Reject::SeqZero) { 0 } else { self.seq },
            kind: if self.reject == Some(Reject::SpaceInKind) {
                "re served".into()
            } else {
                self.kind.clone()
            },
            schema: self.schema,
            payload: self.payload.clone(),
            rejected: self.reject.is_some(),
        }
    }

    fn event_id(&self, ns: &str) -> String {
        format!("{ns}{}-{}", FLOWS[self.flow], self.id)
    }

    fn wire(&self, ns: &str) -> pb::EventEnvelope {
        let m = self.model(ns);
        let payload_json = match self.reject {
            Some(Reject::PayloadArray) => "[1]".to_owned(),
            Some(Reject::PayloadFloat) => r#"{"amount":1.5}"#.to_owned(),
            Some(Reject::PayloadNested) => r#"{"amount":{"n":1}}"#.to_owned(),
            _ if self.tidy => canon::canonical_payload(&self.payload),
            _ => {
                let members: Vec<String> = self
                    .payload
                    .iter()
                    .rev()
                    .map(|(k, v)| {
                        let one = canon::canonical_payload(&[(k.clone(), v.clone())]);
                        format!(" {} ", &one[1..one.len() - 1].replacen(':', " : ", 1))
                    })
                    .collect();
                format!("{{{}}}", members.join(","))
            }
        };
        pb::EventEnvelope {
            event_id: m.event_id,
            flow_id: m.flow_id,
            seq: m.seq,
            kind: m.kind,
            schema: m.schema,
            payload_json,
        }
    }
}

/// One step of a consumer case.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    /// One Receive stream carrying these envelopes.
    Receive(Vec<Env>),
    Apply {
        flow: usize,
        max_steps: u32,
    },
    ApplyAll {
        max_steps: u32,
    },
    /// SIGKILL the consumer and start it again on the same file, v2 decoder on or off.
    Restart {
        v2: bool,
    },
    /// Restart the consumer armed at `point`, run `op` (a Receive for receive points, an
    /// Apply for apply points), then SIGKILL it if it is still up and restart it unarmed.
    Crash {
        point: &'static str,
        op: Box<Op>,
        v2: bool,
    },
}

const RECEIVE_POINTS: [&str; 2] = ["consumer.receive.after_insert", "consumer.receive.after_commit"];
const APPLY_POINTS: [&str; 3] =
    ["consumer.apply.after_projection", "consumer.apply.after_effect", "consumer.apply.after_commit"];

fn crash_when(point: &str) -> CrashWhen {
    if point.ends_with("after_commit") { CrashWhen::AfterCommit } else { CrashWhen::BeforeCommit }
}

/// A consumer case: the v2 setting it starts with, and its steps.
#[derive(Clone, Debug)]
struct Case {
    v2: bool,
    ops: Vec<Op>,
}

fn amount_member(schema: u32, amount: i64) -> Vec<(String, Value)> {
    canon::amount_payload(schema, amount)
}

/// Draws one envelope: mostly a flow's real events, sometimes a conflicting or broken one.
fn gen_env(rng: &mut Rng, amounts: [i64; 2], schemas: &[[u32; 3]; 2]) -> Env {
    let flow = rng.below(2) as usize;
    let seq = rng.between(1, 3);
    let kind = model::KINDS[seq as usize - 1].to_owned();
    let schema = schemas[flow][seq as usize - 1];
    let amount = amounts[flow];
    let mut env = Env {
        flow,
        seq,
        id: seq.to_string(),
        kind,
        schema,
        payload: amount_member(if schema == 2 { 2 } else { 1 }, amount),
        tidy: rng.percent(70),
        reject: None,
    };
    match rng.below(100) {
        0..=63 => {}
        // Same id, another body: a changed amount, or an extra member.
        64..=71 => {
            if rng.percent(50) {
                env.payload = amount_member(if schema == 2 { 2 } else { 1 }, amount + 1);
            } else {
                env.payload.push(("note".into(), Value::Str("x".into())));
            }
        }
        // Another id at the same (flow, seq).
        72..=77 => env.id = format!("{seq}x"),
        // Same id, a payload its schema cannot decode.
        78..=82 => {
            env.schema = 1;
            env.payload = match rng.below(3) {
                0 => vec![("amount".into(), Value::Str("3".into()))],
                1 => vec![("amount".into(), Value::Int(0))],
                _ => vec![("other".into(), Value::Bool(true))],
            };
        }
        // Same id, an illegal step: wrong kind, unknown kind, or a changed amount.
        83..=87 => match rng.below(3) {
            0 => env.kind = model::KINDS[seq as usize % 3].into(),
            1 => env.kind = "shipped".into(),
            _ => env.payload = amount_member(1, amount + 2),
        },
        // Same id, an unknown schema or schema 2.
        88..=94 => {
            env.schema = if rng.percent(50) { 7 } else { 2 };
            env.payload = amount_member(env.schema, amount);
        }
        _ => {
            env.id = format!("{seq}r");
            env.reject = Some(*rng.pick(&[
                Reject::EmptyId,
                Reject::SeqZero,
                Reject::SpaceInKind,
                Reject::PayloadArray,
                Reject::PayloadFloat,
                Reject::PayloadNested,
            ]));
        }
    }
    env
}

fn gen_receive(rng: &mut Rng, amounts: [i64; 2], schemas: &[[u32; 3]; 2]) -> Op {
    let n = rng.between(1, 4);
    Op::Receive((0..n).map(|_| gen_env(rng, amounts, schemas)).collect())
}

fn gen_case(rng: &mut Rng) -> Case {
    let amounts = [rng.between(1, 5) as i64, rng.between(1, 5) as i64];
    let mut schemas = [[1u32; 3]; 2];
    for flow in &mut schemas {
        for s in flow.iter_mut() {
            *s = match rng.below(10) {
                0..=6 => 1,
                7 | 8 => 2,
                _ => 7,
            };
        }
    }
    let n = rng.between(5, 14);
    let ops = (0..n)
        .map(|_| match rng.below(100) {
            0..=44 => gen_receive(rng, amounts, &schemas),
            45..=69 => Op::Apply { flow: rng.below(2) as usize, max_steps: *rng.pick(&[0, 0, 1, 2]) },
            70..=76 => Op::ApplyAll { max_steps: *rng.pick(&[0, 1]) },
            77..=84 => Op::Restart { v2: rng.percent(50) },
            _ => {
                let v2 = rng.percent(50);
                if rng.percent(40) {
                    let op = gen_receive(rng, amounts, &schemas);
                    Op::Crash { point: RECEIVE_POINTS[rng.below(2) as usize], op: Box::new(op), v2 }
                } else {
                    let op = Op::Apply { flow: rng.below(2) as usize, max_steps: 0 };
                    Op::Crash { point: APPLY_POINTS[rng.below(3) as usize], op: Box::new(op), v2 }
                }
            }
        })
        .collect();
    Case { v2: rng.percent(50), ops }
}

// ---------------------------------------------------------------------------------------
// Running a consumer case against the real binary.
// ---------------------------------------------------------------------------------------

/// One consumer process (restarted at will) on one file.
struct ConsumerRig {
    work: Workdir,
    consumer: Option<Consumer>,
    client: Option<ConsumerClient<Channel>>,
    v2: bool,
    starts: u64,
}

impl ConsumerRig {
    fn new() -> ConsumerRig {
        ConsumerRig { work: Workdir::new(), consumer: None, client: None, v2: false, starts: 0 }
    }

    /// SIGKILL whatever runs, and start a consumer on the same file (armed at `point`).
    async fn restart(&mut self, v2: bool, point: Option<&str>) {
        self.client = None;
        drop(self.consumer.take());
        self.starts += 1;
        let log = self.work.path(&format!("consumer.{}.log", self.starts));
        let env: Vec<(&str, &str)> = point.map(|p| (CRASH_ENV, p)).into_iter().collect();
        let consumer = Consumer::start_on(self.work.consumer_db(), log, v2, &env);
        self.client = Some(consumer.client().await);
        self.consumer = Some(consumer);
        self.v2 = v2;
    }

    async fn ensure(&mut self, v2: bool) {
        if self.consumer.is_none() || self.v2 != v2 {
            self.restart(v2, None).await;
        }
    }

    fn client(&self) -> ConsumerClient<Channel> {
        self.client.clone().expect("a running consumer")
    }

    /// Waits for the armed consumer to die at `point`; an error names what happened instead.
    fn died_at(&mut self, point: &str) -> Result<(), String> {
        let mut consumer = self.consumer.take().ok_or("no consumer")?;
        self.client = None;
        let status = consumer.process.wait_exit(START_DEADLINE);
        let log = consumer.process.log_text();
        if status.code() != Some(CRASH_EXIT) || !log.contains(&format!("crash_point={point}")) {
            return Err(format!("expected a crash at {point}, got exit {status:?}; log:\n{log}"));
        }
        Ok(())
    }
}

fn stop_word(stop: i32) -> String {
    pb::ApplyStop::try_from(stop)
        .map(|s| s.as_str_name().to_owned())
        .unwrap_or_else(|_| format!("stop {stop}"))
}

fn reason_word(reason: i32) -> String {
    pb::BlockReason::try_from(reason)
        .map(|s| s.as_str_name().to_owned())
        .unwrap_or_else(|_| format!("reason {reason}"))
}

/// An Apply result in comparable form: ids applied, stop, reason, waiting seq, blocked id,
/// projection (last_seq, state, held).
type ApplyView = (Vec<String>, String, String, u64, String, (u64, String, i64));

fn real_apply(r: &pb::ApplyResult) -> ApplyView {
    let p = r.projection.clone().unwrap_or_default();
    let state = if p.state.is_empty() { "new".to_owned() } else { p.state };
    (
        r.applied_event_ids.clone(),
        stop_word(r.stop),
        reason_word(r.reason),
        r.waiting_for_seq,
        r.blocked_event_id.clone(),
        (p.last_seq, state, p.held),
    )
}

fn model_apply(a: &Applied) -> ApplyView {
    let (stop, reason, waiting, blocked) = match &a.stop {
        Stop::Idle => ("APPLY_STOP_IDLE", "BLOCK_REASON_UNSPECIFIED".to_owned(), 0, String::new()),
        Stop::Limit => ("APPLY_STOP_LIMIT", "BLOCK_REASON_UNSPECIFIED".to_owned(), 0, String::new()),
        Stop::Gap { waiting_for_seq } => {
            ("APPLY_STOP_GAP", "BLOCK_REASON_UNSPECIFIED".to_owned(), *waiting_for_seq, String::new())
        }
        Stop::Blocked { event_id, reason } => {
            ("APPLY_STOP_BLOCKED", format!("BLOCK_REASON_{}", reason.to_uppercase()), 0, event_id.clone())
        }
    };
    let p = a.projection;
    (a.applied.clone(), stop.to_owned(), reason, waiting, blocked, (p.last_seq, p.state().to_owned(), p.held))
}

/// A flow's records in comparable form: projection, inbox rows (seq, id, kind, schema,
/// state, reason, body), effects (seq, id, kind, held).
type FlowView = (
    (u64, String, i64),
    Vec<(u64, String, String, u32, String, String, String)>,
    Vec<(u64, String, String, i64)>,
);

fn model_flow(m: &model::Consumer, flow: &str) -> FlowView {
    let p = m.projection(flow);
    let inbox = m
        .flow_inbox(flow)
        .into_iter()
        .map(|r| {
            (
                r.seq,
                r.event_id.clone(),
                r.kind.clone(),
                r.schema,
                r.state.to_owned(),
                r.reason.unwrap_or("").to_owned(),
                r.body.clone(),
            )
        })
        .collect();
    let effects = m
        .effects
        .get(flow)
        .map(|es| es.iter().map(|e| (e.seq, e.event_id.clone(), e.kind.clone(), e.held)).collect())
        .unwrap_or_default();
    ((p.last_seq, p.state().to_owned(), p.held), inbox, effects)
}

async fn real_flow(client: &mut ConsumerClient<Channel>, flow: &str) -> Result<FlowView, String> {
    let f = client
        .get_flow(pb::GetFlowRequest { flow_id: flow.into() })
        .await
        .map_err(|s| format!("GetFlow {flow}: {s}"))?
        .into_inner();
    let p = f.projection.unwrap_or_default();
    let state = if p.state.is_empty() { "new".to_owned() } else { p.state };
    let inbox = f
        .inbox
        .into_iter()
        .map(|r| (r.seq, r.event_id, r.kind, r.schema, r.state, r.reason, r.body))
        .collect();
    let effects = f.effects.into_iter().map(|e| (e.seq, e.event_id, e.kind, e.held)).collect();
    Ok(((p.last_seq, state, p.held), inbox, effects))
}

/// Sends `envs` on one Receive stream: the answers' words, and whether the stream ended
/// with an error (a dead server) rather than cleanly.
async fn real_receive(
    client: &mut ConsumerClient<Channel>,
    envs: Vec<pb::EventEnvelope>,
) -> (Vec<String>, bool) {
    let mut words = Vec::new();
    let mut stream = match client.receive(tokio_stream::iter(envs)).await {
        Ok(r) => r.into_inner(),
        Err(_) => return (words, true),
    };
    loop {
        match stream.message().await {
            Ok(Some(a)) => words.push(
                pb::ReceiveOutcome::try_from(a.outcome)
                    .map(|o| o.as_str_name().trim_start_matches("RECEIVE_OUTCOME_").to_owned())
                    .unwrap_or_else(|_| format!("outcome {}", a.outcome)),
            ),
            Ok(None) => return (words, false),
            Err(_) => return (words, true),
        }
    }
}

/// Runs one op on the real consumer and the model; an error says where they differ.
async fn run_op(rig: &mut ConsumerRig, m: &mut model::Consumer, ns: &str, op: &Op) -> Result<(), String> {
    match op {
        Op::Receive(envs) => {
            let expected: Vec<&str> = envs.iter().map(|e| m.receive(&e.model(ns)).word()).collect();
            let (got, broken) =
                real_receive(&mut rig.client(), envs.iter().map(|e| e.wire(ns)).collect()).await;
            if broken || got != expected {
                return Err(format!(
                    "Receive answered {got:?} (stream broken: {broken}), model {expected:?}"
                ));
            }
        }
        Op::Apply { flow, max_steps } => {
            let flow_id = format!("{ns}{}", FLOWS[*flow]);
            let Crashed::No(expected) = m.apply(&flow_id, *max_steps, rig.v2, None) else {
                unreachable!("not armed")
            };
            let got = rig
                .client()
                .apply(pb::ApplyRequest { flow_id, max_steps: *max_steps })
                .await
                .map_err(|s| format!("Apply failed: {s}"))?;
            let (got, expected) = (real_apply(got.get_ref()), model_apply(&expected));
            if got != expected {
                return Err(format!("Apply answered {got:?}, model {expected:?}"));
            }
        }
        Op::ApplyAll { max_steps } => {
            let expected: Vec<ApplyView> = m.apply_all(*max_steps, rig.v2).iter().map(model_apply).collect();
            let got = rig
                .client()
                .apply_all(pb::ApplyAllRequest { max_steps: *max_steps })
                .await
                .map_err(|s| format!("ApplyAll failed: {s}"))?;
            // Other cases' flows share the file; only this case's are compared.
            let got: Vec<ApplyView> =
                got.get_ref().results.iter().filter(|r| r.flow_id.starts_with(ns)).map(real_apply).collect();
            if got != expected {
                return Err(format!("ApplyAll answered {got:?}, model {expected:?}"));
            }
        }
        Op::Restart { v2 } => rig.restart(*v2, None).await,
        Op::Crash { point, op, v2 } => {
            let when = crash_when(point);
            let current = rig.v2;
            rig.restart(current, Some(point)).await;
            // Group commit: the transaction that reached an after-commit receive point may
            // also hold envelopes sent after the one that fired, so any longer prefix of the
            // stream may be committed. Each such state is a candidate; the files decide.
            let mut candidates: Vec<model::Consumer> = Vec::new();
            let fired = match op.as_ref() {
                Op::Receive(envs) => {
                    let mut expected = Vec::new();
                    let mut fired = false;
                    for (i, e) in envs.iter().enumerate() {
                        let (answer, hit) = m.receive_armed(&e.model(ns), Some(when));
                        if hit {
                            fired = true;
                            if when == CrashWhen::AfterCommit {
                                let mut longer = m.clone();
                                for later in &envs[i + 1..] {
                                    longer.receive(&later.model(ns));
                                    candidates.push(longer.clone());
                                }
                            }
                            break;
                        }
                        expected.push(answer.word());
                    }
                    let (got, broken) =
                        real_receive(&mut rig.client(), envs.iter().map(|e| e.wire(ns)).collect()).await;
                    let prefix =
                        got.len() <= expected.len() && got.iter().zip(&expected).all(|(g, e)| g == e);
                    let ok = if fired { broken && prefix } else { !broken && got == expected };
                    if !ok {
                        return Err(format!(
                            "armed Receive answered {got:?} (broken: {broken}); model {expected:?} then crash: {fired}"
                        ));
                    }
                    fired
                }
                Op::Apply { flow, max_steps } => {
                    let flow_id = format!("{ns}{}", FLOWS[*flow]);
                    // Group commit: the transaction that reached an after-commit apply point may
                    // also hold the loop's later steps (and the block mark it stopped at), so
                    // each longer run of the loop is a candidate; the files decide.
                    if when == CrashWhen::AfterCommit {
                        let limit = if *max_steps == 0 { 1000 } else { *max_steps };
                        for k in 1..=limit.min(4) {
                            let mut longer = m.clone();
                            longer.apply(&flow_id, k, current, None);
                            candidates.push(longer);
                        }
                    }
                    let expected = m.apply(&flow_id, *max_steps, current, Some(when));
                    let got = rig.client().apply(pb::ApplyRequest { flow_id, max_steps: *max_steps }).await;
                    match (expected, got) {
                        (Crashed::Yes { .. }, Err(_)) => true,
                        (Crashed::No(e), Ok(g)) if real_apply(g.get_ref()) == model_apply(&e) => false,
                        (e, g) => return Err(format!("armed Apply answered {g:?}, model {e:?}")),
                    }
                }
                other => unreachable!("crash ops wrap Receive or Apply, not {other:?}"),
            };
            if fired {
                rig.died_at(point)?;
            }
            rig.restart(*v2, None).await;
            if !candidates.is_empty() {
                let mut client = rig.client();
                let mut real = Vec::new();
                for flow in FLOWS {
                    real.push(real_flow(&mut client, &format!("{ns}{flow}")).await?);
                }
                let matches = |c: &model::Consumer| {
                    FLOWS.iter().zip(&real).all(|(f, r)| model_flow(c, &format!("{ns}{f}")) == *r)
                };
                if !matches(m) {
                    match candidates.into_iter().find(|c| matches(c)) {
                        Some(longer) => *m = longer,
                        None => {
                            return Err(
                                "after the crash the files match no committed prefix of the stream".into()
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs a case under namespace `ns`; the first difference from the model is the error.
async fn run_case(rig: &mut ConsumerRig, case: &Case, ns: &str) -> Result<(), String> {
    rig.ensure(case.v2).await;
    let mut m = model::Consumer::default();
    for (i, op) in case.ops.iter().enumerate() {
        run_op(rig, &mut m, ns, op).await.map_err(|e| format!("step {i} {op:?}: {e}"))?;
        let mut client = rig.client();
        for flow in FLOWS {
            let flow_id = format!("{ns}{flow}");
            let (got, expected) = (real_flow(&mut client, &flow_id).await?, model_flow(&m, &flow_id));
            if got != expected {
                return Err(format!(
                    "step {i} {op:?}: flow {flow_id} records differ\n  real:  {got:?}\n  model: {expected:?}"
                ));
            }
        }
    }
    Ok(())
}

/// Greedy shrinking: drop ops, then envelopes, while the case still fails (each re-run in a
/// fresh namespace on the same files), within `SHRINK_RUNS` re-runs.
async fn shrink(rig: &mut ConsumerRig, case: &Case, tag: &str) -> (Case, String) {
    let mut best = case.clone();
    let mut why = String::new();
    let mut runs = 0usize;
    let mut progress = true;
    while progress && runs < SHRINK_RUNS {
        progress = false;
        let mut candidates: Vec<Case> = Vec::new();
        for i in (0..best.ops.len()).rev() {
            let mut c = best.clone();
            c.ops.remove(i);
            candidates.push(c);
        }
        for (i, op) in best.ops.iter().enumerate() {
            if let Op::Receive(envs) = op {
                for j in (0..envs.len()).rev().filter(|_| envs.len() > 1) {
                    let mut c = best.clone();
                    if let Op::Receive(envs) = &mut c.ops[i] {
                        envs.remove(j);
                    }
                    candidates.push(c);
                }
            }
        }
        for candidate in candidates {
            if runs >= SHRINK_RUNS {
                break;
            }
            runs += 1;
            if let Err(e) = run_case(rig, &candidate, &format!("{tag}s{runs}.")).await {
                best = candidate;
                why = e;
                progress = true;
                break;
            }
        }
    }
    (best, why)
}

/// What a set of cases exercised.
#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    ops: usize,
    envelopes: usize,
    restarts: usize,
    crashes: usize,
}

impl Tally {
    fn add(&mut self, o: Tally) {
        self.cases += o.cases;
        self.ops += o.ops;
        self.envelopes += o.envelopes;
        self.restarts += o.restarts;
        self.crashes += o.crashes;
    }
}

/// Independent rigs (one server process and file each) run cases side by side: the calls
/// are latency-bound, so this is what makes a thousand cases fit in CI. Rig `r` runs cases
/// `r, r + RIGS, …`; the first failure stops the others and is returned.
fn run_rigs<F, Fut>(rigs: usize, cases: usize, rig: F) -> Result<Tally, String>
where
    F: Fn(Vec<usize>, Arc<AtomicBool>) -> Fut + Sync,
    Fut: std::future::Future<Output = Result<Tally, String>>,
{
    let failed = Arc::new(AtomicBool::new(false));
    let results: Vec<Result<Tally, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..rigs)
            .map(|r| {
                let (rig, failed) = (&rig, &failed);
                s.spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
                    let Ok(runtime) = runtime else { return Err("no tokio runtime".to_owned()) };
                    let result =
                        runtime.block_on(rig((r..cases).step_by(rigs).collect(), Arc::clone(failed)));
                    if result.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    result
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| Err(format!("a rig panicked: {p:?}"))))
            .collect()
    });
    let mut tally = Tally::default();
    for r in results {
        tally.add(r?);
    }
    Ok(tally)
}

/// Runs the consumer cases numbered `cases` on one rig (a fresh one every `CASES_PER_RIG` cases).
async fn consumer_cases(seed: u64, cases: Vec<usize>, failed: Arc<AtomicBool>) -> Result<Tally, String> {
    let mut rig = ConsumerRig::new();
    let mut tally = Tally::default();
    for (k, n) in cases.into_iter().enumerate() {
        if failed.load(Ordering::SeqCst) {
            break;
        }
        if k > 0 && k % CASES_PER_RIG == 0 {
            rig = ConsumerRig::new();
        }
        let case = gen_case(&mut Rng::derive(seed, n as u64));
        tally.cases += 1;
        for op in &case.ops {
            tally.ops += 1;
            match op {
                Op::Crash { .. } => tally.crashes += 1,
                Op::Restart { .. } => tally.restarts += 1,
                Op::Receive(envs) => tally.envelopes += envs.len(),
                _ => {}
            }
        }
        if let Err(e) = run_case(&mut rig, &case, &format!("c{n}.")).await {
            let (small, why) = shrink(&mut rig, &case, &format!("c{n}.")).await;
            return Err(format!(
                "model: consumer case {n} of seed {seed} differs from the model \
                 (replay: ORDERED_EVENTS_MODEL_SEED={seed}):\n{e}\n\nfull case ({} ops): {case:#?}\n\n\
                 shrunk case ({} ops): {small:#?}\nshrunk failure: {why}",
                case.ops.len(),
                small.ops.len()
            ));
        }
    }
    Ok(tally)
}

/// Random consumer cases against the real consumer, compared step by step with the model.
#[test]
fn consumer_matches_the_model() {
    let seed = seed();
    let cases = 700 * scale();
    say(&format!("model: consumer: seed {seed}, {cases} cases (replay: ORDERED_EVENTS_MODEL_SEED={seed})"));
    let t = run_rigs(RIGS, cases, |ns, failed| consumer_cases(seed, ns, failed))
        .unwrap_or_else(|e| panic!("{e}"));
    say(&format!(
        "model: consumer: seed {seed}: {} cases, {} operations ({} envelopes, {} restarts, {} armed crash points) \
         matched the model",
        t.cases, t.ops, t.envelopes, t.restarts, t.crashes
    ));
    assert_eq!(t.cases, cases);
    assert!(
        t.crashes > 0 && t.restarts > 0 && t.envelopes > cases,
        "the generator must exercise crashes and restarts"
    );
}

// ---------------------------------------------------------------------------------------
// Producer: Advance.
// ---------------------------------------------------------------------------------------

/// One step of a producer case: an Advance (flow index, event-id suffix, fields), maybe
/// with the producer armed at a crash point, or a plain SIGKILL-and-restart.
#[derive(Clone, Debug, PartialEq, Eq)]
enum POp {
    Advance {
        flow: usize,
        id: String,
        expected_seq: u64,
        kind: String,
        schema: u32,
        amount: i64,
        crash: Option<&'static str>,
    },
    Restart,
}

const PRODUCER_POINTS: [&str; 3] =
    ["producer.after_flow_update", "producer.after_outbox_insert", "producer.after_commit"];

fn advance_request(ns: &str, op: &POp) -> Option<model::AdvanceRequest> {
    let POp::Advance { flow, id, expected_seq, kind, schema, amount, .. } = op else { return None };
    Some(model::AdvanceRequest {
        flow_id: format!("{ns}{}", FLOWS[*flow]),
        event_id: if id.is_empty() { String::new() } else { format!("{ns}{}-{id}", FLOWS[*flow]) },
        expected_seq: *expected_seq,
        kind: kind.clone(),
        schema: *schema,
        amount: *amount,
    })
}

/// Draws a producer case, steering with a model copy so most requests are plausible (the
/// flow's current seq, its legal next kind) and some are not.
fn gen_producer_case(rng: &mut Rng) -> Vec<POp> {
    let mut m = model::Producer::default();
    let amounts = [rng.between(1, 5) as i64, rng.between(1, 5) as i64];
    let n = rng.between(4, 12);
    let mut ops = Vec::new();
    for _ in 0..n {
        if rng.percent(8) {
            ops.push(POp::Restart);
            continue;
        }
        let flow = rng.below(2) as usize;
        let (seq, _) = m.flows.get(FLOWS[flow]).copied().unwrap_or((0, 0));
        let plausible = rng.percent(70);
        let expected_seq = if plausible { seq } else { rng.below(4) };
        let kind = if plausible && seq < 3 {
            model::KINDS[seq as usize].to_owned()
        } else if rng.percent(5) {
            "shipped".into()
        } else {
            (*rng.pick(&model::KINDS)).to_owned()
        };
        let id = match rng.below(100) {
            0..=1 => String::new(),
            2..=60 => (expected_seq + 1).to_string(),
            _ => rng.between(1, 4).to_string(),
        };
        let schema = match rng.below(100) {
            0..=74 => 1,
            75..=96 => 2,
            _ => 3,
        };
        let amount = match rng.below(100) {
            0..=79 => amounts[flow],
            80..=96 => amounts[flow] + 1,
            _ => 0,
        };
        let crash = rng.percent(12).then(|| *rng.pick(&PRODUCER_POINTS));
        let op = POp::Advance { flow, id, expected_seq, kind, schema, amount, crash };
        if let Some(req) = advance_request("", &op) {
            m.advance(&req, crash.map(crash_when));
        }
        ops.push(op);
    }
    ops
}

/// One producer process (restarted at will) on one file.
struct ProducerRig {
    work: Workdir,
    producer: Option<Producer>,
    client: Option<ProducerClient<Channel>>,
    starts: u64,
}

impl ProducerRig {
    async fn restart(&mut self, point: Option<&str>) {
        self.client = None;
        drop(self.producer.take());
        self.starts += 1;
        let log = self.work.path(&format!("producer.{}.log", self.starts));
        let env: Vec<(&str, &str)> = point.map(|p| (CRASH_ENV, p)).into_iter().collect();
        let producer = Producer::start_on(self.work.producer_db(), log, &env);
        self.client = Some(producer.client().await);
        self.producer = Some(producer);
    }

    fn client(&self) -> ProducerClient<Channel> {
        self.client.clone().expect("a running producer")
    }
}

/// An Advance answer in comparable form.
fn real_advance(r: Result<tonic::Response<pb::AdvanceResponse>, tonic::Status>) -> Result<Advance, String> {
    match r {
        Err(s) if s.code() == tonic::Code::InvalidArgument => Ok(Advance::InvalidArgument),
        Err(s) => Err(format!("Advance failed: {s}")),
        Ok(r) => {
            let r = r.into_inner();
            let outcome = pb::AdvanceOutcome::try_from(r.outcome)
                .map(|o| o.as_str_name().trim_start_matches("ADVANCE_OUTCOME_"))
                .unwrap_or("?");
            let outcome = ["COMMITTED", "EXISTING", "CONFLICT", "STALE", "INVALID_TRANSITION"]
                .into_iter()
                .find(|w| *w == outcome)
                .unwrap_or("?");
            let state = ["new", "reserved", "confirmed", "released"]
                .into_iter()
                .find(|s| *s == r.state)
                .unwrap_or("?");
            let event = r.event.map(|e| model::OutboxRow {
                event_id: e.event_id,
                flow_id: e.flow_id,
                seq: e.seq,
                kind: e.kind,
                schema: e.schema,
                body: e.body,
            });
            Ok(Advance::Answer { outcome, seq: r.seq, state, event })
        }
    }
}

type ProducerView = (u64, String, i64, Vec<(String, u64, String, u32, String, bool, u64)>);

async fn real_producer_flow(
    client: &mut ProducerClient<Channel>,
    flow: &str,
) -> Result<ProducerView, String> {
    let f = client
        .get_flow(pb::GetFlowRequest { flow_id: flow.into() })
        .await
        .map_err(|s| format!("GetFlow {flow}: {s}"))?
        .into_inner();
    let rows = f
        .outbox
        .into_iter()
        .map(|r| (r.event_id, r.seq, r.kind, r.schema, r.body, r.accepted, r.attempts))
        .collect();
    Ok((f.seq, f.state, f.amount, rows))
}

fn model_producer_flow(m: &model::Producer, flow: &str) -> ProducerView {
    let (seq, amount) = m.flows.get(flow).copied().unwrap_or((0, 0));
    let mut rows: Vec<_> = m
        .outbox
        .values()
        .filter(|r| r.flow_id == flow)
        .map(|r| (r.event_id.clone(), r.seq, r.kind.clone(), r.schema, r.body.clone(), false, 0))
        .collect();
    rows.sort_by_key(|r| r.1);
    (seq, model::state_name(seq).to_owned(), amount, rows)
}

async fn run_producer_case(rig: &mut ProducerRig, ops: &[POp], ns: &str) -> Result<(), String> {
    if rig.producer.is_none() {
        rig.restart(None).await;
    }
    let mut m = model::Producer::default();
    for (i, op) in ops.iter().enumerate() {
        let step = |e: String| format!("step {i} {op:?}: {e}");
        match op {
            POp::Restart => rig.restart(None).await,
            POp::Advance { crash, .. } => {
                let req = advance_request(ns, op).expect("an Advance op");
                if let Some(point) = crash {
                    rig.restart(Some(point)).await;
                }
                let (expected, fired) = m.advance(&req, crash.map(crash_when));
                let wire = pb::AdvanceRequest {
                    flow_id: req.flow_id.clone(),
                    event_id: req.event_id.clone(),
                    expected_seq: req.expected_seq,
                    kind: req.kind.clone(),
                    schema: req.schema,
                    amount: req.amount,
                };
                let got = rig.client().advance(wire).await;
                if fired {
                    if got.is_ok() {
                        return Err(step(format!("answered {got:?} but the model crashes at {crash:?}")));
                    }
                    let mut producer = rig.producer.take().expect("running");
                    rig.client = None;
                    let status = producer.process.wait_exit(START_DEADLINE);
                    let point = crash.unwrap_or_default();
                    if status.code() != Some(CRASH_EXIT)
                        || !producer.process.log_text().contains(&format!("crash_point={point}"))
                    {
                        return Err(step(format!("expected a crash at {point}, got {status:?}")));
                    }
                } else {
                    let got = real_advance(got).map_err(step)?;
                    if got != expected {
                        return Err(step(format!("answered {got:?}, model {expected:?}")));
                    }
                }
                if crash.is_some() {
                    rig.restart(None).await;
                }
            }
        }
        let mut client = rig.client();
        for flow in FLOWS {
            let flow_id = format!("{ns}{flow}");
            let (got, expected) =
                (real_producer_flow(&mut client, &flow_id).await?, model_producer_flow(&m, &flow_id));
            if got != expected {
                return Err(step(format!("flow {flow_id} differs\n  real:  {got:?}\n  model: {expected:?}")));
            }
        }
    }
    Ok(())
}

/// Runs producer cases on one rig.
async fn producer_cases(seed: u64, cases: Vec<usize>, failed: Arc<AtomicBool>) -> Result<Tally, String> {
    let mut rig = ProducerRig { work: Workdir::new(), producer: None, client: None, starts: 0 };
    let mut tally = Tally::default();
    for n in cases {
        if failed.load(Ordering::SeqCst) {
            break;
        }
        let case = gen_producer_case(&mut Rng::derive(seed, n as u64));
        tally.cases += 1;
        tally.ops += case.len();
        tally.crashes += case.iter().filter(|o| matches!(o, POp::Advance { crash: Some(_), .. })).count();
        tally.restarts += case.iter().filter(|o| matches!(o, POp::Restart)).count();
        let Err(e) = run_producer_case(&mut rig, &case, &format!("p{n}.")).await else { continue };
        // Shrink: drop ops while it still fails.
        let mut best = case.clone();
        let mut why = e.clone();
        let mut runs = 0usize;
        'shrink: while runs < SHRINK_RUNS {
            for j in (0..best.len()).rev() {
                let mut candidate = best.clone();
                candidate.remove(j);
                runs += 1;
                if let Err(e) = run_producer_case(&mut rig, &candidate, &format!("p{n}.s{runs}.")).await {
                    best = candidate;
                    why = e;
                    continue 'shrink;
                }
                if runs >= SHRINK_RUNS {
                    break 'shrink;
                }
            }
            break;
        }
        return Err(format!(
            "model: producer case {n} of seed {seed} differs from the model \
             (replay: ORDERED_EVENTS_MODEL_SEED={}):\n{e}\n\nfull case: {case:#?}\n\nshrunk case: {best:#?}\n\
             shrunk failure: {why}",
            seed ^ PRODUCER_SEED
        ));
    }
    Ok(tally)
}

/// Random Advance cases against the real producer, compared step by step with the model.
#[test]
fn producer_matches_the_model() {
    let seed = seed() ^ PRODUCER_SEED;
    let cases = 300 * scale();
    say(&format!(
        "model: producer: {cases} cases (replay: ORDERED_EVENTS_MODEL_SEED={})",
        seed ^ PRODUCER_SEED
    ));
    let t = run_rigs(RIGS / 2, cases, |ns, failed| producer_cases(seed, ns, failed))
        .unwrap_or_else(|e| panic!("{e}"));
    say(&format!(
        "model: producer: seed {}: {} cases, {} operations ({} restarts, {} armed crash points) matched the model",
        seed ^ PRODUCER_SEED,
        t.cases,
        t.ops,
        t.restarts,
        t.crashes
    ));
    assert_eq!(t.cases, cases);
    assert!(t.crashes > 0, "the generator must exercise crash points");
}
