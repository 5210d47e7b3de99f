//! A tiny in-memory model of the spec (SPEC §5 Advance, §6 Receive, §7 Apply), written from
//! the text alone for the model test: it predicts every answer and the final records, and
//! the test compares them with the real binaries step by step. It shares no code with the
//! services (its canonical body is [`crate::canon`]).

use std::collections::BTreeMap;

use crate::canon::{self, Value};

/// The three steps, by seq.
pub const KINDS: [&str; 3] = ["reserved", "confirmed", "released"];

/// The largest integer the transport admits (2^53).
pub const MAX_INT: i64 = 1 << 53;

/// A flow's state name for a seq reached by legal steps (0 = `new`).
pub fn state_name(seq: u64) -> &'static str {
    match seq {
        0 => "new",
        n => KINDS.get(n as usize - 1).copied().unwrap_or("?"),
    }
}

/// Units held in a state: `reserved` and `confirmed` hold the amount.
pub fn held(state: &str, amount: i64) -> i64 {
    if state == "reserved" || state == "confirmed" { amount } else { 0 }
}

/// The legal-step rule shared by Advance and Apply: the state reached, or why not.
pub fn step(from_seq: u64, fixed_amount: i64, kind: &str, amount: i64) -> Result<u64, &'static str> {
    let Some(to) = KINDS.iter().position(|k| *k == kind) else { return Err("unknown kind") };
    if to as u64 != from_seq {
        return Err("illegal step");
    }
    if from_seq > 0 && amount != fixed_amount {
        return Err("amount changed");
    }
    Ok(from_seq + 1)
}

// ---------------------------------------------------------------------------------------
// Consumer: Receive and Apply.
// ---------------------------------------------------------------------------------------

/// An envelope as the model sees it: its fields, its payload members, and whether it breaks
/// a transport limit (the generator knows, because it built it that way).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The event id.
    pub event_id: String,
    /// The flow.
    pub flow_id: String,
    /// The step's seq in its flow.
    pub seq: u64,
    /// The step kind.
    pub kind: String,
    /// The payload schema.
    pub schema: u32,
    /// The payload members, in the order sent.
    pub payload: Vec<(String, Value)>,
    /// Whether it breaks a transport limit (answered REJECTED).
    pub rejected: bool,
}

impl Envelope {
    /// The canonical body the consumer stores and compares.
    pub fn body(&self) -> String {
        canon::Body {
            event_id: self.event_id.clone(),
            flow_id: self.flow_id.clone(),
            seq: self.seq,
            kind: self.kind.clone(),
            schema: self.schema,
            payload: self.payload.clone(),
        }
        .canonical()
    }
}

/// Receive's answer (the proto enum's short word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Receive {
    /// Stored.
    Accepted,
    /// The same body under a stored id: nothing written.
    Duplicate,
    /// Another body under a stored id: refused.
    IdConflict,
    /// Another id at a stored (flow, seq): refused.
    SequenceConflict,
    /// Breaks a transport limit: nothing stored.
    Rejected,
}

impl Receive {
    /// The short word, as the relay prints it (`ACCEPTED`, …).
    pub fn word(self) -> &'static str {
        match self {
            Receive::Accepted => "ACCEPTED",
            Receive::Duplicate => "DUPLICATE",
            Receive::IdConflict => "ID_CONFLICT",
            Receive::SequenceConflict => "SEQUENCE_CONFLICT",
            Receive::Rejected => "REJECTED",
        }
    }
}

/// An inbox row in the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxRow {
    /// The event id.
    pub event_id: String,
    /// The flow.
    pub flow_id: String,
    /// The step's seq in its flow.
    pub seq: u64,
    /// The step kind.
    pub kind: String,
    /// The payload schema.
    pub schema: u32,
    /// The canonical body.
    pub body: String,
    /// The payload members.
    pub payload: Vec<(String, Value)>,
    /// `pending`, `blocked` or `applied`.
    pub state: &'static str,
    /// Set exactly while blocked.
    pub reason: Option<&'static str>,
}

