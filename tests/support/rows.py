"""Jobs put in and read back by the tests that run real workers on them."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Engine, Table

from sqla_jobq import client

Raw = psycopg.Connection[Any]

# Everything but the payload, which psycopg would decode (and a test may have
# stored one Python cannot).
STATE = "id, status, attempts, max_attempts, last_error, locked_until, result"


def enqueue(engine: Engine, table: Table, task: str, payload: Any = None, **kw: Any) -> int:
    """One job, committed."""
    with engine.begin() as conn:
        return client.enqueue(conn, table, task, payload or {}, **kw)


def job_row(raw: Raw, table: Table, job_id: int, columns: str = STATE) -> dict[str, Any]:
    """A job's row as it is now (it must exist)."""
    with raw.cursor(row_factory=dict_row) as cur:
        found = cur.execute(
            f'SELECT {columns} FROM "{table.name}" WHERE id = %s', (job_id,)
        ).fetchone()
    assert found is not None, f"job {job_id} is gone"
    return found
