//! The model test's consumer side: random cases of Receive / Apply / ApplyAll (duplicates,
//! reorderings, conflicting bodies, sequence conflicts, unknown schemas and schema 2 with and
//! without the v2 decoder, transport-invalid envelopes), SIGKILL-and-reopen and armed crash
//! points, against the real `consumer` and `model::Consumer`: each answer, and each flow's
//! projection, inbox and effects.

use harness::canon::{self, Value};
use harness::model::{self, Applied, CrashWhen, Crashed, Envelope, Stop};
use harness::{Consumer, Workdir};
use proptest::prelude::*;
use proto::crash::CrashPoint;
use proto::pb;
use proto::pb::consumer_client::ConsumerClient;
use tonic::transport::Channel;

use super::{FLOWS, Side, Tally, crash_when, run_rigs, say, scale, seed};

/// Consumer rigs running side by side.
const RIGS: usize = 8;
/// Cases per run (times `ORDERED_EVENTS_MODEL_CASES`).
const CASES: usize = 700;

const RECEIVE_POINTS: [CrashPoint; 2] =
    [CrashPoint::ConsumerReceiveAfterInsert, CrashPoint::ConsumerReceiveAfterCommit];
const APPLY_POINTS: [CrashPoint; 3] = [
    CrashPoint::ConsumerApplyAfterProjection,
    CrashPoint::ConsumerApplyAfterEffect,
    CrashPoint::ConsumerApplyAfterCommit,
];

// ---------------------------------------------------------------------------------------
// Cases, independent of names (a namespace is added when a case runs, so a shrunk case can
// run again on the same files). An envelope names how it departs from its flow's real event
// at that seq, and the real events follow from the case's amounts and schemas.
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

/// How a sent envelope departs from its flow's real event at that seq.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Change {
    /// The real event.
    None,
    /// Same id, another body: the amount plus one.
    OtherAmount,
    /// Same id, another body: an extra member.
    ExtraMember,
    /// Another id at the same (flow, seq).
    OtherId,
    /// Same id, schema 1 with a payload it cannot decode (a string, zero, no amount).
    Undecodable(u8),
    /// Same id, an illegal step: the wrong kind, an unknown kind, or a changed amount.
    Illegal(u8),
    /// Same id, another schema (7: unknown; 2: needs the v2 decoder).
    Schema(u32),
    /// A fresh id whose envelope breaks a transport limit.
    Rejected(Reject),
}

/// One envelope of a case: flow index, seq, how it departs from the real event, and whether
/// its payload text is written in canonical order (false: reversed, with spaces).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sent {
    flow: usize,
    seq: u64,
    change: Change,
    tidy: bool,
}

/// One step of a consumer case.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    /// One Receive stream carrying these envelopes.
    Receive(Vec<Sent>),
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
        point: CrashPoint,
        op: Box<Op>,
        v2: bool,
    },
}

/// A consumer case: the v2 setting it starts with, each flow's amount and the schema of
/// each of its three real events, and the steps.
#[derive(Clone, Debug)]
struct Case {
    v2: bool,
    amounts: [i64; 2],
    schemas: [[u32; 3]; 2],
    ops: Vec<Op>,
}

/// One envelope of a case in full: fields and payload members.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Env {
    flow: usize,
    id: String,
    seq: u64,
    kind: String,
    schema: u32,
    payload: Vec<(String, Value)>,
    tidy: bool,
    reject: Option<Reject>,
}

impl Sent {
    /// The envelope in full, for a case with these amounts and schemas.
    fn resolve(&self, case: &Case) -> Env {
        let (flow, seq) = (self.flow, self.seq);
        let schema = case.schemas[flow][seq as usize - 1];
        let amount = case.amounts[flow];
        let mut env = Env {
            flow,
            id: seq.to_string(),
            seq,
            kind: model::KINDS[seq as usize - 1].to_owned(),
            schema,
            payload: canon::amount_payload(if schema == 2 { 2 } else { 1 }, amount),
            tidy: self.tidy,
            reject: None,
        };
        match &self.change {
            Change::None => {}
            Change::OtherAmount => {
                env.payload = canon::amount_payload(if schema == 2 { 2 } else { 1 }, amount + 1)
            }
            Change::ExtraMember => env.payload.push(("note".into(), Value::Str("x".into()))),
            Change::OtherId => env.id = format!("{seq}x"),
            Change::Undecodable(k) => {
                env.schema = 1;
                env.payload = match k {
                    0 => vec![("amount".into(), Value::Str("3".into()))],
                    1 => vec![("amount".into(), Value::Int(0))],
                    _ => vec![("other".into(), Value::Bool(true))],
                };
            }
            Change::Illegal(k) => match k {
                0 => env.kind = model::KINDS[seq as usize % 3].into(),
                1 => env.kind = "shipped".into(),
                _ => env.payload = canon::amount_payload(1, amount + 2),
            },
            Change::Schema(schema) => {
                env.schema = *schema;
                env.payload = canon::amount_payload(*schema, amount);
            }
            Change::Rejected(r) => {
                env.id = format!("{seq}r");
                env.reject = Some(*r);
            }
        }
        env
    }
}

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
            committed_at_us: None,
        }
    }
}

