"""Runs the dashboard's statements on a sync Engine and hands back plain values.

The only module of the dashboard that executes SQL. Its methods block, so the
routes call them through `run_in_threadpool`. Reads take one connection and
no explicit transaction; every action is one short transaction (a bulk retry,
one per batch), so the dashboard never holds VACUUM back or a row lock for
longer than a statement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Connection, Engine, Executable, Row, RowMapping, Table, select
from sqlalchemy.exc import IntegrityError, ProgrammingError

from .. import presence, queue_statements, statements
from ..job import InvalidJob
from . import queries
from .filters import Cursor, JobFilter

# Ids per bulk-retry transaction: short enough that a worker's claim never
# waits long behind it, large enough that round trips do not dominate.
RETRY_BATCH = 500

_T = TypeVar("_T")


# A failed job whose unique key an active job took meanwhile would break the
# partial unique index if queued again.
KEY_TAKEN = "its unique key belongs to a job that is still queued or running"


class Refused(Exception):
    """An action the queue's rules forbid; shown as one line (409)."""


@dataclass(frozen=True)
class Minute:
    at: datetime
    done: int
    failed: int


@dataclass(frozen=True)
class Queue:
    """One line of the overview: the queue's jobs by state, and its settings.

    `paused` is None when the table predates the queue settings (schema
    version 5): the dashboard then neither shows nor offers pausing.
    """

    queue: str
    ready: int = 0
    scheduled: int = 0
    running: int = 0
    failed: int = 0
    done_last_hour: int = 0
    oldest_ready_age: float | None = None
    paused: bool | None = None
    concurrency_limit: int | None = None


@dataclass(frozen=True)
class Overview:
    queues: Sequence[Queue]
    minutes: Sequence[Minute]
    settings: bool  # the schema has queue settings: pausing can be shown and offered


@dataclass(frozen=True)
class Page:
    """One page of the list, newest first, and the cursors to its neighbours."""

    rows: Sequence[Row[Any]]
    newer: int | None
    older: int | None


@dataclass(frozen=True)
class Store:
    engine: Engine
    table: Table

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(select(1))

    def overview(self) -> Overview:
        """Every queue with jobs, and every paused or limited one without:
        a paused queue stays listed (and can be resumed) after its jobs are gone."""
        with self.engine.connect() as conn:
            counts = conn.execute(queries.queue_overview(self.table)).mappings().all()
            minutes = [Minute(*r) for r in conn.execute(queries.throughput(self.table))]
            settings = _missing_table_is_none(
                lambda: conn.execute(queue_statements.settings(self.table)).all()
            )
        if settings is None:
            return Overview([Queue(**row) for row in counts], minutes, settings=False)
        held = {s.queue: s for s in settings}
        queues = {row["queue"]: Queue(**row, paused=False) for row in counts}
        for name, setting in held.items():
            base = queues.get(name, Queue(name))
            queues[name] = replace(
                base, paused=setting.paused, concurrency_limit=setting.concurrency_limit
            )
        return Overview([queues[name] for name in sorted(queues)], minutes, settings=True)

    def stats(self) -> Sequence[RowMapping]:
        """`jobq stats`'s rows, as mappings: a Row's `count` is tuple.count."""
        with self.engine.connect() as conn:
            return conn.execute(statements.stats(self.table)).mappings().all()

    def workers(self) -> Sequence[Row[Any]] | None:
        """The registered workers, live first; None when the table predates
        the worker registry (schema version 5)."""
        with self.engine.connect() as conn:
            return _missing_table_is_none(lambda: conn.execute(presence.listing(self.table)).all())

    def page(self, flt: JobFilter, cursor: Cursor) -> Page:
        with self.engine.connect() as conn:
            rows = list(conn.execute(queries.job_page(self.table, flt, cursor)))
        more = len(rows) > cursor.limit
        rows = rows[: cursor.limit]
        if cursor.after is not None:
            rows.reverse()
            newer_exists, older_exists = more, True
        else:
            newer_exists, older_exists = cursor.before is not None, more
        return Page(
            rows,
            newer=rows[0].id if rows and newer_exists else None,
            older=rows[-1].id if rows and older_exists else None,
        )

    def job(self, job_id: int) -> Row[Any] | None:
        with self.engine.connect() as conn:
            return conn.execute(queries.job_detail(self.table, job_id)).first()

    def retry(self, job_id: int) -> bool:
        """True when the job was failed and is queued again."""
        try:
            with self.engine.begin() as conn:
                return conn.execute(statements.retry(self.table, job_id)).first() is not None
        except IntegrityError:
            raise Refused(f"job {job_id} cannot be retried: {KEY_TAKEN}") from None

    def cancel(self, job_id: int) -> bool:
        """True when the job was queued or running and is cancelled (a running
        one's worker hears of it on its next heartbeat, or sooner by NOTIFY)."""
        with self.engine.begin() as conn:
            return conn.execute(statements.cancel(self.table, job_id)).first() is not None

    def pause(self, queue: str) -> None:
        """Stop every worker taking jobs of `queue`; its running jobs finish."""
        self._set(queue, queue_statements.pause)

    def resume(self, queue: str) -> None:
        self._set(queue, queue_statements.resume)

    def _set(self, queue: str, builder: Callable[[Table, str], Executable]) -> None:
        try:
            statement = builder(self.table, queue)
        except InvalidJob as exc:
            raise Refused(str(exc)) from None
        with self.engine.begin() as conn:
            conn.execute(statement)

    def failed_summary(self, flt: JobFilter) -> tuple[int, int | None]:
        """How many failed jobs match `flt`, and the newest one's id."""
        with self.engine.connect() as conn:
            count, upto = conn.execute(queries.failed_summary(self.table, flt)).one()
        return count, upto

    def bulk_retry(self, flt: JobFilter, upto: int) -> int:
        """Retry the failed jobs matching `flt` up to id `upto`, a batch per
        transaction; returns how many went back to the queue."""
        after, total = 0, 0
        while True:
            with self.engine.begin() as conn:
                batch = queries.failed_batch(
                    self.table, flt, after=after, upto=upto, limit=RETRY_BATCH
                )
                ids = conn.execute(batch).scalars().all()
                if not ids:
                    return total
                total += self._retry_batch(conn, ids)
            after = ids[-1]

    def _retry_batch(self, conn: Connection, ids: Sequence[int]) -> int:
        """One statement for the batch; one job at a time only when a unique
        key is in the way, skipping the jobs whose key is taken."""
        try:
            with conn.begin_nested():
                return len(conn.execute(statements.retry_many(self.table, ids)).all())
        except IntegrityError:
            return sum(self._retry_alone(conn, job_id) for job_id in ids)

    def _retry_alone(self, conn: Connection, job_id: int) -> int:
        try:
            with conn.begin_nested():
                return len(conn.execute(statements.retry(self.table, job_id)).all())
        except IntegrityError:
            return 0


def _missing_table_is_none(read: Callable[[], _T]) -> _T | None:
    """`read()`, or None when a table it needs predates schema version 5."""
    try:
        return read()
    except ProgrammingError as exc:
        if isinstance(exc.orig, psycopg.errors.UndefinedTable):
            return None
        raise
