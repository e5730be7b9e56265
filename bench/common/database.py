"""The scratch database the benchmarks run in, its queue table, and what became of its jobs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names

SERVER_URL = os.environ.get(
    "JOBQ_BENCH_SERVER_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


@dataclass
class Sizes:
    """Problem sizes; `--quick` shrinks them all."""

    throughput_jobs: int = 20_000
    latency_jobs: int = 200
    latency_gap: float = 0.015
    enqueue_jobs: int = 100_000
    single_enqueues: int = 300
    history_rows: int = 1_000_000
    history_cycles: int = 400
    footprint_jobs: int = 100_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            throughput_jobs=3_000,
            latency_jobs=40,
            latency_gap=0.01,
            enqueue_jobs=10_000,
            single_enqueues=50,
            history_rows=50_000,
            history_cycles=100,
            footprint_jobs=5_000,
        )


@dataclass
class Bench:
    """The scratch database one `python -m bench` run works in."""

    name: str
    url: str
    sizes: Sizes
    rounds: int
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        return conninfo(self.url)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)


@contextmanager
def scratch_database(sizes: Sizes, rounds: int) -> Iterator[Bench]:
    name = f"jobq_bench_{os.getpid()}"
    admin = conninfo(SERVER_URL)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = parse_url(SERVER_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield Bench(name, url, sizes, rounds)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_table(bench: Bench, name: str = "jobs") -> None:
    names = Names(name, None)
    with bench.connect() as conn:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (names.qualified,)).fetchone()
        if exists and exists[0]:
            for sql in down_statements(names, LATEST, 0):
                conn.execute(sql.encode())
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())


def drop_table(bench: Bench, name: str) -> None:
    with bench.connect() as conn:
        for sql in down_statements(Names(name, None), LATEST, 0):
            conn.execute(sql.encode())


def fill(bench: Bench, count: int, *, task: str = "noop", table: str = "jobs") -> None:
    """A fresh queue: TRUNCATE, `count` ready no-op jobs, VACUUM ANALYZE, CHECKPOINT.

    Every contender starts from exactly this state (the CHECKPOINT too: after
    one, the first change to each page writes the whole page to the WAL, and a
    checkpoint falling inside one contender's run would cost it alone).
    """
    with bench.connect() as conn:
        conn.execute(f"TRUNCATE {table}, {table}_archive")
        insert_ready(conn, count, task=task, table=table)
        conn.execute(f"VACUUM ANALYZE {table}")
        conn.execute("CHECKPOINT")


def insert_ready(
    conn: psycopg.Connection[Any], count: int, *, task: str = "noop", table: str = "jobs"
) -> None:
    """`count` ready jobs of `task` with empty payloads, in one INSERT."""
    conn.execute(
        f"INSERT INTO {table} (task, payload, run_at) "
        "SELECT %s, '{}'::jsonb, now() - interval '1 second' FROM generate_series(1, %s)",
        (task, count),
    )


@dataclass(frozen=True)
class Outcome:
    """What the database says about one drain of the queue."""

    total: int
    done_once: int
    seconds: float  # min(started_at) .. max(finished_at)

    @property
    def rate(self) -> float:
        return self.done_once / self.seconds if self.seconds > 0 else 0.0


def with_archive(table: str = "jobs", columns: str = "*") -> str:
    """The jobs table and its archive as one relation (for FROM): workers move
    done jobs there as they complete (by default) or after `--archive-after`,
    and a drain or a scene read back from the rows must count them."""
    return (
        f"(SELECT {columns} FROM {table} "
        f"UNION ALL SELECT {columns} FROM {table}_archive) AS {table}"
    )


FINISHED_COLUMNS = (
    "id, status, attempts, max_attempts, created_at, started_at, finished_at"
)


def outcome(bench: Bench, table: str = "jobs") -> Outcome:
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'done' AND attempts = 1), "
            "extract(epoch FROM max(finished_at) - min(started_at)) "
            f"FROM {with_archive(table, FINISHED_COLUMNS)}"
        ).fetchone()
    assert row is not None
    return Outcome(int(row[0]), int(row[1]), float(row[2] or 0.0))


def require_all_done(o: Outcome, what: str) -> None:
    if o.done_once != o.total:
        raise RuntimeError(
            f"{what}: only {o.done_once} of {o.total} jobs are done with attempts = 1"
        )


def own_backend_pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])
