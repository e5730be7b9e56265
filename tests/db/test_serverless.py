"""An idle worker must let a serverless compute sleep: no queries while idle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import statements
from tests.support.rows import every_job

IDLE_WINDOW = 20.0

TASKS = textwrap.dedent(
    """
    import os
    from sqlalchemy import MetaData
    from sqla_jobq import Registry, jobs_table

    registry = Registry(jobs_table(MetaData(), os.environ["JOBQ_TEST_TABLE"]))

    @registry.task(name="noop")
    def noop() -> None:
        pass
    """
)


def _start_worker(
    tmp_path: Path, database_url: str, table: Table, *options: str
) -> subprocess.Popen[bytes]:
    """`jobq worker` on the idle tasks, at WARNING, with `options`."""
    (tmp_path / "idle_tasks.py").write_text(TASKS)
    env = dict(os.environ, JOBQ_TEST_TABLE=table.name, JOBQ_DATABASE_URL=database_url)
    command = [sys.executable, "-m", "sqla_jobq", "worker", "idle_tasks:registry", *options]
    return subprocess.Popen([*command, "--log-level", "WARNING"], cwd=tmp_path, env=env)


@pytest.fixture
def idle_worker(tmp_path: Path, database_url: str, table: Table) -> Iterator[int]:
    proc = _start_worker(tmp_path, database_url, table, "--poll-interval", "660")
    yield proc.pid
    proc.terminate()
    proc.wait(timeout=30)


def _worker_sessions(raw: psycopg.Connection[tuple[object, ...]], pid: int) -> dict[int, datetime]:
    rows = raw.execute(
        "SELECT pid, state_change FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"jobq worker %:{pid}",),
    ).fetchall()
    return {int(str(p)): s for p, s in rows if isinstance(s, datetime)}


def _asleep(raw: psycopg.Connection[tuple[object, ...]], pid: int) -> bool:
    """The worker's last act before sleeping was its next-`run_at` lookup (it
    follows the start-up claim), and that session is idle since."""
    rows = raw.execute(
        "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE %s "
        "AND state = 'idle' AND query LIKE %s",
        (f"jobq worker %:{pid}", "%min(%run_at)%"),
    ).fetchall()
    return bool(rows)


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_idle_worker_sends_no_query_and_still_starts_a_new_job_at_once(
    idle_worker: int, raw: psycopg.Connection[tuple[object, ...]], engine: Engine, table: Table
) -> None:
    _wait_for(lambda: len(_worker_sessions(raw, idle_worker)) >= 2, 30)
    time.sleep(2.0)  # let start-up queries (reap, first claim, next_run_at) settle
    before = _worker_sessions(raw, idle_worker)
    time.sleep(IDLE_WINDOW)
    after = _worker_sessions(raw, idle_worker)
    assert after == before, "an idle worker touched the database"

    with engine.begin() as conn:
        job_id = conn.execute(statements.enqueue(table, "noop", {})).scalar_one()
    enqueued = time.monotonic()

    def done() -> bool:
        row = raw.execute(
            f"SELECT status FROM {every_job(table, 'id, status')} WHERE id = %s", (job_id,)
        ).fetchone()
        return row is not None and row[0] == "done"

    _wait_for(done, 10)
    assert time.monotonic() - enqueued < 2.0, "LISTEN should start the job at once, not the poll"


LAZY_POLL = 30.0


@pytest.fixture
def lazy_worker(tmp_path: Path, database_url: str, table: Table) -> Iterator[int]:
    proc = _start_worker(
        tmp_path, database_url, table, "--poll-interval", str(LAZY_POLL), "--reconnect", "lazy"
    )
    yield proc.pid
    proc.terminate()
    proc.wait(timeout=30)


def test_lazy_worker_cut_off_while_idle_reconnects_only_at_its_next_poll(
    lazy_worker: int, raw: psycopg.Connection[tuple[object, ...]], engine: Engine, table: Table
) -> None:
    """A suspended serverless compute closes every connection; a lazy worker
    must not wake it by reconnecting, only at its next poll, and then catch up."""
    _wait_for(lambda: _asleep(raw, lazy_worker), 30)
    time.sleep(0.5)
    cut = time.monotonic()
    killed = set(_worker_sessions(raw, lazy_worker))
    raw.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"jobq worker %:{lazy_worker}",),
    )
    _wait_for(lambda: not set(_worker_sessions(raw, lazy_worker)) & killed, 10)
    while time.monotonic() - cut < IDLE_WINDOW:
        assert not _worker_sessions(raw, lazy_worker), "the worker reconnected while idle"
        time.sleep(0.5)

    with engine.begin() as conn:
        job_id = conn.execute(statements.enqueue(table, "noop", {})).scalar_one()

    def done() -> bool:
        row = raw.execute(
            f"SELECT status FROM {every_job(table, 'id, status')} WHERE id = %s", (job_id,)
        ).fetchone()
        return row is not None and row[0] == "done"

    _wait_for(done, LAZY_POLL)  # nobody listened: the next poll finds it
    assert _worker_sessions(raw, lazy_worker), "connections are back after the poll"
