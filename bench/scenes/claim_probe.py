"""Claim probe: what one claim's index scan reads, without and then with a held snapshot.

On a throwaway cluster (default settings): 120,000 ready no-op jobs; then five
times, `EXPLAIN (ANALYZE, BUFFERS)` of the claim's locking SELECT (the same
WHERE, ORDER BY and `FOR UPDATE SKIP LOCKED` as `statements._ready`, LIMIT 10;
median of 5) followed by 10,000 jobs claimed and completed in batches of 50
(two updates per job, as the worker makes). Then the same again while another
session holds a `REPEATABLE READ` snapshot taken before those jobs. The probes
run a few seconds apart, so autovacuum (naptime 60 s) rarely comes in between.

It shows why a held snapshot slows the worker down, not only the vacuum: the
index entries of claimed rows cannot be marked dead while the snapshot may
still see them, so every claim re-reads them and their heap pages.

`--minutes` scales the jobs per step (0.1: 1,000).
"""

from __future__ import annotations

import re
import statistics
from typing import Any

import psycopg

from .. import common
from . import base

SELECT = (
    "EXPLAIN (ANALYZE, BUFFERS) SELECT id FROM jobs WHERE queue = 'default' "
    "AND status = 'queued' AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 10 "
    "FOR UPDATE SKIP LOCKED"
)
# Claim, then complete, as two statements: one statement cannot update a row
# its own CTE updated (PostgreSQL applies only one of the two), so a single
# CTE-fed completion would leave every job running, with one dead version
# instead of the worker's two.
CLAIM = (
    "UPDATE jobs SET status = 'running', attempts = attempts + 1, started_at = now() "
    "WHERE id = ANY(ARRAY(SELECT id FROM jobs WHERE queue = 'default' AND status = 'queued' "
    "AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 50 FOR UPDATE SKIP LOCKED)) "
    "RETURNING id"
)
COMPLETE = "UPDATE jobs SET status = 'done', finished_at = now() WHERE id = ANY(%s)"


def _step(conn: psycopg.Connection[Any]) -> None:
    """50 jobs claimed and completed, each commit apart, as a worker does."""
    ids = [row[0] for row in conn.execute(CLAIM).fetchall()]
    conn.execute(COMPLETE, [ids])


def _probe(conn: psycopg.Connection[Any]) -> tuple[float, int]:
    ms, buffers = [], []
    for _ in range(5):
        plan = "\n".join(str(r[0]) for r in conn.execute(SELECT).fetchall())
        found_ms = re.search(r"Execution Time: ([\d.]+)", plan)
        found_buf = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
        assert found_ms and found_buf, plan
        ms.append(float(found_ms.group(1)))
        buffers.append(int(found_buf.group(1)) + int(found_buf.group(2) or 0))
    return statistics.median(ms), int(statistics.median(buffers))


def run(minutes: float, log: Any) -> dict[str, Any]:
    per_step = max(1_000, int(10_000 * min(1.0, minutes)))
    steps: list[dict[str, Any]] = []
    with base.throwaway_cluster() as cluster:
        common.fill(cluster.bench(), 12 * per_step)
        with cluster.connect() as conn, psycopg.connect(cluster.dsn()) as holder:
            for phase in ("no snapshot held", "snapshot held"):
                if phase == "snapshot held":
                    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    holder.execute("SELECT id FROM jobs LIMIT 1").fetchall()
                for k in range(5):
                    ms, buffers = _probe(conn)
                    steps.append(
                        {"phase": phase, "jobs_since": k * per_step, "ms": ms, "buffers": buffers}
                    )
                    log(
                        f"  {phase}: after {k * per_step:>6,} more jobs: claim scan "
                        f"{ms:.2f} ms, {buffers:,} buffers"
                    )
                    for _ in range(per_step // 50):
                        _step(conn)
            holder.rollback()
    return {"jobs_per_step": per_step, "steps": steps}


def report(r: dict[str, Any]) -> str:
    lines = [f"{'phase':<18} {'jobs since':>10} {'claim scan ms':>14} {'buffers':>8}"]
    for s in r["steps"]:
        lines.append(f"{s['phase']:<18} {s['jobs_since']:>10,} {s['ms']:>14.2f} {s['buffers']:>8,}")
    return "\n".join(lines)
