#!/usr/bin/env python3
"""Issues 16 and 18: what the consumer's apply costs per row when it also writes the row's
`applied_at_us` (consumer.db up to schema 11: the row grows by 6 bytes and its page splits)
against the state alone (schema 12: the row is rewritten in place; the time is its effect's).
30 000 rows in the inbox's shape, received in transactions of 60 and applied after each.

Run each shape with and without the apply under callgrind (the real interpreter, not a pyenv
shim) and divide the difference by 30 000:

    PY=$(python3 -c 'import sys; print(sys.executable)')
    for v in grow same; do for a in 0 1; do
        valgrind --tool=callgrind --callgrind-out-file=/tmp/cg_$v$a $PY scripts/measure_applied_at_sqlite.py $v $a
    done; done

It prints the pages in use afterwards (free pages excluded)."""
import sys

from fresh_sqlite import fresh

shape, apply = sys.argv[1], sys.argv[2] == "1"
assert shape in ("grow", "same")
path = f"/tmp/measure_applied_at_{shape}{int(apply)}.db"
c = fresh(path)
c.executescript("""
CREATE TABLE inbox(event_id TEXT PRIMARY KEY, flow_id TEXT NOT NULL, seq INTEGER NOT NULL CHECK(seq >= 1),
 kind TEXT NOT NULL, schema INTEGER NOT NULL,
 state TEXT NOT NULL CHECK(state = 'pending' OR state = 'blocked' OR state = 'applied'), reason TEXT,
 received_at_us INTEGER NOT NULL, applied_at_us INTEGER, committed_at_us INTEGER, UNIQUE(flow_id, seq));
CREATE INDEX inbox_unapplied ON inbox(flow_id, seq, state) WHERE state <> 'applied';
""")
N = 30_000
rows = [(f, s) for s in (1, 2, 3) for f in range(N // 3)]
for start in range(0, N, 60):
    c.execute("BEGIN")
    for (f, s) in rows[start:start + 60]:
        c.execute(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, state, received_at_us, committed_at_us)"
            " VALUES (?,?,?,?,?,'pending',?,?)",
            (f"f{f:07d}-{s}", f"f{f:07d}", s, "reserved", 1, 1796611331503509 + start, 1796611330197072 + start))
    c.execute("COMMIT")
    if apply:
        c.execute("BEGIN")
        for position in range(start + 1, start + 61):
            if shape == "grow":
                c.execute("UPDATE inbox SET state = 'applied', reason = NULL, applied_at_us = ?2"
                          " WHERE rowid = ?1 AND state <> 'applied'", (position, 1796611331579503 + start))
            else:
                c.execute("UPDATE inbox SET state = 'applied', reason = NULL WHERE rowid = ?1 AND state <> 'applied'",
                          (position,))
        c.execute("COMMIT")
used = c.execute("SELECT (SELECT page_count FROM pragma_page_count) - (SELECT freelist_count FROM pragma_freelist_count)").fetchone()[0]
print(f"{shape} apply={int(apply)}: {used} pages in use")
