"""`python -m bench.tools.archive_at_completion`: what moving each job to the
archive as it completes (`--archive-after 0`, `statements.complete_to_archive`)
costs a drain, against completing in place and moving later (`60s`, the
default before).

Not part of the suite. On a throwaway cluster (PostgreSQL's default
settings), rounds alternate which kind goes first. Each kind fills the queue
with `--jobs` ready no-op jobs and drains it with `jobq worker -c 8 --burst`;
the rate is the server's (first claim to last completion). In place, the
drain leaves its jobs `done` in the jobs table for a pass to move a minute
later, work a drain's clock never sees, so that pass is run and timed too
(`bench.tools.archive_pass.resumed`: `statements.archive_done` in batches
of `archiving.BATCH`, as the archiver runs them) and the in-place kind is
also reported with it: the same work done both ways. Reported: each
figure's median over the rounds, and the ratios.

`--done-index-cost` instead measures what the done index (schema version 9)
costs the completions that put entries in it: in-place drains with it
against the same drains with it dropped, the order alternating by round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta

from sqlalchemy import MetaData
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateIndex

from sqla_jobq.schema import jobs_table, names_of

from .. import common
from ..scenes import base
from . import archive_pass as archive_pass_tool

KINDS = {"in_place": "60s", "at_completion": "0"}


def drain(cluster: base.Cluster, jobs: int, archive_after: str) -> float:
    """Seconds from the first claim to the last completion of `jobs` no-op jobs."""
    bench = cluster.bench()
    common.fill(bench, jobs)
    cmd = base.worker_cmd(cluster.url(), 8, "--archive-after", archive_after, burst=True)
    common.run_children([cmd], timeout=600)
    outcome = common.outcome(bench)
    common.require_all_done(outcome, f"drain with --archive-after {archive_after}")
    return outcome.seconds


def archive_pass(cluster: base.Cluster, jobs: int) -> float:
    """Seconds for one archiver pass to move the `jobs` done jobs a drain left."""
    with cluster.connect() as conn:
        started = time.perf_counter()
        moved = archive_pass_tool.resumed(conn, "jobs", older_than=timedelta(0))
        seconds = time.perf_counter() - started
    if moved != jobs:
        raise RuntimeError(f"the pass moved {moved:,} of {jobs:,} jobs")
    return seconds


def one_round(cluster: base.Cluster, jobs: int, first: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind in sorted(KINDS, key=lambda k: k != first):
        out[kind] = jobs / drain(cluster, jobs, KINDS[kind])
        if kind == "in_place":
            seconds = jobs / out[kind] + archive_pass(cluster, jobs)
            out["in_place_with_pass"] = jobs / seconds
    return out


@contextmanager
def without_done_index(cluster: base.Cluster) -> Iterator[None]:
    """The jobs table without its done index, rebuilt from the schema after."""
    jobs = jobs_table(MetaData())
    (index,) = (i for i in jobs.indexes if i.name == names_of(jobs).done_index)
    with cluster.connect() as conn:
        conn.execute(f'DROP INDEX "{index.name}"')
    try:
        yield
    finally:
        with cluster.connect() as conn:
            conn.execute(str(CreateIndex(index).compile(dialect=postgresql.dialect())))


def done_index_round(cluster: base.Cluster, jobs: int, first: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind in sorted(("with", "without"), key=lambda k: k != first):
        with nullcontext() if kind == "with" else without_done_index(cluster):
            out[kind] = jobs / drain(cluster, jobs, KINDS["in_place"])
    return out


def done_index_cost(jobs: int, rounds: int) -> int:
    runs: list[dict[str, float]] = []
    with base.throwaway_cluster() as cluster:
        for n in range(rounds):
            first = "with" if n % 2 == 0 else "without"
            runs.append(done_index_round(cluster, jobs, first))
            print(
                f"round {n + 1} ({first} first): in place with the done index "
                f"{runs[-1]['with']:,.0f} jobs/s, without {runs[-1]['without']:,.0f}",
                flush=True,
            )
    ratios = [r["with"] / r["without"] for r in runs]
    print(
        f"median of {rounds} rounds of {jobs:,} jobs, -c 8 --burst, completed in place: "
        f"with the done index {statistics.median(ratios):.2f}x of without it "
        f"(per round {', '.join(f'{x:.2f}x' for x in ratios)})"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tools.archive_at_completion", description=__doc__
    )
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--done-index-cost",
        action="store_true",
        help="in-place drains with the done index against the same without it",
    )
    args = parser.parse_args()
    if args.done_index_cost:
        return done_index_cost(args.jobs, args.rounds)
    rounds: list[dict[str, float]] = []
    with base.throwaway_cluster() as cluster:
        for n in range(args.rounds):
            first = "in_place" if n % 2 == 0 else "at_completion"
            rounds.append(one_round(cluster, args.jobs, first))
            print(
                f"round {n + 1} ({first} first): "
                + ", ".join(f"{k} {v:,.0f} jobs/s" for k, v in rounds[-1].items()),
                flush=True,
            )
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    at = median["at_completion"]
    print(
        f"median of {args.rounds} rounds of {args.jobs:,} jobs, -c 8 --burst: at completion "
        f"{at:,.0f} jobs/s; in place {median['in_place']:,.0f} (at completion "
        f"{at / median['in_place']:.2f}x), in place with its archiver pass "
        f"{median['in_place_with_pass']:,.0f} ({at / median['in_place_with_pass']:.2f}x)"
    )
    result = {"jobs": args.jobs, "rounds": rounds, "median": median}
    common.dump_json(common.REPO / "bench" / "results" / "archive-at-completion.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
