//! The independent checker of a chaos run. After the faults stop and the system
//! drains, it reads producer.db and consumer.db through `harness::db` (no service store, no
//! protocol module) and the clients' recorded answers, and reports every breach of:
//!
//! - I1 every committed event (outbox row, or an Advance answered COMMITTED/EXISTING) is in
//!   the outbox with the acknowledged body, and applied (an effect and an `applied` inbox row);
//! - I2 no (flow, seq) and no event id has two effects;
//! - I3 each flow's effects, in apply (rowid) order, are exactly seqs 1..n with the legal
//!   kinds, and the projection stands at the last of them;
//! - I4 nothing the producer refused (STALE, INVALID_TRANSITION, CONFLICT) is stored or applied;
//! - I5 no conflicting body was stored or applied: every inbox row's body is byte-identical to
//!   the outbox body of its event id, effects match it, and no forged delivery got in;
//! - I6 pending work drains to zero (no unaccepted outbox row, no unapplied inbox row) within
//!   a deadline;
//! - I7 each store passes its integrity check: `PRAGMA integrity_check` is `ok` on SQLite;
//!   on PostgreSQL (whose server guards its pages) the backlog counters equal the rows.
//!
//! Besides these, `Answers` flags an Advance answer the spec does not allow for its request.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::backend::Target;
use crate::canon;
use crate::db::{self, Compactable, EffectRow, InboxRow, OutboxRow, ProjectionRow, Store};

/// One property the checker judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Invariant {
    /// Every Advance answer is one the spec allows for that request.
    Answers,
    /// I1: every committed event is applied.
    I1CommittedApplied,
    /// I2: no (flow, seq) or event id has two effects.
    I2OneEffect,
    /// I3: each flow's effects are exactly seqs 1..n in order.
    I3Contiguous,
    /// I4: nothing the producer refused is stored or applied.
    I4RefusedNotApplied,
    /// I5: no conflicting body was stored or applied.
    I5NoConflictingBody,
    /// I6: pending work drains to zero within the deadline.
    I6Drained,
    /// I7: `PRAGMA integrity_check` is ok on both files.
    I7Integrity,
}

impl Invariant {
    /// The short name used in reports (`I1` … `I7`, `answers`).
    pub fn code(self) -> &'static str {
        match self {
            Invariant::Answers => "answers",
            Invariant::I1CommittedApplied => "I1",
            Invariant::I2OneEffect => "I2",
            Invariant::I3Contiguous => "I3",
            Invariant::I4RefusedNotApplied => "I4",
            Invariant::I5NoConflictingBody => "I5",
            Invariant::I6Drained => "I6",
            Invariant::I7Integrity => "I7",
        }
    }

    /// What the invariant says, in words.
    pub fn meaning(self) -> &'static str {
        match self {
            Invariant::Answers => "every Advance answer is allowed for its request",
            Invariant::I1CommittedApplied => "every committed event is applied",
            Invariant::I2OneEffect => "no (flow, seq) or event id has two effects",
            Invariant::I3Contiguous => "each flow's effects are exactly seqs 1..n in order",
            Invariant::I4RefusedNotApplied => "nothing the producer refused is applied",
            Invariant::I5NoConflictingBody => "no conflicting body was applied",
            Invariant::I6Drained => "pending drains to zero within the deadline",
            Invariant::I7Integrity => {
                "each store passes its integrity check (SQLite: PRAGMA integrity_check; PostgreSQL: exact backlog counters)"
            }
        }
    }

    /// Every invariant, in report order.
    pub const ALL: [Invariant; 8] = [
        Invariant::Answers,
        Invariant::I1CommittedApplied,
        Invariant::I2OneEffect,
        Invariant::I3Contiguous,
        Invariant::I4RefusedNotApplied,
        Invariant::I5NoConflictingBody,
        Invariant::I6Drained,
        Invariant::I7Integrity,
    ];
}

/// Why a client sent an Advance: the real next step of its flow, or a request the producer
/// must refuse (or, for `Existing`, answer without writing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Intent {
    /// The flow's legal next step.
    Step,
    /// A fresh event id with a wrong `expected_seq`: must be STALE.
    Stale,
    /// A fresh event id with an illegal kind or a changed amount: must be INVALID_TRANSITION.
    Invalid,
    /// A committed event id with a different body: must be CONFLICT.
    Conflict,
    /// An exact retry of a committed step: must be EXISTING.
    Existing,
}

