#!/usr/bin/env python3
"""Issue 18: what the relay's mark costs per outbox row, and which part of it is which.
30 000 rows in producer.db's outbox shape (schema 9), inserted in transactions of 60 as
`Advance` inserts them (three-step flows interleaved) and marked after each, in the
`(flow_id, seq)` order the relay's page reads them, with the relay's statement.

Shapes:
  now      the schema as it is: the mark sets the acceptance columns (the row grows by
           ~20 bytes) and moves the row from `outbox_unaccepted` to `outbox_accepted_by`;
  noindex  no partial index (what moving the row between them costs);
  inplace  both indexes, but the row is inserted with acceptance columns of the size the
           mark writes, so the mark rewrites it in place (what the row's growth costs);
  counter  the schema as it is, and a statement that only counts the send (`attempts`), as
           an answer that does not accept the row does: no index is touched and the row
           keeps its size (what the statement costs apart from the acceptance).

Run each shape with and without the mark under callgrind (the real interpreter, not a pyenv
shim) and divide the difference by 30 000:

    PY=$(python3 -c 'import sys; print(sys.executable)')
    for v in now noindex inplace counter; do for m in 0 1; do
        valgrind --tool=callgrind --callgrind-out-file=/tmp/cg_mark_$v$m $PY scripts/measure_mark_sqlite.py $v $m
    done; done

It prints the pages in use afterwards (free pages excluded)."""
import sys

from fresh_sqlite import fresh

shape, mark = sys.argv[1], sys.argv[2] == "1"
assert shape in ("now", "noindex", "inplace", "counter")
path = f"/tmp/measure_mark_{shape}{int(mark)}.db"
c = fresh(path)
c.executescript("""
CREATE TABLE outbox(
    id INTEGER PRIMARY KEY,
    event_id TEXT NOT NULL UNIQUE,
    flow_id TEXT NOT NULL,
    seq INTEGER NOT NULL CHECK(seq >= 1),
    kind TEXT NOT NULL,
    schema INTEGER NOT NULL,
    accepted INTEGER NOT NULL DEFAULT 0 CHECK(accepted IN (0,1)),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_outcome TEXT,
    committed_at_us INTEGER NOT NULL,
    accepted_at_us INTEGER,
    accepted_position INTEGER,
    accepted_by INTEGER CHECK(accepted_by IS NULL OR typeof(accepted_by) = 'integer'),
    UNIQUE(flow_id, seq)
);
""")
if shape != "noindex":
    c.executescript("""
CREATE INDEX outbox_unaccepted ON outbox(flow_id, seq) WHERE accepted = 0;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;
""")
N = 30_000
FLOWS = N // 3
# Advance's arrival order: 64 clients each driving a flow's three steps back to back.
rows = []
for first in range(0, FLOWS, 64):
    group = range(first, min(first + 64, FLOWS))
    rows += [(f, s) for s in (1, 2, 3) for f in group]
position = 0
for start in range(0, N, 60):
    batch = rows[start:start + 60]
    c.execute("BEGIN")
    for (f, s) in batch:
        flow = f"bench{f:07d}"
        if shape == "inplace":
            c.execute(
                "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, committed_at_us,"
                " last_outcome, accepted_at_us, accepted_position, accepted_by)"
                " VALUES (?,?,?,?,1,?, 'XXXXXXXX', 1796611330197072, 32767, 1)",
                (f"{flow}-{s}", flow, s, "reserved", 1796611330197072 + start))
        else:
            c.execute(
                "INSERT INTO outbox(event_id, flow_id, seq, kind, schema, committed_at_us)"
                " VALUES (?,?,?,?,1,?)",
                (f"{flow}-{s}", flow, s, "reserved", 1796611330197072 + start))
    c.execute("COMMIT")
    if mark:
        c.execute("BEGIN")
        ordered = sorted((f, s, start + 1 + i) for i, (f, s) in enumerate(batch))
        for (f, s, row_id) in ordered:
            event_id = f"bench{f:07d}-{s}"
            position += 1
            if shape == "counter":
                c.execute("UPDATE outbox SET attempts = attempts + 1 WHERE id = ?2 AND event_id = ?1",
                          (event_id, row_id))
                continue
            c.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_outcome = ?2, accepted = 1,"
                " accepted_at_us = ?3,"
                " accepted_by = CASE WHEN ?4 IS NOT NULL THEN ?4 ELSE accepted_by END,"
                " accepted_position = CASE WHEN ?4 IS NOT NULL THEN ?5 ELSE accepted_position END"
                " WHERE id = ?6 AND event_id = ?1 AND accepted = 0",
                (event_id, "ACCEPTED", 1796611331579503 + start, 1, position, row_id))
        c.execute("COMMIT")
used = c.execute("SELECT (SELECT page_count FROM pragma_page_count) - (SELECT freelist_count FROM pragma_freelist_count)").fetchone()[0]
print(f"{shape} mark={int(mark)}: {used} pages in use")
