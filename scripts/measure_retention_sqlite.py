#!/usr/bin/env python3
"""Issue 16: how much a SQLite producer file grows per event with and without compaction, for
the candidate shapes (run: python3 scripts/measure_retention_sqlite.py none inplace_digest_compact
sep_digest_insert sep_digest_compact). Simulates the producer schema, 100k events, retention 0."""
import sqlite3, os, hashlib, sys
N = 100_000
B = 1000
def body(fid, seq, eid, kind):
    return '{"event_id":"%s","flow_id":"%s","kind":"%s","payload":{"amount":%d},"schema":1,"seq":%d}' % (eid, fid, kind, 3, seq)
KINDS = ["reserved", "confirmed", "released"]
def events():
    i = 0
    f = 0
    while i < N:
        fid = "flow-%08d" % f
        for s in range(1, 4):
            if i >= N: break
            yield fid, s, "%s-e%d" % (fid, s), KINDS[s-1] if s<3 else "released"
            i += 1
        f += 1
BASE = """CREATE TABLE flow(flow_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, state TEXT NOT NULL, amount INTEGER NOT NULL);"""
COLS = """event_id TEXT {pk}, flow_id TEXT NOT NULL REFERENCES flow(flow_id), seq INTEGER NOT NULL, kind TEXT NOT NULL, schema INTEGER NOT NULL,
 {body} accepted INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, last_outcome TEXT, committed_at_us INTEGER NOT NULL,
 accepted_at_us INTEGER, accepted_by TEXT, accepted_position INTEGER, body_sha256 BLOB, UNIQUE(flow_id, seq)"""
IDX = """CREATE INDEX outbox_unaccepted ON outbox(flow_id, seq) WHERE accepted = 0;
CREATE INDEX outbox_accepted_by ON outbox(accepted_by, accepted_position) WHERE accepted = 1;"""
def run(shape):
    path = "/tmp/oe_retention_%s.db" % shape
    for s in ["", "-wal", "-shm"]:
        if os.path.exists(path+s): os.remove(path+s)
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA auto_vacuum=INCREMENTAL")
    c.execute("PRAGMA journal_mode=WAL")
    c.executescript(BASE)
    sep = shape in ("sep_digest_insert", "sep_digest_compact")
    if sep:
        c.executescript("CREATE TABLE outbox(id INTEGER PRIMARY KEY, " + COLS.format(pk="NOT NULL UNIQUE", body="") + ");" + IDX +
                        "CREATE TABLE outbox_body(id INTEGER PRIMARY KEY, body TEXT NOT NULL);")
    else:
        c.executescript("CREATE TABLE outbox(" + COLS.format(pk="PRIMARY KEY", body="body TEXT,") + ");" + IDX)
    pending = []
    sizes = {}
    n = 0
    def flush():
        c.execute("BEGIN IMMEDIATE")
        for fid, s, eid, kind in pending:
            b = body(fid, s, eid, kind)
            dig = hashlib.sha256(b.encode()).digest() if shape in ("sep_digest_insert", "inplace_digest_insert") else None
            if s == 1:
                c.execute("INSERT INTO flow VALUES (?,?,?,?)", (fid, s, kind, 3))
            else:
                c.execute("UPDATE flow SET seq=?, state=? WHERE flow_id=?", (s, kind, fid))
            if sep:
                cur = c.execute("INSERT INTO outbox(event_id, flow_id, seq, kind, schema, committed_at_us, body_sha256) VALUES (?,?,?,?,1,1700000000000000,?)", (eid, fid, s, kind, dig))
                c.execute("INSERT INTO outbox_body(id, body) VALUES (?,?)", (cur.lastrowid, b))
            else:
                c.execute("INSERT INTO outbox(event_id, flow_id, seq, kind, schema, body, committed_at_us, body_sha256) VALUES (?,?,?,?,1,?,1700000000000000,?)", (eid, fid, s, kind, b, dig))
        c.execute("COMMIT")
        c.execute("BEGIN IMMEDIATE")
        for fid, s, eid, kind in pending:
            c.execute("UPDATE outbox SET accepted=1, attempts=1, last_outcome='ACCEPTED', accepted_at_us=1700000000000001, accepted_by='0123456789abcdef0123456789abcdef', accepted_position=? WHERE event_id=?", (n, eid))
        c.execute("COMMIT")
        # compaction
        if shape != "none":
            c.execute("BEGIN IMMEDIATE")
            if shape == "inplace_digest_compact":
                for (eid, b) in c.execute("SELECT event_id, body FROM outbox WHERE accepted=1 AND body IS NOT NULL").fetchall():
                    c.execute("UPDATE outbox SET body=NULL, body_sha256=? WHERE event_id=?", (hashlib.sha256(b.encode()).digest(), eid))
            elif shape == "inplace_digest_insert":
                c.execute("UPDATE outbox SET body=NULL WHERE accepted=1 AND body IS NOT NULL")
            elif shape == "sep_digest_insert":
                c.execute("DELETE FROM outbox_body WHERE id IN (SELECT o.id FROM outbox o JOIN outbox_body b ON b.id=o.id WHERE o.accepted=1)")
            elif shape == "sep_digest_compact":
                for (i, b) in c.execute("SELECT o.id, b.body FROM outbox o JOIN outbox_body b ON b.id=o.id WHERE o.accepted=1").fetchall():
                    c.execute("UPDATE outbox SET body_sha256=? WHERE id=?", (hashlib.sha256(b.encode()).digest(), i))
                    c.execute("DELETE FROM outbox_body WHERE id=?", (i,))
            c.execute("COMMIT")
            c.execute("PRAGMA incremental_vacuum")
        pending.clear()
    for ev in events():
        pending.append(ev); n += 1
        if len(pending) == B: flush()
        if n in (10_000, 50_000, 100_000):
            if pending: flush()
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes[n] = os.path.getsize(path)
    if pending: flush()
    print("%-24s" % shape, " ".join("%dk=%8d B (%.0f B/ev)" % (k//1000, v, v/k) for k, v in sizes.items()),
          " growth 50k->100k: %.1f B/ev" % ((sizes[100000]-sizes[50000])/50000))
for s in sys.argv[1:]:
    run(s)