/// A flow's projection (`new`: last_seq 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Projection {
    /// The last applied seq.
    pub last_seq: u64,
    /// Units held.
    pub held: i64,
    /// The amount fixed by the first step.
    pub amount: i64,
}

impl Projection {
    /// The state name.
    pub fn state(&self) -> &'static str {
        state_name(self.last_seq)
    }
}

/// One effect record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effect {
    /// The event applied.
    pub event_id: String,
    /// The seq reached.
    pub seq: u64,
    /// The step kind.
    pub kind: String,
    /// Units held after it.
    pub held: i64,
}

/// Why an Apply stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Nothing left to apply.
    Idle,
    /// The next seq has not arrived, but a later one has.
    Gap {
        /// The seq the flow waits for.
        waiting_for_seq: u64,
    },
    /// The next row cannot be applied.
    Blocked {
        /// The blocked row.
        event_id: String,
        /// Why (`unsupported_schema`, `invalid_payload`, `invalid_transition`).
        reason: &'static str,
    },
    /// The step limit was reached.
    Limit,
}

/// What one Apply did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The flow.
    pub flow_id: String,
    /// The event ids applied, in order.
    pub applied: Vec<String>,
    /// Why it stopped.
    pub stop: Stop,
    /// The projection after it.
    pub projection: Projection,
}

/// The consumer's records.
#[derive(Clone, Debug, Default)]
pub struct Consumer {
    /// Inbox rows by event id.
    pub inbox: BTreeMap<String, InboxRow>,
    /// Event id by (flow, seq): the uniqueness Receive keeps.
    pub by_seq: BTreeMap<(String, u64), String>,
    /// Projections by flow.
    pub projections: BTreeMap<String, Projection>,
    /// Effects by flow, in apply order.
    pub effects: BTreeMap<String, Vec<Effect>>,
}

/// Where an armed crash point fires relative to the write it guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashWhen {
    /// Before the commit: the write is lost.
    BeforeCommit,
    /// After the commit, before the answer: the write stays.
    AfterCommit,
}

/// How a Receive or Apply ended when a crash point was armed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Crashed<T> {
    /// The crash point was not reached; the call answered normally.
    No(T),
    /// It fired after these answers / steps.
    Yes {
        /// What was answered or applied before it fired.
        before: T,
    },
}

impl Consumer {
    /// SPEC §6 for one envelope.
    pub fn receive(&mut self, env: &Envelope) -> Receive {
        self.receive_armed(env, None).0
    }

    /// Receive with an armed receive crash point: the second value says whether it fired
    /// (only an accepting write reaches it).
    pub fn receive_armed(&mut self, env: &Envelope, crash: Option<CrashWhen>) -> (Receive, bool) {
        if env.rejected {
            return (Receive::Rejected, false);
        }
        let body = env.body();
        if let Some(row) = self.inbox.get(&env.event_id) {
            return (if row.body == body { Receive::Duplicate } else { Receive::IdConflict }, false);
        }
        if self.by_seq.contains_key(&(env.flow_id.clone(), env.seq)) {
            return (Receive::SequenceConflict, false);
        }
        if crash != Some(CrashWhen::BeforeCommit) {
            self.by_seq.insert((env.flow_id.clone(), env.seq), env.event_id.clone());
            self.inbox.insert(
                env.event_id.clone(),
                InboxRow {
                    event_id: env.event_id.clone(),
                    flow_id: env.flow_id.clone(),
                    seq: env.seq,
                    kind: env.kind.clone(),
                    schema: env.schema,
                    body,
                    payload: env.payload.clone(),
                    state: "pending",
                    reason: None,
                },
            );
        }
        (Receive::Accepted, crash.is_some())
    }

    /// The flow's projection (new if nothing was applied).
    pub fn projection(&self, flow: &str) -> Projection {
        self.projections.get(flow).copied().unwrap_or_default()
    }

