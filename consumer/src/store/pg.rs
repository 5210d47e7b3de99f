//! All SQL of the consumer on PostgreSQL (schema `ordered_events_consumer`): the same tables,
//! columns and rules as consumer.db, an explicit `position` identity column where SQLite has
//! its rowid (inbox: arrival order; effect: apply order), and the backlog counter kept exact
//! by PL/pgSQL triggers in the same transactions. Every applied step is a compare-and-set on
//! the flow's projection and effects are unique per (flow_id, seq) and per event_id, so two
//! appliers (threads or instances) can never apply one step twice. Sessions run in READ
//! COMMITTED with `synchronous_commit=on` (set by `proto::pg` for every pooled session).

use std::future::Future;

use deadpool_postgres::{Pool, Transaction};
use proto::body::Event;
use proto::crash::{CrashPoint, CrashSwitch};
use proto::db::{OpenMode, StepFailure};
use proto::pg::{PgError, PgKind};
use proto::target::PgUrl;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::{
    Admission, Backlog, BacklogCounts, BacklogReader, BatchAnswer, CompactReport, EffectRecord, FlowRun,
    FlowView, Identity, InboxRecord, InboxState, Incoming, Next, RawInbox, ReceiveContext, ReceiveOutcome,
    Received, Result, StepOutcome, StoreError, StoredBody, checked_projection, commit_lag_us, reports,
    settle,
};
use crate::apply::{ApplyOptions, FlowResult, Stop};
use crate::rules::{BlockReason, Decision, Projection, decide_next};
use crate::storage::StorageWatch;

/// The columns `raw_inbox` reads, as a macro so the statements are literals.
macro_rules! inbox_columns {
    () => {
        "i.event_id, i.flow_id, i.seq, i.kind, i.schema, i.body, i.body_sha256, i.state, i.reason, i.committed_at_us"
    };
}

/// The consumer's schema on PostgreSQL.
pub const KIND: PgKind = PgKind {
    name: "consumer",
    schema: "ordered_events_consumer",
    version: 8,
    ddl: DDL,
    upgrades: &[
        UPGRADE_TO_2,
        UPGRADE_TO_3,
        UPGRADE_TO_4,
        UPGRADE_TO_5,
        UPGRADE_TO_6,
        UPGRADE_TO_7,
        UPGRADE_TO_8,
    ],
};

/// Connections in the pool: the Receive writer, the appliers (Apply, auto-apply), readers
/// (GetFlow, ListStuck, Identify) and the metrics scrape each take one while they work.
const POOL_SIZE: usize = 8;

/// How often one step is tried again after a deadlock or serialization failure (rolled back
/// to its savepoint, so repeating it is safe).
const STEP_RETRIES: usize = 3;

/// How often one apply step is decided again after another applier moved the flow first
/// (rolled back to its savepoint). Each lost race is another applier's progress on the flow.
const RACE_RETRIES: usize = 16;

/// The backlog counter's triggers (version 2): one per statement, not per row, each adding
/// the statement's net change of unapplied rows read from its transition tables. A batch
/// written with one multi-row statement then moves the counter row once: version 1's row
/// triggers rewrote that single row once per inbox row, and every transaction that touched
/// the inbox queued behind its lock once per row. Any session (psql included) keeps it exact.
macro_rules! backlog_triggers {
    () => {
        r#"
CREATE FUNCTION backlog_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT;
BEGIN
    SELECT count(*) INTO n FROM added WHERE state <> 'applied';
    IF n <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied + n WHERE id = 1;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER backlog_inserted AFTER INSERT ON inbox REFERENCING NEW TABLE AS added
FOR EACH STATEMENT EXECUTE FUNCTION backlog_inserted();
CREATE FUNCTION backlog_updated() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT;
BEGIN
    SELECT (SELECT count(*) FROM after_rows WHERE state <> 'applied')
         - (SELECT count(*) FROM before_rows WHERE state <> 'applied') INTO n;
    IF n <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied + n WHERE id = 1;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER backlog_updated AFTER UPDATE ON inbox
REFERENCING OLD TABLE AS before_rows NEW TABLE AS after_rows
FOR EACH STATEMENT EXECUTE FUNCTION backlog_updated();
CREATE FUNCTION backlog_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT;
BEGIN
    SELECT count(*) INTO n FROM removed WHERE state <> 'applied';
    IF n <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied - n WHERE id = 1;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER backlog_deleted AFTER DELETE ON inbox REFERENCING OLD TABLE AS removed
FOR EACH STATEMENT EXECUTE FUNCTION backlog_deleted();
"#
    };
}

/// Version 1 to 2: the per-row counter triggers become per-statement ones.
const UPGRADE_TO_2: &str = concat!(
    "DROP TRIGGER backlog_insert ON inbox;
     DROP TRIGGER backlog_applied ON inbox;
     DROP FUNCTION backlog_insert();
     DROP FUNCTION backlog_applied();",
    backlog_triggers!()
);

/// Version 2 to 3: `inbox.committed_at_us`, the producer's committed time as the envelope
/// carried it (NULL when it did not: older relays, grpcurl), kept beside the body and never
/// compared, so `Apply` can measure commit→applied; and `backlog` counts the blocked rows by
/// reason, kept exact by the same statement-level triggers as `unapplied` (one UPDATE of the
/// counter row per statement, as before). The counts start from the rows already blocked.
macro_rules! upgrade_to_3 {
    () => {
        r#"
ALTER TABLE inbox ADD COLUMN committed_at_us BIGINT;
ALTER TABLE backlog
    ADD COLUMN blocked_unsupported_schema BIGINT NOT NULL DEFAULT 0 CHECK(blocked_unsupported_schema >= 0),
    ADD COLUMN blocked_invalid_payload BIGINT NOT NULL DEFAULT 0 CHECK(blocked_invalid_payload >= 0),
    ADD COLUMN blocked_invalid_transition BIGINT NOT NULL DEFAULT 0 CHECK(blocked_invalid_transition >= 0);
UPDATE backlog SET
    blocked_unsupported_schema =
        (SELECT count(*) FROM inbox WHERE state <> 'applied' AND reason = 'unsupported_schema'),
    blocked_invalid_payload =
        (SELECT count(*) FROM inbox WHERE state <> 'applied' AND reason = 'invalid_payload'),
    blocked_invalid_transition =
        (SELECT count(*) FROM inbox WHERE state <> 'applied' AND reason = 'invalid_transition')
WHERE id = 1;
CREATE OR REPLACE FUNCTION backlog_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT; s BIGINT; p BIGINT; t BIGINT;
BEGIN
    SELECT count(*) FILTER (WHERE state <> 'applied'),
           count(*) FILTER (WHERE reason = 'unsupported_schema'),
           count(*) FILTER (WHERE reason = 'invalid_payload'),
           count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM added;
    IF n <> 0 OR s <> 0 OR p <> 0 OR t <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied + n,
            blocked_unsupported_schema = blocked_unsupported_schema + s,
            blocked_invalid_payload = blocked_invalid_payload + p,
            blocked_invalid_transition = blocked_invalid_transition + t
        WHERE id = 1;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION backlog_updated() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT; s BIGINT; p BIGINT; t BIGINT;
BEGIN
    SELECT count(*) FILTER (WHERE state <> 'applied'),
           count(*) FILTER (WHERE reason = 'unsupported_schema'),
           count(*) FILTER (WHERE reason = 'invalid_payload'),
           count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM after_rows;
    SELECT n - count(*) FILTER (WHERE state <> 'applied'),
           s - count(*) FILTER (WHERE reason = 'unsupported_schema'),
           p - count(*) FILTER (WHERE reason = 'invalid_payload'),
           t - count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM before_rows;
    IF n <> 0 OR s <> 0 OR p <> 0 OR t <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied + n,
            blocked_unsupported_schema = blocked_unsupported_schema + s,
            blocked_invalid_payload = blocked_invalid_payload + p,
            blocked_invalid_transition = blocked_invalid_transition + t
        WHERE id = 1;
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION backlog_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT; s BIGINT; p BIGINT; t BIGINT;
BEGIN
    SELECT count(*) FILTER (WHERE state <> 'applied'),
           count(*) FILTER (WHERE reason = 'unsupported_schema'),
           count(*) FILTER (WHERE reason = 'invalid_payload'),
           count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM removed;
    IF n <> 0 OR s <> 0 OR p <> 0 OR t <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied - n,
            blocked_unsupported_schema = blocked_unsupported_schema - s,
            blocked_invalid_payload = blocked_invalid_payload - p,
            blocked_invalid_transition = blocked_invalid_transition - t
        WHERE id = 1;
    END IF;
    RETURN NULL;
END $$;
"#
    };
}

/// Version 2 to 3 (see [`upgrade_to_3`]).
const UPGRADE_TO_3: &str = upgrade_to_3!();

/// The schema at version 2 (kept whole: version 3's is this plus [`UPGRADE_TO_3`]). Ids
/// compare bytewise (`COLLATE "C"`), as SQLite and the producer schema compare them, so flows
/// page and list in the same order whatever the locale. Trigger functions name their table
/// with the schema, so a session with another `search_path` (psql) keeps the counter exact too.
macro_rules! ddl_v2 {
    () => {
        concat!(
            r#"
CREATE TABLE inbox(
    position BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    event_id TEXT COLLATE "C" PRIMARY KEY,
    flow_id TEXT COLLATE "C" NOT NULL,
    seq BIGINT NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    -- The canonical body, stored verbatim and never edited.
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending' CHECK(state = 'pending' OR state = 'blocked' OR state = 'applied'),
    reason TEXT CHECK(reason = 'unsupported_schema' OR reason = 'invalid_payload' OR reason = 'invalid_transition'),
    received_at_us BIGINT NOT NULL,
    applied_at_us BIGINT,
    UNIQUE(flow_id, seq),
    -- A reason exists exactly while the row is blocked.
    CHECK((state = 'blocked') = (reason IS NOT NULL))
);
-- Only unapplied rows are indexed: the backlog is counted and found without scanning history.
CREATE INDEX inbox_unapplied ON inbox(flow_id, seq, state) WHERE state <> 'applied';
CREATE TABLE projection(
    flow_id TEXT COLLATE "C" PRIMARY KEY,
    last_seq BIGINT NOT NULL CHECK(last_seq >= 1),
    state TEXT NOT NULL CHECK(state = 'reserved' OR state = 'confirmed' OR state = 'released'),
    held BIGINT NOT NULL,
    amount BIGINT NOT NULL CHECK(amount >= 1)
);
-- position order is apply order.
CREATE TABLE effect(
    position BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    event_id TEXT COLLATE "C" NOT NULL UNIQUE REFERENCES inbox(event_id),
    flow_id TEXT COLLATE "C" NOT NULL,
    seq BIGINT NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    held BIGINT NOT NULL,
    applied_at_us BIGINT NOT NULL,
    UNIQUE(flow_id, seq)
);
-- The number of unapplied (pending + blocked) inbox rows, kept exact by triggers inside the
-- same transactions that change it, so the backlog cap is checked in O(1).
CREATE TABLE backlog(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    unapplied BIGINT NOT NULL CHECK(unapplied >= 0)
);
INSERT INTO backlog(id, unapplied) VALUES (1, 0);
-- Written by the storage probe while commits fail; nothing reads it.
CREATE TABLE probe(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    probed_at_us BIGINT
);
INSERT INTO probe(id, probed_at_us) VALUES (1, NULL);
"#,
            backlog_triggers!()
        )
    };
}

/// Version 2's DDL, for the upgrade test.
#[cfg(test)]
pub(crate) const DDL_V2: &str = ddl_v2!();

/// Version 3 to 4 (retention, issue 16): a compacted inbox row keeps everything but its body,
/// which is replaced by the SHA-256 digest of it (`body_sha256`), updated in place: the
/// row's position, its uniqueness constraints and every Receive answer stay as they were.
/// The dead tuples' space is reused by later rows once vacuumed, so autovacuum visits the
/// inbox after 2 % of its rows changed (the default 20 % lets a large inbox bloat between
/// visits). The partial index `inbox_uncompacted` holds exactly the applied rows that still
/// have a body, so a pass finds them without reading the history (and a new event's insert,
/// pending, never enters it).
macro_rules! upgrade_to_4 {
    () => {
        r#"
ALTER TABLE inbox ALTER COLUMN body DROP NOT NULL;
ALTER TABLE inbox ADD COLUMN body_sha256 BYTEA;
ALTER TABLE inbox ADD CONSTRAINT inbox_body_or_tombstone CHECK(
    body IS NOT NULL AND body_sha256 IS NULL
    OR body IS NULL AND state = 'applied' AND octet_length(body_sha256) = 32);
CREATE INDEX inbox_uncompacted ON inbox(applied_at_us) WHERE state = 'applied' AND body IS NOT NULL;
ALTER TABLE inbox SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000);
"#
    };
}
const UPGRADE_TO_4: &str = upgrade_to_4!();

