"""Pauses and concurrency limits hold across real `jobq worker` processes.

The handlers (tests/support/workerapp.py, task `sleep`) record their start and end
in a side table from connections of their own; the limit is checked on those
times, so it is what the handlers saw, not what the workers believed.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import client
from sqla_jobq import queue_statements as qs
from sqla_jobq.statements import NewJob
from tests.db.test_worker import WorkerProcess, events, wait_idle
from tests.support import APP_DIR
from tests.support.processes import JOBQ
from tests.support.rows import every_job
from tests.support.waiting import wait_until
from tests.support.workerapp import SIDE_DDL

Raw = psycopg.Connection[Any]
Start = Any  # (*args: str) -> WorkerProcess


@pytest.fixture
def side(raw: Raw, table: Table) -> Iterator[str]:
    name = f"{table.name}_side"
    raw.execute(SIDE_DDL.format(side=f'"{name}"'))
    yield name
    raw.execute(f'DROP TABLE IF EXISTS "{name}"')


@pytest.fixture
def start(database_url: str, table: Table, side: str, tmp_path: Path) -> Iterator[Start]:
    """Start `jobq worker workerapp:registry ARGS...`; all are stopped at teardown."""
    started: list[WorkerProcess] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBQ_")}
    env.update(
        JOBQ_DATABASE_URL=database_url,
        JOBQ_TEST_TABLE=table.name,
        JOBQ_TEST_SIDE=side,
        PYTHONUNBUFFERED="1",
    )

    def run(*args: str) -> WorkerProcess:
        log_path = tmp_path / f"worker{len(started)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [JOBQ, "worker", "workerapp:registry", "--log-level", "WARNING", *args],
                cwd=APP_DIR,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append(WorkerProcess(proc, log_path))
        return started[-1]

    yield run
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(timeout=30)


def statuses(raw: Raw, table: Table) -> dict[str, int]:
    return dict(
        raw.execute(
            f"SELECT status, count(*) FROM {every_job(table, 'status')} GROUP BY 1"
        ).fetchall()
    )


def most_at_once(raw: Raw, side: str) -> int:
    """The most handlers running at one instant, from their recorded start and end."""
    row = raw.execute(
        f"""WITH spans AS (
              SELECT job_id, min(at) FILTER (WHERE event = 'started') AS s,
                     max(at) FILTER (WHERE event = 'finished') AS f
              FROM "{side}" GROUP BY job_id)
            SELECT max((SELECT count(*) FROM spans o WHERE o.s <= x.s AND x.s < o.f))
            FROM spans x"""
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_four_workers_of_four_slots_never_run_more_than_a_limit_of_2_and_run_every_job(
    engine: Engine, table: Table, raw: Raw, side: str, start: Start
) -> None:
    with engine.begin() as conn:
        conn.execute(qs.set_concurrency_limit(table, "default", 2))
    workers = [start("-c", "4", "--poll-interval", "0.5") for _ in range(4)]
    with engine.begin() as conn:  # all at once: every worker is woken and races
        ids = client.enqueue_many(conn, table, [NewJob("sleep", {"seconds": 0.2})] * 16)

    wait_until(lambda: statuses(raw, table) == {"done": 16}, 120, "all 16 jobs done")
    for worker in workers:
        assert "ERROR" not in worker.log(), worker.log()
    ran = events(raw, side)
    assert sorted(e["job_id"] for e in ran if e["event"] == "started") == sorted(ids)
    assert sorted(e["job_id"] for e in ran if e["event"] == "finished") == sorted(ids)
    assert {e["attempt"] for e in ran} == {1}
    assert most_at_once(raw, side) == 2


def test_a_worker_started_after_a_pause_takes_nothing_until_resumed(
    engine: Engine, table: Table, raw: Raw, side: str, start: Start
) -> None:
    with engine.begin() as conn:
        conn.execute(qs.pause(table, "default"))
        ids = [client.enqueue(conn, table, "record", {"n": n}) for n in range(3)]
    worker = start("-c", "2")
    wait_idle(raw, worker)  # it has claimed (nothing) and gone to sleep
    assert statuses(raw, table) == {"queued": 3} and events(raw, side) == []

    with engine.begin() as conn:
        conn.execute(qs.resume(table, "default"))
    wait_until(lambda: statuses(raw, table) == {"done": 3}, 60, "the 3 jobs done")
    assert sorted(e["job_id"] for e in events(raw, side)) == ids
