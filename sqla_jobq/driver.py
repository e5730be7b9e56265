"""The worker's hot path: the statements, compiled once, on raw psycopg.

The worker runs the same Core statements an app imports, but compiles each
once and executes it on an autocommit psycopg connection: a claim or a fenced
completion is a single atomic statement, so wrapping it in BEGIN/COMMIT would
only add two round trips, and compiling it per call would only add CPU. A lost
connection is dropped and reopened on the next call.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from sqlalchemy import ClauseElement, Table
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

from . import statements
from .db import conninfo
from .registry import Job

log = logging.getLogger("sqla_jobq.driver")

_DIALECT = pg_psycopg.dialect()  # type: ignore[no-untyped-call]
# Nothing of ours may hold VACUUM back: a session left idle in a transaction
# (a bug, or a debugger) is ended by the server after a minute.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000


@dataclass(frozen=True)
class Compiled:
    sql: str
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, stmt: ClauseElement) -> Compiled:
        compiled = stmt.compile(dialect=_DIALECT)
        return cls(compiled.string, dict(compiled.params))

    def params(self, **values: Any) -> dict[str, Any]:
        return {**self.defaults, **values}


def worker_name() -> str:
    """`application_name` for our sessions, so `jobq doctor` can tell them apart."""
    return f"jobq worker {socket.gethostname()}:{os.getpid()}"[:63]


def connect_kwargs(prepared: bool) -> dict[str, Any]:
    return {
        "autocommit": True,
        "application_name": worker_name(),
        "options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_MS}",
        # Behind a transaction-mode pooler that does not track prepared
        # statements (PgBouncer < 1.21), server-side preparation must be off.
        "prepare_threshold": 0 if prepared else None,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }


class Driver:
    """One autocommit connection running the compiled lifecycle statements."""

    def __init__(
        self, url: str, table: Table, queues: Sequence[str], lease: timedelta, prepared: bool
    ) -> None:
        self.url = conninfo(url)
        self.prepared = prepared
        self.lease = lease
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        queue: statements.Queues = queues[0] if len(queues) == 1 else list(queues)
        self.sql = {
            "claim": Compiled.of(statements.claim(table, queue=queue, lease=lease)),
            "complete_many": Compiled.of(statements.complete_many(table, [])),
            "fail": Compiled.of(statements.fail(table, 0, 0, "")),
            "extend_leases": Compiled.of(statements.extend_leases(table, [], lease)),
            "release": Compiled.of(statements.release(table, 0, 0)),
            "reap": Compiled.of(statements.reap(table)),
            "next_run_at": Compiled.of(statements.next_run_at(table, queue=queue)),
            "prune": Compiled.of(statements.prune(table, older_than=timedelta(0))),
        }

    async def _connection(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.url, row_factory=tuple_row, **connect_kwargs(self.prepared)
            )
        return self._conn

    async def _run(self, name: str, **values: Any) -> psycopg.AsyncCursor[tuple[Any, ...]]:
        stmt = self.sql[name]
        conn = await self._connection()
        try:
            return await conn.execute(stmt.sql, stmt.params(**values))
        except psycopg.OperationalError:
            await self.close()
            raise

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                await conn.close()
            except psycopg.Error:
                log.debug("error while closing a broken connection", exc_info=True)

    async def claim(self, limit: int) -> list[Job]:
        cur = await self._run("claim", limit=limit)
        return [Job(*row[:6]) for row in await cur.fetchall()]

    async def complete_many(self, jobs: Sequence[tuple[int, int]]) -> set[int]:
        cur = await self._run(
            "complete_many", ids=[j[0] for j in jobs], attempts=[j[1] for j in jobs]
        )
        return {row[0] for row in await cur.fetchall()}

    async def fail(self, job_id: int, attempts: int, error: str) -> tuple[str, float] | None:
        """The job's new status and seconds until its retry, or None if not ours."""
        cur = await self._run(
            "fail", id=job_id, attempts=attempts, error=statements.error_text(error)
        )
        row = await cur.fetchone()
        if row is None:
            return None
        return str(row[1]), max(row[4].total_seconds(), 0.0)

    async def extend_leases(self, jobs: Sequence[tuple[int, int]], lease: timedelta) -> set[int]:
        cur = await self._run(
            "extend_leases", ids=[j[0] for j in jobs], attempts=[j[1] for j in jobs], lease=lease
        )
        return {row[0] for row in await cur.fetchall()}

    async def release(self, job_id: int, attempts: int) -> bool:
        cur = await self._run("release", id=job_id, attempts=attempts)
        return cur.rowcount == 1

    async def reap(self) -> list[tuple[int, str, int]]:
        cur = await self._run("reap")
        return [(row[0], row[1], row[2]) for row in await cur.fetchall()]

    async def prune(self, older_than: timedelta, limit: int) -> int:
        """One batch of finished jobs deleted, in its own (autocommit) transaction."""
        cur = await self._run("prune", older_than=older_than, limit=limit)
        return cur.rowcount

    async def seconds_until_next(self) -> float | None:
        """Seconds until the earliest queued job is due (server clock), or None."""
        cur = await self._run("next_run_at")
        row = await cur.fetchone()
        if row is None or row[0] is None:
            return None
        seconds: float = (row[0] - row[1]).total_seconds()
        return max(seconds, 0.0)