/// How one statement's inbox changes moved the gap and ready counts: `wc(flow_id, seq,
/// was_state, now_state)` (a state is NULL where the row was or is absent) is defined by the
/// trigger, and this computes `gap_d` and `ready_d`. Each touched flow's waiting state is read
/// now and, for before the statement, rebuilt from the changes: the rows it applied start at
/// the flow's next seq before it (so that is where it was), the changed rows take their old
/// states and inserted rows are not there. A flow's state follows from its lowest unapplied
/// row (no unapplied row is below the next seq), so each flow costs two probes of the partial
/// index `inbox_unapplied` (its lowest unapplied row now, and its lowest one the statement did
/// not touch) and one of its projection. The same rules as [`crate::waiting`]: idle (no
/// unapplied row), gap (the next seq not stored), ready (stored and pending), blocked.
/// Run after the statement took the backlog row's lock, so the flows' rows and projections
/// it reads are final for every transaction that committed before it, and no other
/// transaction moves a waiting state until this one ends.
macro_rules! waiting_delta {
    () => {
        r#"
    wf AS (
        SELECT flow_id,
               min(seq) FILTER (WHERE was_state <> 'applied' AND now_state = 'applied') AS applied_from,
               array_agg(seq) AS seqs,
               min(seq) FILTER (WHERE was_state <> 'applied') AS was_lowest,
               (array_agg(was_state ORDER BY seq) FILTER (WHERE was_state <> 'applied'))[1] AS was_lowest_state
        FROM wc GROUP BY flow_id),
    wn AS (
        SELECT wf.*, coalesce(pr.last_seq, 0) + 1 AS nxt
        FROM wf LEFT JOIN ordered_events_consumer.projection pr ON pr.flow_id = wf.flow_id),
    ws AS (
        SELECT
            CASE WHEN lo.seq IS NULL THEN 'idle' WHEN lo.seq = wn.nxt THEN lo.state ELSE 'gap' END AS after_state,
            CASE WHEN wn.was_lowest IS NULL AND un.seq IS NULL THEN 'idle'
                 WHEN wn.was_lowest IS NOT NULL AND (un.seq IS NULL OR wn.was_lowest < un.seq)
                     THEN CASE WHEN wn.was_lowest = coalesce(wn.applied_from, wn.nxt)
                               THEN wn.was_lowest_state ELSE 'gap' END
                 WHEN un.seq = coalesce(wn.applied_from, wn.nxt) THEN un.state
                 ELSE 'gap'
            END AS before_state
        FROM wn
        LEFT JOIN LATERAL (
            SELECT i.seq, i.state FROM ordered_events_consumer.inbox i
            WHERE i.flow_id = wn.flow_id AND i.state <> 'applied' ORDER BY i.seq LIMIT 1) lo ON true
        LEFT JOIN LATERAL (
            SELECT i.seq, i.state FROM ordered_events_consumer.inbox i
            WHERE i.flow_id = wn.flow_id AND i.state <> 'applied' AND i.seq <> ALL(wn.seqs)
            ORDER BY i.seq LIMIT 1) un ON true)
    SELECT count(*) FILTER (WHERE after_state = 'gap') - count(*) FILTER (WHERE before_state = 'gap'),
           count(*) FILTER (WHERE after_state = 'pending') - count(*) FILTER (WHERE before_state = 'pending')
      INTO gap_d, ready_d FROM ws;
    IF gap_d <> 0 OR ready_d <> 0 THEN
        UPDATE ordered_events_consumer.waiting_flows
        SET gap = gap + gap_d, ready = ready + ready_d WHERE id = 1;
    END IF;
"#
    };
}

/// One counter trigger function: `$counts` sets the statement's net change of unapplied rows
/// and of blocked rows by reason (`n`, `s`, `p`, `t`), the counter row's UPDATE adds it
/// (and takes the row's lock), then the waiting flows' change ([`waiting_delta`]) is counted
/// from the statement's changed rows, `$changes`.
macro_rules! counter_function {
    ($name:literal, $counts:literal, $changes:literal) => {
        concat!(
            "CREATE OR REPLACE FUNCTION ",
            $name,
            "() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n BIGINT; s BIGINT; p BIGINT; t BIGINT; gap_d BIGINT; ready_d BIGINT;
BEGIN",
            $counts,
            "
    IF n <> 0 OR s <> 0 OR p <> 0 OR t <> 0 THEN
        UPDATE ordered_events_consumer.backlog SET unapplied = unapplied + n,
            blocked_unsupported_schema = blocked_unsupported_schema + s,
            blocked_invalid_payload = blocked_invalid_payload + p,
            blocked_invalid_transition = blocked_invalid_transition + t
        WHERE id = 1;
    WITH wc AS (",
            $changes,
            "),",
            waiting_delta!(),
            "
    END IF;
    RETURN NULL;
END $$;
"
        )
    };
}

/// Version 4 to 5: `waiting_flows` counts the flows waiting at a gap and the ready ones, kept
/// exact by the same statement triggers as the backlog counters (one UPDATE of its row when a
/// statement moved one, see [`waiting_delta`], serialised by the backlog row's lock), so the
/// metrics scrape reads them instead of walking the waiting flows. Every inbox writer is
/// waited for first (`LOCK`): a transaction already inside the old trigger functions would not
/// count its change. The counts start from the rows as they are (each waiting flow's lowest
/// unapplied row against its projection, once). A table of its own rather than columns of
/// `backlog`: altering `backlog` needs a lock that a running Receive (holding `backlog` for
/// its cap, then queued behind the inbox lock) would deadlock with. An inbox row's flow_id and
/// seq never change, and every change of an unapplied row's state moves one of the backlog
/// counters, so those statements are the ones looked at.
macro_rules! upgrade_to_5 {
    () => {
        concat!(
            r#"
LOCK TABLE inbox IN SHARE ROW EXCLUSIVE MODE;
CREATE TABLE waiting_flows(
    id INTEGER PRIMARY KEY CHECK(id = 1),
    gap BIGINT NOT NULL CHECK(gap >= 0),
    ready BIGINT NOT NULL CHECK(ready >= 0)
);
WITH w AS (
         SELECT DISTINCT ON (flow_id) flow_id, seq AS lowest, state FROM inbox
         WHERE state <> 'applied' ORDER BY flow_id, seq),
     c AS (
         SELECT count(*) FILTER (WHERE w.lowest > coalesce(pr.last_seq, 0) + 1) AS gap,
                count(*) FILTER (WHERE w.lowest = coalesce(pr.last_seq, 0) + 1 AND w.state = 'pending') AS ready
         FROM w LEFT JOIN projection pr ON pr.flow_id = w.flow_id)
INSERT INTO waiting_flows(id, gap, ready) SELECT 1, c.gap, c.ready FROM c;
"#,
            counter_function!(
                "backlog_inserted",
                "
    SELECT count(*) FILTER (WHERE state <> 'applied'),
           count(*) FILTER (WHERE reason = 'unsupported_schema'),
           count(*) FILTER (WHERE reason = 'invalid_payload'),
           count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM added;",
                "SELECT flow_id, seq, NULL::text AS was_state, state AS now_state FROM added"
            ),
            counter_function!(
                "backlog_updated",
                "
    SELECT count(*) FILTER (WHERE state <> 'applied'),
           count(*) FILTER (WHERE reason = 'unsupported_schema'),
           count(*) FILTER (WHERE reason = 'invalid_payload'),
           count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM after_rows;
    SELECT n - count(*) FILTER (WHERE state <> 'applied'),
           s - count(*) FILTER (WHERE reason = 'unsupported_schema'),
           p - count(*) FILTER (WHERE reason = 'invalid_payload'),
           t - count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM before_rows;",
                "SELECT a.flow_id, a.seq, b.state AS was_state, a.state AS now_state
         FROM (SELECT * FROM before_rows WHERE state <> 'applied') b
         JOIN after_rows a ON a.event_id = b.event_id
         WHERE a.state IS DISTINCT FROM b.state OR a.reason IS DISTINCT FROM b.reason
         UNION ALL
         SELECT a.flow_id, a.seq, b.state, a.state
         FROM (SELECT * FROM after_rows WHERE state <> 'applied') a
         JOIN before_rows b ON b.event_id = a.event_id AND b.state = 'applied'"
            ),
            counter_function!(
                "backlog_deleted",
                "
    SELECT -count(*) FILTER (WHERE state <> 'applied'),
           -count(*) FILTER (WHERE reason = 'unsupported_schema'),
           -count(*) FILTER (WHERE reason = 'invalid_payload'),
           -count(*) FILTER (WHERE reason = 'invalid_transition')
      INTO n, s, p, t FROM removed;",
                "SELECT flow_id, seq, state AS was_state, NULL::text AS now_state FROM removed"
            )
        )
    };
}
const UPGRADE_TO_5: &str = upgrade_to_5!();

/// Version 5 to 6: the effect's foreign key to the inbox goes. Its check was a per-row query
/// locking the inbox row (`FOR KEY SHARE`, a multixact once the same transaction marks that
/// row applied) for every effect, about 8 % of the server's CPU per event with the
/// producer's (perf, `bench --backend postgres`), and it guarded nothing the store does not
/// already: an effect is inserted only by the transaction that marks its inbox row applied,
/// and that mark must change exactly one row per effect or the group is rolled back; an inbox
/// row is never deleted (compaction keeps it as a tombstone). SQLite keeps
/// `foreign_keys=ON` and its key (SPEC §2 asks it of every SQLite connection).
macro_rules! upgrade_to_6 {
    () => {
        "ALTER TABLE effect DROP CONSTRAINT effect_event_id_fkey;\n"
    };
}
const UPGRADE_TO_6: &str = upgrade_to_6!();

/// Version 6 to 7: an effect is kept by its inbox row's position (`effect_log`, as SQLite's
/// schemas 8 and 10 keep it) instead of repeating the event id, flow id and seq in the row and
/// in two unique text indexes. The inbox's own keys make it unique per event id and per
/// (flow_id, seq): an effect names exactly one inbox row and there is one per position.
/// `applied` numbers effects in apply order, uniquely (the old `effect.position`, and its
/// index: the highest is one index read); `effect` is a view with the old columns, so readers
/// (GetFlow, operators' queries) see the same rows. The upgrade copies every effect once,
/// keyed by its inbox row's position.
macro_rules! upgrade_to_7 {
    () => {
        r#"
CREATE TABLE effect_log(
    position BIGINT PRIMARY KEY,
    applied BIGINT GENERATED BY DEFAULT AS IDENTITY UNIQUE,
    kind TEXT NOT NULL,
    held BIGINT NOT NULL,
    applied_at_us BIGINT NOT NULL
);
INSERT INTO effect_log(position, applied, kind, held, applied_at_us)
    SELECT i.position, e.position, e.kind, e.held, e.applied_at_us
    FROM effect e JOIN inbox i ON i.event_id = e.event_id ORDER BY e.position;
SELECT setval(pg_get_serial_sequence('effect_log', 'applied'),
              (SELECT coalesce(max(applied), 0) + 1 FROM effect_log), false);
DROP TABLE effect;
CREATE VIEW effect AS
    SELECT e.applied AS position, i.event_id, i.flow_id, i.seq, e.kind, e.held, e.applied_at_us
    FROM effect_log e JOIN inbox i ON i.position = e.position;
"#
    };
}
const UPGRADE_TO_7: &str = upgrade_to_7!();

/// Version 8: at `--retention 0` an applied row loses its body in the statement that marks
/// it applied ([`MARK_APPLIED_COMPACTING`]) instead of in a later pass: every update writes
/// a new version of the row for vacuum to reclaim, and the pass's was a second one per row,
/// which with the producer's cost the server 300-313 us of CPU per event at retention 0
/// against 203-213 without compaction (README, Retention). Those statements add their rows
/// and body bytes to `compacted_rows` and `compacted_bytes`, which the next pass of any
/// consumer reports (log line, metrics) and sets back to 0, so each row is counted once,
/// after its commit.
macro_rules! upgrade_to_8 {
    () => {
        r#"
ALTER TABLE backlog
    ADD COLUMN compacted_rows BIGINT NOT NULL DEFAULT 0 CHECK(compacted_rows >= 0),
    ADD COLUMN compacted_bytes BIGINT NOT NULL DEFAULT 0 CHECK(compacted_bytes >= 0);
"#
    };
}
const UPGRADE_TO_8: &str = upgrade_to_8!();

/// The schema (version 8): version 2's, then the upgrades to 3 … 8, so a new schema and an
/// upgraded one are the same.
const DDL: &str = concat!(
    ddl_v2!(),
    upgrade_to_3!(),
    upgrade_to_4!(),
    upgrade_to_5!(),
    upgrade_to_6!(),
    upgrade_to_7!(),
    upgrade_to_8!()
);

impl From<tokio_postgres::Error> for StoreError {
    /// A deadlock or serialization failure aborted the transaction (retryable, as a whole
    /// transaction); a lock timeout is contention (retryable); a lost server or connection
    /// is unavailable storage (retryable, and health goes NOT_SERVING);
    /// a constraint or a trigger's exception refused one row; anything else failed.
    fn from(e: tokio_postgres::Error) -> StoreError {
        classify(&e)
    }
}

/// The store error for a client error (see the `From` impl).
fn classify(e: &tokio_postgres::Error) -> StoreError {
    let text = proto::pg::describe(e);
    let code = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
    if proto::pg::is_serialization_failure(e) {
        StoreError::Aborted(text)
    } else if code == "55P03" {
        StoreError::Busy(text)
    } else if proto::pg::refuses_writes(e) || proto::pg::is_retryable(e) {
        // A read-only session (a standby after a failover) is noted, so the pool replaces the
        // sessions opened before, and retryable.
        StoreError::Unavailable(text)
    } else if code.starts_with("23") || code == "P0001" {
        StoreError::Refused(text)
    } else {
        StoreError::Failed(text)
    }
}

impl From<deadpool_postgres::PoolError> for StoreError {
    /// No connection could be had: the server is unreachable or refuses connections.
    fn from(e: deadpool_postgres::PoolError) -> StoreError {
        match e {
            deadpool_postgres::PoolError::Backend(e) => {
                let e = StoreError::from(e);
                match e {
                    StoreError::Failed(text) | StoreError::Refused(text) => StoreError::Unavailable(text),
                    other => other,
                }
            }
            other => StoreError::Unavailable(format!("no database connection: {other}")),
        }
    }
}

/// The consumer's schema on a PostgreSQL server: a pool of sessions.
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
}

