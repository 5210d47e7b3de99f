//! The model test's producer side: random Advance cases (plausible next steps, stale and
//! illegal requests, retries, conflicting bodies, malformed fields) with SIGKILL-and-restart
//! and armed producer crash points, against the real `producer` and `model::Producer`.

use harness::model::{self, Advance};
use harness::{Producer, Workdir};
use proptest::prelude::*;
use proto::crash::CrashPoint;
use proto::pb;
use proto::pb::producer_client::ProducerClient;
use tonic::transport::Channel;

use super::{FLOWS, Side, Tally, crash_when, run_rigs, say, scale, seed};

/// Mixed into the seed for the producer cases, so the two tests draw different streams.
const PRODUCER_SEED: u64 = 0x00AD_7A4C;
/// Producer rigs running side by side.
const RIGS: usize = 4;
/// Cases per run (times `ORDERED_EVENTS_MODEL_CASES`).
const CASES: usize = 300;

const PRODUCER_POINTS: [CrashPoint; 3] = [
    CrashPoint::ProducerAfterFlowUpdate,
    CrashPoint::ProducerAfterOutboxInsert,
    CrashPoint::ProducerAfterCommit,
];

// ---------------------------------------------------------------------------------------
// Cases. A request names what it asks relative to the flow's state when it runs (its next
// step, a given seq), so a shrunk case keeps asking the same kind of question.
// ---------------------------------------------------------------------------------------

/// Which step an Advance asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Step {
    /// The flow's legal next step at its current seq (`released` again once finished).
    Next,
    /// A given expected_seq and kind: mostly stale or illegal.
    Given { expected_seq: u64, kind: &'static str },
}

/// The event id an Advance uses.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Id {
    /// `<flow>-<expected_seq + 1>`: the natural id of the step.
    Natural,
    /// `<flow>-<n>`: often another step's id (a retry or a conflict).
    Given(u64),
    /// Empty (INVALID_ARGUMENT).
    Empty,
}

/// The amount an Advance carries.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Amount {
    /// The flow's amount.
    Flow,
    /// The flow's amount plus one (illegal after the first step).
    Changed,
    /// Zero (INVALID_ARGUMENT).
    Zero,
}

/// One step of a producer case.
#[derive(Clone, Debug, PartialEq, Eq)]
enum POp {
    /// An Advance on flow `flow`, maybe with the producer armed at `crash`.
    Advance { flow: usize, step: Step, id: Id, schema: u32, amount: Amount, crash: Option<CrashPoint> },
    /// SIGKILL the producer and start it again on the same file.
    Restart,
}

/// A producer case: each flow's amount, and the steps.
#[derive(Clone, Debug)]
struct Case {
    amounts: [i64; 2],
    ops: Vec<POp>,
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let kind = prop_oneof![
        95 => proptest::sample::select(model::KINDS.to_vec()),
        5 => Just("shipped"),
    ];
    prop_oneof![
        7 => Just(Step::Next),
        3 => (0..4u64, kind).prop_map(|(expected_seq, kind)| Step::Given { expected_seq, kind }),
    ]
}

fn op_strategy() -> impl Strategy<Value = POp> {
    let id = prop_oneof![59 => Just(Id::Natural), 39 => (1..=4u64).prop_map(Id::Given), 2 => Just(Id::Empty)];
    let schema = prop_oneof![75 => Just(1u32), 22 => Just(2), 3 => Just(3)];
    let amount = prop_oneof![80 => Just(Amount::Flow), 17 => Just(Amount::Changed), 3 => Just(Amount::Zero)];
    let crash = prop_oneof![88 => Just(None), 12 => proptest::sample::select(PRODUCER_POINTS.to_vec()).prop_map(Some)];
    let advance = (0..2usize, step_strategy(), id, schema, amount, crash).prop_map(
        |(flow, step, id, schema, amount, crash)| POp::Advance { flow, step, id, schema, amount, crash },
    );
    prop_oneof![92 => advance, 8 => Just(POp::Restart)]
}

fn case_strategy() -> impl Strategy<Value = Case> {
    // 1..=15 steps: the mean of the earlier 4..=12, with room to shrink to one.
    ([1..=5i64, 1..=5i64], proptest::collection::vec(op_strategy(), 1..=15))
        .prop_map(|(amounts, ops)| Case { amounts, ops })
}

/// The request an Advance op makes when the model stands at `m`, under namespace `ns`.
fn request(ns: &str, amounts: [i64; 2], m: &model::Producer, op: &POp) -> Option<model::AdvanceRequest> {
    let POp::Advance { flow, step, id, schema, amount, .. } = op else { return None };
    let flow_id = format!("{ns}{}", FLOWS[*flow]);
    let (seq, _) = m.flows.get(&flow_id).copied().unwrap_or((0, 0));
    let (expected_seq, kind) = match step {
        Step::Next => (seq, model::KINDS.get(seq as usize).copied().unwrap_or("released")),
        Step::Given { expected_seq, kind } => (*expected_seq, *kind),
    };
    let event_id = match id {
        Id::Natural => format!("{flow_id}-{}", expected_seq + 1),
        Id::Given(n) => format!("{flow_id}-{n}"),
        Id::Empty => String::new(),
    };
    let amount = match amount {
        Amount::Flow => amounts[*flow],
        Amount::Changed => amounts[*flow] + 1,
        Amount::Zero => 0,
    };
    Some(model::AdvanceRequest {
        flow_id,
        event_id,
        expected_seq,
        kind: kind.to_owned(),
        schema: *schema,
        amount,
    })
}

