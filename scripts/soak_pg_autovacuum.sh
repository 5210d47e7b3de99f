#!/bin/bash
# The retention soak (issue 16) on a PostgreSQL server of its own with autovacuum on.
#
# The shared server the tests use runs with autovacuum off, so a soak there measures tables
# that are never vacuumed. This starts a private cluster (initdb in a temporary directory,
# run as the `postgres` user, port 5433 unless PORT is set), passes any extra server
# settings given in PG_SETTINGS (e.g. "-c autovacuum_naptime=10s"), runs
# `bench --soak --backend postgres` against it with the arguments given to this script
# (e.g. `--flows 333334 --output soak.json`), then stops the cluster and removes it.
#
#   scripts/soak_pg_autovacuum.sh --flows 333334
#   PG_SETTINGS="-c autovacuum_naptime=10s -c autovacuum_vacuum_cost_delay=0" \
#     scripts/soak_pg_autovacuum.sh --flows 333334
#
# Needs PostgreSQL's server binaries (PG_BIN, default the newest /usr/lib/postgresql/*/bin)
# and root (to run them as `postgres`), as on this project's CI machine.
set -euo pipefail
PORT=${PORT:-5433}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
BENCH=${BENCH:-target/release/bench}
DIR=$(mktemp -d /var/tmp/oe-pg-soak-XXXXXX)
chown postgres "$DIR"
stop() {
  su postgres -c "$PG_BIN/pg_ctl -D $DIR/data -m fast stop" >/dev/null 2>&1 || true
  rm -rf "$DIR"
}
trap stop EXIT
su postgres -c "$PG_BIN/initdb -D $DIR/data -A trust -U postgres" >"$DIR/initdb.log"
su postgres -c "$PG_BIN/pg_ctl -D $DIR/data -w -l $DIR/server.log \
  -o '-p $PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$DIR -c autovacuum=on ${PG_SETTINGS:-}' start" >/dev/null
psql -h 127.0.0.1 -p "$PORT" -U postgres -Atc \
  "SELECT 'server: ' || version() || '; autovacuum=' || current_setting('autovacuum')
          || ' naptime=' || current_setting('autovacuum_naptime')
          || ' cost_delay=' || current_setting('autovacuum_vacuum_cost_delay')"
"$BENCH" --soak --backend postgres --pg-url "postgres://postgres@127.0.0.1:$PORT/postgres" "$@"