/// What one Advance call got back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// COMMITTED, with the stored event's body.
    Committed {
        /// The canonical body answered.
        body: String,
    },
    /// EXISTING, with the stored event's body.
    Existing {
        /// The canonical body answered.
        body: String,
    },
    /// CONFLICT, with the stored event's body.
    Conflict {
        /// The canonical body answered.
        body: String,
    },
    /// STALE.
    Stale,
    /// INVALID_TRANSITION.
    InvalidTransition,
    /// The call failed ambiguously (transport error, server gone): it may or may not have
    /// committed. The client retries it with the same event id.
    Unknown {
        /// The error seen.
        error: String,
    },
    /// Anything else (INVALID_ARGUMENT, an unspecified outcome): never allowed here.
    Other {
        /// What came back.
        what: String,
    },
}

/// One Advance call and its answer, as a client recorded it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvanceRecord {
    /// The flow.
    pub flow_id: String,
    /// The event id sent.
    pub event_id: String,
    /// The seq the client believed the flow was at.
    pub expected_seq: u64,
    /// The step kind asked for.
    pub kind: String,
    /// The payload schema.
    pub schema: u32,
    /// The amount.
    pub amount: i64,
    /// Why the client sent it.
    pub intent: Intent,
    /// What came back.
    pub answer: Answer,
}

impl AdvanceRecord {
    /// The canonical body this request would commit (seq = expected_seq + 1).
    pub fn requested_body(&self) -> String {
        canon::advance_body(
            &self.event_id,
            &self.flow_id,
            self.expected_seq,
            &self.kind,
            self.schema,
            self.amount,
        )
    }
}

/// A delivery the chaos driver forged and sent to the consumer directly: a committed event
/// id with a different body (must be ID_CONFLICT) or a new event id at a held (flow, seq)
/// (must be SEQUENCE_CONFLICT). Neither may ever be stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgedRecord {
    /// The event id sent.
    pub event_id: String,
    /// The flow.
    pub flow_id: String,
    /// The seq sent.
    pub seq: u64,
    /// The canonical body of what was sent.
    pub body: String,
    /// The consumer's answer (short word, e.g. `ID_CONFLICT`), or the transport error.
    pub answer: String,
}

/// Everything the clients saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct History {
    /// Every Advance call, in the order recorded.
    pub advances: Vec<AdvanceRecord>,
    /// Every forged delivery.
    pub forged: Vec<ForgedRecord>,
}

/// The two databases (files, or one PostgreSQL database holding both schemas).
#[derive(Clone, Debug)]
pub struct Files {
    /// producer.db (or the producer's schema).
    pub producer_db: Target,
    /// consumer.db (or the consumer's schema).
    pub consumer_db: Target,
}

/// One breach.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Which invariant.
    pub invariant: Invariant,
    /// What was seen.
    pub detail: String,
}

/// The checker's judgement and what it read.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Verdict {
    /// Every breach found.
    pub violations: Vec<Violation>,
    /// Outbox rows (committed events).
    pub committed_events: u64,
    /// Distinct flows with at least one committed event.
    pub committed_flows: u64,
    /// Effect rows.
    pub effects: u64,
}

impl Verdict {
    /// True when no invariant was breached.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// The invariants breached, each once.
    pub fn breached(&self) -> BTreeSet<Invariant> {
        self.violations.iter().map(|v| v.invariant).collect()
    }

    /// One line per invariant (`I1 ok` or `I1 VIOLATED (n): first detail`).
    pub fn summary_lines(&self) -> Vec<String> {
        Invariant::ALL
            .iter()
            .map(|inv| {
                let hits: Vec<&Violation> = self.violations.iter().filter(|v| v.invariant == *inv).collect();
                match hits.first() {
                    None => format!("{} ok: {}", inv.code(), inv.meaning()),
                    Some(first) => format!(
                        "{} VIOLATED ({}x): {}; first: {}",
                        inv.code(),
                        hits.len(),
                        inv.meaning(),
                        first.detail
                    ),
                }
            })
            .collect()
    }
}

/// How the wait for pending work ended (I6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Drain {
    /// Nothing was pending after this long.
    Drained(Duration),
    /// Still pending at the deadline: unaccepted outbox rows, unapplied inbox rows.
    TimedOut {
        /// Unaccepted outbox rows.
        unaccepted: u64,
        /// Unapplied inbox rows.
        unapplied: u64,
    },
}