    fn decode(row: &InboxRow, support_v2: bool) -> Result<i64, &'static str> {
        let field = match row.schema {
            1 => "amount",
            2 if support_v2 => "units",
            _ => return Err("unsupported_schema"),
        };
        match row.payload.iter().find(|(k, _)| k == field) {
            Some((_, Value::Int(n))) if *n >= 1 => Ok(*n),
            _ => Err("invalid_payload"),
        }
    }

    /// SPEC §7 for one flow (`max_steps` 0 = 1000). With `crash` armed at an apply point, the
    /// first step that would be applied fires it.
    pub fn apply(
        &mut self,
        flow: &str,
        max_steps: u32,
        support_v2: bool,
        crash: Option<CrashWhen>,
    ) -> Crashed<Applied> {
        let limit = if max_steps == 0 { 1000 } else { max_steps } as usize;
        let mut applied = Vec::new();
        loop {
            let from = self.projection(flow);
            let next = from.last_seq + 1;
            let done = |stop, applied| Applied { flow_id: flow.to_owned(), applied, stop, projection: from };
            let Some(id) = self.by_seq.get(&(flow.to_owned(), next)).cloned() else {
                let later =
                    self.by_seq.range((flow.to_owned(), next)..).next().is_some_and(|((f, _), _)| f == flow);
                let stop = if later { Stop::Gap { waiting_for_seq: next } } else { Stop::Idle };
                return Crashed::No(done(stop, applied));
            };
            if applied.len() >= limit {
                return Crashed::No(done(Stop::Limit, applied));
            }
            let row = self.inbox[&id].clone();
            let decided = Self::decode(&row, support_v2).and_then(|amount| {
                step(from.last_seq, from.amount, &row.kind, amount)
                    .map(|to| (to, if from.last_seq == 0 { amount } else { from.amount }))
                    .map_err(|_| "invalid_transition")
            });
            match decided {
                Err(reason) => {
                    let r = self.inbox.get_mut(&id).expect("row just read");
                    r.state = "blocked";
                    r.reason = Some(reason);
                    return Crashed::No(done(Stop::Blocked { event_id: id, reason }, applied));
                }
                Ok((to, amount)) => {
                    if crash == Some(CrashWhen::BeforeCommit) {
                        return Crashed::Yes { before: done(Stop::Idle, applied) };
                    }
                    let state = state_name(to);
                    let after = Projection { last_seq: to, held: held(state, amount), amount };
                    self.projections.insert(flow.to_owned(), after);
                    self.effects.entry(flow.to_owned()).or_default().push(Effect {
                        event_id: id.clone(),
                        seq: to,
                        kind: row.kind.clone(),
                        held: after.held,
                    });
                    let r = self.inbox.get_mut(&id).expect("row just read");
                    r.state = "applied";
                    r.reason = None;
                    applied.push(id);
                    if crash == Some(CrashWhen::AfterCommit) {
                        return Crashed::Yes { before: done(Stop::Idle, applied) };
                    }
                }
            }
        }
    }

    /// ApplyAll: Apply for every flow with unapplied rows, in flow_id order.
    pub fn apply_all(&mut self, max_steps: u32, support_v2: bool) -> Vec<Applied> {
        let mut flows: Vec<String> =
            self.inbox.values().filter(|r| r.state != "applied").map(|r| r.flow_id.clone()).collect();
        flows.sort();
        flows.dedup();
        flows
            .into_iter()
            .map(|f| match self.apply(&f, max_steps, support_v2, None) {
                Crashed::No(a) | Crashed::Yes { before: a } => a,
            })
            .collect()
    }

    /// The flow's inbox rows in seq order.
    pub fn flow_inbox(&self, flow: &str) -> Vec<&InboxRow> {
        let mut rows: Vec<&InboxRow> = self.inbox.values().filter(|r| r.flow_id == flow).collect();
        rows.sort_by_key(|r| r.seq);
        rows
    }
}

// ---------------------------------------------------------------------------------------
// Producer: Advance.
// ---------------------------------------------------------------------------------------

