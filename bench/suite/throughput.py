"""1 and 2: throughput of `jobq worker --burst`, against the ceilings.

Every contender drains the same freshly filled queue (TRUNCATE, N ready no-op
jobs, VACUUM ANALYZE, CHECKPOINT) and the rate comes from the database: N jobs divided by
max(finished_at) - min(started_at), the first claim to the last completion,
so interpreter start-up is not counted against anyone (the process wall time
is recorded too). Afterwards every job must be `done` with `attempts = 1`.

The ceilings run the same lease lifecycle: claim 10 with SKIP LOCKED
(committed on its own), then one fenced completion of exactly the claimed
(id, attempts) pairs, as two statements:

* pgbench: the worker's claim (the same SQL, LIMIT 10 written in) inside a
  CTE whose outer SELECT folds the claimed ids and attempts into two arrays,
  which `\\gset` hands to the client; the second statement is the worker's
  fenced `complete_many` of exactly those pairs. pgbench runs each statement
  in its own transaction (no BEGIN in the script), so the claim is committed
  before the completion starts, as in the worker.
* bench.loop: 8 threads of plain psycopg running the worker's own compiled
  statements, prepared, on autocommit connections.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import common
from ..common import BackendCPU, Bench

PGBENCH = "/usr/bin/pgbench"
CLIENTS = 8
BATCH = 10

PGBENCH_SCRIPT = """\
WITH next AS (
  SELECT id FROM jobs
  WHERE queue = 'default' AND status = 'queued' AND run_at <= now()
  ORDER BY priority DESC, run_at, id
  LIMIT 10
  FOR UPDATE SKIP LOCKED
), claimed AS (
  UPDATE jobs SET status = 'running', attempts = jobs.attempts + 1,
    locked_until = now() + interval '5 minutes', started_at = now()
  WHERE jobs.id = ANY (ARRAY(SELECT id FROM next))
  RETURNING jobs.id, jobs.task, jobs.queue, jobs.payload, jobs.attempts,
    jobs.max_attempts, jobs.locked_until
)
SELECT coalesce(array_agg(id), '{}') AS ids, coalesce(array_agg(attempts), '{}') AS att
FROM claimed
\\gset
UPDATE jobs SET status = 'done', locked_until = NULL, finished_at = now()
WHERE id = ANY (CAST(:ids AS bigint[]))
  AND attempts = (CAST(:att AS int[]))[array_position(CAST(:ids AS bigint[]), id)]
  AND status = 'running'
RETURNING id;
"""


@dataclass(frozen=True)
class Contender:
    name: str
    commands: Callable[[Bench, Path], list[list[str]]]
    task: str = "noop"


def _worker(
    procs: int, concurrency: int, log_level: str = "WARNING", *extra: str
) -> Callable[..., Any]:
    def commands(bench: Bench, tmp: Path) -> list[list[str]]:
        return [
            common.worker_command(
                bench, concurrency=concurrency, burst=True, log_level=log_level, extra=extra
            )
            for _ in range(procs)
        ]

    return commands


def _pgbench(bench: Bench, tmp: Path) -> list[list[str]]:
    script = tmp / "lifecycle.sql"
    script.write_text(PGBENCH_SCRIPT)
    # Enough transactions per client to drain the queue with some to spare;
    # the spare ones claim nothing and do not move max(finished_at).
    per_client = math.ceil(bench.sizes.throughput_jobs / (CLIENTS * BATCH) * 1.15) + 5
    return [
        [
            PGBENCH,
            "-n",
            "-M",
            "prepared",
            "-c",
            str(CLIENTS),
            "-j",
            "2",
            "-t",
            str(per_client),
            "-f",
            str(script),
            "-d",
            bench.dsn,
        ]
    ]


def _loop(batch: int) -> Callable[[Bench, Path], list[list[str]]]:
    def commands(bench: Bench, tmp: Path) -> list[list[str]]:
        return [[sys.executable, "-m", "bench.suite.loop", bench.dsn, str(CLIENTS), str(batch)]]

    return commands


CONTENDERS = [
    Contender("worker 1x8", _worker(1, 8)),
    Contender("worker 2x4", _worker(2, 4)),
    Contender("worker 1x8 async", _worker(1, 8), task="anoop"),
    Contender("worker 1x8 INFO", _worker(1, 8, "INFO")),
    # The cost or gain of freezing startup's objects out of the collector.
    Contender("worker 1x8 no gc freeze", _worker(1, 8, "WARNING", "--no-gc-freeze")),
    Contender("psycopg loop 8 threads", _loop(BATCH)),
    # Not a target: the same loop claiming 40, about what the worker's
    # prefetch makes its claims, to show how much of the gap is batch size.
    Contender("psycopg loop, claim 40", _loop(40)),
    Contender("pgbench -c 8 -j 2", _pgbench),
]


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    n = bench.sizes.throughput_jobs
    common.create_table(bench)
    per: dict[str, list[dict[str, float]]] = {c.name: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="jobq-bench-") as tmpdir:
        tmp = Path(tmpdir)
        # Untimed warm-up: caches, the first full-page writes, the OS page cache.
        common.fill(bench, min(n, 5_000))
        common.run_children(_worker(1, 8)(bench, tmp))
        for r in range(bench.rounds):
            for c in CONTENDERS:
                common.fill(bench, n, task=c.task)
                with BackendCPU(bench.name) as pg:
                    children = common.run_children(c.commands(bench, tmp))
                o = common.outcome(bench)
                common.require_all_done(o, c.name)
                sample = {
                    "jobs_per_s": o.rate,
                    "seconds": o.seconds,
                    "wall_s": max(f.wall for f in children),
                    "client_cpu_s_per_10k": sum(f.cpu for f in children) / n * 10_000,
                    "pg_cpu_s_per_10k": pg.seconds / n * 10_000,
                }
                if c.name.endswith("INFO"):
                    lines = sum(f.stderr.count("\n") for f in children)
                    sample["log_lines"] = lines
                per[c.name].append(sample)
                log(
                    f"  round {r + 1} {c.name:<24} {o.rate:>9,.0f} jobs/s  "
                    f"client {sample['client_cpu_s_per_10k']:.2f} s/10k  "
                    f"pg {sample['pg_cpu_s_per_10k']:.2f} s/10k"
                )
    return summarize(per, bench.rounds)


def summarize(per: dict[str, list[dict[str, float]]], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"contenders": {}, "ratios": {}}
    for name, samples in per.items():
        keys = samples[0].keys()
        out["contenders"][name] = {
            "median": {k: common.median([s[k] for s in samples]) for k in keys},
            "rounds": samples,
        }

    def per_round_ratio(a: str, b: str) -> float:
        return common.median(
            [common.ratio(per[a][i]["jobs_per_s"], per[b][i]["jobs_per_s"]) for i in range(rounds)]
        )

    for ours in ("worker 1x8", "worker 2x4", "worker 1x8 async", "worker 1x8 INFO"):
        out["ratios"][f"{ours} / psycopg loop"] = per_round_ratio(ours, "psycopg loop 8 threads")
        out["ratios"][f"{ours} / pgbench"] = per_round_ratio(ours, "pgbench -c 8 -j 2")
    out["ratios"]["worker 1x8 INFO / worker 1x8"] = per_round_ratio("worker 1x8 INFO", "worker 1x8")
    out["ratios"]["worker 1x8 / worker 1x8 no gc freeze"] = per_round_ratio(
        "worker 1x8", "worker 1x8 no gc freeze"
    )
    return out
