"""Jobs put in and read back by the tests that run real workers on them."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Engine, Table

from sqla_jobq import client
from sqla_jobq.schema import names_of

Raw = psycopg.Connection[Any]

# Everything but the payload, which psycopg would decode (and a test may have
# stored one Python cannot).
STATE = "id, status, attempts, max_attempts, last_error, locked_until, result"


def enqueue(engine: Engine, table: Table, task: str, payload: Any = None, **kw: Any) -> int:
    """One job, committed."""
    with engine.begin() as conn:
        return client.enqueue(conn, table, task, payload or {}, **kw)


def job_row(raw: Raw, table: Table, job_id: int, columns: str = STATE) -> dict[str, Any]:
    """A job's row as it is now, in the jobs table or, once a worker has
    moved it (at completion, by default), in the archive (it must exist)."""
    with raw.cursor(row_factory=dict_row) as cur:
        for name in (table.name, names_of(table).archive):
            found = cur.execute(f'SELECT {columns} FROM "{name}" WHERE id = %s', (job_id,))
            row = found.fetchone()
            if row is not None:
                return row
    raise AssertionError(f"job {job_id} is gone")


def job_now(raw: Raw, table: Table, job_id: int) -> dict[str, Any]:
    """Every column of a job's row, wherever it is, with the server's `now()`
    as `db_now` (to compare its times with)."""
    return job_row(raw, table, job_id, "*, now() AS db_now")


def every_job(table: Table, columns: str) -> str:
    """A FROM item over the jobs table and its archive together: a worker
    moves each job to the archive as it completes it (by default), so what
    a test counts or reads back about finished jobs spans both."""
    archive = names_of(table).archive
    return (
        f'(SELECT {columns} FROM "{table.name}" '
        f'UNION ALL SELECT {columns} FROM "{archive}") AS every_job'
    )