/// A seq, position or count as PostgreSQL's BIGINT. Seqs are at most 2^53 (transport
/// limits) and positions and counts come from BIGINT columns, so no value here overflows.
fn big(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A schema as the INTEGER column stores it: the transport limits keep it within 1..=65535.
fn schema_column(schema: u32) -> i32 {
    i32::try_from(schema).unwrap_or(i32::MAX)
}

/// A BIGINT read back as the unsigned value it stores (never negative: CHECKs and identity).
fn unsigned(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl PgStore {
    /// Opens (creating or upgrading if needed) the consumer schema on `url` and logs the
    /// `consumer database open` line with the durability settings.
    pub async fn open(url: &PgUrl) -> std::result::Result<PgStore, PgError> {
        let opened = proto::pg::open(url, &KIND, OpenMode::Create, POOL_SIZE).await?;
        Ok(PgStore { pool: opened.pool })
    }

    pub(crate) async fn identify(&self, probes: Vec<(u64, String)>) -> Result<(Identity, Vec<bool>)> {
        let client = self.pool.get().await?;
        // A position past BIGINT names no row: probed as -1, which no position is.
        let positions: Vec<i64> = probes.iter().map(|(p, _)| i64::try_from(*p).unwrap_or(-1)).collect();
        // One statement: one snapshot; the probed positions by the unique index on position.
        let row = client
            .query_one(
                "WITH probed AS (SELECT position, event_id FROM inbox WHERE position = ANY($1::bigint[]))
                 SELECT (SELECT database_id FROM meta WHERE id = 1),
                        (SELECT coalesce(max(position), 0) FROM inbox),
                        coalesce((SELECT array_agg(position ORDER BY position) FROM probed), '{}'),
                        coalesce((SELECT array_agg(event_id ORDER BY position) FROM probed), '{}')",
                &[&positions],
            )
            .await?;
        let database_id: Option<String> = row.get(0);
        let database_id =
            database_id.ok_or_else(|| StoreError::Inconsistent("the meta row is missing".into()))?;
        let found_at: Vec<i64> = row.get(2);
        let found_ids: Vec<String> = row.get(3);
        let found: std::collections::HashMap<i64, String> = found_at.into_iter().zip(found_ids).collect();
        let held = positions
            .iter()
            .zip(&probes)
            .map(|(at, (_, event_id))| found.get(at).is_some_and(|held| held == event_id))
            .collect();
        Ok((Identity { database_id, highest_position: unsigned(row.get(1)) }, held))
    }

    pub(crate) async fn receive_batch(&self, jobs: &[Incoming], ctx: ReceiveContext) -> Vec<BatchAnswer> {
        let mut attempt = 0;
        loop {
            match self.receive_once(jobs, ctx).await {
                Ok(answers) => return answers,
                Err(e) if attempt < ABORT_RETRIES => {
                    // The server aborted the batch's transaction (a deadlock with another
                    // consumer on the same rows, say): nothing of it was written.
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "receive: transaction aborted; running the batch again");
                    abort_pause(attempt).await;
                }
                Err(e) => {
                    if let Some(watch) = ctx.storage {
                        watch.commit_failed(&e);
                    }
                    return jobs
                        .iter()
                        .map(|job| {
                            job.stream.fail();
                            Some(Err(e.clone()))
                        })
                        .collect();
                }
            }
        }
    }

    /// One attempt at a Receive batch: its answers, or `Err` (only [`StoreError::Aborted`])
    /// when the server aborted the transaction before anything was answered.
    async fn receive_once(
        &self,
        jobs: &[Incoming],
        ctx: ReceiveContext,
    ) -> std::result::Result<Vec<BatchAnswer>, StoreError> {
        let report = |e: &StoreError| {
            if let Some(watch) = ctx.storage {
                watch.commit_failed(e);
            }
        };
        let fail_all = |e: StoreError| -> std::result::Result<Vec<BatchAnswer>, StoreError> {
            if matches!(e, StoreError::Aborted(_)) {
                return Err(e);
            }
            report(&e);
            Ok(jobs
                .iter()
                .map(|job| {
                    job.stream.fail();
                    Some(Err(e.clone()))
                })
                .collect())
        };
        let mut client = match self.pool.get().await {
            Ok(client) => client,
            Err(e) => return fail_all(e.into()),
        };
        let tx = match client.transaction().await {
            Ok(tx) => tx,
            Err(e) => return fail_all(e.into()),
        };
        let mut results: Vec<BatchAnswer> = Vec::with_capacity(jobs.len());
        let mut inserted = false;
        let pipelined = match pipeline_fits(&tx, jobs.len(), ctx.admission).await {
            Ok(fits) => fits,
            Err(e) => return fail_all(e),
        };
        let mut next = 0;
        if pipelined {
            // The fast path: the whole batch in one multi-row insert. Should any envelope
            // fail or need a closer look, it is undone and the batch goes envelope by
            // envelope below, exactly as before.
            let live: Vec<usize> = (0..jobs.len()).filter(|&i| !jobs[i].stream.failed()).collect();
            let events: Vec<&Incoming> = live.iter().map(|&i| &jobs[i]).collect();
            match insert_all(&tx, &events, runtime::now_us()).await {
                Ok(Some(decided)) => {
                    results.resize(jobs.len(), None);
                    for (&i, answer) in live.iter().zip(decided) {
                        inserted |= answer.outcome == ReceiveOutcome::Accepted;
                        results[i] = Some(Ok(answer));
                    }
                    if inserted {
                        ctx.crash.reach(CrashPoint::ConsumerReceiveAfterInsert);
                    }
                    next = jobs.len();
                }
                Ok(None) => {}
                Err(e) => {
                    drop(tx);
                    return fail_all(e);
                }
            }
        }
        let mut busy_retries = 0;
        while next < jobs.len() {
            if pipelined {
                // Every envelope left, in one round trip; the first that fails rolls back
                // alone and the ones after it go in the next round.
                let round: Vec<usize> = (next..jobs.len()).filter(|&i| !jobs[i].stream.failed()).collect();
                let events: Vec<&Incoming> = round.iter().map(|&i| &jobs[i]).collect();
                let (decided, failure) = pipeline(&tx, &events, runtime::now_us()).await;
                let mut decided = decided.into_iter();
                let mut at = next;
                for &i in &round {
                    while at < i {
                        results.push(None);
                        at += 1;
                    }
                    match decided.next() {
                        Some(answer) => {
                            if matches!(&answer, Ok(r) if r.outcome == ReceiveOutcome::Accepted) {
                                inserted = true;
                                ctx.crash.reach(CrashPoint::ConsumerReceiveAfterInsert);
                            }
                            if let Err(e) = &answer {
                                report(e);
                                jobs[i].stream.fail();
                            }
                            results.push(Some(answer));
                            at += 1;
                        }
                        None => break,
                    }
                }
                match failure {
                    None => {
                        while at < jobs.len() {
                            results.push(None);
                            at += 1;
                        }
                        next = jobs.len();
                    }
                    Some(StepFailure::RolledBack(StoreError::Busy(_))) if busy_retries < STEP_RETRIES => {
                        // A deadlock or serialization failure, rolled back to the envelope's
                        // savepoint: deciding it again is safe.
                        busy_retries += 1;
                        next = at;
                    }
                    Some(StepFailure::RolledBack(e)) => {
                        // `at` is the failed envelope: the first of the round not decided.
                        report(&e);
                        jobs[at].stream.fail();
                        results.push(Some(Err(e)));
                        next = at + 1;
                    }
                    Some(StepFailure::TransactionLost(e)) => {
                        drop(tx);
                        return fail_all(e);
                    }
                }
                continue;
            }
            let job = &jobs[next];
            next += 1;
            if job.stream.failed() {
                results.push(None);
                continue;
            }
            let mut attempt = 0;
            let decided = loop {
                let now = runtime::now_us();
                let decided = in_savepoint(&tx, || {
                    insert_pending(&tx, &job.event, job.committed_at_us, now, ctx.admission)
                })
                .await;
                match decided {
                    Err(StepFailure::RolledBack(StoreError::Busy(_))) if attempt < STEP_RETRIES => {
                        attempt += 1
                    }
                    other => break other,
                }
            };
            match decided {
                Ok(received) => {
                    if received.outcome == ReceiveOutcome::Accepted {
                        inserted = true;
                        ctx.crash.reach(CrashPoint::ConsumerReceiveAfterInsert);
                    }
                    results.push(Some(Ok(received)));
                }
                Err(StepFailure::RolledBack(e)) => {
                    report(&e);
                    job.stream.fail();
                    results.push(Some(Err(e)));
                }
                Err(StepFailure::TransactionLost(e)) => {
                    drop(tx);
                    return fail_all(e);
                }
            }
        }
        if !inserted {
            // Nothing was written: the transaction rolls back (on drop).
            drop(tx);
            return Ok(results);
        }
        if let Some(refused) = ctx.storage.map_or(Ok(()), |watch| watch.before_commit()).err() {
            drop(tx);
            return fail_all(refused);
        }
        if let Err(e) = tx.commit().await {
            return fail_all(e.into());
        }
        if let Some(watch) = ctx.storage {
            watch.commit_succeeded();
        }
        ctx.crash.reach(CrashPoint::ConsumerReceiveAfterCommit);
        Ok(results)
    }

    pub(crate) async fn apply_flows(
        &self,
        flows: Vec<String>,
        max_steps: u32,
        opts: ApplyOptions,
    ) -> Vec<FlowResult> {
        let mut runs = FlowRun::all(flows);
        let max_batch = opts.max_batch.max(1);
        // The crash points between a step's writes need the step-by-step path.
        let fast = !opts.crash.is_armed_at(CrashPoint::ConsumerApplyAfterProjection)
            && !opts.crash.is_armed_at(CrashPoint::ConsumerApplyAfterEffect);
        let mut next = 0;
        let mut aborted = 0;
        while next < runs.len() {
            let started = std::time::Instant::now();
            let group_start = next;
            let mut client = match self.pool.get().await {
                Ok(client) => client,
                Err(e) => {
                    fail_rest(&mut runs[next..], e.into(), &opts);
                    break;
                }
            };
            let tx = match client.transaction().await {
                Ok(tx) => tx,
                Err(e) => {
                    fail_rest(&mut runs[next..], e.into(), &opts);
                    break;
                }
            };
            let mut steps = 0;
            let mut lost = None;
            // The group decided and written by the fast path goes straight to its commit.
            let mut written = false;
            if fast {
                match apply_fast(&tx, &mut runs, next, max_steps, max_batch, &opts).await {
                    Ok(Some(after)) => {
                        next = after;
                        written = true;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        lost = Some(e.clone());
                        runs[next].end = Some(Err(e));
                        next += 1;
                    }
                }
            }
            while !written && lost.is_none() && next < runs.len() && steps < max_batch {
                let run = &mut runs[next];
                let budget_left = run.committed.len() + run.pending.len() < max_steps as usize;
                match step_in_tx(&tx, &run.flow_id, budget_left, &opts).await {
                    Ok(Progress::Applied { event_id, lag_us }) => {
                        run.applied(event_id, lag_us);
                        run.wrote = true;
                        steps += 1;
                    }
                    Ok(Progress::Stopped { stop, projection, wrote }) => {
                        run.wrote |= wrote;
                        steps += usize::from(wrote);
                        run.end = Some(Ok((stop, projection)));
                        next += 1;
                    }
                    Err(StepFailure::RolledBack(e)) => {
                        run.end = Some(Err(e));
                        next += 1;
                    }
                    Err(StepFailure::TransactionLost(e)) => {
                        lost = Some(e.clone());
                        run.end = Some(Err(e));
                        run.forget_pending();
                        run.wrote = false;
                        next += 1;
                        break;
                    }
                }
            }
            let wrote_any = runs.iter().any(|r| r.wrote);
            let finished = if let Some(e) = lost {
                drop(tx);
                Err(e)
            } else if wrote_any {
                match opts.storage.map_or(Ok(()), |watch| watch.before_commit()) {
                    Ok(()) => tx.commit().await.map_err(StoreError::from),
                    Err(refused) => {
                        drop(tx);
                        Err(refused)
                    }
                }
            } else {
                // Nothing written: the transaction rolls back (on drop).
                drop(tx);
                Ok(())
            };
            drop(client);
            if let Err(StoreError::Aborted(e)) = &finished
                && aborted < ABORT_RETRIES
            {
                // The server aborted the group's transaction (a deadlock with another
                // applier, say): nothing of it was written; run the same group again.
                aborted += 1;
                tracing::debug!(error = %e, attempt = aborted, "apply: transaction aborted; running the group again");
                // Every flow from the group's first on: those it ended, the one it was in
                // (past steps committed by earlier groups stay), and the untouched rest.
                for run in &mut runs[group_start..] {
                    run.pending.clear();
                    run.wrote = false;
                    run.end = None;
                }
                next = group_start;
                abort_pause(aborted).await;
                continue;
            }
            aborted = 0;
            settle(&mut runs, finished, started, &opts);
        }
        reports(runs, &opts)
    }

    pub(crate) async fn flows_with_unapplied(&self, after: &str, limit: usize) -> Result<Vec<String>> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "SELECT DISTINCT flow_id FROM inbox WHERE state <> 'applied' AND flow_id > $1
                 ORDER BY flow_id LIMIT $2",
            )
            .await?;
        let rows = client.query(&stmt, &[&after, &big(limit as u64)]).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    pub(crate) async fn flows_blocked(
        &self,
        reason: BlockReason,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>> {
        let client = self.pool.get().await?;
        let stmt = client
            .prepare_cached(
                "SELECT DISTINCT flow_id FROM inbox
                 WHERE state <> 'applied' AND state = 'blocked' AND reason = $1 AND flow_id > $2
                 ORDER BY flow_id LIMIT $3",
            )
            .await?;
        let rows = client.query(&stmt, &[&reason.as_str(), &after, &big(limit as u64)]).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// One compaction pass: transactions of at most `COMPACT_BATCH` rows, each one UPDATE
    /// that takes its rows from `inbox_uncompacted` with `FOR UPDATE SKIP LOCKED` (another
    /// instance's pass skips them, and a row it compacted first no longer matches once its
    /// lock is granted), so concurrent passes never compact or count a row twice. The digest
    /// is computed by the server from the UTF-8 bytes of the stored body: the same bytes the
    /// canonical body has everywhere.
    ///
    /// First it takes the rows applies compacted at retention 0 since the last pass (see
    /// [`UPGRADE_TO_8`]) into the report.
    pub(crate) async fn compact(&self, cutoff_us: i64, crash: CrashSwitch) -> Result<CompactReport> {
        let mut report = CompactReport::default();
        {
            let client = self.pool.get().await?;
            let stmt = client.prepare_cached(COLLECT_SQL).await?;
            let row = client.query_one(&stmt, &[]).await?;
            report.compacted = unsigned(row.get(0));
            report.body_bytes = unsigned(row.get(1));
            report.when_finished = report.compacted;
        }
        let batch = runtime::retention::COMPACT_BATCH;
        loop {
            let mut client = self.pool.get().await?;
            let tx = client.transaction().await?;
            let stmt = tx.prepare_cached(COMPACT_SQL).await?;
            let rows = tx.query(&stmt, &[&cutoff_us, &(batch as i64)]).await?;
            if rows.is_empty() {
                // Nothing written: dropping the transaction rolls it back.
                break;
            }
            crash.reach(CrashPoint::ConsumerCompactAfterBatch);
            tx.commit().await?;
            crash.reach(CrashPoint::ConsumerCompactAfterCommit);
            report.compacted += rows.len() as u64;
            report.body_bytes += rows.iter().map(|r| unsigned(r.get::<_, i32>(0).into())).sum::<u64>();
            report.batches += 1;
            if rows.len() < batch {
                break;
            }
        }
        Ok(report)
    }

    pub(crate) async fn flow(&self, flow_id: &str) -> Result<FlowView> {
        let mut client = self.pool.get().await?;
        // One REPEATABLE READ transaction: projection, inbox and effects are one snapshot.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        let projection = projection(&tx, flow_id).await?;
        let stmt = tx
            .prepare_cached(concat!(
                "SELECT ",
                inbox_columns!(),
                " FROM inbox i WHERE flow_id = $1 ORDER BY seq"
            ))
            .await?;
        let inbox = tx
            .query(&stmt, &[&flow_id])
            .await?
            .iter()
            .map(|r| raw_inbox(r, 0).check())
            .collect::<Result<_>>()?;
        let stmt = tx
            .prepare_cached(
                "SELECT event_id, flow_id, seq, kind, held FROM effect WHERE flow_id = $1 ORDER BY seq",
            )
            .await?;
        let effects = tx
            .query(&stmt, &[&flow_id])
            .await?
            .iter()
            .map(|r| EffectRecord {
                event_id: r.get(0),
                flow_id: r.get(1),
                seq: unsigned(r.get(2)),
                kind: r.get(3),
                held: r.get(4),
            })
            .collect();
        tx.commit().await?;
        Ok(FlowView { projection, inbox, effects })
    }

    pub(crate) async fn backlog(&self, limit: usize) -> Result<(Vec<Backlog>, u64)> {
        let mut client = self.pool.get().await?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await?;
        let total: i64 =
            tx.query_one("SELECT count(*) FROM inbox WHERE state <> 'applied'", &[]).await?.get(0);
        // Per flow: how many unapplied rows, the lowest one, and the projection.
        let stmt = tx
            .prepare_cached(concat!(
                "SELECT g.waiting, p.last_seq, p.state, p.held, p.amount, ",
                inbox_columns!(),
                " FROM (SELECT flow_id, count(*) AS waiting, min(seq) AS lowest FROM inbox
                        WHERE state <> 'applied' GROUP BY flow_id ORDER BY flow_id LIMIT $1) g
                  JOIN inbox i ON i.flow_id = g.flow_id AND i.seq = g.lowest
                  LEFT JOIN projection p ON p.flow_id = g.flow_id
                  ORDER BY g.flow_id"
            ))
            .await?;
        let rows = tx.query(&stmt, &[&big(limit as u64)]).await?;
        tx.commit().await?;
        let mut flows = Vec::with_capacity(rows.len());
        for r in rows {
            let lowest = raw_inbox(&r, 5).check()?;
            let projection = checked_projection(&lowest.flow_id, projection_columns(&r, 1))?;
            flows.push(Backlog {
                flow_id: lowest.flow_id.clone(),
                projection,
                waiting_rows: unsigned(r.get(0)),
                lowest,
            });
        }
        Ok((flows, unsigned(total)))
    }

    pub(crate) async fn probe(&self, watch: &'static StorageWatch) -> Result<()> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        tx.execute("UPDATE probe SET probed_at_us = $1 WHERE id = 1", &[&runtime::now_us()]).await?;
        watch.before_commit()?;
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn unapplied_count(&self) -> Result<u64> {
        let client = self.pool.get().await?;
        let row = client.query_one("SELECT unapplied FROM backlog WHERE id = 1", &[]).await?;
        Ok(unsigned(row.get(0)))
    }

    pub(crate) async fn backlog_counts(&self) -> Result<BacklogCounts> {
        let client = self.pool.get().await?;
        // One statement: one snapshot.
        let stmt = client.prepare_cached(BACKLOG_COUNTS_SQL).await?;
        let r = client.query_one(&stmt, &[]).await?;
        Ok(BacklogCounts {
            unapplied: unsigned(r.get(0)),
            blocked: [unsigned(r.get(1)), unsigned(r.get(2)), unsigned(r.get(3))],
            gap: unsigned(r.get(4)),
            ready: unsigned(r.get(5)),
        })
    }

    pub(crate) fn backlog_reader(&self) -> BacklogReader {
        let store = self.clone();
        let handle = tokio::runtime::Handle::current();
        // The scrape runs on a blocking thread, outside the runtime's workers: blocking on
        // the runtime's handle there is allowed.
        std::sync::Arc::new(move || handle.block_on(store.backlog_counts()).map_err(|e| e.to_string()))
    }

    pub(crate) fn pool_status(&self) -> runtime::metrics::PoolStatus {
        let status = self.pool.status();
        runtime::metrics::PoolStatus {
            max: status.max_size,
            size: status.size,
            available: status.available,
            waiting: status.waiting,
        }
    }

    /// The schema's columns and function bodies, to compare a new schema with an upgraded one.
    #[cfg(test)]
    pub(crate) async fn schema_definition(&self) -> Vec<String> {
        let client = self.pool.get().await.unwrap();
        let rows = client
            .query(
                "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
                        || ' ' || coalesce(column_default, '')
                 FROM information_schema.columns WHERE table_schema = 'ordered_events_consumer'
                 UNION ALL
                 SELECT p.proname || ' ' || p.prosrc FROM pg_proc p
                 JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'ordered_events_consumer'
                 ORDER BY 1",
                &[],
            )
            .await
            .unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Runs SQL on a pooled session (tests add triggers and edit rows by hand).
    #[cfg(test)]
    pub(crate) async fn execute_batch(&self, sql: &str) {
        self.pool.get().await.unwrap().batch_execute(sql).await.unwrap();
    }
}

/// The backlog counters, kept exact by the triggers (one row read).
const BACKLOG_COUNTS_SQL: &str =
    "SELECT b.unapplied, b.blocked_unsupported_schema, b.blocked_invalid_payload,
            b.blocked_invalid_transition, w.gap, w.ready FROM backlog b, waiting_flows w
     WHERE b.id = 1 AND w.id = 1";

/// Fails every flow not yet done with `e` (no transaction could be had).
fn fail_rest(runs: &mut [FlowRun], e: StoreError, opts: &ApplyOptions) {
    if let Some(watch) = opts.storage {
        watch.commit_failed(&e);
    }
    for run in runs {
        run.end = Some(Err(e.clone()));
    }
}

/// A group's flows, their projections and up to `$2` unapplied rows after each projection,
/// in one statement (one snapshot): flows in the order given, rows in seq order; a flow with
/// no such row comes once with NULL row columns.
const READ_GROUP_SQL: &str = concat!(
    "SELECT f.n, p.last_seq, p.state, p.held, p.amount, ",
    inbox_columns!(),
    " FROM unnest($1::text[]) WITH ORDINALITY AS f(flow_id, n)
      LEFT JOIN projection p ON p.flow_id = f.flow_id
      LEFT JOIN LATERAL (
          SELECT event_id, flow_id, seq, kind, schema, body, body_sha256, state, reason, committed_at_us
          FROM inbox
          WHERE inbox.flow_id = f.flow_id AND inbox.state <> 'applied'
            AND inbox.seq > coalesce(p.last_seq, 0)
          ORDER BY seq LIMIT $2) i ON true
      ORDER BY f.n, i.seq"
);

/// One compaction batch: up to `$2` applied rows applied before `$1` that still have a body
/// lose it for its digest; returns the dropped body's size per row. The rows are taken in
/// apply order, the order of `inbox_uncompacted`, so the plan is a walk of that index that
/// stops after `$2` rows whatever the statistics; without the order a generic plan built a
/// bitmap of every row still to compact for each batch.
pub(crate) const COMPACT_SQL: &str = "WITH c AS (
         SELECT event_id, octet_length(body) AS bytes FROM inbox
         WHERE state = 'applied' AND body IS NOT NULL AND applied_at_us < $1
         ORDER BY applied_at_us LIMIT $2 FOR UPDATE SKIP LOCKED)
     UPDATE inbox i SET body_sha256 = sha256(convert_to(i.body, 'UTF8')), body = NULL
     FROM c WHERE i.event_id = c.event_id
     RETURNING c.bytes";

/// Marks the rows `$1` names (all unapplied) applied at `$2` and, at retention 0, compacts
/// them in the same statement: `u` marks the rows and drops their bodies for their digests
/// (computed by the server from the same UTF-8 bytes as a pass's), `b` counts them and their
/// bodies' bytes (`$3`, summed by the caller from the bodies it applied: the statement's row
/// count is checked against them, so they are exactly these rows') for the next pass to
/// report ([`UPGRADE_TO_8`]). Returns the rows marked, as the plain `UPDATE` does. `$1` is an
/// array of event ids, or one id with `_ONE`. The `UPDATE` is the plain one's, with the same
/// plan: an index read per id (a first version read the bodies' sizes in a join of the inbox
/// with itself, and slowed down as the table grew).
macro_rules! mark_applied_compacting {
    ($match:literal) => {
        concat!(
            "WITH u AS (
                 UPDATE inbox SET state = 'applied', reason = NULL, applied_at_us = $2,
                     body_sha256 = sha256(convert_to(body, 'UTF8')), body = NULL
                 WHERE event_id ",
            $match,
            " AND state <> 'applied'
                 RETURNING 1),
             b AS (
                 UPDATE backlog SET compacted_rows = compacted_rows + (SELECT count(*) FROM u),
                     compacted_bytes = compacted_bytes + $3
                 WHERE id = 1 AND EXISTS (SELECT 1 FROM u))
             SELECT count(*) FROM u"
        )
    };
}
const MARK_APPLIED_COMPACTING: &str = mark_applied_compacting!("= ANY($1::text[])");
const MARK_APPLIED_COMPACTING_ONE: &str = mark_applied_compacting!("= $1");

/// Runs a [`mark_applied_compacting`] statement: the rows it marked.
async fn mark_compacting(
    tx: &Transaction<'_>,
    stmt: &tokio_postgres::Statement,
    params: &[&(dyn ToSql + Sync)],
) -> std::result::Result<u64, tokio_postgres::Error> {
    let row = tx.query_one(stmt, params).await?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// The rows (and body bytes) applies compacted since the last pass, set back to 0; the row
/// is locked, so two passes never take the same count. Writes nothing when there is none.
const COLLECT_SQL: &str = "WITH old AS (
         SELECT compacted_rows, compacted_bytes FROM backlog WHERE id = 1 FOR UPDATE
     ),
     taken AS (
         UPDATE backlog b SET compacted_rows = 0, compacted_bytes = 0
         FROM old WHERE b.id = 1 AND old.compacted_rows > 0
     )
     SELECT compacted_rows, compacted_bytes FROM old";

/// What the fast path decided for one flow of a group.
struct Planned {
    /// Index into the group's runs.
    run: usize,
    /// The projection read.
    from: Projection,
    /// The projection after the steps below.
    after: Projection,
    /// Applied steps in seq order: (event_id, seq, kind, held after it, committed at).
    steps: Vec<(String, u64, proto::flow::Kind, i64, Option<i64>)>,
    /// The bytes of those steps' bodies (counted when Apply compacts them, at retention 0).
    body_bytes: i64,
    /// A blocked mark to write (the row's event id and the reason).
    block: Option<(String, BlockReason)>,
    /// Why the flow stopped; `None` when the group filled up first (it goes on next group).
    end: Option<Stop>,
}

/// The apply fast path for the flows from `runs[first]` on: one read of every flow's
/// projection and waiting rows, decisions in memory exactly as step-by-step would make
/// them (same step, limit and batch rules), then every write of the group in one round trip
/// of multi-row statements, each compare-and-set counted. Returns the index of the first
/// flow not finished. `Ok(None)` when anything is not as read (another applier moved a
/// flow, a trigger refused a write, a stored row does not parse): the savepoint is rolled
/// back, nothing of the group is written, and the step-by-step path takes over and reports
/// each flow as it always did. `Err` when the transaction is lost.
async fn apply_fast(
    tx: &Transaction<'_>,
    runs: &mut [FlowRun],
    first: usize,
    max_steps: u32,
    max_batch: usize,
    opts: &ApplyOptions,
) -> std::result::Result<Option<usize>, StoreError> {
    let count = (runs.len() - first).min(max_batch);
    let flows: Vec<&str> = runs[first..first + count].iter().map(|r| r.flow_id.as_str()).collect();
    let per_flow = big((max_steps as u64).min(max_batch as u64) + 1);
    let read = tx.prepare_cached(READ_GROUP_SQL).await?;
    let params: [&(dyn ToSql + Sync); 2] = [&flows, &per_flow];
    let rows = match APPLY_FAST.begin(tx, &read, &params).await? {
        Ok(rows) => rows,
        Err(e) => return APPLY_FAST.undo(tx, e).await,
    };
    let Some(plans) = plan_group(&rows, &runs[first..first + count], max_steps, max_batch, opts) else {
        return APPLY_FAST
            .undo(tx, StoreError::Busy("a stored row needs the step-by-step path".into()))
            .await;
    };
    let now = runtime::now_us();
    if let Err(e) = write_group(tx, &plans, &runs[first..], now, opts.compact_applied).await {
        return APPLY_FAST.undo(tx, e).await;
    }
    let mut after = first;
    for plan in plans {
        let run = &mut runs[first + plan.run];
        if let Some((event_id, reason)) = &plan.block {
            if let Some(Stop::Blocked { detail, .. }) = &plan.end {
                tracing::warn!(
                    flow_id = %run.flow_id,
                    %event_id,
                    seq = plan.after.last_seq + 1,
                    reason = reason.as_str(),
                    %detail,
                    "event blocked: kept stored, re-evaluated on every Apply"
                );
            }
        }
        run.wrote |= !plan.steps.is_empty() || plan.block.is_some();
        for (event_id, seq, _, _, committed_at_us) in plan.steps {
            tracing::debug!(flow_id = %run.flow_id, %event_id, seq, "applied");
            run.applied(event_id, commit_lag_us(committed_at_us, now));
        }
        if let Some(stop) = plan.end {
            run.end = Some(Ok((stop, plan.after)));
            after = first + plan.run + 1;
        }
    }
    Ok(Some(after))
}

/// How often a transaction the server aborted (deadlock, serialization failure) is run again
/// as a whole before its calls fail with `UNAVAILABLE`.
const ABORT_RETRIES: u32 = 8;

/// A short, growing, jittered pause before running an aborted transaction again, so the
/// transaction it deadlocked with can finish first.
async fn abort_pause(attempt: u32) {
    let jitter = u64::try_from(runtime::now_us()).unwrap_or(0) % 5;
    tokio::time::sleep(std::time::Duration::from_millis(u64::from(attempt) * 5 + jitter)).await;
}

/// A fast path's savepoint: opened in the same round trip as the path's first statement,
/// and rolled back when the path gives way to the step-by-step one.
#[derive(Clone, Copy)]
struct FastPath {
    open: &'static str,
    undo: &'static str,
    /// Logged (debug) when the path is undone.
    undone: &'static str,
}

/// The Receive batch's multi-row insert.
const RECEIVE_FAST: FastPath = FastPath {
    open: "SAVEPOINT batch",
    undo: "ROLLBACK TO SAVEPOINT batch; RELEASE SAVEPOINT batch",
    undone: "receive: the batch insert is undone; deciding envelope by envelope",
};

/// The apply group's read and writes.
const APPLY_FAST: FastPath = FastPath {
    open: "SAVEPOINT group_fast",
    undo: "ROLLBACK TO SAVEPOINT group_fast; RELEASE SAVEPOINT group_fast",
    undone: "apply: the group's fast path is undone; going step by step",
};

impl FastPath {
    /// The savepoint and `statement`, in one round trip. The outer `Err` loses the
    /// transaction (no savepoint); the inner one is the statement's failure (then
    /// [`FastPath::undo`]).
    async fn begin(
        self,
        tx: &Transaction<'_>,
        statement: &tokio_postgres::Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Result<Vec<Row>>, StoreError> {
        let statements: Vec<PipedFuture<'_, Vec<Row>>> = vec![
            Box::pin(async move { tx.batch_execute(self.open).await.map(|()| Vec::new()) }),
            Box::pin(tx.query(statement, params)),
        ];
        let mut answers = in_order(statements).await.into_iter();
        answers.next().unwrap_or(Ok(Vec::new()))?;
        Ok(answers.next().unwrap_or(Ok(Vec::new())).map_err(|e| classify(&e)))
    }

    /// Rolls the savepoint back after `e`: `Ok(None)` (the step-by-step path takes over), or
    /// the transaction is lost when the server is gone or the rollback fails.
    async fn undo<T>(
        self,
        tx: &Transaction<'_>,
        e: StoreError,
    ) -> std::result::Result<Option<T>, StoreError> {
        if e.loses_transaction() {
            return Err(e);
        }
        tracing::debug!(error = %e, "{}", self.undone);
        tx.batch_execute(self.undo).await?;
        Ok(None)
    }
}

/// The decisions of [`apply_fast`], from the rows of [`READ_GROUP_SQL`]. `None` when a row
/// is not what this store writes (the step-by-step path reports it).
fn plan_group(
    rows: &[Row],
    runs: &[FlowRun],
    max_steps: u32,
    max_batch: usize,
    opts: &ApplyOptions,
) -> Option<Vec<Planned>> {
    let per_flow = (max_steps as usize).min(max_batch) + 1;
    let mut plans = Vec::new();
    let mut steps = 0;
    let mut at = 0;
    for (k, run) in runs.iter().enumerate() {
        let n = k as i64 + 1;
        let flow_rows: Vec<&Row> = rows[at..].iter().take_while(|r| r.get::<_, i64>(0) == n).collect();
        at += flow_rows.len();
        if flow_rows.is_empty() {
            return None;
        }
        let from = checked_projection(&run.flow_id, projection_columns(flow_rows[0], 1)).ok()?;
        let waiting: Vec<InboxRecord> = flow_rows
            .iter()
            .filter(|r| r.get::<_, Option<String>>(5).is_some())
            .map(|r| raw_inbox(r, 5).check())
            .collect::<Result<_>>()
            .ok()?;
        let mut plan =
            Planned { run: k, from, after: from, steps: Vec::new(), body_bytes: 0, block: None, end: None };
        let mut waiting = waiting.into_iter();
        let group_full = loop {
            if steps >= max_batch {
                break true;
            }
            let Some(row) = waiting.next() else {
                if plan.steps.len() + 1 >= per_flow {
                    // Every row read was applied: what follows is unknown.
                    return None;
                }
                plan.end = Some(Stop::Idle);
                break false;
            };
            if row.seq != plan.after.next_seq() {
                plan.end = Some(Stop::Gap { waiting_for_seq: plan.after.next_seq() });
                break false;
            }
            if run.committed.len() + plan.steps.len() >= max_steps as usize {
                plan.end = Some(Stop::Limit);
                break false;
            }
            let event = Event::from_canonical_body(&row.body).ok()?;
            match decide_next(&plan.after, &event, opts.support_v2) {
                Decision::Block { reason, detail } => {
                    if row.state != InboxState::Blocked || row.reason != Some(reason) {
                        plan.block = Some((row.event_id.clone(), reason));
                        steps += 1;
                    }
                    plan.end = Some(Stop::Blocked { event_id: row.event_id, reason, detail });
                    break false;
                }
                Decision::Apply { kind, after } => {
                    if after.last_seq != row.seq {
                        return None;
                    }
                    plan.body_bytes += row.body.len() as i64;
                    plan.steps.push((row.event_id, row.seq, kind, after.held, row.committed_at_us));
                    plan.after = after;
                    steps += 1;
                }
            }
        };
        plans.push(plan);
        if group_full {
            break;
        }
    }
    Some(plans)
}

/// Every write of a planned group in one round trip: the projections' compare-and-sets
/// first (they take the flows' row locks), then the effects in apply order, the applied
/// marks and the blocked marks. Each statement's row count must be exactly the planned one,
/// else (another applier moved a flow) the group is not written as planned: `Busy`.
async fn write_group(
    tx: &Transaction<'_>,
    plans: &[Planned],
    runs: &[FlowRun],
    now_us: i64,
    compact: bool,
) -> Result<()> {
    let flow = |p: &Planned| runs[p.run].flow_id.as_str();
    let moved: Vec<&Planned> = plans.iter().filter(|p| !p.steps.is_empty()).collect();
    let (new, old): (Vec<&Planned>, Vec<&Planned>) =
        moved.iter().copied().partition(|p| p.from == Projection::NEW);
    let columns = |ps: &[&Planned]| {
        (
            ps.iter().map(|p| flow(p)).collect::<Vec<&str>>(),
            ps.iter().map(|p| big(p.after.last_seq)).collect::<Vec<i64>>(),
            ps.iter().map(|p| p.after.state.as_str()).collect::<Vec<&str>>(),
            ps.iter().map(|p| p.after.held).collect::<Vec<i64>>(),
            ps.iter().map(|p| p.after.amount).collect::<Vec<i64>>(),
        )
    };
    let (n_flows, n_seq, n_state, n_held, n_amount) = columns(&new);
    let (o_flows, o_seq, o_state, o_held, o_amount) = columns(&old);
    let o_from_seq: Vec<i64> = old.iter().map(|p| big(p.from.last_seq)).collect();
    let o_from_state: Vec<&str> = old.iter().map(|p| p.from.state.as_str()).collect();
    let o_from_held: Vec<i64> = old.iter().map(|p| p.from.held).collect();
    let o_from_amount: Vec<i64> = old.iter().map(|p| p.from.amount).collect();
    let mut e_ids = Vec::new();
    let mut e_flows = Vec::new();
    let mut e_seqs = Vec::new();
    let mut e_kinds = Vec::new();
    let mut e_held = Vec::new();
    for p in &moved {
        for (event_id, seq, kind, held, _) in &p.steps {
            e_ids.push(event_id.as_str());
            e_flows.push(flow(p));
            e_seqs.push(big(*seq));
            e_kinds.push(kind.as_str());
            e_held.push(*held);
        }
    }
    let blocks: Vec<&(String, BlockReason)> = plans.iter().filter_map(|p| p.block.as_ref()).collect();
    let b_ids: Vec<&str> = blocks.iter().map(|b| b.0.as_str()).collect();
    let b_reasons: Vec<&str> = blocks.iter().map(|b| b.1.as_str()).collect();

    let insert_projections = tx
        .prepare_cached(
            "INSERT INTO projection(flow_id, last_seq, state, held, amount)
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::bigint[])
             ON CONFLICT(flow_id) DO NOTHING",
        )
        .await?;
    let update_projections = tx
        .prepare_cached(
            "UPDATE projection p SET last_seq = u.s, state = u.st, held = u.h, amount = u.a
             FROM unnest($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::bigint[],
                         $6::bigint[], $7::text[], $8::bigint[], $9::bigint[])
                  AS u(f, s, st, h, a, fs, fst, fh, fa)
             WHERE p.flow_id = u.f AND p.last_seq = u.fs AND p.state = u.fst AND p.held = u.fh
               AND p.amount = u.fa",
        )
        .await?;
    let insert_effects = tx
        .prepare_cached(
            "INSERT INTO effect_log(position, kind, held, applied_at_us)
             SELECT i.position, t.k, t.h, $6
             FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::bigint[])
                  WITH ORDINALITY AS t(e, f, s, k, h, n)
             JOIN inbox i ON i.event_id = t.e AND i.flow_id = t.f AND i.seq = t.s
             ORDER BY t.n",
        )
        .await?;
    let mark_applied = tx
        .prepare_cached(if compact {
            MARK_APPLIED_COMPACTING
        } else {
            "UPDATE inbox SET state = 'applied', reason = NULL, applied_at_us = $2
             WHERE event_id = ANY($1::text[]) AND state <> 'applied'"
        })
        .await?;
    let mark_blocked = tx
        .prepare_cached(
            "UPDATE inbox SET state = 'blocked', reason = u.r
             FROM unnest($1::text[], $2::text[]) AS u(e, r)
             WHERE inbox.event_id = u.e AND inbox.state <> 'applied'
               AND (inbox.state <> 'blocked' OR inbox.reason IS DISTINCT FROM u.r)",
        )
        .await?;
    let p_new: [&(dyn ToSql + Sync); 5] = [&n_flows, &n_seq, &n_state, &n_held, &n_amount];
    let p_old: [&(dyn ToSql + Sync); 9] = [
        &o_flows,
        &o_seq,
        &o_state,
        &o_held,
        &o_amount,
        &o_from_seq,
        &o_from_state,
        &o_from_held,
        &o_from_amount,
    ];
    let p_effects: [&(dyn ToSql + Sync); 6] = [&e_ids, &e_flows, &e_seqs, &e_kinds, &e_held, &now_us];
    let body_bytes: i64 = moved.iter().map(|p| p.body_bytes).sum();
    let p_applied: [&(dyn ToSql + Sync); 2] = [&e_ids, &now_us];
    let p_compacting: [&(dyn ToSql + Sync); 3] = [&e_ids, &now_us, &body_bytes];
    let p_blocked: [&(dyn ToSql + Sync); 2] = [&b_ids, &b_reasons];
    let mut writes: Vec<(PipedFuture<'_, u64>, usize)> = Vec::new();
    if !new.is_empty() {
        writes.push((Box::pin(tx.execute(&insert_projections, &p_new)), new.len()));
    }
    if !old.is_empty() {
        writes.push((Box::pin(tx.execute(&update_projections, &p_old)), old.len()));
    }
    if !e_ids.is_empty() {
        writes.push((Box::pin(tx.execute(&insert_effects, &p_effects)), e_ids.len()));
        let mark: PipedFuture<'_, u64> = if compact {
            Box::pin(mark_compacting(tx, &mark_applied, &p_compacting))
        } else {
            Box::pin(tx.execute(&mark_applied, &p_applied))
        };
        writes.push((mark, e_ids.len()));
    }
    if !b_ids.is_empty() {
        writes.push((Box::pin(tx.execute(&mark_blocked, &p_blocked)), b_ids.len()));
    }
    let (statements, expected): (Vec<_>, Vec<usize>) = writes.into_iter().unzip();
    for (answer, expected) in in_order(statements).await.into_iter().zip(expected) {
        let written = answer?;
        if written != expected as u64 {
            return Err(StoreError::Busy(format!(
                "a group write touched {written} rows where {expected} were planned: another applier moved"
            )));
        }
    }
    Ok(())
}

