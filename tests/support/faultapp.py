"""Tasks for the fault suite's `jobq worker faultapp:registry` processes.

Configured by environment variables, set by `Workers.env` in tests/support/processes.py:

* ``JOBQ_FAULT_TABLE``: the queue table (built with `jobs_table`, as an app would);
* ``JOBQ_FAULT_DSN``: a direct PostgreSQL URL for the side-effect table (never the
  pooler, so the side effects are counted on the real server);
* ``JOBQ_FAULT_LEASE``: the tasks' lease in seconds (default 2);
* ``JOBQ_FAULT_TASKS``: a JSON list of extra task names registered as `echo`
  (hostile names, to show a worker runs them verbatim).

Every handler first records ``(job_id, attempt, pid, payload)`` in the side table
``<table>_fx``, so the tests can count executions from the database. The side
connection is per thread and retried across server restarts, so a handler's side
effect is never what fails a job.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import MetaData

from sqla_jobq import Registry, current_job, jobs_table
from sqla_jobq.db import conninfo

TABLE = os.environ.get("JOBQ_FAULT_TABLE", "jobs")
DSN = os.environ.get("JOBQ_FAULT_DSN", "")
LEASE = timedelta(seconds=float(os.environ.get("JOBQ_FAULT_LEASE", "2")))
SIDE_RETRY_SECONDS = 60.0

registry = Registry(jobs_table(MetaData(), TABLE))
_local = threading.local()


def side_table(table: str) -> str:
    return f"{table}_fx"


_INSERT = sql.SQL(
    "INSERT INTO {} (job_id, attempt, pid, task, queue, payload) VALUES (%s, %s, %s, %s, %s, %s)"
).format(sql.Identifier(side_table(TABLE)))


def _connection() -> psycopg.Connection[Any]:
    conn: psycopg.Connection[Any] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(
            conninfo(DSN), autocommit=True, application_name="jobq fault side effect"
        )
        _local.conn = conn
    return conn


def record(payload: dict[str, Any]) -> None:
    """The side effect: one row per execution, written before the handler's work."""
    job = current_job()
    values = (job.id, job.attempts, os.getpid(), job.task, job.queue, json.dumps(payload))
    deadline = time.monotonic() + SIDE_RETRY_SECONDS
    while True:
        try:
            _connection().execute(_INSERT, values)
            return
        except psycopg.OperationalError:
            conn = getattr(_local, "conn", None)
            _local.conn = None
            if conn is not None:
                conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@registry.task(name="fx.work", lease=LEASE, max_attempts=25)
def work(n: int, sleep: float = 0.0) -> None:
    record({"n": n, "sleep": sleep})
    if sleep:
        time.sleep(sleep)


@registry.task(name="fx.poison", lease=LEASE, max_attempts=3)
def poison() -> None:
    """Takes its worker process down with it, every time."""
    record({})
    os._exit(1)


def echo(**kwargs: Any) -> None:
    record(kwargs)


registry.task(name="fx.echo", lease=LEASE)(echo)
for _name in json.loads(os.environ.get("JOBQ_FAULT_TASKS", "[]")):
    registry.task(name=_name, lease=LEASE)(echo)
