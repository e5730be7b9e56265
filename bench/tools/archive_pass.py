"""`python -m bench.tools.archive_pass`: one archiver pass late in a held snapshot.

Not part of the suite. What resuming each batch past the last id the one before it moved
(`statements.archive_done`, through the done index) buys against batches that
each start from the beginning (`statements.archive`, the archiver before it), in the
state `bench.scenes held-snapshot` leaves a table in after minutes of a hold.
Two queue tables get the same `--jobs` queued jobs; another session takes a
REPEATABLE READ snapshot and holds it; every job is then claimed and
completed (two updates), and all but the last `--old` are moved out (deleted),
as earlier passes would have: the table holds the dead versions of every job,
none of which can be cleaned up, and `--old` done jobs old enough to move
behind them. Then one pass of `archiving.BATCH`-sized batches moves those
from each table to its archive, the order alternating between rounds.
Reported: the pass's time per kind, median of the rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import MetaData, Table

from sqla_jobq.archiving import BATCH
from sqla_jobq.db import compiled
from sqla_jobq.schema import jobs_table
from sqla_jobq.statements import FIRST_ID, archive, archive_done

from .. import common

Conn = psycopg.Connection[Any]
OLDER_THAN = timedelta(minutes=1)


def from_first_page(conn: Conn, table: str) -> int:
    """The archiver before: every batch starts from the beginning."""
    sql, params = compiled(archive(_jobs(table), **_batch(), statuses=["done"]))
    total = 0
    while (count := conn.execute(sql, params).rowcount) > 0:
        total += count
        if count < BATCH:
            break
    return total


def resumed(conn: Conn, table: str, older_than: timedelta = OLDER_THAN) -> int:
    """The archiver now: every batch starts past the last id the one before it moved."""
    sql, params = compiled(archive_done(_jobs(table), **_batch(older_than)))
    total = 0
    reached = FIRST_ID
    while True:
        row = conn.execute(sql, {**params, "after_id": reached}).fetchone()
        assert row is not None  # an aggregate: always one row
        count, reached = int(row[0]), row[1]
        total += count
        if count < BATCH:
            return total


def _jobs(table: str) -> Table:
    return jobs_table(MetaData(), name=table)


def _batch(older_than: timedelta = OLDER_THAN) -> dict[str, Any]:
    return {"older_than": older_than, "limit": BATCH, "skip_locked": True}


def _enqueue(conn: Conn, table: str, jobs: int) -> None:
    conn.execute(
        f"INSERT INTO {table} (payload, task) SELECT '{{}}', 'noop' FROM generate_series(1, %s)",
        (jobs,),
    )
    conn.execute(f"VACUUM ANALYZE {table}")


def _work(conn: Conn, table: str, old: int) -> None:
    """Claim and complete every job, as a worker would (one version each),
    then delete all but the last `old`, as earlier passes would have moved them."""
    conn.execute(f"UPDATE {table} SET status = 'running', attempts = 1, started_at = now()")
    conn.execute(f"UPDATE {table} SET status = 'done', finished_at = now() - interval '2 minutes'")
    conn.execute(f"DELETE FROM {table} WHERE id <= (SELECT max(id) FROM {table}) - %s", (old,))


def one_round(bench: common.Bench, jobs: int, old: int, first: str) -> dict[str, float]:
    kinds = {"from_first_page": from_first_page, "resumed": resumed}
    for name in kinds:
        common.create_table(bench, f"pass_{name}")
    out: dict[str, float] = {}
    with psycopg.connect(bench.dsn) as holder, bench.connect() as conn:
        for name in kinds:
            _enqueue(conn, f"pass_{name}", jobs)
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1 FROM pass_resumed LIMIT 1").fetchall()
        for name in kinds:
            _work(conn, f"pass_{name}", old)
        conn.execute("CHECKPOINT")
        for name in sorted(kinds, key=lambda k: k != first):
            started = time.perf_counter()
            moved = kinds[name](conn, f"pass_{name}")
            out[name] = time.perf_counter() - started
            if moved != old:
                raise RuntimeError(f"{name}: moved {moved:,} of {old:,} jobs")
        holder.rollback()
    for name in kinds:
        common.drop_table(bench, f"pass_{name}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.archive_pass", description=__doc__)
    parser.add_argument(
        "--jobs", type=int, default=1_000_000, help="jobs worked during the hold, per table"
    )
    parser.add_argument(
        "--old", type=int, default=35_000, help="of them, still to move (5 s at 7,000 jobs/s)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: list[dict[str, float]] = []
    with common.scratch_database(common.Sizes(), args.rounds) as bench:
        for r in range(args.rounds):
            first = "resumed" if r % 2 else "from_first_page"
            runs.append(one_round(bench, args.jobs, args.old, first))
            print(
                f"round {r + 1}: from the first page {runs[-1]['from_first_page']:.2f} s, "
                f"resumed {runs[-1]['resumed']:.2f} s",
                flush=True,
            )
    old = statistics.median(r["from_first_page"] for r in runs)
    new = statistics.median(r["resumed"] for r in runs)
    print(
        f"{args.old:,} of {args.jobs:,} jobs to move, batches of {BATCH:,}, a snapshot "
        f"held: a pass took "
        f"{old:.2f} s from the first page, {new:.2f} s resumed ({new / old:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
