"""Running one attempt's handler inside its own error boundary (internal).

Everything that can go wrong with one job stays with that job: its payload is
decoded here (not in the claim, where one undecodable payload would strand a
whole batch), its handler's every outcome is captured as a value, and
`outcome_of` is the one function that turns that value into what the worker
records.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .attempt import Attempt, Cancel, Outcome
from .capture import Captured, capture_async
from .job import CancelSignal, Job, LeaseLost, decode_json, is_mapping, set_current_job
from .observe import Observer
from .registry import Registry, Task
from .threads import HandlerThreads
from .transactions import Completed, Transactions

log = logging.getLogger("sqla_jobq.worker")


class Refused(Exception):
    """A job that cannot be run at all: its failure is recorded without a call."""


class OnThread:
    """A plain handler handed to a handler thread by `Runner.start`."""

    __slots__ = ("context", "future")

    def __init__(self, future: asyncio.Future[Captured], context: contextvars.Context) -> None:
        self.future = future
        self.context = context


# What `Runner.start` returns: a plain handler's thread, or an outcome to await.
Started = OnThread | Callable[[], Awaitable[Outcome]]


class Runner:
    def __init__(
        self,
        registry: Registry,
        threads: HandlerThreads,
        observers: Sequence[Observer] = (),
        transactions: Transactions | None = None,
    ) -> None:
        self.registry = registry
        self.threads = threads
        # Only observers with a `handler_context` of their own are entered
        # around each handler: an ExitStack and a generator per job, for one
        # that yields and does nothing, was a tenth of a no-op job's cost.
        self.in_handler = [
            o for o in observers if type(o).handler_context is not Observer.handler_context
        ]
        self.transactions = transactions

    def start(self, attempt: Attempt) -> Started:
        """Start the attempt's handler: for a plain one, the thread it was
        handed to (`OnThread`, then `after_thread`); otherwise a function
        giving its outcome to await. Neither raises for anything the job does.

        A plain handler is handed to a thread here and now, so the thread wakes
        while the worker's loop goes on with its turn, rather than a turn
        later when a task awaiting it first runs: that turn was a tenth of an
        idle worker's pickup latency. An async handler starts when awaited.
        """
        try:
            task, job = prepare(self.registry, attempt)
        except Refused as exc:
            return outcome_now(Outcome(error=str(exc)))
        context = contextvars.copy_context()
        if task.is_async:
            call = self._in(context, task, job)
            work = functools.partial(_invoke, call)
            if self.in_handler:
                work = functools.partial(self._observed_async, job, attempt.row, call)
            return lambda: self._outcome(attempt, _on_loop(attempt, context, work()))
        run = self._plain(task, job, attempt.row, context)
        return OnThread(self.threads.run(run), context)

    def start_plain(
        self,
        row: dict[str, Any],
        cancel_event: CancelSignal,
        base: contextvars.Context,
        loop: asyncio.AbstractEventLoop,
    ) -> tuple[OnThread, Callable[[], object]] | None:
        """From any thread (the listener's, see `sqla_jobq.pickup`; a handler
        thread's, see `sqla_jobq.ready`): a claimed row's plain handler made
        ready to run in a copy of `base`, the worker's context: what the loop
        awaits, and the handler's call, to run on that thread. None for an
        async handler or a job refused (the loop starts those)."""
        try:
            task, job = prepare_row(self.registry, row, cancel_event)
        except Refused:
            return None
        if task.is_async:
            return None
        context = base.copy()
        run = self._plain(task, job, row, context)
        future: asyncio.Future[Captured] = asyncio.Future(loop=loop)
        return OnThread(future, context), run

    def _plain(
        self, task: Task[Any, Any], job: Job, row: dict[str, Any], context: contextvars.Context
    ) -> Callable[[], object]:
        """A plain handler's call, inside `context` (the job set there) and
        every observer's `handler_context`."""
        call = self._in(context, task, job)
        if self.in_handler:
            call = functools.partial(self._observed, job, row, call)
        return functools.partial(context.run, call)

    def after_thread(
        self, attempt: Attempt, on_thread: OnThread
    ) -> Outcome | Callable[[], Awaitable[Outcome]]:
        """The outcome of a plain handler whose thread has finished; or, if it
        returned an awaitable (a decorator around an `async def` hides it from
        iscoroutinefunction), the outcome of running that, to await: the work
        is in the awaitable, so it runs rather than being dropped unawaited."""
        captured = on_thread.future.result()
        value = captured.value
        if value is not None and captured.error is None and inspect.isawaitable(value):
            return lambda: self._outcome(attempt, _on_loop(attempt, on_thread.context, value))
        return outcome_of(attempt, captured)

    async def _outcome(self, attempt: Attempt, captured: Awaitable[Captured]) -> Outcome:
        return outcome_of(attempt, await captured)

    def _in(
        self, context: contextvars.Context, task: Task[Any, Any], job: Job
    ) -> Callable[[], Any]:
        """The handler's call, with `current_job()` set to `job` in `context`
        (which the call must then run in)."""
        context.run(set_current_job, job)
        return self._callable(task, job)

    def _callable(self, task: Task[Any, Any], job: Job) -> Callable[[], Any]:
        call = functools.partial(task.fn, **job.payload)
        if not task.transactional:
            return call
        if self.transactions is None:
            raise RuntimeError("transactional tasks need a Runner with Transactions")
        if task.is_async:
            return functools.partial(self.transactions.run_async, task.table, job, call)
        return functools.partial(self.transactions.run, task.table, job, call)

    def _contexts(self, job: Job, row: dict[str, Any]) -> contextlib.ExitStack:
        """Every observer's `handler_context`, entered around one handler call."""
        stack = contextlib.ExitStack()
        for observer in self.in_handler:
            stack.enter_context(observer.handler_context(job, row))
        return stack

    def _observed(self, job: Job, row: dict[str, Any], call: Callable[[], Any]) -> Any:
        with self._contexts(job, row):
            return call()

    async def _observed_async(self, job: Job, row: dict[str, Any], call: Callable[[], Any]) -> Any:
        with self._contexts(job, row):
            return await _invoke(call)


def outcome_now(outcome: Outcome) -> Callable[[], Awaitable[Outcome]]:
    """What `Runner.start` returns for an attempt that is over before it began."""

    async def now() -> Outcome:
        return outcome

    return now


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


def prepare(registry: Registry, attempt: Attempt) -> tuple[Task[Any, Any], Job]:
    """The task and the job to call it with, or `Refused` saying why the
    attempt fails without a call (the worker and `testing.drain` alike)."""
    return prepare_row(registry, attempt.row, attempt.cancel_event)


def prepare_row(
    registry: Registry, row: dict[str, Any], cancel_event: CancelSignal
) -> tuple[Task[Any, Any], Job]:
    """`prepare` for a claimed row whose `Attempt` is not built yet."""
    name = row["task"]
    task = registry.get(name)
    if task is None:
        raise Refused(f"UnknownTask: task {name!r} is not registered on this worker")
    payload = decode_payload(row["payload"])
    mismatch = task.mismatch(payload)
    if mismatch is not None:
        raise Refused(f"InvalidPayload: {mismatch}")
    return task, Job.from_row(row, payload=payload, cancel_event=cancel_event)


def decode_payload(raw: Any) -> dict[str, Any]:
    """The payload as keyword arguments, or `Refused` saying why not."""
    try:
        payload = decode_json(raw) if isinstance(raw, str | bytes) else raw
    except (ValueError, RecursionError) as exc:
        raise Refused(f"InvalidPayload: cannot decode the payload: {exc}") from None
    if not is_mapping(payload):
        raise Refused(f"InvalidPayload: expected a JSON object, got {type(payload).__name__}")
    return dict(payload)


# The outcome of every handler that returned None: Outcome is immutable, so
# one value serves them all.
SUCCEEDED = Outcome()


def outcome_of(attempt: Attempt, captured: Captured) -> Outcome:
    """The one place a handler's result or exception becomes what is recorded."""
    exc = captured.error
    if exc is None:
        if captured.value is None:
            return SUCCEEDED
        if isinstance(captured.value, Completed):
            return Outcome(result=captured.value.value, settled="done")
        return Outcome(result=captured.value)
    if isinstance(exc, LeaseLost):
        log.warning("%s: %s; its transaction was rolled back", attempt.describe(), exc)
        return Outcome(error=f"LeaseLost: {exc}", settled="lost")
    if isinstance(exc, asyncio.CancelledError):
        if attempt.cancelled is Cancel.TIMEOUT:
            return timed_out(attempt)
        if attempt.cancelled is not None:
            return Outcome(error=f"CancelledError: {attempt.cancelled.value}")
        # Not asked for by the worker: something inside the handler (a
        # sub-task's cancellation, a timeout of its own) ended this attempt.
        detail = str(exc) or "the handler was cancelled, not by the worker"
        return Outcome(error=f"CancelledError: {detail}", exc=exc)
    log.error("%s raised", attempt.describe(), exc_info=exc)
    return Outcome(error=f"{type(exc).__name__}: {exc}", exc=exc)


def timed_out(attempt: Attempt) -> Outcome:
    """The failure recorded for an attempt that outran its task's timeout."""
    return Outcome(error=f"TimeoutError: {attempt.task_name} ran longer than its timeout")
