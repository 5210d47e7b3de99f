//! The checker's own tests: small producer.db/consumer.db files built by hand with SQL (no
//! service involved), one clean history the checker must pass, and one synthetic history per
//! invariant (I1–I7) that it must flag.

use std::time::Duration;

use super::*;
use crate::backend::Backend;

/// A hand-built pair of stores: flow A committed and applied in full (3 steps), flow B up to
/// seq 2; the history has every step's COMMITTED answer plus a STALE and a CONFLICT refusal.
/// On the selected backend: two SQLite files, or one scratch PostgreSQL database with the two
/// schemas of the contract (`position` as the last column of `inbox` and `effect`).
struct Fixture {
    _dir: tempfile::TempDir,
    _pg: Option<proto::pg::testing::TestDb>,
    files: Files,
    history: History,
}

fn body(event_id: &str, flow: &str, seq: u64, amount: i64) -> String {
    canon::Body {
        event_id: event_id.into(),
        flow_id: flow.into(),
        seq,
        kind: KINDS[seq as usize - 1].into(),
        schema: 1,
        payload: canon::amount_payload(1, amount),
    }
    .canonical()
}

fn step(flow: &str, seq: u64) -> AdvanceRecord {
    let event_id = format!("{flow}{seq}");
    AdvanceRecord {
        answer: Answer::Committed { body: body(&event_id, flow, seq, 3) },
        flow_id: flow.into(),
        event_id,
        expected_seq: seq - 1,
        kind: KINDS[seq as usize - 1].into(),
        schema: 1,
        amount: 3,
        intent: Intent::Step,
    }
}

// Schema 5 keeps bodies in `outbox_body` (keyed by the row's id): a view gives the readers
// that shape while the fixture inserts bodies inline.
const SQLITE_PRODUCER: &str = "PRAGMA journal_mode=WAL;
    CREATE TABLE outbox(id INTEGER PRIMARY KEY, event_id TEXT UNIQUE, flow_id TEXT, seq INTEGER,
        kind TEXT, schema INTEGER, body TEXT, accepted INTEGER, attempts INTEGER, last_outcome TEXT,
        body_sha256 BLOB);
    CREATE VIEW outbox_body AS SELECT id, body FROM outbox WHERE body IS NOT NULL;";
const SQLITE_CONSUMER: &str = "PRAGMA journal_mode=WAL;
    CREATE TABLE inbox(event_id TEXT, flow_id TEXT, seq INTEGER, kind TEXT, schema INTEGER,
        body TEXT, state TEXT, reason TEXT, received_at_us INTEGER);
    CREATE TABLE effect(event_id TEXT, flow_id TEXT, seq INTEGER, kind TEXT, held INTEGER);
    CREATE TABLE projection(flow_id TEXT PRIMARY KEY, last_seq INTEGER, state TEXT, held INTEGER);";
const PG_PRODUCER: &str = "CREATE SCHEMA ordered_events_producer;
    CREATE TABLE ordered_events_producer.outbox(event_id TEXT PRIMARY KEY, flow_id TEXT, seq BIGINT,
        kind TEXT, schema INTEGER, body TEXT, accepted INTEGER, attempts BIGINT, last_outcome TEXT,
        body_sha256 BYTEA);";
const PG_CONSUMER: &str = "CREATE SCHEMA ordered_events_consumer;
    CREATE TABLE ordered_events_consumer.inbox(event_id TEXT, flow_id TEXT, seq BIGINT, kind TEXT,
        schema INTEGER, body TEXT, state TEXT, reason TEXT, received_at_us BIGINT,
        position BIGINT GENERATED ALWAYS AS IDENTITY);
    CREATE TABLE ordered_events_consumer.effect(event_id TEXT, flow_id TEXT, seq BIGINT, kind TEXT,
        held BIGINT, position BIGINT GENERATED ALWAYS AS IDENTITY);
    CREATE TABLE ordered_events_consumer.projection(flow_id TEXT PRIMARY KEY, last_seq BIGINT,
        state TEXT, held BIGINT);";