/// Counts of pending work: (unaccepted outbox rows, unapplied inbox rows).
pub fn pending(files: &Files) -> Result<(u64, u64), String> {
    let unaccepted = db::count_unaccepted(&db::try_open_ro(&files.producer_db)?)?;
    let unapplied = db::count_unapplied(&db::try_open_ro(&files.consumer_db)?)?;
    Ok((unaccepted, unapplied))
}

/// Polls [`pending`] until both counts are zero or `deadline` passes (I6).
pub fn wait_drained(files: &Files, deadline: Duration) -> Drain {
    let start = Instant::now();
    let mut last = (u64::MAX, u64::MAX);
    let drained = crate::background::poll(deadline, || match pending(files) {
        Ok((0, 0)) => Some(()),
        Ok(counts) => {
            last = counts;
            None
        }
        Err(_) => None,
    });
    match drained {
        Some(()) => Drain::Drained(start.elapsed()),
        None => Drain::TimedOut { unaccepted: last.0, unapplied: last.1 },
    }
}

/// What the files hold, read through [`crate::db`].
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// producer.db's outbox.
    pub outbox: Vec<OutboxRow>,
    /// consumer.db's inbox.
    pub inbox: Vec<InboxRow>,
    /// consumer.db's effects, in apply order.
    pub effects: Vec<EffectRow>,
    /// consumer.db's projections.
    pub projections: Vec<ProjectionRow>,
}

impl Snapshot {
    /// Reads both stores, each in one read transaction (so a store's tables agree).
    pub fn read(files: &Files) -> Result<Snapshot, String> {
        let p = db::try_open_ro(&files.producer_db)?;
        let outbox = p.snapshot(db::read_outbox).map_err(|e| format!("producer: {e}"))?;
        let c = db::try_open_ro(&files.consumer_db)?;
        let (inbox, effects, projections) = c
            .snapshot(|c| Ok((db::read_inbox(c)?, db::read_effects(c)?, db::read_projections(c)?)))
            .map_err(|e| format!("consumer: {e}"))?;
        Ok(Snapshot { outbox, inbox, effects, projections })
    }
}

/// The kinds of a flow's seqs 1, 2, 3.
const KINDS: [&str; 3] = ["reserved", "confirmed", "released"];

/// Judges the files and the history: each invariant by its own function below. `drain` is
/// how the wait for pending work ended (see [`wait_drained`]); the final snapshot is judged
/// for pending rows too.
pub fn check(files: &Files, history: &History, drain: &Drain) -> Verdict {
    let mut v = Verdict::default();
    let mut flag = |invariant: Invariant, details: Vec<String>| {
        v.violations.extend(details.into_iter().map(|detail| Violation { invariant, detail }));
    };
    flag(Invariant::I7Integrity, i7_integrity(files));
    let snap = match Snapshot::read(files) {
        Ok(s) => s,
        Err(e) => {
            flag(Invariant::I7Integrity, vec![format!("the files cannot be read: {e}")]);
            flag(Invariant::I6Drained, i6_drained(drain, &Snapshot::default()));
            return v;
        }
    };
    let ix = Index::new(&snap, history);
    flag(Invariant::Answers, allowed_answers(history));
    flag(Invariant::I1CommittedApplied, i1_committed_applied(&ix, &snap));
    flag(Invariant::I2OneEffect, i2_one_effect(&ix));
    flag(Invariant::I3Contiguous, i3_contiguous(&ix, &snap));
    flag(Invariant::I4RefusedNotApplied, i4_refused_not_applied(&ix, history));
    flag(Invariant::I5NoConflictingBody, i5_no_conflicting_body(&ix, &snap, history));
    flag(Invariant::I6Drained, i6_drained(drain, &snap));
    v.committed_events = snap.outbox.len() as u64;
    v.committed_flows = snap.outbox.iter().map(|r| &r.flow_id).collect::<BTreeSet<_>>().len() as u64;
    v.effects = snap.effects.len() as u64;
    v
}

