#!/bin/bash
# PostgreSQL: what an outbox keeps per event after compaction, with the body in the row
# (`inline`, the store's schema today: compaction sets `body` NULL and writes `body_sha256`)
# against bodies and digests in tables of their own (`apart`: compaction deletes the body row
# and inserts a digest row; the outbox row is never rewritten by it) and against bodies in a
# table partitioned by id range with the digest written with the row (`parts`: compaction
# drops a whole partition once all its rows are finished), and each without compaction.
# `queue` is `parts` with an outbox row that is never updated: the rows the relay still has to
# send are a queue table of their own (`(flow_id, seq, id)`, deleted by the mark) and the mark
# inserts a row into `outbox_accepted` instead of updating the outbox row. `hot` and `hot90`
# are `inline` with compaction allowed to be a HOT update (see their DDL below).
#
# Each round inserts 5 000 events (ids as `bench` makes them: f0000001-1, ...), marks them
# accepted as the relay does (an UPDATE of each row), compacts them at retention 0 (or not)
# and runs VACUUM on every table every VACUUM_EVERY rounds (default 1; standing in for
# autovacuum, which the shared server does not run: at 8 000 events/s a 10 s naptime is 16
# rounds). After every 10 rounds it prints, per event, the bytes of all the design's relations
# (heaps, indexes, TOAST) and of the outbox's indexes alone, and how many of the outbox's
# updates so far were HOT.
#
#   scripts/measure_bodies_apart_pg.sh [rounds]      (default 40: 200 000 events a design)
#   VACUUM_EVERY=16 scripts/measure_bodies_apart_pg.sh 80
#   DESIGNS=parts scripts/measure_bodies_apart_pg.sh     (one design: inline, hot, hot90, apart, parts or queue)
set -euo pipefail
ROUNDS=${1:-40}
PSQL="psql -h 127.0.0.1 -U postgres -qAt -v ON_ERROR_STOP=1"
N=5000
VACUUM_EVERY=${VACUUM_EVERY:-1}

# The store's outbox (producer schema 4) and the two other layouts: the same columns in the
# same order, `apart` and `parts` keyed by a bigint id with the body out of the row.
# outbox_ddl KEY AFTER_SCHEMA AT_END MORE: the columns before `flow_id`, after `schema` and
# before the UNIQUE constraint (each ending in a comma), then more statements.
outbox_ddl() {
  cat <<SQL
CREATE TABLE outbox(
    $1
    flow_id TEXT COLLATE "C" NOT NULL,
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    $2
    accepted INTEGER NOT NULL DEFAULT 0,
    attempts BIGINT NOT NULL DEFAULT 0,
    last_outcome TEXT,
    committed_at_us BIGINT NOT NULL,
    accepted_at_us BIGINT,
    accepted_by TEXT,
    accepted_position BIGINT,
    partition SMALLINT NOT NULL,
    marked_by TEXT,
    marked_epoch BIGINT,
    $3
    UNIQUE(flow_id, seq)
);
CREATE INDEX outbox_unaccepted ON outbox(flow_id, seq) WHERE accepted = 0;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
$4
SQL
}
by_id='id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id TEXT COLLATE "C" NOT NULL UNIQUE,'
inline_ddl=$(outbox_ddl 'event_id TEXT COLLATE "C" PRIMARY KEY,' 'body TEXT,' 'body_sha256 BYTEA,' \
  'CREATE INDEX outbox_compactable ON outbox(accepted_at_us) WHERE accepted = 1 AND body IS NOT NULL;')
# `hot`: `inline` with the compactable rows' index not naming `body`, so compaction changes
# no indexed column and may be a HOT update (no new index entries); `hot90` leaves each heap
# page 10 % free for the new versions.
hot_ddl=$(outbox_ddl 'event_id TEXT COLLATE "C" PRIMARY KEY,' 'body TEXT,' 'body_sha256 BYTEA,' \
  'CREATE INDEX outbox_compactable ON outbox(accepted_at_us) WHERE accepted = 1;')
