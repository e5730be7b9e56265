"""5: finished history must not slow the claim down.

Two queue tables with the same schema: `jobs` holds only the ready jobs,
`jobs_hist` the same ready jobs after N finished ones (inserted with
generate_series in SQL, then VACUUM ANALYZE). One cycle is what a worker does
per batch: claim 10 (the worker's own compiled claim, prepared, autocommit)
and complete them in one fenced statement. Figure: the median cycle latency,
rounds alternating between the two tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import MetaData

from sqla_jobq.driver import Compiled
from sqla_jobq.schema import jobs_table
from sqla_jobq.statements import claim, complete_many

from .. import common
from ..common import Bench

BATCH = 10
TABLES = ("jobs", "jobs_hist")


def _prepare(bench: Bench, ready: int, history: int) -> None:
    for name in TABLES:
        common.create_table(bench, name)
    with bench.connect() as conn:
        conn.execute(
            "INSERT INTO jobs_hist (task, payload, status, attempts, run_at, created_at, "
            "started_at, finished_at) "
            "SELECT 'noop', jsonb_build_object('n', i), "
            "CASE WHEN i %% 50 = 0 THEN 'failed' ELSE 'done' END, 1, "
            "now() - interval '1 day' + i * interval '1 ms', "
            "now() - interval '1 day' + i * interval '1 ms', "
            "now() - interval '1 day' + i * interval '1 ms', "
            "now() - interval '1 day' + i * interval '1 ms' + interval '5 ms' "
            "FROM generate_series(1, %s) AS i",
            (history,),
        )
        for name in TABLES:
            conn.execute(
                f"INSERT INTO {name} (task, payload, run_at) "
                "SELECT 'noop', '{}'::jsonb, now() - interval '1 second' "
                "FROM generate_series(1, %s)",
                (ready,),
            )
        for name in TABLES:
            conn.execute(f"VACUUM ANALYZE {name}")


def _cycles(bench: Bench, table: str, count: int) -> list[float]:
    t = jobs_table(MetaData(), table)
    claim_sql = Compiled.of(claim(t, queue="default", lease=timedelta(minutes=5)))
    complete_sql = Compiled.of(complete_many(t, []))
    params = claim_sql.params(limit=BATCH)
    out: list[float] = []
    with psycopg.connect(bench.dsn, autocommit=True, prepare_threshold=0) as conn:
        for _ in range(5):  # prepare both statements
            rows = conn.execute(claim_sql.sql, params).fetchall()
            conn.execute(
                complete_sql.sql,
                complete_sql.params(ids=[r[0] for r in rows], attempts=[r[4] for r in rows]),
            ).fetchall()
        for _ in range(count):
            started = time.perf_counter()
            rows = conn.execute(claim_sql.sql, params).fetchall()
            done = conn.execute(
                complete_sql.sql,
                complete_sql.params(ids=[r[0] for r in rows], attempts=[r[4] for r in rows]),
            ).fetchall()
            out.append((time.perf_counter() - started) * 1000)
            if len(rows) != BATCH or len(done) != BATCH:
                raise RuntimeError(f"{table}: claimed {len(rows)}, completed {len(done)}")
    return out


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    cycles = bench.sizes.history_cycles
    history = bench.sizes.history_rows
    started = time.perf_counter()
    _prepare(bench, (cycles + 5) * BATCH * bench.rounds, history)
    took = time.perf_counter() - started
    log(f"  {history:,} finished rows inserted and analyzed in {took:.1f}s")
    per: dict[str, list[float]] = {name: [] for name in TABLES}
    for r in range(bench.rounds):
        for name in TABLES:
            per[name].append(common.median(_cycles(bench, name, cycles)))
        log(
            f"  round {r + 1} claim 10 + complete: empty {per['jobs'][-1]:.3f} ms, "
            f"with history {per['jobs_hist'][-1]:.3f} ms"
        )
    for name in TABLES:
        common.drop_table(bench, name)
    return {
        "history_rows": history,
        "empty_ms": common.median(per["jobs"]),
        "history_ms": common.median(per["jobs_hist"]),
        "ratio": common.median(
            [common.ratio(h, e) for h, e in zip(per["jobs_hist"], per["jobs"], strict=True)]
        ),
        "rounds": per,
    }
