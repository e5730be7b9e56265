"""Tasks for the real `jobq worker` processes the tests start.

Run from this directory as `jobq worker workerapp:registry`. The queue table
is `JOBQ_TEST_TABLE` and the side table the handlers write their executions to
is `JOBQ_TEST_SIDE` (both created by the test). Each execution is recorded from
a connection of the handler's own (one per thread, autocommit, asynchronous
commit so 10,000 of them stay fast), never from the worker's connections.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import MetaData

from sqla_jobq import Registry, current_job, jobs_table
from sqla_jobq.db import conninfo

SIDE_DDL = """CREATE TABLE {side} (
  n       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  job_id  bigint NOT NULL,
  attempt int    NOT NULL,
  pid     int    NOT NULL,
  event   text   NOT NULL,
  info    jsonb,
  at      timestamptz NOT NULL DEFAULT clock_timestamp()
)"""

registry = Registry(jobs_table(MetaData(), os.environ.get("JOBQ_TEST_TABLE", "jobs")))
_local = threading.local()


def _connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(
            conninfo(os.environ["JOBQ_DATABASE_URL"]),
            autocommit=True,
            application_name="jobq test handler",
            options="-c synchronous_commit=off",
        )
        _local.conn = conn
    return conn


def record(event: str, info: Any = None) -> None:
    """One row in the side table for the running job (call from a handler)."""
    job = current_job()
    _connection().execute(
        f'INSERT INTO "{os.environ["JOBQ_TEST_SIDE"]}" (job_id, attempt, pid, event, info) '
        "VALUES (%s, %s, %s, %s, %s)",
        (job.id, job.attempts, os.getpid(), event, None if info is None else json.dumps(info)),
    )


def _job_info() -> dict[str, Any]:
    job = current_job()
    return {
        "id": job.id,
        "attempts": job.attempts,
        "queue": job.queue,
        "task": job.task,
        "payload": job.payload,
        "max_attempts": job.max_attempts,
    }


@registry.task(name="record")
def record_task(n: int = 0) -> None:
    """Records that it ran; nothing else."""
    record("ran")


@registry.task(name="sleep")
def sleep_task(seconds: float) -> None:
    """Default lease (5 min): records its start and its end."""
    record("started")
    time.sleep(seconds)
    record("finished")


@registry.task(name="short_lease", lease=timedelta(seconds=2))
def short_lease(seconds: float, only_attempt: int | None = None) -> None:
    """Sleeps on `only_attempt` (every attempt when None); a 2 s lease."""
    record("started")
    if only_attempt is None or current_job().attempts == only_attempt:
        time.sleep(seconds)
    record("finished")


@registry.task(name="heartbeat", lease=timedelta(seconds=1))
def heartbeat(seconds: float) -> None:
    """Runs four times its 1 s lease: only heartbeats keep it."""
    record("started")
    time.sleep(seconds)
    record("finished")


@registry.task(name="crash", lease=timedelta(seconds=1), max_attempts=3)
def crash() -> None:
    """Kills its own worker process, every time."""
    record("started")
    os.kill(os.getpid(), signal.SIGKILL)


@registry.task(name="whoami_sync", queue="other")
def whoami_sync(x: int) -> None:
    record("whoami", _job_info())


@registry.task(name="whoami_async")
async def whoami_async(x: int) -> None:
    await asyncio.sleep(0.01)
    info = _job_info()
    await asyncio.to_thread(record, "whoami", info)


@registry.task(name="boom")
def boom(message: str) -> None:
    raise ValueError(message)


@registry.task(name="switch_interval")
def switch_interval() -> float:
    """What the process's GIL switch interval is while a handler runs."""
    return sys.getswitchinterval()


@registry.task(name="startup_scanned")
def startup_scanned() -> dict[str, int | bool]:
    """How many objects the process froze, and whether the cyclic garbage
    collector still scans this module's registry, made at import."""
    return {
        "frozen": gc.get_freeze_count(),
        "registry_scanned": any(o is registry for o in gc.get_objects()),
    }


@registry.task(name="typed")
def typed(a: int, b: str) -> None:
    record("ran")