impl Fixture {
    /// The fixture on the selected backend; `None` (after the SKIPPED line) when it is
    /// PostgreSQL and no server answers.
    fn new() -> Option<Fixture> {
        let dir = tempfile::tempdir().expect("temp dir");
        let (pg, files) = match Backend::current() {
            Backend::Sqlite => {
                let files = Files {
                    producer_db: dir.path().join("p.db").into(),
                    consumer_db: dir.path().join("c.db").into(),
                };
                db::execute(&files.producer_db, SQLITE_PRODUCER);
                db::execute(&files.consumer_db, SQLITE_CONSUMER);
                (None, files)
            }
            Backend::Postgres => {
                let pg = proto::pg::testing::TestDb::create("checker")?;
                let target = Target::Postgres(pg.url().to_owned());
                db::execute(&target, PG_PRODUCER);
                db::execute(&target, PG_CONSUMER);
                (Some(pg), Files { producer_db: target.clone(), consumer_db: target })
            }
        };
        let mut f = Fixture { _dir: dir, _pg: pg, files, history: History::default() };
        let (mut producer, mut consumer) = (String::new(), String::new());
        for (flow, n) in [("A", 3), ("B", 2)] {
            for seq in 1..=n {
                let rec = step(flow, seq);
                let (id, kind) = (&rec.event_id, &rec.kind);
                let b = body(id, flow, seq, 3);
                let held = if seq == 3 { 0 } else { 3 };
                producer.push_str(&format!(
                    "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, accepted, attempts)
                     VALUES ('{id}', '{flow}', {seq}, '{kind}', 1, '{b}', 1, 1);"
                ));
                consumer.push_str(&format!(
                    "INSERT INTO inbox VALUES ('{id}', '{flow}', {seq}, '{kind}', 1, '{b}', 'applied', NULL, 0);
                     INSERT INTO effect VALUES ('{id}', '{flow}', {seq}, '{kind}', {held});"
                ));
                f.history.advances.push(rec);
            }
        }
        f.producer(&producer);
        f.consumer(&consumer);
        f.consumer(
            "INSERT INTO projection VALUES ('A', 3, 'released', 0);
             INSERT INTO projection VALUES ('B', 2, 'confirmed', 3);",
        );
        let history = &mut f.history;
        // Refusals the producer gave: a stale fresh id, and A1 again with another amount.
        let mut stale = step("B", 3);
        stale.event_id = "B-stale".into();
        stale.expected_seq = 0;
        stale.intent = Intent::Stale;
        stale.answer = Answer::Stale;
        history.advances.push(stale);
        let mut conflict = step("A", 1);
        conflict.amount = 9;
        conflict.intent = Intent::Conflict;
        conflict.answer = Answer::Conflict { body: body("A1", "A", 1, 3) };
        history.advances.push(conflict);
        Some(f)
    }

    /// Runs `sql` on the producer's tables (unqualified names).
    fn producer(&self, sql: &str) {
        Self::run(&self.files.producer_db, Store::Producer, sql);
    }

    /// Runs `sql` on the consumer's tables (unqualified names).
    fn consumer(&self, sql: &str) {
        Self::run(&self.files.consumer_db, Store::Consumer, sql);
    }

    fn run(target: &Target, store: Store, sql: &str) {
        match target {
            Target::Sqlite(_) => db::execute(target, sql),
            Target::Postgres(_) => {
                db::execute(target, &format!("SET search_path TO {};{sql}", store.pg_schema()))
            }
        }
    }

    fn check(&self) -> Verdict {
        check(&self.files, &self.history, &wait_drained(&self.files, Duration::ZERO))
    }
}

/// Asserts that `verdict` flags `invariant` (and prints every violation when it does not).
fn assert_flags(verdict: &Verdict, invariant: Invariant) {
    assert!(
        verdict.breached().contains(&invariant),
        "{} not flagged; verdict: {:#?}",
        invariant.code(),
        verdict.violations
    );
}

#[test]
fn a_clean_history_passes() {
    let Some(f) = Fixture::new() else { return };
    let v = f.check();
    assert!(v.ok(), "{:#?}", v.violations);
    assert_eq!((v.committed_events, v.committed_flows, v.effects), (5, 2, 5));
}

#[test]
fn i1_a_committed_event_never_applied() {
    let Some(f) = Fixture::new() else { return };
    // B2 is committed and marked accepted, but the consumer has no trace of it.
    f.consumer(
        "DELETE FROM inbox WHERE event_id = 'B2'; DELETE FROM effect WHERE event_id = 'B2';
         UPDATE projection SET last_seq = 1, state = 'reserved' WHERE flow_id = 'B';",
    );
    let v = f.check();
    assert_flags(&v, Invariant::I1CommittedApplied);
    assert_eq!(v.breached(), BTreeSet::from([Invariant::I1CommittedApplied]), "{:#?}", v.violations);
}

