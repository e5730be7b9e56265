"""The thin layer that executes the statements on a SQLAlchemy connection.

Everything here runs inside the caller's transaction and never commits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from . import statements
from .statements import NewJob

Executor = Connection | Session
AsyncExecutor = AsyncConnection | AsyncSession
ENQUEUE_PAGE = 5000


def enqueue(conn: Executor, table: Table, task: str | None, payload: Any, **options: Any) -> int:
    """Insert one job in the caller's transaction and return its id.

    With a unique key, a concurrent duplicate committed while we waited is not
    visible to the first attempt's snapshot; the second attempt sees it.
    """
    stmt = statements.enqueue(table, task, payload, **options)
    for _ in range(2):
        job_id = conn.execute(stmt).scalar()
        if job_id is not None:
            return int(job_id)
    raise RuntimeError("enqueue with unique_key found neither a new nor an existing job")


def enqueue_many(conn: Executor, table: Table, rows: Iterable[NewJob]) -> list[int]:
    """Insert many jobs, one round trip per page, returning ids in input order."""
    rows = list(rows)
    ids: list[int] = []
    for start in range(0, len(rows), ENQUEUE_PAGE):
        page = rows[start : start + ENQUEUE_PAGE]
        found = list(conn.execute(statements.enqueue_many(table, page)).scalars())
        missing = [i for i, job_id in enumerate(found) if job_id is None]
        if missing:  # as in `enqueue`: a duplicate committed while we waited
            again = conn.execute(statements.enqueue_many(table, [page[i] for i in missing]))
            for i, job_id in zip(missing, again.scalars(), strict=True):
                found[i] = job_id
        ids += _ids(found)
    return ids


def _ids(found: list[Any]) -> list[int]:
    if any(job_id is None for job_id in found):
        raise RuntimeError("enqueue_many with unique_key found neither a new nor an existing job")
    return [int(job_id) for job_id in found]


async def enqueue_async(
    conn: AsyncExecutor, table: Table, task: str | None, payload: Any, **options: Any
) -> int:
    """`enqueue` on an `AsyncConnection` or `AsyncSession`."""
    stmt = statements.enqueue(table, task, payload, **options)
    for _ in range(2):
        job_id = (await conn.execute(stmt)).scalar()
        if job_id is not None:
            return int(job_id)
    raise RuntimeError("enqueue with unique_key found neither a new nor an existing job")


async def enqueue_many_async(
    conn: AsyncExecutor, table: Table, rows: Iterable[NewJob]
) -> list[int]:
    """`enqueue_many` on an `AsyncConnection` or `AsyncSession`."""
    rows = list(rows)
    ids: list[int] = []
    for start in range(0, len(rows), ENQUEUE_PAGE):
        page = rows[start : start + ENQUEUE_PAGE]
        found = list((await conn.execute(statements.enqueue_many(table, page))).scalars())
        missing = [i for i, job_id in enumerate(found) if job_id is None]
        if missing:  # as in `enqueue`: a duplicate committed while we waited
            again = await conn.execute(statements.enqueue_many(table, [page[i] for i in missing]))
            for i, job_id in zip(missing, again.scalars(), strict=True):
                found[i] = job_id
        ids += _ids(found)
    return ids
