"""The cost of watching a worker: no-op throughput with observers vs without.

The same drain as bench.throughput's "worker 1x8" (N ready no-op jobs, rate
from the database's first start to last finish), run three ways in
interleaved rounds, each a ratio against the plain worker of the same round:

* `--metrics-port`: the Prometheus observer, its hooks on every job
  (goal: at least 0.95x);
* `--otel` with no tracer provider configured: what the OpenTelemetry
  observer costs an app that does not trace (the API's no-op spans), which
  is why `jobq worker` only turns it on by itself for an app that configured
  a provider.

The worker's own CPU time per job is recorded beside the rate: on a shared
machine it drifts less than the rate does.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from .. import common
from ..common import Bench

CONCURRENCY = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CONTENDERS: dict[str, Callable[[], list[str]]] = {
    "worker 1x8": lambda: ["--no-otel"],
    "worker 1x8 --metrics-port": lambda: ["--no-otel", "--metrics-port", str(_free_port())],
    "worker 1x8 --otel (no provider)": lambda: ["--otel"],
}
BASELINE = "worker 1x8"


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    n = bench.sizes.throughput_jobs
    common.create_table(bench)
    common.fill(bench, min(n, 5_000))  # untimed warm-up
    common.run_children([common.worker_command(bench, concurrency=CONCURRENCY, burst=True)])
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for r in range(bench.rounds):
        # Rotated, so none always runs on the table the others left behind
        # (the shared server has no autovacuum).
        for name in common.rotated(list(CONTENDERS), r):
            extra = CONTENDERS[name]
            common.fill(bench, n)
            cmd = common.worker_command(bench, concurrency=CONCURRENCY, burst=True, extra=extra())
            [child] = common.run_children([cmd])
            o = common.outcome(bench)
            common.require_all_done(o, name)
            rates[name].append(o.rate)
            cpu[name].append(child.cpu / n * 1e6)
            per_job = cpu[name][-1]
            log(f"  round {r + 1} {name:<32} {o.rate:>9,.0f} jobs/s {per_job:>6.1f} us CPU/job")
    return {
        "jobs_per_s": {name: common.median(v) for name, v in rates.items()},
        "cpu_us_per_job": {name: common.median(v) for name, v in cpu.items()},
        "rounds": {"jobs_per_s": rates, "cpu_us_per_job": cpu},
        "ratios": _per_round(rates),
        "cpu_ratios": _per_round(cpu),
    }


def _per_round(values: dict[str, list[float]]) -> dict[str, float]:
    """Each contender over the plain worker of the same round; the median."""
    baseline = values[BASELINE]
    return {name: common.per_round(v, baseline) for name, v in values.items() if name != BASELINE}