apart_ddl=$(outbox_ddl "$by_id" '' '' \
  'CREATE TABLE outbox_body(id BIGINT PRIMARY KEY, body TEXT NOT NULL);
   CREATE TABLE outbox_digest(id BIGINT PRIMARY KEY, sha256 BYTEA NOT NULL);')
parts_ddl=$(outbox_ddl "$by_id" 'body_sha256 BYTEA NOT NULL,' '' \
  'CREATE TABLE outbox_body(id BIGINT NOT NULL, body TEXT NOT NULL) PARTITION BY RANGE (id);')
queue_ddl="
CREATE TABLE outbox(
    $by_id
    flow_id TEXT COLLATE \"C\" NOT NULL,
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    body_sha256 BYTEA NOT NULL,
    committed_at_us BIGINT NOT NULL,
    partition SMALLINT NOT NULL,
    UNIQUE(flow_id, seq)
);
CREATE TABLE outbox_unaccepted(flow_id TEXT COLLATE \"C\", seq BIGINT, id BIGINT NOT NULL,
                               PRIMARY KEY (flow_id, seq));
CREATE TABLE outbox_accepted(
    id BIGINT PRIMARY KEY,
    attempts BIGINT NOT NULL,
    last_outcome TEXT,
    accepted_at_us BIGINT,
    accepted_by TEXT,
    accepted_position BIGINT,
    marked_by TEXT,
    marked_epoch BIGINT
);
CREATE INDEX outbox_accepted_by ON outbox_accepted(accepted_by, accepted_position);
CREATE TABLE outbox_body(id BIGINT NOT NULL, body TEXT NOT NULL) PARTITION BY RANGE (id);"

# Round r's rows: flows r*N/3 .. as three-step flows, bodies shaped like the store's.
rows_sql() {
  local r=$1
  cat <<SQL
SELECT 'f'||lpad(g::text,7,'0')||'-'||s AS event_id, 'f'||lpad(g::text,7,'0') AS flow_id, s AS seq,
       (ARRAY['reserved','confirmed','released'])[s] AS kind, 1 AS schema,
       '{"event_id":"f'||lpad(g::text,7,'0')||'-'||s||'","flow_id":"f'||lpad(g::text,7,'0')||'","kind":"'
         ||(ARRAY['reserved','confirmed','released'])[s]||'","payload":{"amount":3},"schema":1,"seq":'||s||'}' AS body,
       1700000000000000 + g AS committed_at_us, (g % 64)::smallint AS partition
FROM generate_series($r*$((N / 3)), ($r+1)*$((N / 3))-1) g, generate_series(1,3) s
SQL
}

mark_sql="UPDATE outbox SET accepted = 1, attempts = attempts + 1, last_outcome = 'ACCEPTED',
    accepted_at_us = committed_at_us + 5000, accepted_by = '6c0914b7ee19a632c8e3f51183a0f96b',
    accepted_position = committed_at_us - 1700000000000000, marked_by = 'relay-1', marked_epoch = 1
  WHERE accepted = 0;"

# body_partition PSQL ROUND: round ROUND's partition of `outbox_body`, for the ids the
# identity gives its rows next.
body_partition() {
  local q=$1 r=$2 from
  from=$($q -c "SELECT coalesce(max(id), 0) + 1 FROM outbox")
  $q -c "CREATE TABLE outbox_body_$r PARTITION OF outbox_body FOR VALUES FROM ($from) TO ($((from + N / 3 * 3)));
         ALTER TABLE outbox_body_$r ADD PRIMARY KEY (id)"
}

# with_digested_rows ROUND: `WITH x` (round ROUND's rows) and `o` (their outbox rows, the
# digest written with each, returning id, event_id, flow_id, seq), for `parts` and `queue`.
with_digested_rows() {
  cat <<SQL
WITH x AS ($(rows_sql $1)), o AS (
  INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body_sha256, committed_at_us, partition)
  SELECT event_id, flow_id, seq, kind, schema, sha256(convert_to(body, 'UTF8')), committed_at_us, partition
  FROM x
  RETURNING id, event_id, flow_id, seq)
SQL
}

CURRENT_DB=
trap '[ -z "$CURRENT_DB" ] || $PSQL -c "DROP DATABASE IF EXISTS $CURRENT_DB WITH (FORCE)"' EXIT

