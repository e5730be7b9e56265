"""The thin layer that executes the statements on a SQLAlchemy connection.

Everything here runs inside the caller's transaction and never commits.

`enqueue_many` of many plain jobs (no unique key, due now) on a psycopg
connection takes the COPY path: ids drawn from the identity sequence in one
statement, then the rows streamed with COPY on the same connection, in the
same transaction. On this machine that is several times faster than the
array INSERT of `statements.enqueue_many`, which serves every other case.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import psycopg
from sqlalchemy import Table
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from . import statements, traceparent
from .job import InvalidJob, Job, LeaseLost, NewJob

__all__ = [
    "AsyncExecutor",
    "Executor",
    "complete_in",
    "complete_in_async",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "enqueue_payloads",
    "enqueue_payloads_async",
]

Executor = Connection | Session
AsyncExecutor = AsyncConnection | AsyncSession
ENQUEUE_PAGE = 5000
# Below this many rows the one-statement INSERT (one round trip) wins over
# COPY (three: draw the ids, start the COPY, end it).
COPY_MIN_ROWS = 1000


def enqueue(conn: Executor, table: Table, task: str | None, payload: Any, **options: Any) -> int:
    """Insert one job in the caller's transaction and return its id.

    With a unique key, a concurrent duplicate committed while we waited is not
    visible to the first attempt's snapshot; the second attempt sees it.
    The current span's trace context, if any, is stored with the job.
    """
    stmt = statements.enqueue(table, task, payload, **_traced(options))
    for _ in range(2):
        job_id = conn.execute(stmt).scalar()
        if job_id is not None:
            return int(job_id)
    raise RuntimeError("enqueue with unique_key found neither a new nor an existing job")


def _traced(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the current span's traceparent, unless one was given."""
    return {"traceparent": traceparent.current(), **options}


def enqueue_many(conn: Executor, table: Table, rows: Iterable[NewJob]) -> list[int]:
    """Insert many jobs, returning ids in input order: with COPY when they are
    many plain jobs on a psycopg connection, else one round trip per page."""
    rows = list(rows)
    trace = traceparent.current()
    copied = _copy_many(conn, table, rows, trace)
    if copied is not None:
        return copied
    ids: list[int] = []
    for page, stmt in _pages(table, rows, trace):
        found = list(conn.execute(stmt).scalars())
        missing = _missing(found)
        if missing:  # as in `enqueue`: a duplicate committed while we waited
            again = conn.execute(
                statements.enqueue_many(table, [page[i] for i in missing], trace)
            )
            found = _filled(found, missing, again.scalars())
        ids += _ids(found)
    return ids


def enqueue_payloads(
    conn: Executor, table: Table, job: NewJob, payloads: Iterable[Any]
) -> list[int]:
    """`enqueue_many` of one job per payload, every other field taken from
    `job`: a task's bulk enqueue, with the fields checked once, not per row."""
    payloads = list(payloads)
    if len(payloads) >= COPY_MIN_ROWS:
        values = statements.copy_payload_rows(job, payloads, traceparent.current())
        copied = _copy(conn, table, values)
        if copied is not None:
            return copied
    return enqueue_many(conn, table, [replace(job, payload=p) for p in payloads])


def _pages(
    table: Table, rows: list[NewJob], trace: str | None
) -> list[tuple[list[NewJob], Any]]:
    """Every page's statement, built (so every row checked) before any is sent."""
    pages = [rows[start : start + ENQUEUE_PAGE] for start in range(0, len(rows), ENQUEUE_PAGE)]
    return [(page, statements.enqueue_many(table, page, trace)) for page in pages]


def _missing(found: list[Any]) -> list[int]:
    return [i for i, job_id in enumerate(found) if job_id is None]


def _filled(found: list[Any], missing: list[int], again: Iterable[Any]) -> list[Any]:
    found = list(found)
    for i, job_id in zip(missing, again, strict=True):
        found[i] = job_id
    return found


def _copy_many(
    conn: Executor, table: Table, rows: list[NewJob], trace: str | None
) -> list[int] | None:
    """The COPY path of `enqueue_many`, or None when it does not apply."""
    if len(rows) < COPY_MIN_ROWS:
        return None
    return _copy(conn, table, statements.copy_rows(rows, trace))