/// What one step inside the open transaction did.
enum Progress {
    Applied { event_id: String, lag_us: Option<u64> },
    Stopped { stop: Stop, projection: Projection, wrote: bool },
}

/// Runs `step` inside `SAVEPOINT step`: released on success; on failure only the step's
/// writes are undone (`ROLLBACK TO`), so the transaction and the steps before it may still
/// commit. A lost connection, or a savepoint that cannot be undone, loses the transaction.
async fn in_savepoint<T, F, Fut>(
    tx: &Transaction<'_>,
    step: F,
) -> std::result::Result<T, StepFailure<StoreError>>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    if let Err(e) = tx.batch_execute("SAVEPOINT step").await {
        return Err(StepFailure::TransactionLost(e.into()));
    }
    match step().await {
        Ok(value) => match tx.batch_execute("RELEASE SAVEPOINT step").await {
            Ok(()) => Ok(value),
            Err(e) => Err(StepFailure::TransactionLost(e.into())),
        },
        Err(e) if e.loses_transaction() => Err(StepFailure::TransactionLost(e)),
        Err(e) => match tx.batch_execute("ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step").await {
            Ok(()) => Err(StepFailure::RolledBack(e)),
            Err(_) => Err(StepFailure::TransactionLost(e)),
        },
    }
}