/// The snapshot and history looked up the ways the invariants need them.
struct Index<'a> {
    outbox: HashMap<&'a str, &'a OutboxRow>,
    inbox: HashMap<&'a str, &'a InboxRow>,
    effects_by_id: HashMap<&'a str, Vec<&'a EffectRow>>,
    effects_by_seq: BTreeMap<(&'a str, u64), Vec<&'a EffectRow>>,
    /// Per flow, in apply order.
    effects_by_flow: BTreeMap<&'a str, Vec<&'a EffectRow>>,
    /// Event id → body, for every Advance a client was told is committed.
    acknowledged: BTreeMap<&'a str, &'a str>,
    /// Fresh ids answered STALE or INVALID_TRANSITION and never acknowledged committed.
    refused_ids: BTreeSet<&'a str>,
}

impl<'a> Index<'a> {
    fn new(snap: &'a Snapshot, history: &'a History) -> Index<'a> {
        let mut ix = Index {
            outbox: snap.outbox.iter().map(|r| (r.event_id.as_str(), r)).collect(),
            inbox: snap.inbox.iter().map(|r| (r.event_id.as_str(), r)).collect(),
            effects_by_id: HashMap::new(),
            effects_by_seq: BTreeMap::new(),
            effects_by_flow: BTreeMap::new(),
            acknowledged: BTreeMap::new(),
            refused_ids: BTreeSet::new(),
        };
        for e in &snap.effects {
            ix.effects_by_id.entry(&e.event_id).or_default().push(e);
            ix.effects_by_seq.entry((&e.flow_id, e.seq)).or_default().push(e);
            ix.effects_by_flow.entry(&e.flow_id).or_default().push(e);
        }
        for r in &history.advances {
            if let (Intent::Step, Answer::Committed { body } | Answer::Existing { body }) =
                (&r.intent, &r.answer)
            {
                ix.acknowledged.insert(&r.event_id, body);
            }
        }
        for r in &history.advances {
            if matches!(r.answer, Answer::Stale | Answer::InvalidTransition)
                && !ix.acknowledged.contains_key(r.event_id.as_str())
            {
                ix.refused_ids.insert(&r.event_id);
            }
        }
        ix
    }
}

/// Every Advance answer is one the spec allows for its request.
fn allowed_answers(history: &History) -> Vec<String> {
    let mut out = Vec::new();
    for r in &history.advances {
        let requested = r.requested_body();
        let ok = match (&r.intent, &r.answer) {
            (_, Answer::Unknown { .. }) => true,
            (Intent::Step, Answer::Committed { body } | Answer::Existing { body }) => *body == requested,
            (Intent::Existing, Answer::Existing { body }) => *body == requested,
            (Intent::Conflict, Answer::Conflict { body }) => *body != requested,
            (Intent::Stale, Answer::Stale) | (Intent::Invalid, Answer::InvalidTransition) => true,
            _ => false,
        };
        if !ok {
            out.push(format!(
                "{} ({:?}, expected_seq {}) was answered {:?}",
                r.event_id, r.intent, r.expected_seq, r.answer
            ));
        }
    }
    out
}

/// I1: every committed event (an outbox row, or an Advance acknowledged COMMITTED/EXISTING)
/// is in the outbox with the acknowledged body, and applied (an effect and an `applied` row).
fn i1_committed_applied(ix: &Index<'_>, snap: &Snapshot) -> Vec<String> {
    let mut out = Vec::new();
    for (id, body) in &ix.acknowledged {
        match ix.outbox.get(id) {
            None => out.push(format!("{id} was acknowledged committed but is not in the outbox")),
            Some(row) if !row.holds(body) => out
                .push(format!("{id} was acknowledged with body {body} but the outbox holds {}", row.shown())),
            Some(_) => {}
        }
    }
    for row in &snap.outbox {
        let applied_row = ix.inbox.get(row.event_id.as_str()).is_some_and(|i| i.state == "applied");
        let has_effect = ix.effects_by_id.contains_key(row.event_id.as_str());
        if !applied_row || !has_effect {
            let state = ix.inbox.get(row.event_id.as_str()).map_or("absent", |i| i.state.as_str());
            out.push(format!(
                "committed {} (flow {}, seq {}) is not applied: inbox {state}, effect {}",
                row.event_id,
                row.flow_id,
                row.seq,
                if has_effect { "present" } else { "absent" }
            ));
        }
    }
    out
}