def _copy(conn: Executor, table: Table, values: list[tuple[Any, ...]] | None) -> list[int] | None:
    """COPY `values` (rows of `statements.copy_rows`) into `table`, their ids
    drawn first; None when they need the INSERT or `conn` is not psycopg's."""
    connection = conn.connection() if isinstance(conn, Session) else conn
    driver = connection.connection.driver_connection
    if values is None or not isinstance(driver, psycopg.Connection):
        return None
    # Through SQLAlchemy, so its transaction begins here if it had not yet.
    ids = _expand(conn.execute(statements.reserve_ids(table, len(values))).all())
    command = statements.copy_command(table)
    try:
        with driver.cursor() as cur, cur.copy(command) as copy:
            for job_id, row in zip(ids, values, strict=True):
                copy.write_row((job_id, *row))
    except psycopg.Error as exc:
        raise DBAPIError.instance(command, None, exc, psycopg.Error) from exc
    return ids


async def _copy_many_async(
    conn: AsyncExecutor, table: Table, rows: list[NewJob], trace: str | None
) -> list[int] | None:
    """`_copy_many` on an `AsyncConnection` or `AsyncSession`."""
    if len(rows) < COPY_MIN_ROWS:
        return None
    return await _copy_async(conn, table, statements.copy_rows(rows, trace))


async def _copy_async(
    conn: AsyncExecutor, table: Table, values: list[tuple[Any, ...]] | None
) -> list[int] | None:
    """`_copy` on an `AsyncConnection` or `AsyncSession`."""
    connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
    driver = (await connection.get_raw_connection()).driver_connection
    if values is None or not isinstance(driver, psycopg.AsyncConnection):
        return None
    ids = _expand((await conn.execute(statements.reserve_ids(table, len(values)))).all())
    command = statements.copy_command(table)
    try:
        async with driver.cursor() as cur, cur.copy(command) as copy:
            for job_id, row in zip(ids, values, strict=True):
                await copy.write_row((job_id, *row))
    except psycopg.Error as exc:
        raise DBAPIError.instance(command, None, exc, psycopg.Error) from exc
    return ids


def _expand(runs: Iterable[Any]) -> list[int]:
    """The ids of `reserve_ids`' runs of consecutive ids."""
    return [job_id for first, count in runs for job_id in range(first, first + count)]


def _ids(found: list[Any]) -> list[int]:
    if any(job_id is None for job_id in found):
        raise RuntimeError("enqueue_many with unique_key found neither a new nor an existing job")
    return [int(job_id) for job_id in found]


async def enqueue_async(
    conn: AsyncExecutor, table: Table, task: str | None, payload: Any, **options: Any
) -> int:
    """`enqueue` on an `AsyncConnection` or `AsyncSession`."""
    stmt = statements.enqueue(table, task, payload, **_traced(options))
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
    trace = traceparent.current()
    copied = await _copy_many_async(conn, table, rows, trace)
    if copied is not None:
        return copied
    ids: list[int] = []
    for page, stmt in _pages(table, rows, trace):
        found = list((await conn.execute(stmt)).scalars())
        missing = _missing(found)
        if missing:  # as in `enqueue`: a duplicate committed while we waited
            again = await conn.execute(
                statements.enqueue_many(table, [page[i] for i in missing], trace)
            )
            found = _filled(found, missing, again.scalars())
        ids += _ids(found)
    return ids


async def enqueue_payloads_async(
    conn: AsyncExecutor, table: Table, job: NewJob, payloads: Iterable[Any]
) -> list[int]:
    """`enqueue_payloads` on an `AsyncConnection` or `AsyncSession`."""
    payloads = list(payloads)
    if len(payloads) >= COPY_MIN_ROWS:
        values = statements.copy_payload_rows(job, payloads, traceparent.current())
        copied = await _copy_async(conn, table, values)
        if copied is not None:
            return copied
    return await enqueue_many_async(conn, table, [replace(job, payload=p) for p in payloads])


def complete_in(conn: Executor, table: Table, job: Job, result: Any = None) -> None:
    """Complete `job` inside the caller's transaction, with its own database work.

    The fenced `complete` commits or rolls back with everything else the
    transaction did: exactly-once effects for database work. If the fence
    matches no row (the lease was lost and the job is someone else's now),
    raise LeaseLost: roll back, so none of the transaction's writes survive.
    """
    if conn.execute(_completion(table, job, result)).first() is None:
        raise LeaseLost(f"job {job.id} attempt {job.attempts} is no longer ours: roll back")


async def complete_in_async(
    conn: AsyncExecutor, table: Table, job: Job, result: Any = None
) -> None:
    """`complete_in` on an AsyncConnection or AsyncSession."""
    if (await conn.execute(_completion(table, job, result))).first() is None:
        raise LeaseLost(f"job {job.id} attempt {job.attempts} is no longer ours: roll back")


def _completion(table: Table, job: Job, result: Any) -> Any:
    try:
        stmt = statements.complete(table, job.id, job.attempts, result)
    except InvalidJob:  # a return value that is not JSON: complete without it
        stmt = statements.complete(table, job.id, job.attempts)
    return stmt.returning(table.c.id)