// ---------------------------------------------------------------------------------------
// Running a producer case against the real binary.
// ---------------------------------------------------------------------------------------

/// One producer process (restarted at will) on one file.
struct ProducerRig {
    work: Workdir,
    producer: Option<Producer>,
    client: Option<ProducerClient<Channel>>,
    starts: u64,
}

impl ProducerRig {
    /// SIGKILL whatever runs, and start a producer on the same file (armed at `point`).
    async fn restart(&mut self, point: Option<CrashPoint>) {
        self.client = None;
        drop(self.producer.take());
        self.starts += 1;
        let log = self.work.path(&format!("producer.{}.log", self.starts));
        let producer = match point {
            Some(point) => Producer::start_armed(self.work.producer_db(), log, point),
            None => Producer::start_on(self.work.producer_db(), log, &[]),
        };
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

/// A flow's records in comparable form: seq, state, amount, outbox rows (id, seq, kind,
/// schema, body, accepted, attempts).
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

/// Runs a case under namespace `ns`; the first difference from the model is the error. A
/// case that failed leaves no producer behind (it may have crashed where the model did not),
/// so the next case (the shrinker's) starts a fresh one instead of failing to connect.
async fn run_case(rig: &mut ProducerRig, case: &Case, ns: &str) -> Result<(), String> {
    let result = run_ops(rig, case, ns).await;
    if result.is_err() {
        rig.client = None;
        drop(rig.producer.take());
    }
    result
}

async fn run_ops(rig: &mut ProducerRig, case: &Case, ns: &str) -> Result<(), String> {
    if rig.producer.is_none() {
        rig.restart(None).await;
    }
    let mut m = model::Producer::default();
    for (i, op) in case.ops.iter().enumerate() {
        let step = |e: String| format!("step {i} {op:?}: {e}");
        match op {
            POp::Restart => rig.restart(None).await,
            POp::Advance { crash, .. } => {
                let req = request(ns, case.amounts, &m, op).expect("an Advance op");
                if let Some(point) = crash {
                    rig.restart(Some(*point)).await;
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
                match crash {
                    Some(point) if fired => {
                        if got.is_ok() {
                            return Err(step(format!(
                                "{req:?} answered {got:?} but the model crashes at {point}"
                            )));
                        }
                        let mut producer = rig.producer.take().expect("running");
                        rig.client = None;
                        producer.process.wait_crash(*point).map_err(step)?;
                    }
                    _ => {
                        let got = real_advance(got).map_err(step)?;
                        if got != expected {
                            return Err(step(format!("{req:?} answered {got:?}, model {expected:?}")));
                        }
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

/// The producer side of the model test.
struct ProducerSide;

impl Side for ProducerSide {
    type Case = Case;
    type Rig = ProducerRig;

    fn tally(case: &Case) -> Tally {
        Tally {
            cases: 1,
            ops: case.ops.len(),
            envelopes: 0,
            restarts: case.ops.iter().filter(|o| matches!(o, POp::Restart)).count(),
            crashes: case.ops.iter().filter(|o| matches!(o, POp::Advance { crash: Some(_), .. })).count(),
        }
    }

    fn rig() -> ProducerRig {
        ProducerRig { work: Workdir::new(), producer: None, client: None, starts: 0 }
    }

    fn run(
        rig: &mut ProducerRig,
        case: &Case,
        ns: &str,
    ) -> impl std::future::Future<Output = Result<(), String>> {
        run_case(rig, case, ns)
    }
}

/// Random Advance cases against the real producer, compared step by step with the model.
#[test]
fn producer_matches_the_model() {
    if !harness::backend::ready() {
        return;
    }
    let seed = seed();
    let cases = CASES * scale();
    say(&format!("model: producer: seed {seed}, {cases} cases (replay: ORDERED_EVENTS_MODEL_SEED={seed})"));
    let t = run_rigs::<ProducerSide>("producer", seed, PRODUCER_SEED, RIGS, cases, case_strategy())
        .unwrap_or_else(|e| panic!("{e}"));
    say(&format!(
        "model: producer: seed {seed}: {} cases, {} operations ({} restarts, {} armed crash points) matched the model",
        t.cases, t.ops, t.restarts, t.crashes
    ));
    assert_eq!(t.cases, cases);
    assert!(t.crashes > 0, "the generator must exercise crash points");
}