/// I2: one effect per (flow, seq) and per event id.
fn i2_one_effect(ix: &Index<'_>) -> Vec<String> {
    let mut out = Vec::new();
    for ((flow, seq), list) in &ix.effects_by_seq {
        if list.len() > 1 {
            let ids: Vec<&str> = list.iter().map(|e| e.event_id.as_str()).collect();
            out.push(format!("flow {flow} seq {seq} has {} effects: {ids:?}", list.len()));
        }
    }
    for (id, list) in &ix.effects_by_id {
        if list.len() > 1 {
            out.push(format!("event {id} has {} effects", list.len()));
        }
    }
    out
}

/// I3: per flow, the effects in apply order are seqs 1..n with the legal kinds, and the
/// projection stands at the last of them (and no projection stands without effects).
fn i3_contiguous(ix: &Index<'_>, snap: &Snapshot) -> Vec<String> {
    let mut out = Vec::new();
    let projections: HashMap<&str, &ProjectionRow> =
        snap.projections.iter().map(|p| (p.flow_id.as_str(), p)).collect();
    for (flow, list) in &ix.effects_by_flow {
        let seqs: Vec<u64> = list.iter().map(|e| e.seq).collect();
        let expected: Vec<u64> = (1..=list.len() as u64).collect();
        if seqs != expected {
            out.push(format!("flow {flow}: effects in apply order have seqs {seqs:?}"));
            continue;
        }
        for e in list {
            let legal = KINDS.get(e.seq as usize - 1).copied();
            if legal != Some(e.kind.as_str()) {
                out.push(format!("flow {flow}: seq {} applied as {:?}", e.seq, e.kind));
            }
        }
        let last = list[list.len() - 1];
        match projections.get(flow) {
            Some(p) if p.last_seq == last.seq && p.state == last.kind && p.held == last.held => {}
            other => out.push(format!(
                "flow {flow}: last effect is seq {} {} held {}, projection {other:?}",
                last.seq, last.kind, last.held
            )),
        }
    }
    for p in &snap.projections {
        if !ix.effects_by_flow.contains_key(p.flow_id.as_str()) {
            out.push(format!("flow {}: projection {p:?} but no effects", p.flow_id));
        }
    }
    out
}

/// I4: nothing the producer refused is stored or applied. A fresh id answered STALE or
/// INVALID_TRANSITION (and never committed) must be nowhere; a CONFLICT request's body must
/// never be the stored one.
fn i4_refused_not_applied(ix: &Index<'_>, history: &History) -> Vec<String> {
    let mut out = Vec::new();
    for id in &ix.refused_ids {
        let places: Vec<&str> = [
            ("outbox", ix.outbox.contains_key(id)),
            ("inbox", ix.inbox.contains_key(id)),
            ("effect", ix.effects_by_id.contains_key(id)),
        ]
        .into_iter()
        .filter_map(|(name, hit)| hit.then_some(name))
        .collect();
        if !places.is_empty() {
            out.push(format!("refused {id} is in {places:?}"));
        }
    }
    for r in &history.advances {
        if matches!(r.answer, Answer::Conflict { .. }) {
            let refused = r.requested_body();
            let id = r.event_id.as_str();
            if ix.outbox.get(id).is_some_and(|o| o.holds(&refused))
                || ix.inbox.get(id).is_some_and(|i| i.holds(&refused))
            {
                out.push(format!("the refused conflicting body of {} is stored", r.event_id));
            }
        }
    }
    out
}

/// I5: what the consumer stored and applied is exactly what the producer committed: every
/// inbox body is byte-identical to the outbox body of its id, effects match the outbox, and
/// no forged delivery was accepted or stored.
fn i5_no_conflicting_body(ix: &Index<'_>, snap: &Snapshot, history: &History) -> Vec<String> {
    let mut out = Vec::new();
    for i in &snap.inbox {
        match ix.outbox.get(i.event_id.as_str()) {
            // Compared by digest: either side may be a tombstone (retention).
            Some(o) if o.digest() == i.digest() => {}
            Some(o) => out.push(format!(
                "{} ({}): inbox body {} differs from the outbox body {}",
                i.event_id,
                i.state,
                i.shown(),
                o.shown()
            )),
            None if ix.refused_ids.contains(i.event_id.as_str()) => {}
            None => out.push(format!(
                "{} ({}) is in the inbox but the producer never committed it",
                i.event_id, i.state
            )),
        }
    }
    for e in &snap.effects {
        if let Some(o) = ix.outbox.get(e.event_id.as_str()) {
            if (o.flow_id.as_str(), o.seq, o.kind.as_str()) != (e.flow_id.as_str(), e.seq, e.kind.as_str()) {
                out.push(format!(
                    "effect {} is flow {} seq {} {} but the outbox says flow {} seq {} {}",
                    e.event_id, e.flow_id, e.seq, e.kind, o.flow_id, o.seq, o.kind
                ));
            }
        } else if !ix.refused_ids.contains(e.event_id.as_str()) {
            out.push(format!("effect {} has no committed event", e.event_id));
        }
    }
    for f in &history.forged {
        if f.answer == "ACCEPTED" || f.answer == "DUPLICATE" {
            out.push(format!(
                "forged delivery {} (flow {}, seq {}) was answered {}",
                f.event_id, f.flow_id, f.seq, f.answer
            ));
        }
        if ix.inbox.get(f.event_id.as_str()).is_some_and(|i| i.holds(&f.body)) {
            out.push(format!("forged delivery {} is stored in the inbox", f.event_id));
        }
    }
    out
}

