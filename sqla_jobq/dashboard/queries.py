"""Pure builders for what the dashboard reads: they return SQLAlchemy
constructs and execute nothing, as `sqla_jobq.statements` does.

The job list pages by keyset on the primary key (``WHERE id < :before ORDER
BY id DESC LIMIT n``), never by OFFSET: PostgreSQL walks the primary-key
index backwards and stops after one page, so the tenth page of a table of ten
million rows costs what the first does. Status literals go inline
(`status_is`), as everywhere in this package.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    Interval,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    func,
    literal_column,
    or_,
    select,
)

from ..statements import FINISHED_STATUSES, status_is
from .filters import Cursor, JobFilter

HOUR = timedelta(hours=1)
# Inline, so the GROUP BY expression is textually the selected one.
MINUTE = literal_column("'minute'", Text)


def _ago(span: timedelta, name: str) -> ColumnElement[Any]:
    return func.now() - bindparam(name, span, type_=Interval)


def _ready(table: Table) -> ColumnElement[bool]:
    return and_(status_is(table.c.status, "queued"), table.c.run_at <= func.now())


def queue_overview(table: Table) -> Select[Any]:
    """Per queue: ready, scheduled, running, failed, done in the last hour and
    the oldest ready job's age in seconds (NULL when nothing is ready)."""
    c = table.c
    queued = status_is(c.status, "queued")
    done_lately = and_(status_is(c.status, "done"), c.finished_at >= _ago(HOUR, "hour"))
    return (
        select(
            c.queue,
            func.count().filter(_ready(table)).label("ready"),
            func.count().filter(and_(queued, c.run_at > func.now())).label("scheduled"),
            func.count().filter(status_is(c.status, "running")).label("running"),
            func.count().filter(status_is(c.status, "failed")).label("failed"),
            func.count().filter(done_lately).label("done_last_hour"),
            func.extract("epoch", func.now() - func.min(c.run_at).filter(_ready(table))).label(
                "oldest_ready_age"
            ),
        )
        .group_by(c.queue)
        .order_by(c.queue)
    )


def throughput(table: Table, minutes: int = 60) -> Select[Any]:
    """Jobs finished `done` and `failed` in each of the last `minutes` minutes,
    the current one included; minutes without any are there with zeros, so
    the chart's axis comes from the server's clock, not the browser's."""
    if minutes < 1:
        raise ValueError(f"minutes must be at least 1, got {minutes}")
    c = table.c
    now = func.date_trunc(MINUTE, func.now())
    first = now - bindparam("span", timedelta(minutes=minutes - 1), type_=Interval)
    minute = func.date_trunc(MINUTE, c.finished_at)
    per = (
        select(
            minute.label("minute"),
            func.count().filter(status_is(c.status, "done")).label("done"),
            func.count().filter(status_is(c.status, "failed")).label("failed"),
        )
        .where(or_(*(status_is(c.status, s) for s in FINISHED_STATUSES)))
        .where(c.finished_at >= first)
        .group_by(minute)
        .subquery("per")
    )
    slots = (
        func.generate_series(first, now, bindparam("step", timedelta(minutes=1), type_=Interval))
        .table_valued("minute")
        .render_derived(name="slots")
    )
    return (
        select(
            slots.c.minute,
            func.coalesce(per.c.done, 0).label("done"),
            func.coalesce(per.c.failed, 0).label("failed"),
        )
        .select_from(slots.outerjoin(per, per.c.minute == slots.c.minute))
        .order_by(slots.c.minute)
    )


def _matching(table: Table, flt: JobFilter) -> list[ColumnElement[bool]]:
    c = table.c
    where: list[ColumnElement[bool]] = []
    if flt.queue is not None:
        where.append(c.queue == flt.queue)
    if flt.task is not None:
        where.append(c.task == flt.task)
    if flt.status == "ready":
        where.append(_ready(table))
    elif flt.status == "scheduled":
        where += [status_is(c.status, "queued"), c.run_at > func.now()]
    elif flt.status is not None:
        where.append(status_is(c.status, flt.status))
    if flt.error is not None:
        where.append(c.last_error.ilike(f"%{_escape_like(flt.error)}%", escape="\\"))
    return where


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


ERROR_PREVIEW = 160


def job_page(table: Table, flt: JobFilter, cursor: Cursor) -> Select[Any]:
    """One page of matching jobs plus one row more, which tells whether
    another page follows. Newest first; with `cursor.after` the rows come
    oldest first (walking towards newer jobs) and the caller reverses them."""
    c = table.c
    listed = select(
        c.id,
        c.queue,
        c.task,
        c.status,
        c.attempts,
        c.max_attempts,
        c.run_at,
        c.created_at,
        c.finished_at,
        func.left(c.last_error, ERROR_PREVIEW).label("last_error"),
        func.now().label("now"),
    ).where(*_matching(table, flt))
    limit = bindparam("limit", cursor.limit + 1, type_=Integer)
    if cursor.after is not None:
        return listed.where(c.id > cursor.after).order_by(c.id.asc()).limit(limit)
    if cursor.before is not None:
        listed = listed.where(c.id < cursor.before)
    return listed.order_by(c.id.desc()).limit(limit)


def job_detail(table: Table, job_id: int) -> Select[Any]:
    """Every column of one job, and the server's `now()` to age its lease by."""
    return select(table, func.now().label("now")).where(table.c.id == job_id)


def failed_summary(table: Table, flt: JobFilter) -> Select[int, Any]:
    """How many failed jobs match, and the newest one's id: a bulk retry goes
    no further, so jobs that fail after the count was shown are left alone."""
    c = table.c
    return select(func.count().label("count"), func.max(c.id).label("upto")).where(
        *_matching(table, flt.failed())
    )


def failed_batch(
    table: Table, flt: JobFilter, *, after: int, upto: int, limit: int
) -> Select[int]:
    """The next ids of failed jobs matching, in id order, for a bulk retry
    that walks the table in batches of short transactions."""
    c = table.c
    return (
        select(c.id)
        .where(*_matching(table, flt.failed()), c.id > after, c.id <= upto)
        .order_by(c.id)
        .limit(bindparam("limit", limit, type_=Integer))
    )
