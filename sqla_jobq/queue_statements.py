"""Pure builders for a queue's settings: pause, resume, concurrency limit.

A queue needs no row to exist: without one it is neither paused nor limited.
These upsert its row in `<table>_queues` and execute nothing, so they run in
the caller's transaction (an app's migration, an admin script, a request).
The claim reads that table inside its own statement (`statements.claim`), so
a setting holds for every worker on every host from its commit on, workers
started later included; a row trigger wakes the workers when a queue may
hand out more (resumed, limit changed).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    MetaData,
    Select,
    Table,
    Text,
    any_,
    bindparam,
    false,
    func,
    or_,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningInsert

from .job import InvalidJob, check_short_text
from .schema import queues_table
from .statements import status_is

MAX_LIMIT = 2**31 - 1  # the column is an int


def pause(table: Table, queue: str) -> ReturningInsert[Any]:
    """Stop `queue` handing out jobs; running jobs finish as usual."""
    return _upsert(table, queue, paused=true())


def resume(table: Table, queue: str) -> ReturningInsert[Any]:
    """Let a paused `queue` hand out jobs again (its limit, if any, still holds)."""
    return _upsert(table, queue, paused=false())


def set_concurrency_limit(table: Table, queue: str, limit: int | None) -> ReturningInsert[Any]:
    """At most `limit` jobs of `queue` running at once across all workers;
    `None` or 0 removes the limit. Lowering it below the jobs running now
    stops nothing: claims wait until enough of them have finished."""
    return _upsert(table, queue, concurrency_limit=_limit_value(limit))


def settings(table: Table) -> Select[Any]:
    """Every paused or limited queue, with its running jobs and the jobs
    enqueued since its setting last changed (a paused queue's growing backlog)."""
    s = queues_table(MetaData(), table.name, table.schema).c
    c = table.c
    # The limit's own count (see `migrations.steps._claim_slots_body`), which
    # the running index serves: running jobs hold a lease.
    running = select(func.count()).where(
        c.queue == s.name, status_is(c.status, "running"), c.locked_until.is_not(None)
    )
    arrived = select(func.count()).where(
        c.queue == s.name, status_is(c.status, "queued"), c.created_at > s.updated_at
    )
    return (
        select(
            s.name.label("queue"),
            s.paused,
            s.concurrency_limit,
            s.updated_at,
            running.scalar_subquery().label("running"),
            arrived.scalar_subquery().label("queued_since_change"),
        )
        .where(or_(s.paused, s.concurrency_limit.is_not(None)))
        .order_by(s.name)
    )


def limited(table: Table, queues: list[str]) -> Select[Any]:
    """Which of `queues` have a concurrency limit: a worker claims no jobs
    ahead of its free slots for them, since a job waiting in one worker's
    buffer would hold a slot another worker could run."""
    s = queues_table(MetaData(), table.name, table.schema).c
    names = bindparam("queues", queues, type_=ARRAY(Text))
    return select(s.name).where(s.name == any_(names), s.concurrency_limit.is_not(None))


def _upsert(table: Table, queue: str, **values: ColumnElement[Any]) -> ReturningInsert[Any]:
    s = queues_table(MetaData(), table.name, table.schema)
    name = bindparam("queue", queue_name(queue), type_=Text)
    insert = pg_insert(s).values(name=name, **values)
    changed = {key: insert.excluded[key] for key in values}
    return insert.on_conflict_do_update(
        index_elements=[s.c.name], set_={**changed, "updated_at": func.now()}
    ).returning(s.c.name, s.c.paused, s.c.concurrency_limit)


def queue_name(queue: str) -> str:
    """A queue name a setting can be stored under, or InvalidJob saying why not."""
    if isinstance(queue, str) and not queue:
        raise InvalidJob("the queue name must not be empty")
    return check_short_text("queue", queue)


def _limit_value(limit: int | None) -> ColumnElement[Any]:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise InvalidJob(f"the concurrency limit must be a whole number, not {limit!r}")
    if limit is not None and not 0 <= limit <= MAX_LIMIT:
        raise InvalidJob(
            f"the concurrency limit must be between 1 and {MAX_LIMIT:,} (0 or none removes it), "
            f"got {limit}"
        )
    return bindparam("concurrency_limit", limit or None, type_=Integer)
