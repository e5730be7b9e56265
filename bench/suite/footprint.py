"""6: the worker's memory and the database's CPU per job.

An idle `jobq worker -c 8` (not burst) starts on an empty queue; once it is
LISTENing, the CPU counters are read (the worker's, and those of every backend
of the scratch database except ours) and N no-op jobs arrive in one INSERT.
While it works, its VmRSS is sampled; when every job is done, the counters
are read again (the worker and its backends still alive, so nothing is lost
to sampling) along with VmHWM, the peak resident set. Then SIGTERM.

Right after the burst lands, the table is ANALYZEd, as autovacuum would soon
do: a table that has never had statistics gets a claim plan that sorts every
queued row (docs/benchmarks.md, "Findings").
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from .. import common
from ..common import Bench

MB = 1024 * 1024


def _round(bench: Bench) -> dict[str, Any]:
    n = bench.sizes.footprint_jobs
    with bench.connect() as conn:
        conn.execute("TRUNCATE jobs, jobs_archive")
    proc = subprocess.Popen(
        common.worker_command(bench, concurrency=8, burst=False, extra=["--poll-interval", "60"]),
        cwd=common.REPO,
        env=common.child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with bench.connect() as conn:
            me = common.own_backend_pid(conn)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND query ILIKE 'LISTEN%%'"
                ).fetchone()
                if row and row[0]:
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError("footprint worker did not start")
            time.sleep(0.2)
            worker_cpu0 = common.proc_cpu(proc.pid) or 0.0
            rss_idle = common.proc_status(proc.pid, "VmRSS") or 0
            pg = common.BackendCPU(bench.name, exclude=[me], interval=0.25)
            samples: list[tuple[int, int]] = []  # (jobs done, VmRSS)
            with pg:
                conn.execute(
                    "INSERT INTO jobs (task, payload) SELECT 'noop', '{}'::jsonb "
                    "FROM generate_series(1, %s)",
                    (n,),
                )
                # What autovacuum does soon after such a burst (this server
                # runs with autovacuum off): without statistics the claim's
                # plan sorts every queued row (see docs/benchmarks.md).
                conn.execute("ANALYZE jobs")
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    # Done jobs move to the archive as they complete (the default).
                    row = conn.execute(
                        f"SELECT count(*) FROM {common.with_archive('jobs', 'status')} "
                        "WHERE status = 'done'"
                    ).fetchone()
                    done = int(row[0]) if row else 0
                    samples.append((done, common.proc_status(proc.pid, "VmRSS") or 0))
                    if done >= n:
                        break
                    time.sleep(0.25)
                else:
                    raise RuntimeError("footprint worker did not finish in time")
            worker_cpu = (common.proc_cpu(proc.pid) or 0.0) - worker_cpu0
            hwm = common.proc_status(proc.pid, "VmHWM") or 0
        o = common.outcome(bench)
        common.require_all_done(o, "footprint worker")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    busy = [rss for done, rss in samples if n * 0.1 <= done < n]
    return {
        "jobs": n,
        "jobs_per_s": o.rate,
        "vmhwm_mb": hwm / MB,
        "rss_idle_mb": rss_idle / MB,
        "rss_min_mb": (min(busy) if busy else 0) / MB,
        "rss_max_mb": (max(busy) if busy else 0) / MB,
        "rss_by_progress_mb": _by_progress(samples, n),
        "pg_cpu_s_per_10k": pg.seconds / n * 10_000,
        "worker_cpu_s_per_10k": worker_cpu / n * 10_000,
    }


def _by_progress(samples: list[tuple[int, int]], n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pct in (10, 25, 50, 75, 100):
        at = [rss for done, rss in samples if done >= n * pct / 100]
        if at:
            out[f"{pct}%"] = round(at[0] / MB, 1)
    return out


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    common.create_table(bench)
    rounds = []
    for r in range(bench.rounds):
        result = _round(bench)
        rounds.append(result)
        log(
            f"  round {r + 1} {result['jobs']:,} jobs at {result['jobs_per_s']:,.0f}/s: "
            f"VmHWM {result['vmhwm_mb']:.1f} MB, RSS {result['rss_by_progress_mb']}, "
            f"postgres {result['pg_cpu_s_per_10k']:.2f} s/10k, "
            f"worker {result['worker_cpu_s_per_10k']:.2f} s/10k"
        )
    keys = (
        "jobs_per_s",
        "vmhwm_mb",
        "rss_idle_mb",
        "rss_min_mb",
        "rss_max_mb",
        "pg_cpu_s_per_10k",
        "worker_cpu_s_per_10k",
    )
    summary: dict[str, Any] = {k: common.median([r[k] for r in rounds]) for k in keys}
    summary["rss_growth_mb"] = common.median([r["rss_max_mb"] - r["rss_min_mb"] for r in rounds])
    summary["rounds"] = rounds
    return summary
