"""4: bulk enqueue against COPY, and a single enqueue's latency and round trips.

Bulk: N `NewJob` rows (task `echo`, payload {"n": i}) through
`client.enqueue_many` on a SQLAlchemy connection, in one transaction, timed
from the call to the COMMIT's return, payload encoding and validation
included. Baseline, same run: psycopg `COPY jobs (task, payload, queue) FROM
STDIN` of the same rows, json.dumps per row included, also one transaction.

Single: `echo.enqueue(conn, n=i)` inside an open transaction, median latency,
and its round trips counted exactly from libpq's protocol trace (every
frontend Sync or simple Query ends a round trip).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.pool import NullPool

from sqla_jobq import client, jobs
from sqla_jobq.statements import NewJob

from .. import common
from ..common import Bench


def _rows(n: int) -> list[NewJob]:
    return [NewJob(task="echo", payload={"n": i}) for i in range(n)]


def _ours(bench: Bench, rows: list[NewJob]) -> float:
    engine = create_engine(bench.url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
            conn.commit()
            started = time.perf_counter()
            with conn.begin():
                ids = client.enqueue_many(conn, jobs, rows)
            elapsed = time.perf_counter() - started
    finally:
        engine.dispose()
    if len(ids) != len(rows):
        raise RuntimeError(f"enqueue_many returned {len(ids)} ids for {len(rows)} rows")
    return len(rows) / elapsed


def _copy(bench: Bench, rows: list[NewJob]) -> float:
    with bench.connect() as conn:
        conn.autocommit = False
        started = time.perf_counter()
        with conn.cursor() as cur, cur.copy("COPY jobs (task, payload, queue) FROM STDIN") as copy:
            for row in rows:
                copy.write_row((row.task, json.dumps(row.payload), row.queue))
        conn.commit()
        return len(rows) / (time.perf_counter() - started)


def _count(bench: Bench) -> int:
    with bench.connect() as conn:
        row = conn.execute("SELECT count(*) FROM jobs").fetchone()
    return int(row[0]) if row else 0


def _single(bench: Bench, count: int) -> dict[str, float]:
    """Median latency of one `task.enqueue` in an open transaction, and its round trips."""
    from psycopg.pq import Trace

    from bench.tasks import echo

    engine = create_engine(bench.url, poolclass=NullPool)
    statements = 0

    def on_execute(*_: Any) -> None:
        nonlocal statements
        statements += 1

    latencies: list[float] = []
    try:
        with engine.connect() as conn:
            with conn.begin():
                for i in range(20):  # warm up: compile caches, prepared statements
                    echo.enqueue(conn, n=i)
            event.listen(conn, "before_cursor_execute", on_execute)
            with conn.begin():
                conn.exec_driver_sql("SELECT 1")
                statements = 0
                for i in range(count):
                    started = time.perf_counter()
                    echo.enqueue(conn, n=i)
                    latencies.append((time.perf_counter() - started) * 1000)
            per_call_statements = statements / count
            # Round trips of one call, from libpq's own trace of the protocol.
            pgconn = conn.connection.dbapi_connection.pgconn  # type: ignore[union-attr]
            with conn.begin(), tempfile.TemporaryDirectory() as tmp:
                conn.exec_driver_sql("SELECT 1")
                trace = Path(tmp) / "trace"
                with open(trace, "w") as f:
                    pgconn.trace(f.fileno())
                    pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)
                    echo.enqueue(conn, n=-1)
                    pgconn.untrace()
                round_trips = sum(
                    1
                    for line in trace.read_text().splitlines()
                    if line.startswith("F") and line.split("\t")[2].split()[0] in ("Sync", "Query")
                )
    finally:
        engine.dispose()
    return {
        "median_ms": common.median(latencies),
        "p99_ms": common.percentile(latencies, 99),
        "statements_per_call": per_call_statements,
        "round_trips_per_call": float(round_trips),
    }


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    n = bench.sizes.enqueue_jobs
    common.create_table(bench)
    rows = _rows(n)
    per: dict[str, list[float]] = {"enqueue_many": [], "copy": []}
    for r in range(bench.rounds):
        for name, fn in (("enqueue_many", _ours), ("copy", _copy)):
            with bench.connect() as conn:
                conn.execute("TRUNCATE jobs")
                conn.execute("CHECKPOINT")
            per[name].append(fn(bench, rows))
            if _count(bench) != n:
                raise RuntimeError(f"{name} did not insert {n} rows")
        log(
            f"  round {r + 1} enqueue_many {per['enqueue_many'][-1]:>9,.0f} jobs/s  "
            f"COPY {per['copy'][-1]:>9,.0f} jobs/s"
        )
    with bench.connect() as conn:
        conn.execute("TRUNCATE jobs")
    single = _single(bench, bench.sizes.single_enqueues)
    log(
        f"  single enqueue {single['median_ms']:.3f} ms, "
        f"{single['round_trips_per_call']:.0f} round trip(s)"
    )
    return {
        "enqueue_many_jobs_per_s": common.median(per["enqueue_many"]),
        "copy_jobs_per_s": common.median(per["copy"]),
        "ratio": common.median(
            [common.ratio(a, b) for a, b in zip(per["enqueue_many"], per["copy"], strict=True)]
        ),
        "rounds": per,
        "single": single,
    }
