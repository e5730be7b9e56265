"""`python -m bench.tools.soak`: does the jobs table level off under steady work?

A queue table takes an insert and three dead row versions per job (claim,
completion, deletion), so it is the first table to bloat. With pruning on and
autovacuum allowed to work, its size must stop growing with the number of jobs
processed. This script enqueues at a fixed rate while a `jobq worker` with
`--prune-older-than` works the jobs, and prints the table's size and
`n_dead_tup` every minute.

It runs on a throwaway cluster of its own (tests/support/cluster.py: initdb as
the `postgres` user, on a free port, PostgreSQL's default settings): the shared
development server has autovacuum turned off, which no production server should.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg

from sqla_jobq import jobs, statements
from sqla_jobq.db import conninfo
from tests.support.cluster import throwaway_cluster

from ..common import REPO


@dataclass
class Sample:
    minute: int
    enqueued: int
    finished: int
    backlog: int
    rows: int
    dead_tuples: int
    table_bytes: int
    total_bytes: int
    autovacuums: int


class Enqueuer(threading.Thread):
    """Enqueues `rate` no-op jobs a second, in ten small transactions a second."""

    def __init__(self, url: str, rate: int) -> None:
        super().__init__(daemon=True)
        self.url, self.rate = url, rate
        self.count = 0
        self.stop = threading.Event()

    def run(self) -> None:
        per_tick = max(1, self.rate // 10)
        rows = [statements.NewJob("noop", {}) for _ in range(per_tick)]
        stmt = statements.enqueue_many(jobs, rows).compile(dialect=_dialect())
        sql, params = stmt.string, stmt.params
        with psycopg.connect(conninfo(self.url), autocommit=True) as conn:
            next_tick = time.monotonic()
            while not self.stop.is_set():
                conn.execute(sql, params)
                self.count += per_tick
                next_tick += 0.1
                time.sleep(max(0.0, next_tick - time.monotonic()))


def _dialect() -> object:
    from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

    return pg_psycopg.dialect()  # type: ignore[no-untyped-call]


def _sample(conn: psycopg.Connection[tuple[object, ...]], minute: int, enq: Enqueuer) -> Sample:
    row = conn.execute(
        """
        SELECT n_live_tup, n_dead_tup, autovacuum_count,
               pg_relation_size('jobs'), pg_total_relation_size('jobs'),
               (SELECT count(*) FROM jobs WHERE status IN ('queued', 'running'))
        FROM pg_stat_user_tables WHERE relname = 'jobs'
        """
    ).fetchone()
    assert row is not None
    live, dead, vacuums, table_bytes, total_bytes, backlog = (int(str(v)) for v in row)
    return Sample(
        minute, enq.count, enq.count - backlog, backlog, live, dead, table_bytes, total_bytes,
        vacuums,
    )


def _worker(url: str, prune_after: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, JOBQ_DATABASE_URL=url)
    return subprocess.Popen(
        [sys.executable, "-m", "sqla_jobq", "worker", "bench.tasks:registry", "-c", "4",
         "--queue", "default", "--prune-older-than", prune_after, "--prune-interval", "30",
         "--log-level", "WARNING"],
        cwd=REPO,
        env=env,
    )


def soak(minutes: int, rate: int, prune_after: str, every: float = 60.0) -> list[Sample]:
    samples: list[Sample] = []
    with throwaway_cluster(settings=(), stop_mode="fast") as cluster:
        url = cluster.url
        subprocess.run([sys.executable, "-m", "sqla_jobq", "migrate", "--database-url", url],
                       check=True, capture_output=True)
        worker = _worker(url, prune_after)
        enqueuer = Enqueuer(url, rate)
        enqueuer.start()
        try:
            with psycopg.connect(conninfo(url), autocommit=True) as conn:
                for minute in range(1, minutes + 1):
                    time.sleep(every)
                    samples.append(_sample(conn, minute, enqueuer))
                    print(_line(samples[-1]), flush=True)
        finally:
            enqueuer.stop.set()
            enqueuer.join()
            worker.terminate()
            worker.wait(60)
    return samples


HEADER = (
    f"{'min':>4} {'enqueued':>10} {'finished':>10} {'backlog':>8} {'rows':>8} "
    f"{'n_dead_tup':>10} {'table MB':>9} {'total MB':>9} {'autovac':>8}"
)


def _line(s: Sample) -> str:
    mb = 1024 * 1024
    return (
        f"{s.minute:>4} {s.enqueued:>10,} {s.finished:>10,} {s.backlog:>8,} {s.rows:>8,} "
        f"{s.dead_tuples:>10,} {s.table_bytes / mb:>9.1f} {s.total_bytes / mb:>9.1f} "
        f"{s.autovacuums:>8}"
    )


def verdict(samples: list[Sample]) -> str:
    """Levelled off: the last third's peak is within 20% of the middle third's."""
    third = max(1, len(samples) // 3)
    middle = max(s.total_bytes for s in samples[third : 2 * third] or samples)
    last = max(s.total_bytes for s in samples[-third:])
    ratio = last / middle if middle else float("inf")
    state = "levelled off" if ratio <= 1.2 else "still growing"
    return f"total size, peak of last third / peak of middle third = {ratio:.2f}: {state}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.soak", description=__doc__)
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--rate", type=int, default=200, help="jobs enqueued per second")
    parser.add_argument("--prune-older-than", default="60s")
    parser.add_argument("--sample-seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "soak.json"))
    args = parser.parse_args()
    print(f"soak: {args.minutes} min at {args.rate} jobs/s, worker -c 4 pruning jobs finished "
          f"over {args.prune_older_than} ago every 30 s; throwaway cluster, default settings")
    print(HEADER, flush=True)
    samples = soak(args.minutes, args.rate, args.prune_older_than, args.sample_seconds)
    print(verdict(samples))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"samples": [asdict(s) for s in samples],
                               "verdict": verdict(samples)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