/// An Advance request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdvanceRequest {
    /// The flow.
    pub flow_id: String,
    /// The event id.
    pub event_id: String,
    /// The seq the client believes the flow is at.
    pub expected_seq: u64,
    /// The step kind.
    pub kind: String,
    /// The payload schema.
    pub schema: u32,
    /// The amount.
    pub amount: i64,
}

impl AdvanceRequest {
    /// The body this request would commit.
    pub fn body(&self) -> String {
        canon::advance_body(
            &self.event_id,
            &self.flow_id,
            self.expected_seq,
            &self.kind,
            self.schema,
            self.amount,
        )
    }

    fn malformed(&self) -> bool {
        let token = |s: &str| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic());
        !token(&self.flow_id)
            || !token(&self.event_id)
            || !KINDS.contains(&self.kind.as_str())
            || !(1..=2).contains(&self.schema)
            || !(1..=MAX_INT).contains(&self.amount)
    }
}

/// A committed outbox row in the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRow {
    /// The event id.
    pub event_id: String,
    /// The flow.
    pub flow_id: String,
    /// The step's seq in its flow.
    pub seq: u64,
    /// The step kind.
    pub kind: String,
    /// The payload schema.
    pub schema: u32,
    /// The canonical body.
    pub body: String,
}

/// Advance's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Advance {
    /// INVALID_ARGUMENT (a status, not an outcome).
    InvalidArgument,
    /// An outcome word (`COMMITTED`, …), the flow's seq and state after the call, and the
    /// stored event for COMMITTED / EXISTING / CONFLICT.
    Answer {
        /// The outcome word.
        outcome: &'static str,
        /// The flow's seq after the call.
        seq: u64,
        /// The flow's state after the call.
        state: &'static str,
        /// The stored event, for COMMITTED / EXISTING / CONFLICT.
        event: Option<OutboxRow>,
    },
}

/// The producer's records.
#[derive(Clone, Debug, Default)]
pub struct Producer {
    /// flow → (seq, amount).
    pub flows: BTreeMap<String, (u64, i64)>,
    /// Outbox rows by event id.
    pub outbox: BTreeMap<String, OutboxRow>,
}

