"""6: claim throughput on a queue limited to 64 against the same queue unlimited.

A limit is enforced inside the claim: claimers of a limited queue take turns
on that queue's lock, each holding it until its claim commits (see
`statements.claim`). That serialisation is the cost measured here. Every
round drains the same freshly filled queue (as in `throughput`) once per run
below, interleaved, and each figure is a ratio of two runs of that round:

* worker 2x8: two `jobq worker --burst -c 8 --prefetch 0` processes, limited
  to 64 / unlimited. They hold at most 32 jobs, so the limit never binds: the
  figure is the lock's cost alone, as a deployment with fewer slots than its
  limit pays it. (With the default prefetch one worker claims all 64 slots
  ahead, and a burst worker stops at its first empty claim.)
* pgbench -c 8: eight clients claiming 10 (the worker's own claim statement,
  values written in) and completing them, nothing in between, limited to 64 /
  unlimited: every claim contends for the queue's lock and 80 > 64 makes the
  limit bind. The worst case, not a target.
* the same pgbench, unlimited, with the claim as it was before queue settings
  (`throughput.PGBENCH_SCRIPT`) against today's: what the check costs a queue
  with no setting.

The rate is the database's: jobs done / (max(finished_at) - min(started_at)).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, func, literal_column, select
from sqlalchemy.dialects import postgresql

from sqla_jobq import jobs
from sqla_jobq import queue_statements as qs
from sqla_jobq.driver import Compiled
from sqla_jobq.statements import claim

from .. import common
from ..common import Bench
from .throughput import PGBENCH, PGBENCH_SCRIPT

LIMIT = 64
CLIENTS = 8
BATCH = 10

COMPLETE = """\
UPDATE jobs SET status = 'done', locked_until = NULL, finished_at = now()
WHERE id = ANY (CAST(:ids AS bigint[]))
  AND attempts = (CAST(:att AS int[]))[array_position(CAST(:ids AS bigint[]), id)]
  AND status = 'running';
"""


def pgbench_script() -> str:
    """The worker's claim with its values written in, its ids and attempts
    folded into two arrays for `\\gset`, then the fenced completion."""
    claimed = claim(jobs, queue="default", limit=BATCH).cte("claimed")
    empty: ColumnElement[Any] = literal_column("'{}'")
    fold = select(
        func.coalesce(func.array_agg(claimed.c.id), empty).label("ids"),
        func.coalesce(func.array_agg(claimed.c.attempts), empty).label("att"),
    )
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    sql = fold.compile(dialect=dialect, compile_kwargs={"literal_binds": True})
    return f"{sql}\n\\gset\n{COMPLETE}"


Commands = Callable[[Bench, Path], list[list[str]]]


def _pgbench(script: str) -> Commands:
    def commands(bench: Bench, tmp: Path) -> list[list[str]]:
        path = tmp / "claim.sql"
        path.write_text(script)
        # Spare transactions: a claim capped by the limit takes fewer than 10,
        # and the spare ones, claiming nothing, do not move max(finished_at).
        per_client = math.ceil(bench.sizes.throughput_jobs / (CLIENTS * BATCH) * 1.5) + 5
        options = ["-n", "-M", "prepared", "-c", str(CLIENTS), "-j", "2", "-t", str(per_client)]
        return [[PGBENCH, *options, "-f", str(path), "-d", bench.dsn]]

    return commands


def _workers(bench: Bench, tmp: Path) -> list[list[str]]:
    no_prefetch = ("--prefetch", "0")
    return [
        common.worker_command(bench, concurrency=8, burst=True, extra=no_prefetch)
        for _ in range(2)
    ]


@dataclass(frozen=True)
class Run:
    name: str
    limit: int | None
    commands: Commands


RUNS = (
    Run("worker 2x8, unlimited", None, _workers),
    Run(f"worker 2x8, limit {LIMIT}", LIMIT, _workers),
    Run("pgbench -c 8, unlimited", None, _pgbench(pgbench_script())),
    Run(f"pgbench -c 8, limit {LIMIT}", LIMIT, _pgbench(pgbench_script())),
    Run("pgbench -c 8, claim without settings", None, _pgbench(PGBENCH_SCRIPT)),
)
# figure: (ours, baseline, target)
FIGURES = {
    f"limit {LIMIT} vs unlimited, worker 2x8": (RUNS[1].name, RUNS[0].name, ">= 0.8x"),
    f"limit {LIMIT} vs unlimited, pgbench -c 8": (RUNS[3].name, RUNS[2].name, "(worst case)"),
    "unlimited: claim with settings vs without, pgbench -c 8": (
        RUNS[2].name,
        RUNS[4].name,
        "(cost of the check)",
    ),
}


def _set_limit(bench: Bench, limit: int | None) -> None:
    stmt = Compiled.of(qs.set_concurrency_limit(jobs, "default", limit))
    with bench.connect() as conn:
        conn.execute(stmt.sql, stmt.params())


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    n = bench.sizes.throughput_jobs
    common.create_table(bench)
    rates: dict[str, list[float]] = {r.name: [] for r in RUNS}
    with tempfile.TemporaryDirectory(prefix="jobq-bench-") as tmpdir:
        tmp = Path(tmpdir)
        common.fill(bench, min(n, 5_000))  # untimed warm-up
        common.run_children(_workers(bench, tmp))
        for r in range(bench.rounds):
            for each in RUNS:
                common.fill(bench, n)
                _set_limit(bench, each.limit)
                common.run_children(each.commands(bench, tmp))
                o = common.outcome(bench)
                common.require_all_done(o, each.name)
                rates[each.name].append(o.rate)
                log(f"  round {r + 1} {each.name:<38} {o.rate:>9,.0f} jobs/s")
    _set_limit(bench, None)
    return summarize(rates, bench.rounds)


def summarize(rates: dict[str, list[float]], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs_per_s": {}, "figures": {}}
    for name, samples in rates.items():
        out["jobs_per_s"][name] = {"median": common.median(samples), "rounds": samples}
    for figure, (ours, base, target) in FIGURES.items():
        per_round = [common.ratio(rates[ours][i], rates[base][i]) for i in range(rounds)]
        out["figures"][figure] = {
            "ours": common.median(rates[ours]),
            "baseline": common.median(rates[base]),
            "ratio": common.median(per_round),
            "ratios": per_round,
            "target": target,
        }
    return out
