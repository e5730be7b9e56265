"""Judge the queue table itself: dead tuples against the vacuum history, its
sizes (and its archive's), and whether every index the schema declares exists
and is valid, with the exact DDL to fix one that is not."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import MetaData
from sqlalchemy.dialects.postgresql.base import PGDialect
from sqlalchemy.schema import CreateIndex, Index

from ..reindex_statements import LEFTOVER_SUFFIX
from ..schema import Names, jobs_table
from ..units import ago, byte_size, iso
from .autovacuum import off_where
from .model import Facts, Finding, Row, Thresholds, ok, warn

_PG = PGDialect()  # type: ignore[no-untyped-call]
_VACUUM_TIMES = ("last_vacuum", "last_autovacuum", "last_analyze", "last_autoanalyze")


def dead_tuple_finding(facts: Facts, names: Names, t: Thresholds, held_back: bool) -> Finding:
    row = facts.table
    live, dead = int(row["n_live_tup"]), int(row["n_dead_tup"])
    ratio = dead / (live + dead) if live + dead else 0.0
    off = off_where(facts)
    autovacuum = off is None
    now = facts.checked_at
    summary = (
        f"live {live:,}, dead {dead:,} ({ratio:.1%}); "
        f"last autovacuum {ago(row['last_autovacuum'], now)}, "
        f"last vacuum {ago(row['last_vacuum'], now)}, "
        f"last autoanalyze {ago(row['last_autoanalyze'], now)}"
        + ("" if off is None else f"; autovacuum is OFF ({off})")
    )
    data = {
        "n_live_tup": live,
        "n_dead_tup": dead,
        "dead_ratio": round(ratio, 4),
        "autovacuum_enabled": autovacuum,
        **{k: iso(row[k]) for k in _VACUUM_TIMES},
    }
    if ratio > t.dead_ratio and dead > t.dead_tuples:
        advice = _vacuum_advice(names, held_back, autovacuum)
        return warn("dead_tuples", "table", summary, advice, data)
    return ok("dead_tuples", "table", summary, data)


# Below this many rows a sort of every queued row is cheap whatever the plan.
UNANALYZED_ROWS = 1_000


def statistics_finding(facts: Facts, names: Names) -> Finding:
    """A queue table never analyzed gets a bad claim plan.

    Without statistics the planner may take the classic ready index and sort
    every queued row on each claim (measured: 14 ms a claim at 100,000 queued
    jobs, ten times the server CPU) instead of walking the claim index and
    stopping at the limit. Autovacuum analyzes a busy table within a minute;
    with autovacuum off, nothing ever does.
    """
    row = facts.table
    rows = int(row["n_live_tup"]) + int(row["n_dead_tup"])
    analyzed = row["last_analyze"] or row["last_autoanalyze"]
    data = {"analyzed": analyzed is not None, "rows": rows}
    if analyzed is None and rows >= UNANALYZED_ROWS:
        summary = f"never analyzed, {rows:,} rows: claims may sort every queued job"
        return warn("statistics", "table", summary, f"ANALYZE {names.qualified}", data)
    when = "never (small table)" if analyzed is None else f"last {ago(analyzed, facts.checked_at)}"
    return ok("statistics", "table", f"analyzed {when}", data)


def _vacuum_advice(names: Names, held_back: bool, autovacuum: bool) -> str:
    table = names.qualified
    if held_back:
        return (
            "VACUUM cannot remove them while what is flagged above holds the horizon: "
            f"end those, then VACUUM (VERBOSE) {table}"
        )
    if not autovacuum:
        return f"autovacuum is off: turn it on, or run VACUUM (VERBOSE) {table} on a schedule"
    # Schema version 6 already vacuums the table at 5,000 dead tuples whatever
    # its size; what is left to tune is how often autovacuum comes round.
    return (
        f"run VACUUM (VERBOSE) {table}; if it recurs, autovacuum comes too rarely for "
        "this rate: check the table's settings (the autovacuum line), then lower "
        "autovacuum_naptime (a server setting)"
    )


def size_finding(facts: Facts, names: Names, t: Thresholds) -> Finding:
    """Sizes, and a warning when the table is mostly empty pages that no longer fit
    in shared_buffers.

    A healthy queue table is small: a few pages of ready and running rows. A
    held snapshot (or a backlog worked off) leaves it large and nearly empty,
    and VACUUM only marks that space free; the free space map then hands new
    rows pages all over the file, and every VACUUM of it (a busy queue table
    is vacuumed every few seconds) reads all of it. In the held-snapshot
    scene (docs/benchmarks.md, eighteenth round) the table a 3-minute hold
    left (a 412 MB heap and 252 MB of indexes for 10,000 live rows) had the
    server read about 530 MB every 10 s from outside shared_buffers until it
    was rewritten, which took 0.7 s. Pickup latency came back as fast either
    way there: what this costs is I/O, which on a disk with an IOPS budget
    (most cloud volumes) is not free. Workers rebuild indexes left that sparse
    (see `reindexing`); only a rewrite gives the heap's space back.
    """
    row = facts.table
    table_bytes, index_bytes = int(row["table_bytes"]), int(row["index_bytes"])
    live, pages = int(row["n_live_tup"]), table_bytes // int(row["block_size"])
    buffers = int(row["shared_buffers_bytes"])
    summary = (
        f"table {byte_size(table_bytes)}, indexes {byte_size(index_bytes)}, "
        f"total with TOAST {byte_size(row['total_bytes'])}"
    )
    data: dict[str, Any] = {
        "table_bytes": table_bytes,
        "index_bytes": index_bytes,
        "total_bytes": row["total_bytes"],
        "shared_buffers_bytes": buffers,
        "pages": pages,
        "live_rows_per_page": round(live / pages, 2) if pages else None,
        "archive_bytes": None,
        "archive_rows_estimate": None,
    }
    archive = facts.archive
    if archive is not None:
        rows = int(archive["rows_estimate"])
        counted = f"about {rows:,} rows" if rows >= 0 else "not analyzed yet"
        summary += f"; archive {byte_size(archive['total_bytes'])}, {counted}"
        data["archive_bytes"] = archive["total_bytes"]
        data["archive_rows_estimate"] = rows if rows >= 0 else None
    if _sparse(row, table_bytes, live, pages, t) and table_bytes + index_bytes > buffers:
        summary += (
            f"; mostly empty ({live:,} live rows in {pages:,} pages) and, with its "
            f"indexes, larger than shared_buffers ({byte_size(buffers)}): every VACUUM "
            "reads all of it from outside PostgreSQL's cache"
        )
        advice = _rewrite_advice(names, table_bytes + index_bytes)
        return warn("table_size", "table", summary, advice, data)
    return ok("table_size", "table", summary, data)


def _sparse(row: Row, table_bytes: int, live: int, pages: int, t: Thresholds) -> bool:
    """Large, with fewer live rows than pages. Until a vacuum or analyze has
    run, n_live_tup is only a tally of inserts and deletes since the statistics
    were last reset (zero after a crash), too weak to warn on."""
    counted = any(row[k] is not None for k in _VACUUM_TIMES)
    return counted and table_bytes >= t.sparse_table_bytes and live < pages


def _rewrite_advice(names: Names, size: int) -> str:
    return (
        "VACUUM leaves a table this size; at a quiet time, once nothing holds the horizon, "
        f"rewrite it: SET lock_timeout = '5s'; VACUUM (FULL, VERBOSE) {names.qualified} "
        "(workers wait while it copies the live rows; the lock timeout keeps it from "
        f"queueing behind a long reader with every claim queued behind it), or pg_repack "
        f"--table {names.qualified} online; or raise shared_buffers above "
        f"{byte_size(size)}"
    )


_LEFTOVER = re.compile(LEFTOVER_SUFFIX)


# What goes wrong without each index, by the name `Names` gives it.
def _index_roles(names: Names) -> dict[str, str]:
    return {
        names.ready_index: "hand-written claims on (queue, run_at) scan the whole table",
        names.claim_index: "every `claim` scans the whole table instead of the ready rows",
        names.running_index: "the reaper scans the whole table",
        names.unique_index: "enqueue with a unique_key fails (ON CONFLICT finds no index)",
        names.done_index: "each archiver pass reads the whole table to find done jobs",
    }


def index_findings(rows: Sequence[Row], names: Names) -> list[Finding]:
    """Each index the schema declares must exist and be valid (indisvalid)."""
    present = {r["name"]: r for r in rows}
    roles = _index_roles(names)
    expected = sorted(jobs_table(MetaData(), names.table, names.schema).indexes, key=_name)
    warnings: list[Finding] = []
    fine: list[str] = []
    for index in expected:
        name = _name(index)
        row = present.get(name)
        role = roles.get(name, "queries that need it scan the whole table")
        if row is None:
            warnings.append(
                warn(
                    "index",
                    f"index {name}",
                    f"missing: {role}",
                    f"recreate it: {_create_index_sql(index)}",
                    {"name": name, "exists": False, "valid": False},
                )
            )
        elif not row["valid"] and not row["building"]:
            warnings.append(
                warn(
                    "index",
                    f"index {name}",
                    f"INVALID (a failed CREATE INDEX CONCURRENTLY?), so ignored: {role}",
                    f"rebuild it: REINDEX INDEX CONCURRENTLY {_qualified_index(names, name)}",
                    {"name": name, "exists": True, "valid": False},
                )
            )
        else:
            fine.append(name if row["valid"] else f"{name} (being built)")
    warnings.extend(_leftover_findings(rows, names))
    if fine:
        warnings.append(ok("index", "indexes", "valid: " + ", ".join(fine), {"valid": fine}))
    return warnings


def _leftover_findings(rows: Sequence[Row], names: Names) -> list[Finding]:
    """An invalid `_ccnew`/`_ccold` copy a REINDEX CONCURRENTLY gave up on
    serves no query, yet every write to the table keeps it up to date. A
    worker's next rebuild drops it; this says so before then."""
    return [
        warn(
            "index",
            f"index {row['name']}",
            "INVALID copy left by a REINDEX CONCURRENTLY that gave up: every enqueue, "
            "claim and completion still writes to it",
            f"drop it: DROP INDEX CONCURRENTLY {_qualified_index(names, str(row['name']))}",
            {"name": row["name"], "exists": True, "valid": False},
        )
        for row in rows
        if not row["valid"] and not row["building"] and _LEFTOVER.search(str(row["name"]))
    ]


def _name(index: Index) -> str:
    return str(index.name)


def _qualified_index(names: Names, name: str) -> str:
    return Names(name, names.schema).qualified


def _create_index_sql(index: Index) -> str:
    """The index's own DDL from the schema, built CONCURRENTLY so writes go on."""
    index.dialect_options["postgresql"]["concurrently"] = True
    sql = str(CreateIndex(index).compile(dialect=_PG))
    return " ".join(sql.split())
