"""What is waiting in the queue, for assertions: `enqueued_jobs`, `assert_enqueued`.

Both read through the caller's connection, so they see jobs its own
uncommitted transaction enqueued. On an `AsyncConnection` or `AsyncSession`,
call them through `run_sync`: ``await conn.run_sync(assert_enqueued, registry,
send_receipt, order_id=1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, Table, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ..registry import Registry, Task
from ..statements import status_is

# At most this many queued jobs are listed in a failed assertion's message.
SHOWN = 20


@dataclass(frozen=True)
class EnqueuedJob:
    """A queued job: due now, scheduled for later, or waiting for its retry."""

    id: int
    task: str | None
    queue: str
    payload: Any
    run_at: datetime
    priority: int
    attempts: int
    max_attempts: int
    unique_key: str | None

    def describe(self) -> str:
        return f"#{self.id} {self.task}({self.payload}) queue={self.queue} run_at={self.run_at}"


def _table(where: Table | Registry) -> Table:
    return where.table if isinstance(where, Registry) else where


def _name(task: str | Task[Any, Any]) -> str:
    return task.name if isinstance(task, Task) else task


def queued(table: Table, task: str | None = None) -> Select[Any]:
    """Queued jobs, in the order of their `run_at`, then ids."""
    c = table.c
    stmt = select(
        c.id, c.task, c.queue, c.payload, c.run_at, c.priority, c.attempts, c.max_attempts,
        c.unique_key,
    ).where(status_is(c.status, "queued"))
    if task is not None:
        stmt = stmt.where(c.task == task)
    return stmt.order_by(c.run_at, c.id)


def enqueued_jobs(
    conn: Connection | Session,
    table_or_registry: Table | Registry,
    task: str | Task[Any, Any] | None = None,
) -> list[EnqueuedJob]:
    """The queued jobs (of `task` only, if given), soonest due first."""
    name = None if task is None else _name(task)
    rows = conn.execute(queued(_table(table_or_registry), name)).mappings()
    return [EnqueuedJob(**row) for row in rows]


def assert_enqueued(
    conn: Connection | Session,
    table_or_registry: Table | Registry,
    task: str | Task[Any, Any],
    /,
    **payload_subset: Any,
) -> list[EnqueuedJob]:
    """The queued jobs of `task` whose payload holds every given keyword
    argument with that value (at least one, else AssertionError listing what
    is queued)."""
    name = _name(task)
    jobs = enqueued_jobs(conn, table_or_registry)
    found = [j for j in jobs if j.task == name and _holds(j.payload, payload_subset)]
    if found:
        return found
    listed = "\n".join(f"  {j.describe()}" for j in jobs[:SHOWN]) or "  (none)"
    more = f"\n  ... and {len(jobs) - SHOWN} more" if len(jobs) > SHOWN else ""
    raise AssertionError(
        f"no queued job of task {name} with payload including {payload_subset}; "
        f"queued jobs:\n{listed}{more}"
    )


def _holds(payload: Any, subset: dict[str, Any]) -> bool:
    return isinstance(payload, dict) and all(
        key in payload and payload[key] == value for key, value in subset.items()
    )
