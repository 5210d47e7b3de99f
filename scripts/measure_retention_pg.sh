#!/bin/bash
# PG: rounds of 5000 accepted rows inserted (into the store's own schema, producer version 5 or later), compact-once at retention $1 (0/off), VACUUM when $2=vacuum.
set -e
BIN=${PRODUCER_BIN:-target/release/producer}
DB=oe_meas_retention_$$
psql -h 127.0.0.1 -U postgres -qAtc "CREATE DATABASE $DB"
URL=postgres://postgres@127.0.0.1:5432/$DB
$BIN --db $URL --retention off --compact-once >/dev/null 2>&1
for r in $(seq 0 39); do
  psql -h 127.0.0.1 -U postgres -d $DB -qAtc "SET search_path=ordered_events_producer;
   INSERT INTO flow SELECT 'flow-'||lpad(g::text,8,'0'), 3, 'released', 3 FROM generate_series($r*1667, $r*1667+1666) g;
   INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, accepted, attempts, last_outcome, committed_at_us, accepted_at_us, accepted_by, accepted_position, partition)
   SELECT 'flow-'||lpad(g::text,8,'0')||'-e'||s, 'flow-'||lpad(g::text,8,'0'), s, (ARRAY['reserved','confirmed','released'])[s], 1,
     '{\"event_id\":\"flow-'||lpad(g::text,8,'0')||'-e'||s||'\",\"flow_id\":\"flow-'||lpad(g::text,8,'0')||'\",\"kind\":\"'||(ARRAY['reserved','confirmed','released'])[s]||'\",\"payload\":{\"amount\":3},\"schema\":1,\"seq\":'||s||'}',
     1, 1, 'ACCEPTED', 1700000000000000, 1700000000000001, consumer_key('0123456789abcdef0123456789abcdef'), g*3+s, flow_partition('flow-'||lpad(g::text,8,'0'))
   FROM generate_series($r*1667, $r*1667+1666) g, generate_series(1,3) s;"
  $BIN --db $URL --retention $1 --compact-once 2>/dev/null >/dev/null
  if [ "$2" = vacuum ]; then psql -h 127.0.0.1 -U postgres -d $DB -qAtc "VACUUM ordered_events_producer.outbox"; fi
  if [ $((r % 10)) = 9 ]; then
    psql -h 127.0.0.1 -U postgres -d $DB -qAtc "SELECT count(*), pg_relation_size('ordered_events_producer.outbox'), pg_total_relation_size('ordered_events_producer.outbox'), round(pg_relation_size('ordered_events_producer.outbox')::numeric/count(*),1), round(pg_total_relation_size('ordered_events_producer.outbox')::numeric/count(*),1) FROM ordered_events_producer.outbox"
  fi
done
psql -h 127.0.0.1 -U postgres -qAtc "DROP DATABASE $DB WITH (FORCE)"
