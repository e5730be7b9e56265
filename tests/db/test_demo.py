"""`jobq demo`: each phase shows what it claims to show, and leaves nothing behind.

Sizes: with 8 workers the naive claim loses most jobs to duplicates (about
a quarter of 2,000 end done, one job taken 8 times, on 2 cores), because all
workers queue behind the same head row; a run with no duplicate at all would
need 2,000 claims in a row to never overlap, so the assertions have a wide
margin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import psycopg
import pytest

from sqla_jobq.db import conninfo
from sqla_jobq.demo import (
    Progress,
    RaceResult,
    Screen,
    demo_schema,
    run_demo,
    run_lease,
    run_naive,
    run_skip_locked,
    schema_exists,
)

JOBS = 2_000
WORKERS = 8
SHORT_LEASE = timedelta(milliseconds=300)
JOBQ_MAIN = "import sys; from sqla_jobq.cli import main; sys.argv[0] = 'jobq'; main()"
JOBQ = [sys.executable, "-c", JOBQ_MAIN]


def demo_schemas(url: str) -> list[str]:
    with psycopg.connect(conninfo(url)) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'jobq\\_demo\\_%'"
        ).fetchall()
    return [row[0] for row in rows]


@pytest.fixture
def no_leftovers(database_url: str) -> Iterator[None]:
    yield
    assert demo_schemas(database_url) == []


def test_naive_claim_hands_jobs_out_twice(database_url: str, no_leftovers: None) -> None:
    seen: list[int] = []
    with demo_schema(database_url) as table:
        result = run_naive(database_url, table, jobs=JOBS, workers=WORKERS, progress=seen.append)
    assert result.claims == JOBS
    assert result.done + result.queued == JOBS
    assert result.done < JOBS
    assert result.max_taken > 1
    assert result.taken_more_than_once > 0
    assert seen[-1] == JOBS


def test_skip_locked_does_every_job_once(database_url: str, no_leftovers: None) -> None:
    with demo_schema(database_url) as table:
        result = run_skip_locked(database_url, table, jobs=JOBS, workers=WORKERS)
    assert result == RaceResult(
        jobs=JOBS,
        workers=WORKERS,
        claims=JOBS,
        done=JOBS,
        queued=0,
        max_taken=1,
        taken_more_than_once=0,
        seconds=result.seconds,
    )
    assert result.done_per_second > 0


def test_lease_fences_out_the_stale_worker(database_url: str, no_leftovers: None) -> None:
    said: list[str] = []
    with demo_schema(database_url) as table:
        result = run_lease(database_url, table, lease=SHORT_LEASE, say=said.append)
    assert (result.stale_attempts, result.owner_attempts) == (1, 2)
    assert result.reaped == 1
    assert result.stale_rowcount == 0
    assert result.owner_rowcount == 1
    assert (result.final_status, result.final_attempts) == ("done", 2)
    assert list(result.steps) == said
    assert any("UPDATE 0" in line for line in said)


def test_run_demo_drops_its_schema(database_url: str, no_leftovers: None) -> None:
    result = run_demo(database_url, jobs=400, workers=4, lease=SHORT_LEASE)
    assert not schema_exists(database_url, result.schema)
    assert result.skip_locked.done == 400
    assert result.lease.stale_rowcount == 0


class Interrupting(Screen):
    """Raises from inside the naive race, as Ctrl-C would in the main thread."""

    schema = ""

    def start(self, server: str, schema: str, jobs: int, workers: int) -> None:
        self.schema = schema

    @contextmanager
    def naive(self, jobs: int, workers: int) -> Iterator[Progress]:
        def progress(done: int) -> None:
            raise KeyboardInterrupt

        yield progress


def test_ctrl_c_mid_race_drops_the_schema(database_url: str, no_leftovers: None) -> None:
    screen = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        run_demo(database_url, jobs=20_000, workers=4, screen=screen)
    assert screen.schema
    assert not schema_exists(database_url, screen.schema)


def test_cli_demo(database_url: str, no_leftovers: None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JOBQ_DATABASE_URL"}
    done = subprocess.run(
        [*JOBQ, "demo", "--jobs", "1000", "--workers", "4", "--database-url", database_url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "4 clients x 250 claims" in out
    assert "1,000 claims finished only" in out
    assert "1,000 of 1,000 jobs done, each exactly once" in out
    assert "attempts = 1: UPDATE 0" in out
    assert "attempts = 2: UPDATE 1" in out
    assert "job 1 done once, after 2 attempts" in out
    assert out.rstrip().endswith("dropped")