impl Producer {
    /// SPEC §5. With `crash` armed at a producer point, a committing call fires it: before
    /// the commit nothing is written; after it the write stays. The second value says
    /// whether it fired.
    pub fn advance(&mut self, req: &AdvanceRequest, crash: Option<CrashWhen>) -> (Advance, bool) {
        if req.malformed() {
            return (Advance::InvalidArgument, false);
        }
        let (seq, amount) = self.flows.get(&req.flow_id).copied().unwrap_or((0, 0));
        let answer =
            |outcome, seq: u64, event| Advance::Answer { outcome, seq, state: state_name(seq), event };
        if let Some(stored) = self.outbox.get(&req.event_id) {
            let outcome = if stored.body == req.body() { "EXISTING" } else { "CONFLICT" };
            return (answer(outcome, seq, Some(stored.clone())), false);
        }
        if seq != req.expected_seq {
            return (answer("STALE", seq, None), false);
        }
        let Ok(to) = step(seq, amount, &req.kind, req.amount) else {
            return (answer("INVALID_TRANSITION", seq, None), false);
        };
        let row = OutboxRow {
            event_id: req.event_id.clone(),
            flow_id: req.flow_id.clone(),
            seq: to,
            kind: req.kind.clone(),
            schema: req.schema,
            body: req.body(),
        };
        if crash == Some(CrashWhen::BeforeCommit) {
            return (answer("COMMITTED", to, Some(row)), true);
        }
        let fixed = if seq == 0 { req.amount } else { amount };
        self.flows.insert(req.flow_id.clone(), (to, fixed));
        self.outbox.insert(req.event_id.clone(), row.clone());
        (answer("COMMITTED", to, Some(row)), crash.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(flow: &str, seq: u64, kind: &str, schema: u32, amount: i64) -> Envelope {
        let field = if schema == 2 { "units" } else { "amount" };
        Envelope {
            event_id: format!("{flow}{seq}"),
            flow_id: flow.into(),
            seq,
            kind: kind.into(),
            schema,
            payload: vec![(field.into(), Value::Int(amount))],
            rejected: false,
        }
    }

    fn applied(c: &mut Consumer, flow: &str, v2: bool) -> Applied {
        match c.apply(flow, 0, v2, None) {
            Crashed::No(a) => a,
            Crashed::Yes { .. } => unreachable!("not armed"),
        }
    }

    /// SPEC §10: arrival 3, 1, 2 with an Apply after each.
    #[test]
    fn the_reference_out_of_order_scenario() {
        let mut c = Consumer::default();
        assert_eq!(c.receive(&env("A", 3, "released", 1, 3)), Receive::Accepted);
        assert_eq!(applied(&mut c, "A", false).stop, Stop::Gap { waiting_for_seq: 1 });
        c.receive(&env("A", 1, "reserved", 1, 3));
        let a = applied(&mut c, "A", false);
        assert_eq!((a.applied.len(), a.stop), (1, Stop::Gap { waiting_for_seq: 2 }));
        c.receive(&env("A", 2, "confirmed", 1, 3));
        let a = applied(&mut c, "A", false);
        assert_eq!((a.applied, a.stop), (vec!["A2".to_owned(), "A3".to_owned()], Stop::Idle));
        assert_eq!(a.projection, Projection { last_seq: 3, held: 0, amount: 3 });
        assert_eq!(c.receive(&env("A", 3, "released", 1, 3)), Receive::Duplicate);
        assert_eq!(c.receive(&env("A", 3, "released", 1, 4)), Receive::IdConflict);
    }

    /// SPEC §10: schema 2 blocks without the decoder and applies with it.
    #[test]
    fn schema_two_blocks_then_applies() {
        let mut c = Consumer::default();
        c.receive(&env("A", 1, "reserved", 1, 3));
        c.receive(&env("A", 2, "confirmed", 2, 3));
        let a = applied(&mut c, "A", false);
        assert_eq!(a.stop, Stop::Blocked { event_id: "A2".into(), reason: "unsupported_schema" });
        assert_eq!(c.inbox["A2"].state, "blocked");
        let a = applied(&mut c, "A", true);
        assert_eq!((a.applied.len(), a.stop, a.projection.held), (1, Stop::Idle, 3));
        assert_eq!(c.inbox["A2"].reason, None);
    }

    /// SPEC §10: advance retries, conflicts and stale requests.
    #[test]
    fn advance_answers() {
        let mut p = Producer::default();
        let req = |id: &str, exp: u64, kind: &str, amount: i64| AdvanceRequest {
            flow_id: "A".into(),
            event_id: id.into(),
            expected_seq: exp,
            kind: kind.into(),
            schema: 1,
            amount,
        };
        let outcome = |a: (Advance, bool)| match a.0 {
            Advance::Answer { outcome, .. } => outcome,
            Advance::InvalidArgument => "INVALID_ARGUMENT",
        };
        assert_eq!(outcome(p.advance(&req("A1", 0, "reserved", 3), None)), "COMMITTED");
        assert_eq!(outcome(p.advance(&req("A2", 1, "confirmed", 3), None)), "COMMITTED");
        assert_eq!(outcome(p.advance(&req("A1", 0, "reserved", 3), None)), "EXISTING");
        assert_eq!(outcome(p.advance(&req("A1", 0, "reserved", 4), None)), "CONFLICT");
        assert_eq!(outcome(p.advance(&req("Ax", 0, "reserved", 3), None)), "STALE");
        assert_eq!(outcome(p.advance(&req("A3", 2, "released", 4), None)), "INVALID_TRANSITION");
        assert_eq!(outcome(p.advance(&req("A3", 2, "shipped", 3), None)), "INVALID_ARGUMENT");
        assert!(p.advance(&req("A3", 2, "released", 3), Some(CrashWhen::BeforeCommit)).1);
        assert_eq!(p.flows["A"], (2, 3));
    }
}
