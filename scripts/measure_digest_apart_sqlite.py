#!/usr/bin/env python3
"""Issues 16 and 18: what compacting an inbox row costs when its digest is written into the row
(`UPDATE inbox SET body_sha256`, consumer.db up to schema 10) against a row of a table of its own
(`INSERT INTO inbox_digest`, schema 11), both with the body's `DELETE`. 30 000 applied rows in
the consumer's shape, compacted in position order in transactions of 500.

Run each shape with and without the compaction under callgrind (the real interpreter, not a
pyenv shim) and divide the difference by 30 000:

    PY=$(python3 -c 'import sys; print(sys.executable)')
    for v in row apart; do for c in 0 1; do
        valgrind --tool=callgrind --callgrind-out-file=/tmp/cg_$v$c $PY scripts/measure_digest_apart_sqlite.py $v $c
    done; done

It prints the pages in use afterwards (free pages excluded) and each table's bytes (`dbstat`)."""
import sqlite3
import sys

from fresh_sqlite import fresh

shape, compact = sys.argv[1], sys.argv[2] == "1"
assert shape in ("row", "apart")
path = f"/tmp/measure_digest_{shape}{int(compact)}.db"
c = fresh(path)
c.executescript("""
CREATE TABLE inbox(event_id TEXT PRIMARY KEY, flow_id TEXT NOT NULL, seq INTEGER NOT NULL CHECK(seq >= 1),
 kind TEXT NOT NULL, schema INTEGER NOT NULL, state TEXT NOT NULL, reason TEXT, received_at_us INTEGER NOT NULL,
 applied_at_us INTEGER, committed_at_us INTEGER,
 body_sha256 BLOB CHECK(body_sha256 IS NULL OR length(body_sha256) = 32),
 UNIQUE(flow_id, seq));
CREATE INDEX inbox_unapplied ON inbox(flow_id, seq, state) WHERE state <> 'applied';
CREATE TABLE inbox_body(position INTEGER PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE inbox_digest(position INTEGER PRIMARY KEY, sha256 BLOB NOT NULL CHECK(length(sha256) = 32));
""")
N = 30_000
rows = [(f, s) for s in (1, 2, 3) for f in range(N // 3)]
for start in range(0, N, 50):
    c.execute("BEGIN")
    for (f, s) in rows[start:start + 50]:
        cur = c.execute(
            "INSERT INTO inbox(event_id, flow_id, seq, kind, schema, state, received_at_us, applied_at_us,"
            " committed_at_us) VALUES (?,?,?,?,?,?,?,?,?)",
            (f"f{f:07d}-{s}", f"f{f:07d}", s, "reserved", 1, "applied", 1796611331503509 + start,
             1796611331579503 + start, 1796611330197072 + start))
        body = ('{"event_id":"f%07d-%d","flow_id":"f%07d","kind":"reserved","payload":{"amount":3},'
                '"schema":1,"seq":%d}' % (f, s, f, s))
        c.execute("INSERT INTO inbox_body(position, body) VALUES (?, ?)", (cur.lastrowid, body))
    c.execute("COMMIT")
if compact:
    digest = bytes(range(32))
    for start in range(1, N + 1, 500):
        c.execute("BEGIN IMMEDIATE")
        for position in range(start, min(start + 500, N + 1)):
            if shape == "row":
                c.execute("UPDATE inbox SET body_sha256 = ?2 WHERE rowid = ?1 AND state = 'applied'"
                          " AND body_sha256 IS NULL", (position, digest))
            else:
                c.execute("INSERT INTO inbox_digest(position, sha256) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                          (position, digest))
            c.execute("DELETE FROM inbox_body WHERE position = ?1", (position,))
        c.execute("COMMIT")
c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
used = c.execute("SELECT (SELECT page_count FROM pragma_page_count) - (SELECT freelist_count FROM pragma_freelist_count)").fetchone()[0]
print(f"{shape} compact={int(compact)}: {used} pages in use")
try:
    for name, size in c.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name ORDER BY name"):
        print(f"  {name}: {size} bytes")
except sqlite3.OperationalError:
    pass  # an SQLite built without dbstat
