"""What `drain` does with one claimed row, apart from executing statements.

The sync and async drains share everything here: the same preparation as the
worker's (`execute.decode_payload`, the task's payload check), the same
classification of what a handler did (`execute.outcome_of` on a captured
value), and the same statements to record it. Only their I/O differs.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Table, Update
from sqlalchemy.sql.dml import ReturningUpdate

from .. import execute, statements
from ..attempt import Attempt, Outcome
from ..job import InvalidJob, Job, set_current_job
from ..registry import Registry, Task
from ..statements import DEFAULT_LEASE, Queues

log = logging.getLogger("sqla_jobq.testing")

# A drain that keeps finding work after this many jobs is most likely running
# a task that enqueues itself; it stops with an error instead of looping on.
MAX_JOBS = 1000


@dataclass(frozen=True)
class Ran:
    """One job `drain` ran, and what became of it.

    `outcome` is "done", "retry" (queued again, due at `retry_at`), "failed"
    (out of attempts), or "cancelled" (the handler cancelled its own job, so
    its completion matched nothing). `error` is the failure as recorded in
    `last_error`; `result` is what the handler returned.
    """

    id: int
    task: str | None
    attempt: int
    outcome: str
    error: str | None = None
    result: Any = None
    retry_at: datetime | None = None


def claim(registry: Registry, queues: Queues | None, now: datetime | None) -> Update:
    """The worker's claim, one job at a time, on the queues a worker of this
    registry would serve unless `queues` says otherwise."""
    names = [queues] if isinstance(queues, str) else list(queues or registry.queues)
    return statements.claim(registry.table, queue=names or ["default"], limit=1, now=now)


def too_many(ran: Sequence[Ran], max_jobs: int) -> None:
    if len(ran) >= max_jobs:
        raise RuntimeError(
            f"drain ran {max_jobs} jobs and more are ready (a task that enqueues itself?): "
            "pass max_jobs= to allow more"
        )


def attempt_of(row: Mapping[Any, Any]) -> Attempt:
    """The attempt `outcome_of` classifies: never cancelled, never timed out."""
    return Attempt.claimed(dict(row), DEFAULT_LEASE, DEFAULT_LEASE)


def prepare(registry: Registry, attempt: Attempt) -> tuple[Task[Any, Any], Job] | Outcome:
    """The task and job to call, or the failure to record without calling
    anything, as the worker decides it."""
    try:
        return execute.prepare(registry, attempt)
    except execute.Refused as exc:
        return Outcome(error=str(exc))


def bound(
    task: Task[Any, Any], job: Job, conn: object
) -> tuple[contextvars.Context, Callable[[], Any]]:
    """The handler call, in a context where `current_job()` is `job`; a
    transactional task gets the drain's connection as its `conn`."""
    context = contextvars.copy_context()
    context.run(set_current_job, job)
    kwargs = dict(job.payload)
    if task.transactional:
        kwargs["conn"] = conn
    return context, functools.partial(task.fn, **kwargs)


def completion(table: Table, attempt: Attempt, result: Any) -> ReturningUpdate[Any]:
    """The fenced completion storing `result`, or without it when it is not
    JSON (the worker logs that and completes the job all the same); selects
    the id if it matched."""
    job_id, attempts = attempt.key
    try:
        stmt = statements.complete(table, job_id, attempts, result)
    except InvalidJob as exc:
        log.warning("%s: result not stored: %s", attempt.describe(), exc)
        stmt = statements.complete(table, job_id, attempts)
    return stmt.returning(table.c.id)


def failure(table: Table, attempt: Attempt, error: str) -> Update:
    return statements.fail(table, attempt.key[0], attempt.key[1], error)


def ran(attempt: Attempt, outcome: Outcome, kind: str, retry_at: datetime | None = None) -> Ran:
    return Ran(
        id=attempt.key[0],
        task=attempt.task_name,
        attempt=attempt.key[1],
        outcome=kind,
        error=outcome.error,
        result=outcome.result,
        retry_at=retry_at,
    )


def completed(attempt: Attempt, outcome: Outcome, matched: Row[Any] | None) -> Ran:
    # Nobody else can take a job the drain's transaction holds locked: only
    # the handler itself, on the same connection, can have ended it.
    return ran(attempt, outcome, "done" if matched is not None else "cancelled")


def failed(attempt: Attempt, outcome: Outcome, row: Row[Any] | None) -> Ran:
    if row is None:
        return ran(attempt, outcome, "cancelled")
    if row.status == "failed":
        return ran(attempt, outcome, "failed")
    return ran(attempt, outcome, "retry", row.run_at)


def aborted(exc: Exception) -> Outcome:
    """The failure of a handler that left the transaction unusable."""
    return Outcome(error=f"{type(exc).__name__}: the handler left the transaction failed: {exc}")
