"""Runs the dashboard's statements on a sync Engine and hands back plain values.

The only module of the dashboard that executes SQL. Its methods block, so the
routes call them through `run_in_threadpool`. Reads take one connection and
no explicit transaction; every action is one short transaction (a bulk retry,
one per batch), so the dashboard never holds VACUUM back or a row lock for
longer than a statement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, Row, RowMapping, Table, select
from sqlalchemy.exc import IntegrityError, ProgrammingError

from .. import presence, statements
from . import queries
from .filters import Cursor, JobFilter

# Ids per bulk-retry transaction: short enough that a worker's claim never
# waits long behind it, large enough that round trips do not dominate.
RETRY_BATCH = 500


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
class Overview:
    queues: Sequence[Row[Any]]
    minutes: Sequence[Minute]


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
        with self.engine.connect() as conn:
            queues = conn.execute(queries.queue_overview(self.table)).all()
            minutes = [Minute(*r) for r in conn.execute(queries.throughput(self.table))]
        return Overview(queues, minutes)

    def stats(self) -> Sequence[RowMapping]:
        """`jobq stats`'s rows, as mappings: a Row's `count` is tuple.count."""
        with self.engine.connect() as conn:
            return conn.execute(statements.stats(self.table)).mappings().all()

    def workers(self) -> Sequence[Row[Any]] | None:
        """The registered workers, live first; None when the table predates
        the worker registry (schema version 5)."""
        try:
            with self.engine.connect() as conn:
                return conn.execute(presence.listing(self.table)).all()
        except ProgrammingError as exc:
            if isinstance(exc.orig, psycopg.errors.UndefinedTable):
                return None
            raise

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
        """True when the job was queued and is cancelled."""
        with self.engine.begin() as conn:
            return conn.execute(statements.cancel(self.table, job_id)).first() is not None

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
