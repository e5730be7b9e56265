"""Pure builders for what the dashboard reads: they return SQLAlchemy
constructs and execute nothing, as `sqla_jobq.statements` does.

The job list pages by keyset on the primary key (``WHERE id < :before ORDER
BY id DESC LIMIT n``), never by OFFSET: PostgreSQL walks the primary-key
index backwards and stops after one page, so the tenth page of a table of ten
million rows costs what the first does. Status literals go inline
(`status_is`), as everywhere in this package.

Finished jobs move to `<table>_archive` (a worker's `archive_after`, one
minute by default; `jobq prune --archive`), and the dashboard keeps showing
them: one job's page and the list read both tables (each walking its own
primary key, so a long archive costs a page what a short one does); the
overview's "done, last hour" and the chart count the archive's last hour
through its `archived_at` index (a job is archived after it finished, so
`archived_at` bounds the range), never the whole archive. Only what can act
on a job (retry, cancel, bulk retry) reads the jobs table alone: an archived
job is history.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    CompoundSelect,
    FromClause,
    Integer,
    Interval,
    MetaData,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    cast,
    false,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP

from ..schema import archive_table
from ..statements import FINISHED_STATUSES, status_is
from .filters import Cursor, JobFilter

HOUR = timedelta(hours=1)
# Inline, so the GROUP BY expression is textually the selected one.
MINUTE = literal_column("'minute'", Text)


def _ago(span: timedelta, name: str) -> ColumnElement[Any]:
    return func.now() - bindparam(name, span, type_=Interval)


def _ready(table: FromClause) -> ColumnElement[bool]:
    return and_(status_is(table.c.status, "queued"), table.c.run_at <= func.now())


def _archive(table: Table) -> Table:
    return archive_table(MetaData(), table.name, table.schema)


# Statuses only the jobs table holds: the archive takes finished jobs alone
# (`statements.archive` refuses others), so a list of them never reads it.
ACTIVE_LIST_STATUSES = ("ready", "scheduled", "queued", "running")


def _archived_since(archive: Table, span: timedelta, name: str) -> ColumnElement[bool]:
    """Archived jobs that finished within `span`: a job is archived after it
    finished, so `archived_at` bounds the range its index serves, and
    `finished_at` says which of those count."""
    since = _ago(span, name)
    return and_(archive.c.archived_at >= since, archive.c.finished_at >= since)


def queue_overview(table: Table) -> Select[Any]:
    """Per queue: ready, scheduled, running, failed, done in the last hour and
    the oldest ready job's age in seconds (NULL when nothing is ready).

    Done in the last hour counts the archive's jobs too (through its
    `archived_at` index: the last hour, not the archive)."""
    c = table.c
    queued = status_is(c.status, "queued")
    done_lately = and_(status_is(c.status, "done"), c.finished_at >= _ago(HOUR, "hour"))
    hot = select(
        c.queue,
        func.count().filter(_ready(table)).label("ready"),
        func.count().filter(and_(queued, c.run_at > func.now())).label("scheduled"),
        func.count().filter(status_is(c.status, "running")).label("running"),
        func.count().filter(status_is(c.status, "failed")).label("failed"),
        func.count().filter(done_lately).label("done_last_hour"),
        func.extract("epoch", func.now() - func.min(c.run_at).filter(_ready(table))).label(
            "oldest_ready_age"
        ),
    ).group_by(c.queue)
    a = _archive(table)
    zero = cast(literal_column("0"), BigInteger)
    cold = (
        select(
            a.c.queue,
            zero.label("ready"),
            zero.label("scheduled"),
            zero.label("running"),
            zero.label("failed"),
            func.count().label("done_last_hour"),
            cast(null(), hot.selected_columns.oldest_ready_age.type).label("oldest_ready_age"),
        )
        .where(status_is(a.c.status, "done"), _archived_since(a, HOUR, "archive_hour"))
        .group_by(a.c.queue)
    )
    both = union_all(hot, cold).subquery("both")
    counted = [
        cast(func.sum(both.c[name]), BigInteger).label(name)
        for name in ("ready", "scheduled", "running", "failed", "done_last_hour")
    ]
    return (
        select(both.c.queue, *counted, func.max(both.c.oldest_ready_age).label("oldest_ready_age"))
        .group_by(both.c.queue)
        .order_by(both.c.queue)
    )


def throughput(table: Table, minutes: int = 60) -> Select[Any]:
    """Jobs finished `done` and `failed` in each of the last `minutes` minutes,
    the current one included; minutes without any are there with zeros, so
    the chart's axis comes from the server's clock, not the browser's."""
    if minutes < 1:
        raise ValueError(f"minutes must be at least 1, got {minutes}")
    now = func.date_trunc(MINUTE, func.now())
    first = now - bindparam("span", timedelta(minutes=minutes - 1), type_=Interval)
    a = _archive(table)
    finished = union_all(
        *(
            select(t.c.status, func.date_trunc(MINUTE, t.c.finished_at).label("minute"))
            .where(or_(*(status_is(t.c.status, s) for s in FINISHED_STATUSES)))
            .where(t.c.finished_at >= first, *since)
            for t, since in ((table, ()), (a, (a.c.archived_at >= first,)))
        )
    ).subquery("finished")
    f = finished.c
    per = (
        select(
            f.minute,
            func.count().filter(status_is(f.status, "done")).label("done"),
            func.count().filter(status_is(f.status, "failed")).label("failed"),
        )
        .group_by(f.minute)
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


def _matching(table: FromClause, flt: JobFilter) -> list[ColumnElement[bool]]:
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


# What the list shows of each job; `last_error` last: shown cut to
# ERROR_PREVIEW, searched whole.
LISTED = (
    "id", "queue", "task", "status", "attempts", "max_attempts", "run_at", "created_at",
    "finished_at", "last_error",
)


def job_page(table: Table, flt: JobFilter, cursor: Cursor) -> Select[Any]:
    """One page of matching jobs plus one row more, which tells whether
    another page follows. Newest first; with `cursor.after` the rows come
    oldest first (walking towards newer jobs) and the caller reverses them.

    Archived jobs are listed too (`archived` is true for them) unless the
    filter asks for a status only the jobs table holds. Each table is read
    by its own primary key in the page's direction and the two are merged (a
    Merge Append under the Limit), so neither is sorted or read whole. The
    filter goes on the union, not on each side: PostgreSQL 15 pushes it down
    into both, but plans the merge only then (with the conditions written
    into each side it sorted both tables' matching rows instead).
    """
    sides: list[tuple[Table, ColumnElement[bool]]] = [(table, false())]
    if flt.status not in ACTIVE_LIST_STATUSES:
        sides.append((_archive(table), true()))
    columns = LISTED
    listed = union_all(
        *(
            select(*(t.c[name] for name in columns), archived.label("archived"))
            for t, archived in sides
        )
    ).subquery("listed")
    c = listed.c
    page = select(
        *(c[name] for name in columns[:-1]),
        func.left(c.last_error, ERROR_PREVIEW).label("last_error"),
        func.now().label("now"),
        c.archived,
    ).where(*_matching(listed, flt))
    limit = bindparam("limit", cursor.limit + 1, type_=Integer)
    if cursor.after is not None:
        return page.where(c.id > cursor.after).order_by(c.id.asc()).limit(limit)
    if cursor.before is not None:
        page = page.where(c.id < cursor.before)
    return page.order_by(c.id.desc()).limit(limit)


def job_detail(table: Table, job_id: int) -> CompoundSelect[Any]:
    """Every column of one job, the server's `now()` to age its lease by, and
    `archived_at` (NULL while the job is in the jobs table): one primary-key
    lookup in each table, on one snapshot, so a job moving meanwhile is
    found in one of them."""
    a = _archive(table)
    never = cast(null(), TIMESTAMP(timezone=True)).label("archived_at")
    return union_all(
        select(table, func.now().label("now"), never).where(table.c.id == job_id),
        select(
            *(a.c[column.name] for column in table.c), func.now().label("now"), a.c.archived_at
        ).where(a.c.id == job_id),
    )


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
