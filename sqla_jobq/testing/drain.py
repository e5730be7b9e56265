"""Running ready jobs in-process, inside the caller's transaction.

`drain` is the worker without the worker: the same claim (so paused queues,
concurrency limits, SKIP LOCKED and `run_at` all hold), the same outcome
classification, the same fenced `complete` (result stored) and `fail`
(retry with backoff, or failed for good), all on the caller's `Connection`
or `Session`, which it never commits. A test that runs it inside an outer
transaction rolled back at the end leaves nothing behind.

Each job's handler and completion run inside a SAVEPOINT: a handler whose
SQL fails on the drain's connection (a transactional task's `conn`) rolls
back to it, and its failure is recorded like any other.

`now` replaces the claim's clock, so a test moves time forward to run
scheduled jobs and retries without sleeping. The retry times `fail` writes
still come from the server's clock, which inside a transaction stands still
at its start: `drain(now=...)` runs every job and retry due by then.
"""

from __future__ import annotations

import asyncio
import inspect
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from ..attempt import Attempt, Outcome
from ..capture import Captured, capture, capture_async
from ..execute import outcome_of
from ..registry import Registry
from ..statements import Queues
from . import steps
from .steps import MAX_JOBS, Ran


def drain(
    conn: Connection | Session,
    registry: Registry,
    queues: Queues | None = None,
    now: datetime | None = None,
    *,
    max_jobs: int = MAX_JOBS,
) -> list[Ran]:
    """Run every ready job of `registry`'s queues (or `queues`), one at a time,
    until none is ready (jobs the handlers enqueue included); what happened
    to each, in order. `async def` handlers run in a loop of their own."""
    claim = steps.claim(registry, queues, now)
    done: list[Ran] = []
    while (row := conn.execute(claim).mappings().first()) is not None:
        steps.too_many(done, max_jobs)
        done.append(_run(conn, registry, steps.attempt_of(row)))
    return done


def _run(conn: Connection | Session, registry: Registry, attempt: Attempt) -> Ran:
    table = registry.table
    savepoint = conn.begin_nested()
    prepared = steps.prepare(registry, attempt)
    if isinstance(prepared, Outcome):
        outcome = prepared
    else:
        task, job = prepared
        own = conn.connection() if isinstance(conn, Session) else conn
        context, call = steps.bound(task, job, own)
        captured = context.run(capture, call)
        if captured.error is None and inspect.isawaitable(captured.value):
            captured = context.run(_run_awaitable, task.name, captured.value)
        outcome = outcome_of(attempt, captured)
    if outcome.ok:
        try:
            matched = conn.execute(steps.completion(table, attempt, outcome.result)).first()
        except DBAPIError as exc:
            outcome = steps.aborted(exc)
        else:
            savepoint.commit()
            return steps.completed(attempt, outcome, matched)
    savepoint.rollback()
    assert outcome.error is not None
    row = conn.execute(steps.failure(table, attempt, outcome.error)).first()
    return steps.failed(attempt, outcome, row)


def _run_awaitable(name: str, awaitable: Any) -> Captured:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(capture_async(awaitable))
    if inspect.iscoroutine(awaitable):
        awaitable.close()
    raise RuntimeError(
        f"drain() cannot await task {name} inside a running event loop: use drain_async()"
    )


async def drain_async(
    conn: AsyncConnection | AsyncSession,
    registry: Registry,
    queues: Queues | None = None,
    now: datetime | None = None,
    *,
    max_jobs: int = MAX_JOBS,
) -> list[Ran]:
    """`drain` on an `AsyncConnection` or `AsyncSession`: `async def` handlers
    are awaited on the caller's loop, plain ones called directly."""
    claim = steps.claim(registry, queues, now)
    done: list[Ran] = []
    while (row := (await conn.execute(claim)).mappings().first()) is not None:
        steps.too_many(done, max_jobs)
        done.append(await _run_async(conn, registry, steps.attempt_of(row)))
    return done


async def _run_async(
    conn: AsyncConnection | AsyncSession, registry: Registry, attempt: Attempt
) -> Ran:
    table = registry.table
    savepoint = await conn.begin_nested()
    prepared = steps.prepare(registry, attempt)
    if isinstance(prepared, Outcome):
        outcome = prepared
    else:
        task, job = prepared
        own = await conn.connection() if isinstance(conn, AsyncSession) else conn
        context, call = steps.bound(task, job, own)
        captured = context.run(capture, call)
        if captured.error is None and inspect.isawaitable(captured.value):
            handler = asyncio.create_task(capture_async(captured.value), context=context)
            captured = await handler
        outcome = outcome_of(attempt, captured)
    if outcome.ok:
        try:
            result = await conn.execute(steps.completion(table, attempt, outcome.result))
        except DBAPIError as exc:
            outcome = steps.aborted(exc)
        else:
            await savepoint.commit()
            return steps.completed(attempt, outcome, result.first())
    await savepoint.rollback()
    assert outcome.error is not None
    row = (await conn.execute(steps.failure(table, attempt, outcome.error))).first()
    return steps.failed(attempt, outcome, row)