#[test]
fn i1_an_acknowledged_commit_lost() {
    let Some(mut f) = Fixture::new() else { return };
    // A client was told B3 committed, but no file has it.
    f.history.advances.push(step("B", 3));
    let v = f.check();
    assert_flags(&v, Invariant::I1CommittedApplied);
    assert!(v.violations.iter().any(|x| x.detail.contains("not in the outbox")), "{:#?}", v.violations);
}

#[test]
fn i2_two_effects_for_one_seq() {
    let Some(f) = Fixture::new() else { return };
    f.consumer("INSERT INTO effect VALUES ('A3', 'A', 3, 'released', 0);");
    assert_flags(&f.check(), Invariant::I2OneEffect);
}

#[test]
fn i3_effects_out_of_order() {
    let Some(f) = Fixture::new() else { return };
    // B's effects were applied 2 before 1.
    f.consumer(
        "DELETE FROM effect WHERE flow_id = 'B';
         INSERT INTO effect VALUES ('B2', 'B', 2, 'confirmed', 3);
         INSERT INTO effect VALUES ('B1', 'B', 1, 'reserved', 3);",
    );
    let v = f.check();
    assert_flags(&v, Invariant::I3Contiguous);
    assert_eq!(v.breached(), BTreeSet::from([Invariant::I3Contiguous]), "{:#?}", v.violations);
}

#[test]
fn i3_a_projection_past_its_effects() {
    let Some(f) = Fixture::new() else { return };
    f.consumer("UPDATE projection SET last_seq = 3, state = 'released', held = 0 WHERE flow_id = 'B';");
    assert_flags(&f.check(), Invariant::I3Contiguous);
}

#[test]
fn i4_a_refused_event_applied() {
    let Some(f) = Fixture::new() else { return };
    // The producer answered B-stale STALE, yet the consumer applied it as B's seq 3.
    let b = body("B-stale", "B", 3, 3);
    f.consumer(&format!(
        "INSERT INTO inbox VALUES ('B-stale', 'B', 3, 'released', 1, '{b}', 'applied', NULL, 0);
         INSERT INTO effect VALUES ('B-stale', 'B', 3, 'released', 0);
         UPDATE projection SET last_seq = 3, state = 'released', held = 0 WHERE flow_id = 'B';"
    ));
    let v = f.check();
    assert_flags(&v, Invariant::I4RefusedNotApplied);
    assert_eq!(v.breached(), BTreeSet::from([Invariant::I4RefusedNotApplied]), "{:#?}", v.violations);
}

#[test]
fn i4_a_refused_conflicting_body_stored() {
    let Some(f) = Fixture::new() else { return };
    let refused = body("A1", "A", 1, 9);
    f.consumer(&format!("UPDATE inbox SET body = '{refused}' WHERE event_id = 'A1';"));
    assert_flags(&f.check(), Invariant::I4RefusedNotApplied);
}

#[test]
fn i5_a_conflicting_body_applied() {
    let Some(f) = Fixture::new() else { return };
    // The consumer holds A2 with amount 4 where the producer committed amount 3.
    let other = body("A2", "A", 2, 4);
    f.consumer(&format!("UPDATE inbox SET body = '{other}' WHERE event_id = 'A2';"));
    let v = f.check();
    assert_flags(&v, Invariant::I5NoConflictingBody);
    assert_eq!(v.breached(), BTreeSet::from([Invariant::I5NoConflictingBody]), "{:#?}", v.violations);
}

/// Compacts outbox row `id` as retention does: the body goes, `digest_of`'s digest stays.
fn compact_outbox(f: &Fixture, id: &str, digest_of: &str) {
    let hex = db::sha256_hex(digest_of);
    let digest = match f.files.producer_db {
        Target::Sqlite(_) => format!("X'{hex}'"),
        Target::Postgres(_) => format!("decode('{hex}', 'hex')"),
    };
    f.producer(&format!("UPDATE outbox SET body = NULL, body_sha256 = {digest} WHERE event_id = '{id}';"));
}

#[test]
fn a_tombstone_whose_digest_matches_passes() {
    let Some(f) = Fixture::new() else { return };
    compact_outbox(&f, "A1", &body("A1", "A", 1, 3));
    compact_outbox(&f, "B2", &body("B2", "B", 2, 3));
    let v = f.check();
    assert!(v.violations.is_empty(), "{:#?}", v.violations);
}

