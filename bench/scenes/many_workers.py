"""Many workers: 4 processes x `-c 8` against 1 process x `-c 32` on the same jobs.

On a throwaway cluster (autovacuum on, default settings), each contender
drains 20,000 no-op jobs with `jobq worker --log-level WARNING`, two ways:

* **running** (the figure of issue 13): the workers are started on an empty
  queue and are up (each has its row in the worker registry) when one INSERT
  of all the jobs commits; its NOTIFY wakes them all at once. This is the
  throughput of workers that run for months: SKIP LOCKED contention, NOTIFY
  fan-out, heartbeats and reaping count, a process's start-up does not.
* **burst, from start-up**: `--burst` workers started on a filled queue
  (TRUNCATE, the jobs, VACUUM ANALYZE, CHECKPOINT). Every process pays its
  own start-up (about 1.3 s of CPU here, mostly imports), and on 2 cores
  the processes still starting take CPU from those already draining.

The rate comes from the server (first claim to last completion), and every
job must be done, claimed once apart from claims handed back unstarted (see
`drained`: with several burst workers a few dozen jobs per drain are handed
back and claimed again; a run with a per-execution stamp file found every job
executed exactly once). Rounds are interleaved; each ratio is the median of
the per-round ratios.

If `/usr/sbin/pgbouncer` exists, two more contenders: the same 4 x 8 through
PgBouncer in transaction mode (`--no-prepared`, `--listen-url` straight to
the server; PgBouncer's default pool size, 20), and 4 x 8 direct with
`--no-prepared`, to tell the pooler's cost from that of unprepared statements.

`--minutes` scales the job count (0.1: 2,000 jobs, 1 round, for a smoke run);
`--jobs N` and `--rounds R` set them: at 20,000 jobs a drain here lasts under
a second, so a pause of 0.1 s moves its rate by a tenth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from tests.support import pgbouncer

from .. import common
from . import base


def run(minutes: float, log: Any, rounds: int = 3, jobs: int | None = None) -> dict[str, Any]:
    n = jobs or max(2_000, int(20_000 * min(1.0, minutes)))
    rounds = rounds if minutes >= 0.5 else 1
    with (
        base.throwaway_cluster() as cluster,
        _pgbouncer(cluster) as bouncer_url,
    ):
        settings = cluster.settings()
        direct = cluster.url()
        contenders: dict[str, list[list[str]]] = {
            "1 x 32": [base.worker_cmd(direct, 32)],
            "4 x 8": [base.worker_cmd(direct, 8) for _ in range(4)],
        }
        if bouncer_url:
            contenders["4 x 8 via PgBouncer"] = [
                base.worker_cmd(bouncer_url, 8, "--no-prepared", "--listen-url", direct)
                for _ in range(4)
            ]
            contenders["4 x 8 direct --no-prepared"] = [
                base.worker_cmd(direct, 8, "--no-prepared") for _ in range(4)
            ]
        log(
            f"many workers: {n:,} no-op jobs per drain, {rounds} rounds interleaved; "
            f"PgBouncer {'in transaction mode' if bouncer_url else 'not installed'}"
        )
        bench = cluster.bench()
        common.fill(bench, min(n, 5_000))  # untimed warm-up
        bursts = {
            "burst 1 x 32": [[*cmd, "--burst"] for cmd in contenders["1 x 32"]],
            "burst 4 x 8": [[*cmd, "--burst"] for cmd in contenders["4 x 8"]],
        }
        common.run_children(bursts["burst 1 x 32"], timeout=600)
        per: dict[str, list[float]] = {name: [] for name in [*contenders, *bursts]}
        back: dict[str, list[int]] = {name: [] for name in per}
        for r in range(rounds):
            for name, cmds in contenders.items():
                rate, handed_back = _running(cluster, n, name, cmds)
                per[name].append(rate)
                back[name].append(handed_back)
                log(f"  round {r + 1} {name:<34} {rate:>9,.0f} jobs/s  ({handed_back} handed back)")
            for name, cmds in bursts.items():
                common.fill(bench, n)
                common.run_children(cmds, timeout=600)
                rate, handed_back = drained(cluster, n, name)
                per[name].append(rate)
                back[name].append(handed_back)
                log(f"  round {r + 1} {name:<34} {rate:>9,.0f} jobs/s  ({handed_back} handed back)")
    ratios = {
        "4 x 8 / 1 x 32": _ratio(per, "4 x 8", "1 x 32"),
        "burst 4 x 8 / burst 1 x 32 (start-up included)": _ratio(
            per, "burst 4 x 8", "burst 1 x 32"
        ),
    }
    if "4 x 8 via PgBouncer" in per:
        ratios["4 x 8 via PgBouncer / 4 x 8 direct"] = _ratio(per, "4 x 8 via PgBouncer", "4 x 8")
        ratios["4 x 8 via PgBouncer / 4 x 8 direct --no-prepared"] = _ratio(
            per, "4 x 8 via PgBouncer", "4 x 8 direct --no-prepared"
        )
        ratios["4 x 8 direct --no-prepared / 4 x 8 direct"] = _ratio(
            per, "4 x 8 direct --no-prepared", "4 x 8"
        )
    return {
        "settings": settings,
        "jobs": n,
        "rounds": rounds,
        "jobs_per_s": per,
        "handed_back": back,
        "ratios": ratios,
    }


def drained(cluster: base.Cluster, n: int, name: str) -> tuple[float, int]:
    """Jobs/s (first claim to last completion) and how many jobs were claimed twice.

    Every job must be `done`, claimed once more than it was handed back
    unstarted: `attempts` is the fencing token and only goes up; a hand-back of
    an attempt that never started refunds it by raising `max_attempts` by one
    (statements.release_many), so `attempts - (max_attempts - 5)` is the number
    of claims that were not refunded, and must be 1 (5 is the default).
    """
    with cluster.connect() as conn:
        row = conn.execute(
            """SELECT count(*), count(*) FILTER (WHERE status = 'done'),
                 count(*) FILTER (WHERE status = 'done' AND attempts - (max_attempts - 5) = 1),
                 count(*) FILTER (WHERE attempts > 1),
                 extract(epoch FROM max(finished_at) - min(started_at))
               FROM """
            + common.with_archive("jobs", common.FINISHED_COLUMNS)
        ).fetchone()
    assert row is not None
    total, done, once, again, seconds = row
    if not total == done == once == n:
        raise RuntimeError(
            f"{name}: {done} of {total} done, {once} with one unrefunded claim (want {n})"
        )
    return n / float(seconds), int(again)


@contextmanager
def _pgbouncer(cluster: base.Cluster) -> Iterator[str | None]:
    """PgBouncer in transaction mode in front of the scene database, at its
    default pool size (20); None where it is not installed."""
    if not pgbouncer.installed():
        yield None
        return
    with pgbouncer.running_pgbouncer(cluster.url(), pool_size=20) as bouncer:
        yield bouncer.url


def _running(
    cluster: base.Cluster, n: int, name: str, cmds: list[list[str]]
) -> tuple[float, int]:
    """Jobs/s of workers already up and idle when `n` jobs arrive in one commit."""
    with cluster.connect() as conn:
        conn.execute("TRUNCATE jobs_workers")
    common.fill(cluster.bench(), 0)
    with base.workers(cmds), cluster.connect() as conn:
        _wait(conn, "SELECT count(*) >= %s FROM jobs_workers", len(cmds), what="workers up")
        common.insert_ready(conn, n)
        _wait(conn, "SELECT count(*) = 0 FROM jobs WHERE status <> 'done'", what=f"{name} done")
    return drained(cluster, n, name)


def _wait(conn: psycopg.Connection[Any], sql: str, *args: Any, what: str) -> None:
    deadline = time.monotonic() + 600
    while not (row := conn.execute(sql, args or None).fetchone()) or not row[0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _ratio(per: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median([x / y for x, y in zip(per[a], per[b], strict=True)])


def report(r: dict[str, Any]) -> str:
    lines = [f"{'contender':<30} {'median jobs/s':>14}   per round (jobs handed back)"]
    for name, rates in r["jobs_per_s"].items():
        back = r["handed_back"][name]
        lines.append(
            f"{name:<30} {statistics.median(rates):>14,.0f}   "
            + ", ".join(f"{x:,.0f} ({b})" for x, b in zip(rates, back, strict=True))
        )
    for name, value in r["ratios"].items():
        lines.append(f"{name}: {value:.2f}x")
    return "\n".join(lines)
