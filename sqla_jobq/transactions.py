"""Transactional tasks: the handler's database work and its completion commit
together (internal).

A task declared `transactional=True` is called with `conn`, a connection in an
open transaction on the worker's engine; when it returns, the fenced
`complete` runs in that same transaction, and one COMMIT makes both durable.
If the fence matches no row (the lease was lost, the job is someone else's
now), `LeaseLost` rolls the whole transaction back, the app's writes
included. That gives exactly-once effects for work done in the database;
side effects outside it (an e-mail sent, an HTTP call) can still happen twice.

The transaction stays open while the handler runs, so keep such tasks short:
an open transaction holds back VACUUM like any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Table, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from .client import complete_in, complete_in_async
from .db import sqlalchemy_url, worker_name
from .job import Job


@dataclass(frozen=True)
class Completed:
    """A transactional handler's return value, its job already completed."""

    value: object


class Transactions:
    """The engines transactional tasks run on, made on first use."""

    def __init__(self, url: str, size: int) -> None:
        self.url = sqlalchemy_url(url)
        self.size = size
        self._sync: Engine | None = None
        self._async: AsyncEngine | None = None

    def _options(self) -> dict[str, Any]:
        return {
            "pool_size": self.size,
            "pool_pre_ping": True,
            "connect_args": {"application_name": worker_name()},
        }

    def run(self, table: Table, job: Job, call: Callable[..., object]) -> Completed:
        """On a handler thread: the handler and its completion in one transaction."""
        if self._sync is None:
            self._sync = create_engine(self.url, **self._options())
        with self._sync.connect() as conn, conn.begin():
            value = call(conn=conn)
            complete_in(conn, table, job, value)
        return Completed(value)

    async def run_async(
        self, table: Table, job: Job, call: Callable[..., Awaitable[object]]
    ) -> Completed:
        if self._async is None:
            self._async = create_async_engine(self.url, **self._options())
        async with self._async.connect() as conn, conn.begin():
            value = await call(conn=conn)
            await complete_in_async(conn, table, job, value)
        return Completed(value)

    async def dispose(self) -> None:
        if self._sync is not None:
            self._sync.dispose()
        if self._async is not None:
            await self._async.dispose()