/// I6: pending work drained within the deadline, and the final files hold none.
fn i6_drained(drain: &Drain, snap: &Snapshot) -> Vec<String> {
    let mut out = Vec::new();
    if let Drain::TimedOut { unaccepted, unapplied } = drain {
        out.push(format!(
            "still pending at the deadline: {unaccepted} unaccepted outbox rows, {unapplied} unapplied inbox rows"
        ));
    }
    let unaccepted = snap.outbox.iter().filter(|o| !o.accepted).count();
    let unapplied = snap.inbox.iter().filter(|i| i.state != "applied").count();
    if unaccepted + unapplied > 0 {
        out.push(format!(
            "final files: {unaccepted} unaccepted outbox rows, {unapplied} unapplied inbox rows"
        ));
    }
    out
}

/// I7: each store passes its backend's integrity check (SQLite: `PRAGMA integrity_check` is
/// `ok`; PostgreSQL: the backlog counters equal the rows they count).
fn i7_integrity(files: &Files) -> Vec<String> {
    [("producer", &files.producer_db, Store::Producer), ("consumer", &files.consumer_db, Store::Consumer)]
        .into_iter()
        .filter_map(|(name, target, store)| {
            db::try_open_ro(target)
                .and_then(|conn| db::integrity_check(&conn, store))
                .err()
                .map(|e| format!("{name}: {e}"))
        })
        .collect()
}

/// What the run exercised, read from the files: redeliveries and out-of-order arrivals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Observed {
    /// Outbox rows sent more than once.
    pub rows_resent: u64,
    /// Sends beyond the first, over all rows.
    pub extra_sends: u64,
    /// Inbox rows that arrived after a larger seq of their flow had arrived (rowid order).
    pub out_of_order_arrivals: u64,
    /// Flows with at least one such arrival.
    pub out_of_order_flows: u64,
    /// Outbox rows compacted to tombstones (retention).
    pub compacted_outbox: u64,
    /// Inbox rows compacted to tombstones (retention).
    pub compacted_inbox: u64,
}

/// Counts redeliveries (outbox `attempts` > 1) and out-of-order arrivals (inbox rowid order
/// against seq order).
pub fn observe(snap: &Snapshot) -> Observed {
    let mut o = Observed::default();
    for row in &snap.outbox {
        if row.attempts > 1 {
            o.rows_resent += 1;
            o.extra_sends += row.attempts - 1;
        }
    }
    let mut max_seen: HashMap<&str, u64> = HashMap::new();
    let mut flows: BTreeSet<&str> = BTreeSet::new();
    let mut arrivals: Vec<&InboxRow> = snap.inbox.iter().collect();
    arrivals.sort_by_key(|r| r.rowid);
    for row in arrivals {
        let seen = max_seen.entry(&row.flow_id).or_insert(0);
        if row.seq < *seen {
            o.out_of_order_arrivals += 1;
            flows.insert(&row.flow_id);
        }
        *seen = (*seen).max(row.seq);
    }
    o.out_of_order_flows = flows.len() as u64;
    o.compacted_outbox = snap.outbox.iter().filter(|r| r.body_sha256.is_some()).count() as u64;
    o.compacted_inbox = snap.inbox.iter().filter(|r| r.body_sha256.is_some()).count() as u64;
    o
}

#[cfg(test)]
#[path = "checker_tests.rs"]
mod tests;