/// Reads the flow's projection and the row at its exact next seq in one statement (one
/// snapshot), decides, and writes the decision, all in one savepoint. A step that lost a
/// race to another applier (its compare-and-set wrote nothing) reads and decides again.
async fn step_in_tx(
    tx: &Transaction<'_>,
    flow_id: &str,
    budget_left: bool,
    opts: &ApplyOptions,
) -> std::result::Result<Progress, StepFailure<StoreError>> {
    let mut attempt = 0;
    loop {
        let step = in_savepoint(tx, || decide_and_write(tx, flow_id, budget_left, opts)).await;
        match step {
            Ok(Some(progress)) => return Ok(progress),
            Ok(None) | Err(StepFailure::RolledBack(StoreError::Busy(_))) if attempt < RACE_RETRIES => {
                attempt += 1
            }
            Ok(None) => {
                return Err(StepFailure::RolledBack(StoreError::Busy(format!(
                    "flow {flow_id}: other appliers moved its projection {} times in a row",
                    RACE_RETRIES + 1
                ))));
            }
            Err(e) => return Err(e),
        }
    }
}

/// One step inside the savepoint; `None` when the compare-and-set lost (decide again).
async fn decide_and_write(
    tx: &Transaction<'_>,
    flow_id: &str,
    budget_left: bool,
    opts: &ApplyOptions,
) -> Result<Option<Progress>> {
    let (from, next) = next_to_apply(tx, flow_id).await?;
    let row = match next {
        None => return Ok(None),
        Some(Next::Idle) => {
            return Ok(Some(Progress::Stopped { stop: Stop::Idle, projection: from, wrote: false }));
        }
        Some(Next::Gap) => {
            let stop = Stop::Gap { waiting_for_seq: from.next_seq() };
            return Ok(Some(Progress::Stopped { stop, projection: from, wrote: false }));
        }
        Some(Next::Row(row)) => row,
    };
    if !budget_left {
        return Ok(Some(Progress::Stopped { stop: Stop::Limit, projection: from, wrote: false }));
    }
    let event = Event::from_canonical_body(&row.body)
        .map_err(|e| StoreError::Inconsistent(format!("inbox {}: {e}", row.event_id)))?;
    match decide_next(&from, &event, opts.support_v2) {
        Decision::Block { reason, detail } => {
            let mut wrote = false;
            if row.state != InboxState::Blocked || row.reason != Some(reason) {
                wrote = mark_blocked(tx, &row.event_id, reason).await?;
                if wrote {
                    tracing::warn!(
                        flow_id,
                        event_id = %row.event_id,
                        seq = row.seq,
                        reason = reason.as_str(),
                        %detail,
                        "event blocked: kept stored, re-evaluated on every Apply"
                    );
                }
            }
            let stop = Stop::Blocked { event_id: row.event_id, reason, detail };
            Ok(Some(Progress::Stopped { stop, projection: from, wrote }))
        }
        Decision::Apply { kind, after } => {
            let now = runtime::now_us();
            match apply_step(tx, &row, &from, kind, &after, opts, now).await? {
                StepOutcome::Applied => {
                    tracing::debug!(flow_id, event_id = %row.event_id, seq = row.seq, "applied");
                    let lag_us = commit_lag_us(row.committed_at_us, now);
                    Ok(Some(Progress::Applied { event_id: row.event_id, lag_us }))
                }
                StepOutcome::Raced => Ok(None),
            }
        }
    }
}

