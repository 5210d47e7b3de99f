"""The set-up the SQLite measurement scripts share: a fresh file at `path` (any earlier one
and its WAL removed), in WAL mode without fsync (the scripts count instructions and pages,
not the disk), in autocommit mode so each script writes its own BEGIN and COMMIT."""
import os
import sqlite3


def fresh(path):
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(path + suffix)
        except FileNotFoundError:
            pass
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=OFF")
    return c
