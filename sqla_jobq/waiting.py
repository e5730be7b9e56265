"""Waiting for a job to end, from outside the worker: `wait_for`, `wait_for_async`.

A waiter marks its job `awaited`, LISTENs on the queue's channel, then reads
the job: a job that ended before the LISTEN is seen by that read, one that
ends later by the `#finished <id>` NOTIFY the table's row trigger sends for
awaited jobs only. So a wait costs one NOTIFY, a dedicated connection for as
long as it lasts and a few reads; jobs nobody waits on cost nothing (the
trigger's WHEN clause skips them without calling any function).

A missed notification cannot hang a waiter: it also polls, backing off from
`POLL_START` to `POLL_MAX` seconds, so it never spins.
"""

from __future__ import annotations

import time
from contextlib import aclosing, closing
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, Row, Table
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine

from . import statements
from .job import JobCancelled
from .migrations.check import check_schema
from .schema import default_jobs, names_of
from .statements import FINISHED_STATUSES

__all__ = ["JobFailed", "wait_for", "wait_for_async"]

POLL_START = 0.1
POLL_MAX = 5.0


class JobFailed(Exception):
    """The awaited job failed for good; `last_error` is what its last attempt raised."""

    def __init__(self, job_id: int, last_error: str | None) -> None:
        super().__init__(f"job {job_id} failed: {last_error or 'no error recorded'}")
        self.job_id = job_id
        self.last_error = last_error


class _Wait:
    """One wait's clock and what it has learnt, shared by the sync and async loops."""

    def __init__(self, table: Table | None, job_id: int, timeout: float) -> None:
        if timeout < 0:
            raise ValueError(f"timeout must not be negative, got {timeout}")
        self.table = default_jobs if table is None else table
        self.job_id = job_id
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.delay = POLL_START
        self.marked = False
        self.status = "queued"
        self.finished = f"#finished {job_id}"
        self.archived = True  # read the archive too (see `refused`)

    def queries(self) -> list[Any]:
        """What to run on this round: the mark until it took, then the read."""
        read = statements.job_outcome(self.table, self.job_id, archived=self.archived)
        return [read] if self.marked else [statements.mark_awaited(self.table, self.job_id), read]

    def refused(self, exc: ProgrammingError) -> bool:
        """True if the read was refused for the archive alone: a role that
        may read the jobs table and not its archive (grants made before
        workers archived by default) then waits on the jobs table, as before."""
        orig = exc.orig
        denied = isinstance(orig, psycopg.errors.InsufficientPrivilege)
        if not (denied and self.archived and names_of(self.table).archive in str(orig)):
            return False
        self.archived = False
        return True

    def learn(self, rows: list[Row[Any] | None]) -> Row[Any] | None:
        """The job's row if it has ended (LookupError if there is none)."""
        *mark, row = rows
        self.marked = self.marked or (bool(mark) and mark[0] is not None)
        if row is None:
            where = self.table.name if self.archived else f"{self.table.name} (nor, maybe, in "
            unread = (
                ""
                if self.archived
                else f"{names_of(self.table).archive}, which this role may not read: GRANT "
                f"SELECT ON {names_of(self.table).archive} TO it)"
            )
            raise LookupError(
                f"job {self.job_id} is not in {where}{unread} "
                "(never enqueued, not committed yet, or pruned)"
            )
        self.status = row.status
        return row if row.status in FINISHED_STATUSES else None

    def next_sleep(self) -> float:
        """How long to listen before reading again; TimeoutError past the deadline."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"job {self.job_id} is still {self.status} after {self.timeout:g}s"
            )
        sleep = min(self.delay, remaining)
        self.delay = min(self.delay * 2, POLL_MAX)
        return sleep


def _result(job_id: int, row: Row[Any]) -> Any:
    if row.status == "failed":
        raise JobFailed(job_id, row.last_error)
    if row.status == "cancelled":
        raise JobCancelled(f"job {job_id} was cancelled")
    return row.result


def _listen_command(channel: str) -> sql.Composed:
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


def wait_for(engine: Engine, job_id: int, *, timeout: float, table: Table | None = None) -> Any:
    """The result job `job_id` stored when it ended (None if it returned none).

    Raises JobFailed or JobCancelled if it ended so, TimeoutError if it has
    not ended within `timeout` seconds (it goes on running), LookupError if
    there is no such job. `table` defaults to `sqla_jobq.jobs`. Wait only for
    a committed job: from inside the transaction that enqueued it, it cannot
    end (no worker sees it) and other sessions cannot find it.
    """
    wait = _Wait(table, job_id, timeout)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        channel = check_schema(conn, wait.table)
    raw = engine.raw_connection()
    listener: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
    raw.detach()  # closed below, never handed back to the pool still listening
    try:
        listener.autocommit = True
        listener.execute(_listen_command(channel))
        while True:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                try:
                    row = wait.learn([conn.execute(s).first() for s in wait.queries()])
                except ProgrammingError as exc:
                    if wait.refused(exc):
                        continue
                    raise
            if row is not None:
                return _result(job_id, row)
            # Closed at once: the generator holds the connection's lock.
            with closing(listener.notifies(timeout=wait.next_sleep())) as notes:
                for note in notes:
                    if note.payload == wait.finished:
                        break
    finally:
        listener.close()


async def wait_for_async(
    engine: AsyncEngine, job_id: int, *, timeout: float, table: Table | None = None
) -> Any:
    """`wait_for` on an AsyncEngine; the event loop is free while it waits."""
    wait = _Wait(table, job_id, timeout)
    async with engine.connect() as conn:
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        channel = await auto.run_sync(check_schema, wait.table)
    raw = await engine.raw_connection()
    listener: psycopg.AsyncConnection[Any] = raw.driver_connection  # type: ignore[assignment]
    raw.detach()
    try:
        await listener.set_autocommit(True)
        await listener.execute(_listen_command(channel))
        while True:
            async with engine.connect() as conn:
                auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
                try:
                    row = wait.learn([(await auto.execute(s)).first() for s in wait.queries()])
                except ProgrammingError as exc:
                    if wait.refused(exc):
                        continue
                    raise
            if row is not None:
                return _result(job_id, row)
            async with aclosing(listener.notifies(timeout=wait.next_sleep())) as notes:
                async for note in notes:
                    if note.payload == wait.finished:
                        break
    finally:
        await listener.close()