fn raw_inbox(r: &Row, at: usize) -> RawInbox {
    RawInbox {
        event_id: r.get(at),
        flow_id: r.get(at + 1),
        seq: unsigned(r.get(at + 2)),
        kind: r.get(at + 3),
        schema: u32::try_from(r.get::<_, i32>(at + 4)).unwrap_or(0),
        body: r.get(at + 5),
        sha256: r.get(at + 6),
        state: r.get(at + 7),
        reason: r.get(at + 8),
        committed_at_us: r.get(at + 9),
    }
}

fn projection_columns(r: &Row, at: usize) -> Option<(u64, String, i64, i64)> {
    let last_seq: Option<i64> = r.get(at);
    last_seq.map(|last_seq| (unsigned(last_seq), r.get(at + 1), r.get(at + 2), r.get(at + 3)))
}

/// The flow's projection; a flow nothing was applied to is [`Projection::NEW`].
async fn projection(tx: &Transaction<'_>, flow_id: &str) -> Result<Projection> {
    let stmt =
        tx.prepare_cached("SELECT last_seq, state, held, amount FROM projection WHERE flow_id = $1").await?;
    let row = tx.query_opt(&stmt, &[&flow_id]).await?;
    checked_projection(flow_id, row.as_ref().and_then(|r| projection_columns(r, 0)))
}

