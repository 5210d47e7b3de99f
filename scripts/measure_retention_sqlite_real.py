# Real schema, real compaction: rows inserted as the producer writes them (SQLite schema 5),
# marked accepted, then `producer --compact-once --retention 0` (or off) after each 1000.
import sqlite3, os, subprocess, json, sys
BIN = os.environ.get("PRODUCER_BIN", "target/release/producer")
mode = sys.argv[1]  # "0" or "off"
path = "/tmp/oe_retention_real_%s.db" % mode
for s in ["", "-wal", "-shm"]:
    if os.path.exists(path + s): os.remove(path + s)
subprocess.run([BIN, "--db", path, "--retention", "off", "--compact-once"], check=True, capture_output=True)
c = sqlite3.connect(path, isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
KINDS = ["reserved", "confirmed", "released"]
n = 0; f = 0; out = {}
def compact():
    r = subprocess.run([BIN, "--db", path, "--retention", mode, "--compact-once"], check=True, capture_output=True, text=True)
    return json.loads(r.stdout)
total = {"compacted": 0}
while n < 100_000:
    c.execute("BEGIN IMMEDIATE")
    for _ in range(333):
        fid = "flow-%08d" % f; f += 1
        for s in range(1, 4):
            eid = "%s-e%d" % (fid, s); kind = KINDS[s-1]
            body = '{"event_id":"%s","flow_id":"%s","kind":"%s","payload":{"amount":3},"schema":1,"seq":%d}' % (eid, fid, kind, s)
            if s == 1: c.execute("INSERT INTO flow VALUES (?,?,?,3)", (fid, s, kind))
            else: c.execute("UPDATE flow SET seq=?, state=? WHERE flow_id=?", (s, kind, fid))
            cur = c.execute("INSERT INTO outbox(event_id, flow_id, seq, kind, schema, committed_at_us, accepted, attempts, last_outcome, accepted_at_us, accepted_by, accepted_position) VALUES (?,?,?,?,1,1700000000000000,1,1,'ACCEPTED',1700000000000001,'0123456789abcdef0123456789abcdef',?)", (eid, fid, s, kind, n))
            c.execute("INSERT INTO outbox_body(id, body) VALUES (?, ?)", (cur.lastrowid, body))
            n += 1
    c.execute("COMMIT")
    r = compact(); total["compacted"] += r.get("compacted", 0)
    if n // 999 in (10, 50, 100) and n % 999 == 0 or n >= 100_000 or n in (9990, 49950):
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        out[n] = os.path.getsize(path)
c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
size = os.path.getsize(path)
print(mode, "events", n, "compacted", total["compacted"], "file", size, "B/event %.1f" % (size / n), {k: "%.1f" % (v / k) for k, v in out.items()}, "last", r)
