"""The worker registry: each worker's row in `<table>_workers` (schema step 5).

A worker writes its row when it starts, refreshes it only on round trips it
makes anyway (right after a claim or a lease extension, at most once per
`BEAT_EVERY`), and deletes it on a clean shutdown. A quiet worker therefore
sends nothing extra, and a serverless compute is left asleep.

Staleness has to be judged by the reader, from what the row promises: a
worker beats at least once per `beat_interval` while alive (its poll interval
while idle, a third of its longest lease while its slots are full, plus the
throttle), so a row silent for twice that plus `STALE_MARGIN` is a worker that
died without leaving. Rows silent for `FORGET_AFTER` beyond that are deleted
when the next worker registers, so crashed workers do not pile up forever.

The builders are pure; `Presence` runs them on one of the worker's own
autocommit psycopg connections and never lets a failure reach the worker.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Delete,
    Interval,
    MetaData,
    Select,
    Table,
    Text,
    bindparam,
    delete,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import Insert as PgInsert
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .db import Query, compiled
from .schema import workers_table

log = logging.getLogger("sqla_jobq.presence")


BEAT_EVERY = timedelta(seconds=10)
STALE_MARGIN = timedelta(seconds=30)
FORGET_AFTER = timedelta(days=1)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself in its row."""

    id: str
    host: str
    pid: int
    queues: tuple[str, ...]
    concurrency: int
    beat_interval: timedelta

    @classmethod
    def here(
        cls,
        queues: Sequence[str],
        concurrency: int,
        poll_interval: float,
        longest_lease: timedelta,
    ) -> WorkerInfo:
        """This process, with the beat it can promise: an idle worker claims
        at least every `poll_interval`, a busy one extends its leases at least
        every third of `longest_lease`; the throttle may hold a beat back by
        up to `BEAT_EVERY` more."""
        host, pid = socket.gethostname(), os.getpid()
        gap = max(timedelta(seconds=poll_interval), longest_lease / 3)
        return cls(
            id=f"{host}:{pid}:{secrets.token_hex(3)}",
            host=host,
            pid=pid,
            queues=tuple(queues),
            concurrency=concurrency,
            beat_interval=gap + BEAT_EVERY,
        )


def _registry(table: Table) -> Table:
    return workers_table(MetaData(), table.name, table.schema)


def _silence_limit(w: Table) -> ColumnElement[Any]:
    """How long a live worker can stay silent: twice its promise, plus a margin."""
    # Added twice, not multiplied: SQLAlchemy's Interval type has no `*`.
    promise = w.c.beat_interval
    return promise + promise + bindparam("margin", STALE_MARGIN, type_=Interval)


def _values(info: WorkerInfo) -> dict[str, Any]:
    return {
        "id": bindparam("id", info.id, type_=Text),
        "host": info.host,
        "pid": info.pid,
        "queues": bindparam("queues", list(info.queues), type_=ARRAY(Text)),
        "concurrency": info.concurrency,
        "beat_interval": bindparam("beat_interval", info.beat_interval, type_=Interval),
        "jobs_done": bindparam("jobs_done", 0, type_=BigInteger),
    }


def register(table: Table, info: WorkerInfo) -> PgInsert:
    """Write the worker's row, and delete rows of workers long dead."""
    w = _registry(table)
    forgotten = (
        delete(w)
        .where(
            w.c.heartbeat_at
            < func.now() - _silence_limit(w) - bindparam("forget", FORGET_AFTER, type_=Interval)
        )
        .returning(w.c.id)
        .cte("forgotten")
    )
    stmt = pg_insert(w).values(**_values(info))
    given = ("host", "pid", "queues", "concurrency", "beat_interval", "jobs_done")
    restart = {"started_at": func.now(), "heartbeat_at": func.now()}
    return stmt.on_conflict_do_update(
        index_elements=[w.c.id], set_={**{c: stmt.excluded[c] for c in given}, **restart}
    ).add_cte(forgotten)


def beat(table: Table, info: WorkerInfo, jobs_done: int) -> PgInsert:
    """Refresh the heartbeat and the count of jobs done. An upsert, so a row
    someone deleted (or `register` forgot, after a long suspend) comes back."""
    w = _registry(table)
    values = _values(info)
    values["jobs_done"] = bindparam("jobs_done", jobs_done, type_=BigInteger)
    stmt = pg_insert(w).values(**values)
    return stmt.on_conflict_do_update(
        index_elements=[w.c.id],
        set_={"heartbeat_at": func.now(), "jobs_done": stmt.excluded.jobs_done},
    )


def leave(table: Table, worker_id: str) -> Delete:
    """Delete the worker's row (a clean shutdown)."""
    w = _registry(table)
    return delete(w).where(w.c.id == bindparam("id", worker_id, type_=Text))


def listing(table: Table) -> Select[Any]:
    """Every registered worker, live ones first, with `heartbeat_age` (seconds
    since its last beat) and `stale` (silent longer than it promised)."""
    w = _registry(table)
    silence = func.now() - w.c.heartbeat_at
    stale = (silence > _silence_limit(w)).label("stale")
    return select(
        w.c.id,
        w.c.host,
        w.c.pid,
        w.c.queues,
        w.c.concurrency,
        w.c.started_at,
        w.c.heartbeat_at,
        w.c.jobs_done,
        w.c.beat_interval,
        func.extract("epoch", silence).label("heartbeat_age"),
        stale,
    ).order_by(stale, w.c.host, w.c.pid, w.c.id)


class Presence:
    """One worker's row, written on a connection the worker already uses.

    Every method returns whether its statement ran; a database error is
    logged and swallowed, because the registry is for people watching, and
    must never stop or slow the work.
    """

    def __init__(
        self,
        table: Table,
        info: WorkerInfo,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self._clock = clock
        self._last = float("-inf")
        self._register = compiled(register(table, info))
        self._beat = compiled(beat(table, info, 0))
        self._leave = compiled(leave(table, info.id))

    async def register(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """At start: write the row."""
        self._last = self._clock()
        return await self._run(conn, self._register, "register")

    async def beat(self, conn: psycopg.AsyncConnection[Any], jobs_done: int) -> bool:
        """After a round trip the worker made anyway: refresh the row, unless
        the last beat is less than `BEAT_EVERY` old (then send nothing)."""
        now = self._clock()
        if now - self._last < BEAT_EVERY.total_seconds():
            return False
        self._last = now
        sql, params = self._beat
        return await self._run(conn, (sql, {**params, "jobs_done": jobs_done}), "beat")

    async def leave(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """At a clean shutdown: delete the row."""
        return await self._run(conn, self._leave, "leave")

    async def _run(self, conn: psycopg.AsyncConnection[Any], query: Query, what: str) -> bool:
        if not conn.autocommit:
            raise ValueError("the worker registry needs an autocommit connection")
        try:
            await conn.execute(*query)
        except psycopg.Error as exc:
            log.warning("worker registry %s failed (ignored): %s", what, exc)
            return False
        return True