/// The flow's projection and what is stored at exactly its next seq ("greater than
/// last_seq" would skip a gap), read in one statement. `None` for the row means the row at
/// the next seq is already applied: another applier moved the flow after this statement's
/// snapshot of the projection (decide again).
async fn next_to_apply(tx: &Transaction<'_>, flow_id: &str) -> Result<(Projection, Option<Next>)> {
    let stmt = tx
        .prepare_cached(concat!(
            "SELECT p.last_seq, p.state, p.held, p.amount, ",
            inbox_columns!(),
            ", EXISTS(SELECT 1 FROM inbox l WHERE l.flow_id = f.flow_id
                      AND l.seq > coalesce(p.last_seq, 0) + 1 AND l.state <> 'applied')
             FROM (SELECT $1::text AS flow_id) f
             LEFT JOIN projection p ON p.flow_id = f.flow_id
             LEFT JOIN inbox i ON i.flow_id = f.flow_id AND i.seq = coalesce(p.last_seq, 0) + 1"
        ))
        .await?;
    let r = tx.query_one(&stmt, &[&flow_id]).await?;
    let from = checked_projection(flow_id, projection_columns(&r, 0))?;
    let event_id: Option<String> = r.get(4);
    if event_id.is_none() {
        let later: bool = r.get(14);
        return Ok((from, Some(if later { Next::Gap } else { Next::Idle })));
    }
    let row = raw_inbox(&r, 4).check()?;
    if row.state == InboxState::Applied {
        return Ok((from, None));
    }
    Ok((from, Some(Next::Row(row))))
}

/// Marks an unapplied row `blocked` with `reason` (a re-evaluation may change the reason).
/// Returns false when nothing changed. The body is never touched.
async fn mark_blocked(tx: &Transaction<'_>, event_id: &str, reason: BlockReason) -> Result<bool> {
    let stmt = tx
        .prepare_cached(
            "UPDATE inbox SET state = 'blocked', reason = $2
             WHERE event_id = $1 AND state <> 'applied' AND (state <> 'blocked' OR reason IS DISTINCT FROM $2)",
        )
        .await?;
    Ok(tx.execute(&stmt, &[&event_id, &reason.as_str()]).await? == 1)
}

/// The applied step of SPEC §7: only if the stored projection is still `from` (checked by
/// the guarded write itself: a compare-and-set, which waits for a concurrent applier's row
/// lock and then re-checks) updates it to `after`, inserts the effect (unique per (flow_id,
/// seq) and per event_id) and marks `row` applied. Any failure (a constraint, a trigger) is
/// returned before the savepoint is released, so its rollback undoes all three. Crash
/// points `consumer.apply.after_projection` and `.after_effect` sit inside.
async fn apply_step(
    tx: &Transaction<'_>,
    row: &InboxRecord,
    from: &Projection,
    kind: proto::flow::Kind,
    after: &Projection,
    opts: &ApplyOptions,
    now_us: i64,
) -> Result<StepOutcome> {
    if after.last_seq != row.seq {
        return Ok(StepOutcome::Raced);
    }
    // The three writes go in one round trip (see `in_order`). If the compare-and-set wrote
    // nothing, the effect insert and the mark that followed it are undone with the savepoint
    // (the step is reported as a race, an error, so the caller rolls the savepoint back).
    let write_projection = if *from == Projection::NEW {
        tx.prepare_cached(
            "INSERT INTO projection(flow_id, last_seq, state, held, amount) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT(flow_id) DO NOTHING",
        )
        .await?
    } else {
        tx.prepare_cached(
            "UPDATE projection SET last_seq = $2, state = $3, held = $4, amount = $5
             WHERE flow_id = $1 AND last_seq = $6 AND state = $7 AND held = $8 AND amount = $9",
        )
        .await?
    };
    let insert_effect = tx
        .prepare_cached(
            "INSERT INTO effect_log(position, kind, held, applied_at_us)
             SELECT position, $4, $5, $6 FROM inbox WHERE event_id = $1 AND flow_id = $2 AND seq = $3",
        )
        .await?;
    let mark_applied = tx
        .prepare_cached(if opts.compact_applied {
            MARK_APPLIED_COMPACTING_ONE
        } else {
            "UPDATE inbox SET state = 'applied', reason = NULL, applied_at_us = $2
             WHERE event_id = $1 AND state <> 'applied'"
        })
        .await?;
    let (after_seq, from_seq, seq) = (big(after.last_seq), big(from.last_seq), big(row.seq));
    let (after_state, from_state, kind) = (after.state.as_str(), from.state.as_str(), kind.as_str());
    let projection_params: Vec<&(dyn ToSql + Sync)> = if *from == Projection::NEW {
        vec![&row.flow_id, &after_seq, &after_state, &after.held, &after.amount]
    } else {
        vec![
            &row.flow_id,
            &after_seq,
            &after_state,
            &after.held,
            &after.amount,
            &from_seq,
            &from_state,
            &from.held,
            &from.amount,
        ]
    };
    let effect_params: [&(dyn ToSql + Sync); 6] =
        [&row.event_id, &row.flow_id, &seq, &kind, &after.held, &now_us];
    let mark_params: [&(dyn ToSql + Sync); 2] = [&row.event_id, &now_us];
    let body_bytes = row.body.len() as i64;
    let compacting_params: [&(dyn ToSql + Sync); 3] = [&row.event_id, &now_us, &body_bytes];
    let writes: Vec<PipedFuture<'_, u64>> = vec![
        Box::pin(tx.execute(&write_projection, &projection_params)),
        Box::pin(tx.execute(&insert_effect, &effect_params)),
        if opts.compact_applied {
            Box::pin(mark_compacting(tx, &mark_applied, &compacting_params))
        } else {
            Box::pin(tx.execute(&mark_applied, &mark_params))
        },
    ];
    let mut answers = in_order(writes).await.into_iter();
    let mut next = || answers.next().unwrap_or(Ok(0));
    let (moved, inserted, marked) = (next(), next(), next());
    if moved? != 1 {
        return Err(StoreError::Busy(format!(
            "flow {}: another applier moved the projection from seq {}",
            row.flow_id, from.last_seq
        )));
    }
    opts.crash.reach(CrashPoint::ConsumerApplyAfterProjection);
    if inserted? != 1 {
        return Err(StoreError::Inconsistent(format!(
            "inbox {} at ({}, {}) is not there to key its effect",
            row.event_id, row.flow_id, row.seq
        )));
    }
    if marked? != 1 {
        return Err(StoreError::Inconsistent(format!(
            "inbox {} vanished or was applied while the projection was at seq {}",
            row.event_id, from.last_seq
        )));
    }
    opts.crash.reach(CrashPoint::ConsumerApplyAfterEffect);
    Ok(StepOutcome::Applied)
}

/// Whether a whole batch of `n` envelopes may be pipelined: no cap, or a cap the batch
/// cannot reach even if every envelope is accepted (the counter row is locked here until the
/// commit, so no other writer moves it meanwhile). Otherwise each envelope is decided with
/// its own round trips, the cap checked before each.
async fn pipeline_fits(tx: &Transaction<'_>, n: usize, admission: Admission) -> Result<bool> {
    let Admission::Cap(cap) = admission else { return Ok(true) };
    let stmt = tx.prepare_cached("SELECT unapplied FROM backlog WHERE id = 1 FOR UPDATE").await?;
    let unapplied = unsigned(tx.query_one(&stmt, &[]).await?.get(0));
    Ok(unapplied.saturating_add(n as u64) < cap)
}

const INSERT_PENDING_SQL: &str =
    "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us, committed_at_us)
     VALUES ($1, $2, $3, $4, $5, $6, 'pending', $7, $8) ON CONFLICT DO NOTHING RETURNING position";

/// What is stored under an event id (its body or a tombstone's digest of it, and its
/// position) and at a (flow_id, seq), read right after the insert (so it sees exactly what
/// an envelope decided alone at that point would see). One lookup by event id.
const STORED_SQL: &str = "SELECT i.body, i.body_sha256, i.position,
            (SELECT event_id FROM inbox WHERE flow_id = $2 AND seq = $3)
     FROM (VALUES (1)) AS one(x) LEFT JOIN inbox i ON i.event_id = $1";

/// A statement sent on a pipeline, boxed so statements of different shapes share a queue.
type PipedFuture<'a, T = Piped> =
    std::pin::Pin<Box<dyn Future<Output = std::result::Result<T, tokio_postgres::Error>> + Send + 'a>>;

/// Sends `statements` in this order and then waits for every answer. A tokio-postgres
/// statement writes its request to the connection when its future is first polled, so each
/// is polled once, in order, before any answer is awaited: the server then receives and runs
/// them in exactly this order, in one round trip.
async fn in_order<T>(
    statements: Vec<PipedFuture<'_, T>>,
) -> Vec<std::result::Result<T, tokio_postgres::Error>> {
    use futures::future::{MaybeDone, maybe_done};
    let mut statements: Vec<MaybeDone<PipedFuture<'_, T>>> = statements.into_iter().map(maybe_done).collect();
    {
        let waker = futures::task::noop_waker();
        let mut first = std::task::Context::from_waker(&waker);
        for statement in &mut statements {
            // `MaybeDone` keeps an answer that is ready at once; the real waker is
            // registered by the join below.
            let _ = std::pin::Pin::new(statement).poll(&mut first);
        }
    }
    futures::future::join_all(statements.iter_mut()).await;
    statements
        .iter_mut()
        .map(|statement| {
            // join_all returned, so every statement is done and its output is taken once.
            std::pin::Pin::new(statement).take_output().expect("a joined statement has its answer")
        })
        .collect()
}

/// One statement's answer in a pipeline.
enum Piped {
    Done,
    Row(Option<Row>),
}

/// SPEC §6 for `events` in order, pipelined: for each, `SAVEPOINT`, the insert, the read of
/// what is stored, `RELEASE`, all sent before the first answer is read (tokio-postgres sends
/// a statement when its future is first polled, and [`in_order`] polls them in order), so the
/// server runs them exactly in sequence and the batch costs one round trip. Returns the
/// answers of the envelopes decided before the first failure, and that failure: the failed
/// envelope's savepoint is rolled back (`RolledBack`; the statements after it were skipped
/// by the server), or the transaction is lost.
async fn pipeline(
    tx: &Transaction<'_>,
    incoming: &[&Incoming],
    now_us: i64,
) -> (Vec<Result<Received>>, Option<StepFailure<StoreError>>) {
    let events: Vec<&Event> = incoming.iter().map(|i| &i.event).collect();
    let prepared = async {
        Ok::<_, tokio_postgres::Error>((
            tx.prepare_cached(INSERT_PENDING_SQL).await?,
            tx.prepare_cached(STORED_SQL).await?,
        ))
    };
    let (insert, stored) = match prepared.await {
        Ok(statements) => statements,
        Err(e) => return (Vec::new(), Some(StepFailure::TransactionLost(e.into()))),
    };
    let bodies: Vec<String> = events.iter().map(|e| e.canonical_body()).collect();
    let seqs: Vec<i64> = events.iter().map(|e| big(e.seq)).collect();
    let schemas: Vec<i32> = events.iter().map(|e| schema_column(e.schema)).collect();
    let mut statements: Vec<PipedFuture<'_>> = Vec::with_capacity(events.len() * 4);
    for (k, e) in events.iter().enumerate() {
        statements.push(Box::pin(async { tx.batch_execute("SAVEPOINT step").await.map(|()| Piped::Done) }));
        let insert = &insert;
        let (body, seq, schema) = (&bodies[k], &seqs[k], &schemas[k]);
        let committed_at_us = &incoming[k].committed_at_us;
        statements.push(Box::pin(async move {
            let params: [&(dyn ToSql + Sync); 8] =
                [&e.event_id, &e.flow_id, seq, &e.kind, schema, body, &now_us, committed_at_us];
            tx.query_opt(insert, &params).await.map(Piped::Row)
        }));
        let stored = &stored;
        statements.push(Box::pin(async move {
            let params: [&(dyn ToSql + Sync); 3] = [&e.event_id, &e.flow_id, seq];
            tx.query_opt(stored, &params).await.map(Piped::Row)
        }));
        statements
            .push(Box::pin(async { tx.batch_execute("RELEASE SAVEPOINT step").await.map(|()| Piped::Done) }));
    }
    let answers = in_order(statements).await;
    let mut decided = Vec::with_capacity(events.len());
    for (k, four) in answers.chunks(4).enumerate() {
        let [savepoint, inserted, read, release] = four else { break };
        if let Err(e) = savepoint {
            return (decided, Some(StepFailure::TransactionLost(classify(e))));
        }
        let failed = inserted.as_ref().err().or(read.as_ref().err());
        if let Some(e) = failed {
            let e = classify(e);
            if e.loses_transaction() {
                return (decided, Some(StepFailure::TransactionLost(e)));
            }
            let undone = tx.batch_execute("ROLLBACK TO SAVEPOINT step; RELEASE SAVEPOINT step").await;
            let failure =
                if undone.is_ok() { StepFailure::RolledBack(e) } else { StepFailure::TransactionLost(e) };
            return (decided, Some(failure));
        }
        if let Err(e) = release {
            return (decided, Some(StepFailure::TransactionLost(classify(e))));
        }
        let (Ok(Piped::Row(inserted)), Ok(Piped::Row(read))) = (inserted, read) else { break };
        decided.push(match (inserted, read) {
            (Some(row), _) => {
                Ok(Received { outcome: ReceiveOutcome::Accepted, position: unsigned(row.get(0)) })
            }
            (None, Some(read)) => stored_answer(events[k], &bodies[k], read),
            (None, None) => Err(StoreError::Inconsistent("the stored-row read returned nothing".into())),
        });
    }
    (decided, None)
}