/// Mostly a flow's real event, sometimes a conflicting or broken one (the weights are
/// percentages times two; shrinking moves toward the first, the real event).
fn sent_strategy() -> impl Strategy<Value = Sent> {
    let reject = proptest::sample::select(vec![
        Reject::EmptyId,
        Reject::SeqZero,
        Reject::SpaceInKind,
        Reject::PayloadArray,
        Reject::PayloadFloat,
        Reject::PayloadNested,
    ]);
    let change = prop_oneof![
        128 => Just(Change::None),
        8 => Just(Change::OtherAmount),
        8 => Just(Change::ExtraMember),
        12 => Just(Change::OtherId),
        10 => (0..3u8).prop_map(Change::Undecodable),
        10 => (0..3u8).prop_map(Change::Illegal),
        14 => prop_oneof![Just(Change::Schema(7)), Just(Change::Schema(2))],
        10 => reject.prop_map(Change::Rejected),
    ];
    let tidy = prop_oneof![7 => Just(true), 3 => Just(false)];
    (0..2usize, 1..=3u64, change, tidy).prop_map(|(flow, seq, change, tidy)| Sent { flow, seq, change, tidy })
}

fn receive_strategy() -> impl Strategy<Value = Vec<Sent>> {
    proptest::collection::vec(sent_strategy(), 1..=4)
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let receive_crash =
        (proptest::sample::select(RECEIVE_POINTS.to_vec()), receive_strategy(), any::<bool>())
            .prop_map(|(point, envs, v2)| Op::Crash { point, op: Box::new(Op::Receive(envs)), v2 });
    let apply_crash = (proptest::sample::select(APPLY_POINTS.to_vec()), 0..2usize, any::<bool>()).prop_map(
        |(point, flow, v2)| Op::Crash { point, op: Box::new(Op::Apply { flow, max_steps: 0 }), v2 },
    );
    prop_oneof![
        45 => receive_strategy().prop_map(Op::Receive),
        25 => (0..2usize, proptest::sample::select(vec![0u32, 0, 1, 2]))
            .prop_map(|(flow, max_steps)| Op::Apply { flow, max_steps }),
        7 => proptest::sample::select(vec![0u32, 1]).prop_map(|max_steps| Op::ApplyAll { max_steps }),
        8 => any::<bool>().prop_map(|v2| Op::Restart { v2 }),
        6 => receive_crash,
        9 => apply_crash,
    ]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let schema = prop_oneof![7 => Just(1u32), 2 => Just(2), 1 => Just(7)];
    let schemas =
        [[schema.clone(), schema.clone(), schema.clone()], [schema.clone(), schema.clone(), schema]];
    // 1..=18 steps: the mean of the earlier 5..=14, with room to shrink to one.
    (any::<bool>(), [1..=5i64, 1..=5i64], schemas, proptest::collection::vec(op_strategy(), 1..=18))
        .prop_map(|(v2, amounts, schemas, ops)| Case { v2, amounts, schemas, ops })
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
    async fn restart(&mut self, v2: bool, point: Option<CrashPoint>) {
        self.client = None;
        drop(self.consumer.take());
        self.starts += 1;
        let log = self.work.path(&format!("consumer.{}.log", self.starts));
        let consumer = match point {
            Some(point) => Consumer::start_armed(self.work.consumer_db(), log, v2, point),
            None => Consumer::start_on(self.work.consumer_db(), log, v2, &[]),
        };
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
    fn died_at(&mut self, point: CrashPoint) -> Result<(), String> {
        let mut consumer = self.consumer.take().ok_or("no consumer")?;
        self.client = None;
        consumer.process.wait_crash(point)
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
async fn run_op(
    rig: &mut ConsumerRig,
    m: &mut model::Consumer,
    case: &Case,
    ns: &str,
    op: &Op,
) -> Result<(), String> {
    let resolve = |sent: &[Sent]| -> Vec<Env> { sent.iter().map(|s| s.resolve(case)).collect() };
    match op {
        Op::Receive(sent) => {
            let envs = resolve(sent);
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
            let when = crash_when(*point);
            let current = rig.v2;
            rig.restart(current, Some(*point)).await;
            // Group commit: the transaction that reached an after-commit receive point may
            // also hold envelopes sent after the one that fired, so any longer prefix of the
            // stream may be committed. Each such state is a candidate; the files decide.
            let mut candidates: Vec<model::Consumer> = Vec::new();
            let fired = match op.as_ref() {
                Op::Receive(sent) => {
                    let envs = resolve(sent);
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
                rig.died_at(*point)?;
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
        run_op(rig, &mut m, case, ns, op).await.map_err(|e| format!("step {i} {op:?}: {e}"))?;
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

/// The consumer side of the model test.
struct ConsumerSide;

impl Side for ConsumerSide {
    type Case = Case;
    type Rig = ConsumerRig;

    fn tally(case: &Case) -> Tally {
        let mut t = Tally { cases: 1, ..Tally::default() };
        for op in &case.ops {
            t.ops += 1;
            match op {
                Op::Crash { .. } => t.crashes += 1,
                Op::Restart { .. } => t.restarts += 1,
                Op::Receive(envs) => t.envelopes += envs.len(),
                _ => {}
            }
        }
        t
    }

    fn rig() -> ConsumerRig {
        ConsumerRig::new()
    }

    fn run(
        rig: &mut ConsumerRig,
        case: &Case,
        ns: &str,
    ) -> impl std::future::Future<Output = Result<(), String>> {
        run_case(rig, case, ns)
    }
}

/// Random consumer cases against the real consumer, compared step by step with the model.
#[test]
fn consumer_matches_the_model() {
    if !harness::backend::ready() {
        return;
    }
    let seed = seed();
    let cases = CASES * scale();
    say(&format!("model: consumer: seed {seed}, {cases} cases (replay: ORDERED_EVENTS_MODEL_SEED={seed})"));
    let t = run_rigs::<ConsumerSide>("consumer", seed, 0, RIGS, cases, case_strategy())
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