#[test]
fn a_tombstone_of_another_body_is_a_conflict() {
    let Some(f) = Fixture::new() else { return };
    // The outbox kept the digest of amount 4 where the client was told amount 3 committed
    // and the consumer holds amount 3.
    compact_outbox(&f, "A2", &body("A2", "A", 2, 4));
    let v = f.check();
    assert_flags(&v, Invariant::I5NoConflictingBody);
    assert_flags(&v, Invariant::I1CommittedApplied);
}

#[test]
fn i5_a_forged_delivery_stored() {
    let Some(mut f) = Fixture::new() else { return };
    let forged = body("forged-1", "B", 3, 3);
    f.history.forged.push(ForgedRecord {
        event_id: "forged-1".into(),
        flow_id: "B".into(),
        seq: 3,
        body: forged.clone(),
        answer: "ACCEPTED".into(),
    });
    f.consumer(&format!(
        "INSERT INTO inbox VALUES ('forged-1', 'B', 3, 'released', 1, '{forged}', 'pending', NULL, 0);"
    ));
    assert_flags(&f.check(), Invariant::I5NoConflictingBody);
}

#[test]
fn i6_pending_work_never_drains() {
    let Some(f) = Fixture::new() else { return };
    f.producer("UPDATE outbox SET accepted = 0 WHERE event_id = 'B2';");
    let drain = wait_drained(&f.files, Duration::ZERO);
    assert_eq!(drain, Drain::TimedOut { unaccepted: 1, unapplied: 0 });
    let v = check(&f.files, &f.history, &drain);
    assert_flags(&v, Invariant::I6Drained);
    assert_eq!(v.breached(), BTreeSet::from([Invariant::I6Drained]), "{:#?}", v.violations);
}

#[test]
fn i7_an_integrity_failure() {
    let Some(f) = Fixture::new() else { return };
    match f.files.consumer_db {
        // An index whose stored entries no longer match its declared order: the schema text is
        // rewritten behind SQLite's back, so the b-tree and the definition disagree.
        Target::Sqlite(_) => f.consumer(
            "CREATE TABLE t(x INTEGER); CREATE INDEX t_x ON t(x); INSERT INTO t VALUES (1), (2), (3);
             PRAGMA writable_schema = ON;
             UPDATE sqlite_schema SET sql = 'CREATE INDEX t_x ON t(x DESC)' WHERE name = 't_x';
             PRAGMA writable_schema = OFF;",
        ),
        // PostgreSQL guards its own pages; what the store must keep exact is its backlog
        // counter, here one off from the (zero) unapplied rows.
        Target::Postgres(_) => f.consumer(
            "CREATE TABLE backlog(id INTEGER PRIMARY KEY, unapplied BIGINT);
             INSERT INTO backlog VALUES (1, 1);",
        ),
    }
    let v = f.check();
    assert_flags(&v, Invariant::I7Integrity);
    assert_eq!(v.breached(), BTreeSet::from([Invariant::I7Integrity]), "{:#?}", v.violations);
}

#[test]
fn answers_a_decoy_that_committed() {
    let Some(mut f) = Fixture::new() else { return };
    let mut stale = step("A", 1);
    stale.event_id = "A-decoy".into();
    stale.intent = Intent::Stale;
    stale.answer = Answer::Committed { body: stale.requested_body() };
    f.history.advances.push(stale);
    assert_flags(&f.check(), Invariant::Answers);
}

#[test]
fn observations_count_resends_and_late_arrivals() {
    let Some(f) = Fixture::new() else { return };
    f.producer("UPDATE outbox SET attempts = 3 WHERE event_id = 'A1';");
    // B2 arrives (rowid order) before B1.
    f.consumer(
        "DELETE FROM inbox WHERE event_id = 'B1';
         INSERT INTO inbox SELECT 'B1', 'B', 1, 'reserved', 1, body, 'applied', NULL, 0 FROM inbox
             WHERE event_id = 'B2';",
    );
    let snap = Snapshot::read(&f.files).expect("read");
    let o = observe(&snap);
    assert_eq!((o.rows_resent, o.extra_sends), (1, 2));
    assert_eq!((o.out_of_order_arrivals, o.out_of_order_flows), (1, 1));
}
