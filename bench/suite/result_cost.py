"""7: no-op throughput with results stored against the same tasks returning None.

Every round drains the same freshly filled queue (as in `throughput`) twice,
interleaved, with `jobq worker --burst -c 8`: once running `noop`, which
returns None (the completion is the plain batched `complete_many`), once
running `noop_result`, which returns a small dict (the same batched
completion carries the results as one more array, so no extra round trip).
The figure is the median of the per-round ratios of the two rates, each the
database's: jobs done / (max(finished_at) - min(started_at)). Afterwards
every job must be done once, and hold a result exactly when its task
returned one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import common
from ..common import Bench

WITHOUT = "returning None"
WITH = "returning a result"
CONTENDERS = {WITHOUT: "noop", WITH: "noop_result"}


def _drain(bench: Bench) -> common.Finished:
    [child] = common.run_children([common.worker_command(bench, concurrency=8, burst=True)])
    return child


def _require_results(bench: Bench, expected: int) -> None:
    with bench.connect() as conn:
        row = conn.execute(  # done jobs move to the archive as they complete
            f"SELECT count(*) FROM {common.with_archive('jobs', 'result')} "
            "WHERE result IS NOT NULL"
        ).fetchone()
    if row is None or row[0] != expected:
        raise RuntimeError(f"expected {expected} stored results, found {row and row[0]}")


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    n = bench.sizes.throughput_jobs
    common.create_table(bench)
    common.fill(bench, min(n, 5_000))  # untimed warm-up
    _drain(bench)
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(bench.rounds):
        # Rotated: always first, the plain one measured 0.70x to 0.78x where
        # alternating rounds gave 0.90x.
        for name in common.rotated(list(CONTENDERS), r):
            common.fill(bench, n, task=CONTENDERS[name])
            child = _drain(bench)
            o = common.outcome(bench)
            common.require_all_done(o, name)
            _require_results(bench, n if name == WITH else 0)
            rates[name].append(o.rate)
            cpu[name].append(child.cpu / n * 1e6)
            per_job = cpu[name][-1]
            log(f"  round {r + 1} {name:<20} {o.rate:>9,.0f} jobs/s {per_job:>6.1f} us CPU/job")
    return {
        "jobs_per_s": {name: common.median(samples) for name, samples in rates.items()},
        "cpu_us_per_job": {name: common.median(samples) for name, samples in cpu.items()},
        "rounds": rates,
        "cpu_rounds": cpu,
        "ratio": common.per_round(rates[WITH], rates[WITHOUT]),
        "cpu_ratio": common.per_round(cpu[WITH], cpu[WITHOUT]),
    }