run() {
  local design=$1 compact=$2 db=oe_meas_apart_$$_$1_$2
  $PSQL -c "CREATE DATABASE $db"
  CURRENT_DB=$db
  local q="$PSQL -d $db"
  case $design in
    inline) $q -c "$inline_ddl" ;;
    hot) $q -c "$hot_ddl" ;;
    hot90) $q -c "$hot_ddl ALTER TABLE outbox SET (fillfactor = 90);" ;;
    apart) $q -c "$apart_ddl" ;;
    parts) $q -c "$parts_ddl" ;;
    queue) $q -c "$queue_ddl" ;;
  esac
  for r in $(seq 0 $((ROUNDS - 1))); do
    if [ "$design" = inline ] || [ "$design" = hot ] || [ "$design" = hot90 ]; then
      $q -c "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us, partition)
             SELECT event_id, flow_id, seq, kind, schema, body, committed_at_us, partition FROM ($(rows_sql $r)) x"
      $q -c "$mark_sql"
      if [ "$compact" = 0 ]; then
        $q -c "UPDATE outbox SET body_sha256 = sha256(convert_to(body, 'UTF8')), body = NULL
               WHERE accepted = 1 AND body IS NOT NULL"
      fi
    elif [ "$design" = queue ]; then
      body_partition "$q" "$r"
      $q -c "$(with_digested_rows $r), b AS (
               INSERT INTO outbox_body(id, body) SELECT o.id, x.body FROM o JOIN x USING (event_id))
             INSERT INTO outbox_unaccepted(flow_id, seq, id) SELECT flow_id, seq, id FROM o"
      $q -c "WITH sent AS (DELETE FROM outbox_unaccepted u RETURNING u.id)
             INSERT INTO outbox_accepted(id, attempts, last_outcome, accepted_at_us, accepted_by,
                                         accepted_position, marked_by, marked_epoch)
             SELECT o.id, 1, 'ACCEPTED', o.committed_at_us + 5000, '6c0914b7ee19a632c8e3f51183a0f96b',
                    o.committed_at_us - 1700000000000000, 'relay-1', 1
             FROM sent JOIN outbox o ON o.id = sent.id"
      if [ "$compact" = 0 ]; then
        $q -c "DROP TABLE outbox_body_$r"
      fi
    elif [ "$design" = parts ]; then
      body_partition "$q" "$r"
      $q -c "$(with_digested_rows $r)
             INSERT INTO outbox_body(id, body) SELECT o.id, x.body FROM o JOIN x USING (event_id)"
      $q -c "$mark_sql"
      if [ "$compact" = 0 ]; then
        # Every row of the round is accepted now: its partition goes whole.
        $q -c "DROP TABLE outbox_body_$r"
      fi
    else
      $q -c "WITH x AS ($(rows_sql $r)), o AS (
               INSERT INTO outbox(event_id, flow_id, seq, kind, schema, committed_at_us, partition)
               SELECT event_id, flow_id, seq, kind, schema, committed_at_us, partition FROM x
               RETURNING id, event_id)
             INSERT INTO outbox_body(id, body) SELECT o.id, x.body FROM o JOIN x USING (event_id)"
      $q -c "$mark_sql"
      if [ "$compact" = 0 ]; then
        $q -c "WITH gone AS (
                 DELETE FROM outbox_body b USING outbox o WHERE o.id = b.id AND o.accepted = 1
                 RETURNING b.id, sha256(convert_to(b.body, 'UTF8')) AS sha256)
               INSERT INTO outbox_digest(id, sha256) SELECT id, sha256 FROM gone ORDER BY id"
      fi
    fi
    if [ $(((r + 1) % VACUUM_EVERY)) = 0 ]; then $q -c "VACUUM"; fi
    if [ $((r % 10)) = 9 ]; then
      $q -c "SELECT '$design retention $compact: ' || count(*) || ' events, '
               || round((SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c
                         JOIN pg_namespace n ON n.oid = c.relnamespace
                         WHERE n.nspname = 'public' AND c.relkind = 'r')::numeric / count(*), 1)
               || ' bytes per event, of which the outbox''s indexes '
               || round(pg_indexes_size('outbox')::numeric / count(*), 1)
             FROM outbox"
      $q -c "SELECT '  outbox updates ' || n_tup_upd || ', of which HOT ' || n_tup_hot_upd
             FROM pg_stat_user_tables WHERE relname = 'outbox'"
    fi
  done
  $PSQL -c "DROP DATABASE $db"
  CURRENT_DB=
}

for design in ${DESIGNS:-inline apart parts queue}; do
  for compact in off 0; do
    run "$design" "$compact"
  done
done
