"""Running one attempt's handler inside its own error boundary (internal).

Everything that can go wrong with one job stays with that job: its payload is
decoded here (not in the claim, where one undecodable payload would strand a
whole batch), its handler's every outcome is captured as a value, and
`outcome_of` is the one function that turns that value into what the worker
records.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .attempt import Attempt, Outcome
from .capture import Captured, capture_async
from .job import Job, set_current_job
from .registry import Registry, Task
from .threads import HandlerThreads

log = logging.getLogger("sqla_jobq.worker")


class Refused(Exception):
    """A job that cannot be run at all: its failure is recorded without a call."""


class Runner:
    def __init__(self, registry: Registry, threads: HandlerThreads) -> None:
        self.registry = registry
        self.threads = threads

    async def run(self, attempt: Attempt) -> Outcome:
        """Run the attempt's handler; never raises for anything the job does."""
        try:
            task, job = self._prepare(attempt)
        except Refused as exc:
            return Outcome(error=str(exc))
        captured = await self._call(attempt, task, job)
        return outcome_of(attempt, captured)

    def _prepare(self, attempt: Attempt) -> tuple[Task[Any, Any], Job]:
        task = self.registry.get(attempt.task_name)
        if task is None:
            raise Refused(
                f"UnknownTask: task {attempt.task_name!r} is not registered on this worker"
            )
        payload = decode_payload(attempt.row["payload"])
        mismatch = task.mismatch(payload)
        if mismatch is not None:
            raise Refused(f"InvalidPayload: {mismatch}")
        return task, Job.from_row(attempt.row, payload=payload)

    async def _call(self, attempt: Attempt, task: Task[Any, Any], job: Job) -> Captured:
        context = contextvars.copy_context()
        context.run(set_current_job, job)
        call = functools.partial(task.fn, **job.payload)
        if task.is_async:
            return await _on_loop(attempt, context, _invoke(call))
        captured = await self.threads.run(functools.partial(context.run, call))
        if captured.error is None and inspect.isawaitable(captured.value):
            # A plain function that returned an awaitable (a decorator around
            # an `async def` hides it from iscoroutinefunction): the work is
            # in the awaitable, so run it here rather than drop it unawaited.
            return await _on_loop(attempt, context, captured.value)
        return captured


async def _invoke(call: Callable[[], Any]) -> Any:
    result = call()
    while inspect.isawaitable(result):
        result = await result
    return result


async def _on_loop(attempt: Attempt, context: contextvars.Context, work: Any) -> Captured:
    """Run an awaitable as the attempt's cancellable handler task."""
    handler = asyncio.create_task(capture_async(work), context=context)
    attempt.handler = handler
    try:
        return await asyncio.shield(handler)
    except asyncio.CancelledError as exc:
        if handler.cancelled():  # cancelled before its first step: nothing ran
            return Captured(error=exc)
        raise
    finally:
        attempt.handler = None


def decode_payload(raw: Any) -> dict[str, Any]:
    """The payload as keyword arguments, or `Refused` saying why not."""
    try:
        payload = json.loads(raw) if isinstance(raw, str | bytes) else raw
    except (ValueError, RecursionError) as exc:
        raise Refused(f"InvalidPayload: cannot decode the payload: {exc}") from None
    if not isinstance(payload, Mapping):
        raise Refused(f"InvalidPayload: expected a JSON object, got {type(payload).__name__}")
    return dict(payload)


def outcome_of(attempt: Attempt, captured: Captured) -> Outcome:
    """The one place a handler's result or exception becomes what is recorded."""
    exc = captured.error
    if exc is None:
        return Outcome()
    if isinstance(exc, asyncio.CancelledError):
        if attempt.cancelled is not None:
            return Outcome(error=f"CancelledError: {attempt.cancelled.value}")
        # Not asked for by the worker: something inside the handler (a
        # sub-task's cancellation, a timeout of its own) ended this attempt.
        detail = str(exc) or "the handler was cancelled, not by the worker"
        return Outcome(error=f"CancelledError: {detail}", exc=exc)
    log.error("%s raised", attempt.describe(), exc_info=exc)
    return Outcome(error=f"{type(exc).__name__}: {exc}", exc=exc)
