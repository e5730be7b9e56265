"""The worker: claim, run, finish, and look after leases.

One asyncio loop drives everything. Claims are committed the moment they are
made (autocommit), so no transaction is open while a handler runs; `async def`
handlers run as tasks, plain functions on a thread pool. Completions are
batched into one fenced statement per flush; failures, lease extensions and
releases are fenced too, and a fenced statement that matches no row means the
job was taken away: the worker logs it and touches nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import psycopg

from .driver import ClaimedRow, Driver
from .notify import Listener
from .registry import Job, Registry, set_current_job
from .schema import names_of

log = logging.getLogger("sqla_jobq.worker")

T = TypeVar("T")

RETRY_START = 0.1
RETRY_MAX = 5.0
FINISH_RETRIES = 12
PRUNE_BATCH = 10_000


@dataclass(frozen=True)
class WorkerOptions:
    """What `jobq worker` takes on its command line."""

    database_url: str
    listen_url: str | None = None
    queues: Sequence[str] = ()
    concurrency: int = 10
    burst: bool = False
    poll_interval: float = 5.0
    shutdown_timeout: float = 30.0
    reap_interval: float = 30.0
    prepared: bool = True
    prune_older_than: timedelta | None = None
    prune_interval: float = 3600.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        for what in ("poll_interval", "shutdown_timeout", "reap_interval"):
            if getattr(self, what) < 0:
                raise ValueError(f"{what.replace('_', '-')} must not be negative")


@dataclass
class Running:
    """A job this worker claimed and has not yet finished recording."""

    row: ClaimedRow
    lease: timedelta
    started: float
    extended: float
    lost: bool = False
    handler_done: bool = False
    task: asyncio.Task[Any] | None = field(default=None, repr=False)


class Finisher:
    """Batches completions into one fenced `complete_many` per flush.

    While one flush is in flight, later completions queue up and go together
    in the next: the busier the worker, the bigger the batches.
    """

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.pending: list[tuple[int, int, asyncio.Future[bool]]] = []
        self.kick = asyncio.Event()

    def complete(self, job_id: int, attempts: int) -> asyncio.Future[bool]:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.pending.append((job_id, attempts, future))
        self.kick.set()
        return future

    async def run(self) -> None:
        while True:
            await self.kick.wait()
            self.kick.clear()
            await self.flush()

    async def flush(self) -> None:
        batch, self.pending = self.pending, []
        if not batch:
            return
        pairs = [(job_id, attempts) for job_id, attempts, _ in batch]
        try:
            owned = await retrying("record completions", lambda: self.driver.complete_many(pairs))
        except psycopg.Error as exc:
            for *_, future in batch:
                future.set_exception(exc)
            return
        for job_id, _, future in batch:
            future.set_result(job_id in owned)


async def retrying(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """Retry a statement across lost connections, with backoff, a bounded number of times.

    Fenced statements are safe to repeat: one that already took effect
    matches no row the second time.
    """
    delay = RETRY_START
    for attempt in range(FINISH_RETRIES):
        try:
            return await call()
        except psycopg.OperationalError as exc:
            if attempt == FINISH_RETRIES - 1:
                raise
            log.warning("could not %s (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)
    raise AssertionError("unreachable")


class Worker:
    def __init__(self, registry: Registry, options: WorkerOptions) -> None:
        self.registry = registry
        self.options = options
        self.queues = list(options.queues) or registry.queues or ["default"]
        leases = [t.lease for t in registry.tasks.values()] or [timedelta(minutes=5)]
        self.claim_lease = min(leases)
        self.claimer = self._driver()
        self.finisher = Finisher(self._driver())
        self.active: dict[int, Running] = {}
        self.executing = 0
        self.event = asyncio.Event()
        self.stopping = False
        self.last_reap = float("-inf")
        self.last_prune = float("-inf")
        self.job_tasks: set[asyncio.Task[None]] = set()
        self.executor = ThreadPoolExecutor(options.concurrency, thread_name_prefix="jobq")
        self.processed = 0

    def _driver(self) -> Driver:
        o = self.options
        table = self.registry.table
        return Driver(o.database_url, table, self.queues, self.claim_lease, o.prepared)

    async def run(self, *, handle_signals: bool = True) -> int:
        """Work until stopped (or, with `burst`, until nothing is ready); exit status.

        With `handle_signals`, SIGTERM/SIGINT stop the worker gracefully and a
        second one exits the process at once; an app embedding the worker in
        another thread passes False and calls `stop()` instead.
        """
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal)
        helpers = [
            asyncio.create_task(self.finisher.run(), name="finisher"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
        ]
        listener = None
        if not self.options.burst:
            listener = Listener(
                self.options.listen_url or self.options.database_url,
                names_of(self.registry.table).channel,
                self.queues,
                self.wake,
            )
            helpers.append(asyncio.create_task(listener.run(), name="listener"))
        log.info(
            "worker started: queues=%s concurrency=%d%s",
            ",".join(self.queues),
            self.options.concurrency,
            " burst" if self.options.burst else "",
        )
        try:
            await self._claim_loop()
            await self._shutdown()
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if listener is not None:
                await listener.stop()
            await self.claimer.close()
            await self.finisher.driver.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
            for sig in signals:
                loop.remove_signal_handler(sig)
        log.info("worker stopped after %d jobs", self.processed)
        return 0

    def wake(self) -> None:
        self.event.set()

    def stop(self) -> None:
        """Stop claiming; running jobs get `shutdown_timeout` to finish."""
        log.info("stopping: no new claims; waiting up to %ss", self.options.shutdown_timeout)
        self.stopping = True
        self.wake()

    def _on_signal(self) -> None:
        if self.stopping:
            log.warning("second signal: exiting now; unfinished leases will expire and be reaped")
            logging.shutdown()
            os._exit(1)
        self.stop()

    async def _claim_loop(self) -> None:
        delay = RETRY_START
        while not self.stopping:
            free = self.options.concurrency - self.executing
            if free <= 0:
                await self._wait(None)
                continue
            self.event.clear()
            try:
                await self._maintain()
                rows = await self.claimer.claim(free)
            except psycopg.Error as exc:
                log.warning("claim failed (%s); retrying in %.1fs", exc, delay)
                await self._wait(delay, interruptible=False)
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY_START
            for row in rows:
                self._start(row)
            if len(rows) == free:
                continue
            if self.options.burst:
                if self.executing == 0 and not rows:
                    return
                await self._wait(None)
                continue
            await self._wait(await self._idle_timeout())

    async def _idle_timeout(self) -> float:
        """Sleep until the next scheduled job is due, or the poll interval."""
        timeout = self.options.poll_interval
        try:
            due = await self.claimer.seconds_until_next()
        except psycopg.Error as exc:
            log.warning("could not look up the next scheduled job: %s", exc)
            return min(timeout, RETRY_MAX)
        return timeout if due is None else min(timeout, due)

    async def _wait(self, timeout: float | None, *, interruptible: bool = True) -> None:
        if not interruptible:
            await asyncio.sleep(timeout or 0)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()

    async def _maintain(self) -> None:
        """Reap and prune when due, piggybacked on claims.

        Riding on the claim loop means an idle worker runs them only when it
        wakes anyway, so maintenance never keeps a serverless compute awake.
        """
        now = time.monotonic()
        if now - self.last_reap >= self.options.reap_interval:
            self.last_reap = now
            for job_id, status, attempts in await self.claimer.reap():
                log.warning(
                    "reaped job %d (attempt %d, lease expired): now %s", job_id, attempts, status
                )
        older_than = self.options.prune_older_than
        if older_than is not None and now - self.last_prune >= self.options.prune_interval:
            self.last_prune = now
            await self._prune(older_than)

    async def _prune(self, older_than: timedelta) -> None:
        total = 0
        while (count := await self.claimer.prune(older_than, PRUNE_BATCH)) > 0:
            total += count
            if count < PRUNE_BATCH:
                break
        if total:
            log.info("pruned %d finished jobs older than %s", total, older_than)

    def _start(self, row: ClaimedRow) -> None:
        task = self.registry.get(row.task)
        lease = task.lease if task is not None else self.claim_lease
        now = time.monotonic()
        # The claim leased it for `claim_lease` (the shortest of all tasks),
        # not its own: date the last extension back so the first heartbeat is
        # due a third of the way into the claim lease, not into the task's.
        head_start = (lease - self.claim_lease).total_seconds() / 3
        self.active[row.id] = Running(row, lease, now, now - head_start)
        self.executing += 1
        job_task = asyncio.create_task(self._execute(row))
        self.job_tasks.add(job_task)
        job_task.add_done_callback(self.job_tasks.discard)

    async def _execute(self, row: ClaimedRow) -> None:
        entry = self.active[row.id]
        try:
            error = await self._call(entry)
        finally:
            entry.handler_done = True
            self.executing -= 1
            self.wake()
        try:
            outcome = "lost" if entry.lost else await self._finish(row, error)
        except psycopg.Error as exc:
            outcome = f"unrecorded ({exc}); the lease will expire and the job run again"
        finally:
            self.active.pop(row.id, None)
        self.processed += 1
        log.info(
            "job %d task=%s attempt=%d duration=%.1fms outcome=%s",
            row.id,
            row.task,
            row.attempts,
            (time.monotonic() - entry.started) * 1000,
            outcome,
        )

    async def _call(self, entry: Running) -> str | None:
        """Run the handler; None on success, else the error to record."""
        row = entry.row
        task = self.registry.get(row.task)
        if task is None:
            return f"UnknownTask: task {row.task!r} is not registered on this worker"
        if not isinstance(row.payload, dict):
            return f"InvalidPayload: expected a JSON object, got {type(row.payload).__name__}"
        try:
            task.signature.bind(**row.payload)
        except TypeError as exc:
            return f"InvalidPayload: payload does not match {task.name}{task.signature}: {exc}"
        context = contextvars.copy_context()
        job = Job(row.id, row.task, row.queue, row.payload, row.attempts, row.max_attempts)
        context.run(set_current_job, job)
        try:
            if task.is_async:
                entry.task = asyncio.create_task(task.fn(**row.payload), context=context)
                await entry.task
            else:
                call = functools.partial(context.run, task.fn, **row.payload)
                await asyncio.get_running_loop().run_in_executor(self.executor, call)
        except asyncio.CancelledError:
            if entry.lost:
                return "cancelled: lease lost"
            raise
        except (Exception, SystemExit) as exc:
            log.error("job %d task=%s raised", row.id, row.task, exc_info=exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    async def _finish(self, row: ClaimedRow, error: str | None) -> str:
        if error is None:
            owned = await self.finisher.complete(row.id, row.attempts)
            return "done" if owned else "lost (no longer ours; not completed)"
        result = await retrying(
            "record a failure", lambda: self.finisher.driver.fail(row.id, row.attempts, error)
        )
        if result is None:
            return "lost (no longer ours; failure not recorded)"
        status, retry_in = result
        return f"failed ({error})" if status == "failed" else f"retry in {retry_in:.0f}s ({error})"

    async def _heartbeat(self) -> None:
        """Extend the leases of jobs running for a third of their lease."""
        tick = max(0.05, min(5.0, self.claim_lease.total_seconds() / 6))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            due: dict[timedelta, list[Running]] = defaultdict(list)
            for entry in self.active.values():
                if not entry.lost and now - entry.extended >= entry.lease.total_seconds() / 3:
                    due[entry.lease].append(entry)
            for lease, entries in due.items():
                await self._extend(lease, entries, now)

    async def _extend(self, lease: timedelta, entries: list[Running], now: float) -> None:
        pairs = [(e.row.id, e.row.attempts) for e in entries]
        try:
            owned = await self.finisher.driver.extend_leases(pairs, lease)
        except psycopg.Error as exc:
            log.warning("could not extend %d leases (%s); will retry", len(pairs), exc)
            return
        for entry in entries:
            if entry.row.id in owned:
                entry.extended = now
            elif entry.row.id in self.active:
                self._lose(entry)

    def _lose(self, entry: Running) -> None:
        entry.lost = True
        log.warning(
            "job %d task=%s attempt=%d: lease lost (reaped or taken over); "
            "it will not be completed by this worker",
            entry.row.id,
            entry.row.task,
            entry.row.attempts,
        )
        if entry.task is not None:
            entry.task.cancel()

    async def _shutdown(self) -> None:
        """Let running jobs finish within the timeout, then hand the rest back."""
        if self.job_tasks:
            log.info("waiting for %d running jobs", len(self.job_tasks))
            await asyncio.wait(set(self.job_tasks), timeout=self.options.shutdown_timeout)
        for entry in list(self.active.values()):
            if entry.lost or entry.handler_done:
                continue
            entry.lost = True
            released = await self.finisher.driver.release(entry.row.id, entry.row.attempts)
            log.warning(
                "job %d task=%s attempt=%d: unfinished at shutdown, %s",
                entry.row.id,
                entry.row.task,
                entry.row.attempts,
                "returned to the queue" if released else "no longer ours",
            )
            if entry.task is not None:
                entry.task.cancel()
        for job_task in self.job_tasks:
            job_task.cancel()
        await asyncio.gather(*self.job_tasks, return_exceptions=True)
        await self.finisher.flush()
