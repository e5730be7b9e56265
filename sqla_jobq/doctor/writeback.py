"""Judge whether the release of a held horizon may stall commits.

A snapshot held for minutes lets the queue table grow by every row version
written meanwhile. When it goes, VACUUM rewrites what the hold grew (hundreds
of MB in the held-snapshot scene) and autovacuum marks the archive's new
pages visible. With `backend_flush_after` at 0, PostgreSQL's default on
Linux, a backend's writes wait in the kernel's page cache until the kernel
writes them back in bulk or the next checkpoint's fsync writes them all at
once, and every commit, which fsyncs the WAL on the same disk, waits behind
that. In docs/benchmarks.md's twenty-third round the checkpoints after a
release synced for 0.38 and 0.44 s, against 0.03 and 0.05 s with the setting
at 256kB for the whole server; in the twenty-fourth, at one load in one
sitting on another VM, whose checkpoints synced in 0.14 s at most, runs
with the setting for the database and runs without it did not differ
beyond their own spread: how much the bursts cost depends on the storage.

The worker sets it on its own sessions (`db.BACKEND_FLUSH_AFTER`); autovacuum
and the app's sessions take the server's value or the database's. `ALTER
DATABASE ... SET` needs no superuser and reaches autovacuum too (autovacuum
workers apply a database's settings, not a role's).

A warning only while the horizon is held back, the one time it is about to
matter: PostgreSQL leaves it at 0 because some workloads (larger than
shared_buffers, smaller than the page cache) lose throughput with it, and a
queue with nothing held drained as fast either way (1.03x).
"""

from __future__ import annotations

from ..units import byte_size
from .model import Facts, Finding, ok, warn

SUGGESTED = "256kB"
# Where a session's value may come from when autovacuum shares it: the
# server's own settings, or the database's. A role's setting, or the client's
# options, is that session's alone.
SHARED_SOURCES = {
    "default",
    "configuration file",
    "command line",
    "environment variable",
    "database",
}


def writeback_finding(facts: Facts, held_back: bool) -> Finding:
    row = facts.writeback
    written, source = int(row["bytes"]), str(row["source"])
    data = {**row, "shared_with_autovacuum": source in SHARED_SOURCES}
    summary = f"backend_flush_after {byte_size(written) if written else '0'} (from the {source})"
    if source not in SHARED_SOURCES:
        summary += "; autovacuum goes by the server's or the database's value"
    if written and source in SHARED_SOURCES:
        return ok("writeback", "server", summary, data)
    if not held_back:
        later = f"{summary}: matters once a long-held horizon moves on"
        return ok("writeback", "server", later, data)
    return warn(
        "writeback",
        "server",
        f"{summary}: when the horizon held above moves on, VACUUM rewrites what the hold "
        "kept, and those writes wait in the kernel's cache, then reach the disk in bursts "
        "(its writeback, the next checkpoint's fsync) that can stall every commit",
        f"ALTER DATABASE \"{facts.database}\" SET backend_flush_after = '{SUGGESTED}' "
        "(new sessions and autovacuum of this database; no superuser needed), "
        "or ALTER SYSTEM SET it for the whole server",
        data,
    )