/// The whole batch as one statement, rows in batch order (so positions are arrival order
/// and a later envelope meets an earlier one exactly as if each were inserted alone).
const INSERT_ALL_SQL: &str =
    "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us, committed_at_us)
     SELECT e, f, s, k, sc, b, 'pending', $7, c
     FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::integer[], $6::text[], $8::bigint[])
          WITH ORDINALITY AS t(e, f, s, k, sc, b, c, n)
     ORDER BY n
     ON CONFLICT DO NOTHING RETURNING event_id, position";

/// For each envelope the insert skipped: what holds its event id (body, position) and its
/// (flow_id, seq), read after the insert.
const HOLDERS_SQL: &str = "SELECT i1.event_id, i1.body, i1.position, i2.event_id, i1.body_sha256
     FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS t(e, f, s, n)
     LEFT JOIN inbox i1 ON i1.event_id = t.e
     LEFT JOIN inbox i2 ON i2.flow_id = t.f AND i2.seq = t.s
     ORDER BY t.n";

/// SPEC §6 for `events` in order with one multi-row insert under one savepoint and, only
/// when some envelope was not inserted, one read of what holds their ids and seqs. The
/// skipped envelopes are decided in memory as they would have been alone at their turn:
/// a row this batch inserted for a LATER envelope did not exist yet at an earlier one's
/// turn. `Ok(None)` when the statement failed (a trigger, a constraint) or a decision needs
/// the envelope-by-envelope path: the savepoint is rolled back and nothing was written.
async fn insert_all(
    tx: &Transaction<'_>,
    incoming: &[&Incoming],
    now_us: i64,
) -> std::result::Result<Option<Vec<Received>>, StoreError> {
    if incoming.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let events: Vec<&Event> = incoming.iter().map(|i| &i.event).collect();
    let committed_at: Vec<Option<i64>> = incoming.iter().map(|i| i.committed_at_us).collect();
    let statement = tx.prepare_cached(INSERT_ALL_SQL).await?;
    let bodies: Vec<String> = events.iter().map(|e| e.canonical_body()).collect();
    let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    let flows: Vec<&str> = events.iter().map(|e| e.flow_id.as_str()).collect();
    let seqs: Vec<i64> = events.iter().map(|e| big(e.seq)).collect();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    let schemas: Vec<i32> = events.iter().map(|e| schema_column(e.schema)).collect();
    let params: [&(dyn ToSql + Sync); 8] =
        [&ids, &flows, &seqs, &kinds, &schemas, &bodies, &now_us, &committed_at];
    let rows = match RECEIVE_FAST.begin(tx, &statement, &params).await? {
        Ok(rows) => rows,
        Err(e) => return RECEIVE_FAST.undo(tx, e).await,
    };
    // Event ids are unique among inserted rows: where each envelope's row went.
    let mut stored: std::collections::HashMap<String, (usize, u64)> = std::collections::HashMap::new();
    let by_id: std::collections::HashMap<&str, usize> =
        ids.iter().enumerate().rev().map(|(k, id)| (*id, k)).collect();
    for row in &rows {
        let id: String = row.get(0);
        let position = unsigned(row.get(1));
        // The first envelope with this id is the one that was inserted (a later one with
        // the same id met it and was skipped).
        let Some(&k) = by_id.get(id.as_str()) else {
            return RECEIVE_FAST.undo(tx, inconsistent_insert()).await;
        };
        stored.insert(id, (k, position));
    }
    let mut decided: Vec<Option<Received>> = (0..events.len())
        .map(|k| {
            stored
                .get(ids[k])
                .filter(|(at, _)| *at == k)
                .map(|&(_, position)| Received { outcome: ReceiveOutcome::Accepted, position })
        })
        .collect();
    let skipped: Vec<usize> = (0..events.len()).filter(|&k| decided[k].is_none()).collect();
    if skipped.is_empty() {
        return Ok(Some(decided.into_iter().flatten().collect()));
    }
    let holders = tx.prepare_cached(HOLDERS_SQL).await?;
    let s_ids: Vec<&str> = skipped.iter().map(|&k| ids[k]).collect();
    let s_flows: Vec<&str> = skipped.iter().map(|&k| flows[k]).collect();
    let s_seqs: Vec<i64> = skipped.iter().map(|&k| seqs[k]).collect();
    let read = match tx.query(&holders, &[&s_ids, &s_flows, &s_seqs]).await {
        Ok(rows) => rows,
        Err(e) => return RECEIVE_FAST.undo(tx, classify(&e)).await,
    };
    if read.len() != skipped.len() {
        return RECEIVE_FAST.undo(tx, inconsistent_insert()).await;
    }
    // A row this batch inserted for envelope `at` existed at envelope k's turn only if at < k.
    let existed_at = |id: &str, k: usize| stored.get(id).is_none_or(|&(at, _)| at < k);
    for (&k, row) in skipped.iter().zip(&read) {
        let id_holder: Option<String> = row.get(0);
        let seq_holder: Option<String> = row.get(3);
        let answer = match id_holder {
            Some(holder) if existed_at(&holder, k) => {
                let Some(stored) = StoredBody::from_columns(row.get(1), row.get(4)) else {
                    return RECEIVE_FAST.undo(tx, inconsistent_insert()).await;
                };
                if stored.is(&bodies[k]) {
                    Received { outcome: ReceiveOutcome::Duplicate, position: unsigned(row.get(2)) }
                } else {
                    Received { outcome: ReceiveOutcome::IdConflict, position: 0 }
                }
            }
            _ => match seq_holder {
                Some(held_by) if existed_at(&held_by, k) => {
                    Received { outcome: ReceiveOutcome::SequenceConflict { held_by }, position: 0 }
                }
                // Neither was taken at its turn, yet it was not inserted: let the
                // envelope-by-envelope path say what it is.
                _ => return RECEIVE_FAST.undo(tx, inconsistent_insert()).await,
            },
        };
        decided[k] = Some(answer);
    }
    Ok(Some(decided.into_iter().flatten().collect()))
}

fn inconsistent_insert() -> StoreError {
    StoreError::Inconsistent("a batch insert skipped an envelope nothing explains".into())
}

/// What the stored rows (read right after an insert that stored nothing) say about `event`.
/// A compacted row is compared by the digest of the body.
fn stored_answer(event: &Event, body: &str, read: &Row) -> Result<Received> {
    let stored = StoredBody::from_columns(read.get(0), read.get(1));
    let position: Option<i64> = read.get(2);
    let holder: Option<String> = read.get(3);
    if position.is_some() && stored.is_none() {
        return Err(StoreError::Inconsistent(format!(
            "inbox {}: no body and no digest of one",
            event.event_id
        )));
    }
    match (stored, holder) {
        (Some(stored), _) if stored.is(body) => {
            Ok(Received { outcome: ReceiveOutcome::Duplicate, position: position.map_or(0, unsigned) })
        }
        (Some(_), _) => Ok(Received { outcome: ReceiveOutcome::IdConflict, position: 0 }),
        (None, Some(held_by)) => {
            Ok(Received { outcome: ReceiveOutcome::SequenceConflict { held_by }, position: 0 })
        }
        (None, None) => Err(StoreError::Inconsistent(format!(
            "inbox insert of {} stored nothing, yet neither its event_id nor its (flow_id, seq) is taken",
            event.event_id
        ))),
    }
}

/// Stores `event` as pending unless its event id or its (flow_id, seq) is already taken, or
/// the backlog is full under `admission` (the counter row is locked first, so the cap is
/// exact across concurrent writers). Writes only for `Accepted`. The insert is tried first
/// (`ON CONFLICT DO NOTHING`); only when it stored nothing are the stored rows read.
async fn insert_pending(
    tx: &Transaction<'_>,
    event: &Event,
    committed_at_us: Option<i64>,
    now_us: i64,
    admission: Admission,
) -> Result<Received> {
    let body = event.canonical_body();
    if let Admission::Cap(cap) = admission {
        let stmt = tx.prepare_cached("SELECT unapplied FROM backlog WHERE id = 1 FOR UPDATE").await?;
        let unapplied = unsigned(tx.query_one(&stmt, &[]).await?.get(0));
        if unapplied >= cap {
            if let Some(known) = stored_outcome(tx, event, &body).await? {
                return Ok(known);
            }
            if !fills_gap(tx, event).await? {
                return Ok(Received { outcome: ReceiveOutcome::BacklogFull { unapplied }, position: 0 });
            }
        }
    }
    let stmt = tx
        .prepare_cached(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, body, state, received_at_us,
                               committed_at_us)
             VALUES ($1, $2, $3, $4, $5, $6, 'pending', $7, $8) ON CONFLICT DO NOTHING RETURNING position",
        )
        .await?;
    let schema = schema_column(event.schema);
    let params: [&(dyn ToSql + Sync); 8] = [
        &event.event_id,
        &event.flow_id,
        &big(event.seq),
        &event.kind,
        &schema,
        &body,
        &now_us,
        &committed_at_us,
    ];
    if let Some(row) = tx.query_opt(&stmt, &params).await? {
        return Ok(Received { outcome: ReceiveOutcome::Accepted, position: unsigned(row.get(0)) });
    }
    stored_outcome(tx, event, &body).await?.ok_or_else(|| {
        StoreError::Inconsistent(format!(
            "inbox insert of {} stored nothing, yet neither its event_id nor its (flow_id, seq) is taken",
            event.event_id
        ))
    })
}

/// What the stored rows say about `event`: the same body under its id (`Duplicate`, with its
/// position), another body (`IdConflict`), another id at its (flow_id, seq)
/// (`SequenceConflict`), or nothing.
async fn stored_outcome(tx: &Transaction<'_>, event: &Event, body: &str) -> Result<Option<Received>> {
    let stmt = tx.prepare_cached("SELECT body, body_sha256, position FROM inbox WHERE event_id = $1").await?;
    if let Some(row) = tx.query_opt(&stmt, &[&event.event_id]).await? {
        let stored = StoredBody::from_columns(row.get(0), row.get(1)).ok_or_else(|| {
            StoreError::Inconsistent(format!("inbox {}: no body and no digest of one", event.event_id))
        })?;
        return Ok(Some(if stored.is(body) {
            Received { outcome: ReceiveOutcome::Duplicate, position: unsigned(row.get(2)) }
        } else {
            Received { outcome: ReceiveOutcome::IdConflict, position: 0 }
        }));
    }
    let stmt = tx.prepare_cached("SELECT event_id FROM inbox WHERE flow_id = $1 AND seq = $2").await?;
    let holder = tx.query_opt(&stmt, &[&event.flow_id, &big(event.seq)]).await?;
    Ok(holder
        .map(|r| Received { outcome: ReceiveOutcome::SequenceConflict { held_by: r.get(0) }, position: 0 }))
}

/// Whether `event` is exactly the next seq of a flow that already has rows waiting behind it.
async fn fills_gap(tx: &Transaction<'_>, event: &Event) -> Result<bool> {
    let next = projection(tx, &event.flow_id).await?.last_seq + 1;
    if event.seq != next {
        return Ok(false);
    }
    let stmt = tx
        .prepare_cached(
            "SELECT EXISTS(SELECT 1 FROM inbox WHERE flow_id = $1 AND seq > $2 AND state <> 'applied')",
        )
        .await?;
    Ok(tx.query_one(&stmt, &[&event.flow_id, &big(event.seq)]).await?.get(0))
}
