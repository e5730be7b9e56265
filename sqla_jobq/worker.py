"""The worker: claim, run, finish, and look after leases.

One asyncio loop drives everything. Claims are committed the moment they are
made (autocommit), so no transaction is open while a handler runs; `async def`
handlers run as tasks, plain functions on handler threads. Completions are
batched into one fenced statement per flush; failures, lease extensions and
releases are fenced too, and a fenced statement that matches no row means the
job was taken away: the worker logs it and touches nothing else.

Round trips per job, not SQL, set the pace, so the hot path is batched end to
end: claims come in batches (with a small prefetch buffer while jobs are
short, so the next claim is in flight while the last batch runs), finished
sync handlers come back to the loop in batches, and completions go out in
batches.
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
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg

from .driver import Driver
from .finisher import RETRY_MAX, RETRY_START, Finisher, retrying
from .notify import Listener
from .registry import Job, Registry, set_current_job
from .schema import names_of
from .threads import HandlerThreads

log = logging.getLogger("sqla_jobq.worker")

PRUNE_BATCH = 10_000
# The prefetch buffer holds about this much work (estimated from a moving
# average of handler durations), so a prefetched job waits about this long
# for a slot: for no-op jobs that is dozens of jobs, for 10 ms jobs a few, and
# jobs longer than that are not prefetched at all (a claim's round trip is
# noise next to them).
PREFETCH_SECONDS = 0.01
DEFAULT_PREFETCH = 64
HANDOFF_SECONDS = 0.0005


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
    # At most this many jobs claimed beyond the free slots, and only while
    # jobs are short (see PREFETCH_SECONDS); 0 turns prefetching off. Their
    # leases run (and are extended) while they wait.
    prefetch: int = DEFAULT_PREFETCH

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must not be negative, got {self.prefetch}")
        for what in ("poll_interval", "shutdown_timeout", "reap_interval", "prune_interval"):
            if getattr(self, what) < 0:
                raise ValueError(f"{what.replace('_', '-')} must not be negative")


@dataclass
class Running:
    """A job this worker claimed and has not yet finished recording."""

    row: Job
    lease: timedelta
    started: float
    extended: float
    lost: bool = False
    handler_done: bool = False
    task: asyncio.Task[Any] | None = field(default=None, repr=False)


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
        self.ready: deque[Running] = deque()  # claimed, waiting for a free slot
        self.executing = 0
        self.avg_handler: float | None = None  # seconds, moving average
        # Claimed and not yet recorded, at most (see _room); held_back says
        # that limit is what keeps the claim loop waiting.
        self.max_held = 2 * (options.concurrency + options.prefetch)
        self.held_back = False
        self.event = asyncio.Event()
        self.stopping = False
        self.last_reap = float("-inf")
        self.last_prune = float("-inf")
        self.job_tasks: set[asyncio.Task[None]] = set()
        self.threads = HandlerThreads(options.concurrency)
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
            self.threads.shutdown()
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

    def _room(self) -> int:
        """How many jobs to claim now (0: wait until running jobs make room).

        Idle slots are filled at once. Beyond them, while jobs are short,
        about PREFETCH_SECONDS of work (at most `prefetch` jobs) is claimed
        ahead, so the next batch is in flight while this one runs and claims
        come in batches of dozens; that top-up waits until it is worth a
        round trip (half the capacity).

        Jobs whose outcome is not recorded yet count too: the worker holds at
        most twice its capacity, so when completions fall behind (a slow or
        lost database), claiming waits for them instead of piling up every
        job of the queue in memory.
        """
        concurrency = self.options.concurrency
        free = concurrency - self.executing - len(self.ready)
        extra = 0
        if self.avg_handler is not None:
            per_slot = PREFETCH_SECONDS / max(self.avg_handler, 1e-6)
            extra = min(self.options.prefetch, int(concurrency * per_slot))
        unheld = self.max_held - len(self.active)
        room = min(free + extra, unheld)
        self.held_back = unheld < free + extra
        if room <= 0:
            return 0
        if free > 0 and not self.ready:
            return room
        return room if room >= (concurrency + extra) // 2 else 0

    async def _claim_loop(self) -> None:
        delay = RETRY_START
        while not self.stopping:
            want = self._room()
            if want <= 0:
                await self._wait(None)
                continue
            self.event.clear()
            try:
                await self._maintain()
                rows = await self.claimer.claim(want)
            except psycopg.Error as exc:
                log.warning("claim failed (%s); retrying in %.1fs", exc, delay)
                await self._wait(delay, interruptible=False)
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY_START
            for row in rows:
                self._take(row)
            self._dispatch()
            if len(rows) == want:
                continue
            if self.options.burst:
                if self.executing == 0 and not rows and not self.ready:
                    return
                await self._wait(None)
                continue
            if rows:
                # Block briefly first: the jobs just started get their handler
                # threads going while this thread waits, not after the lookup.
                await asyncio.sleep(HANDOFF_SECONDS)
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

    def _take(self, row: Job) -> None:
        """A claimed job: ours from now on (its lease is watched), queued for a slot."""
        task = self.registry.get(row.task)
        lease = task.lease if task is not None else self.claim_lease
        now = time.monotonic()
        # The claim leased it for `claim_lease` (the shortest of all tasks),
        # not its own: date the last extension back so the first heartbeat is
        # due a third of the way into the claim lease, not into the task's.
        head_start = (lease - self.claim_lease).total_seconds() / 3
        entry = Running(row, lease, now, now - head_start)
        self.active[row.id] = entry
        self.ready.append(entry)

    def _dispatch(self) -> None:
        """Start waiting jobs while slots are free."""
        while self.ready and self.executing < self.options.concurrency and not self.stopping:
            entry = self.ready.popleft()
            if entry.lost:  # its lease went while it waited: not ours to run
                self.active.pop(entry.row.id, None)
                continue
            entry.started = time.monotonic()
            self.executing += 1
            job_task = asyncio.create_task(self._execute(entry))
            self.job_tasks.add(job_task)
            job_task.add_done_callback(self.job_tasks.discard)

    async def _execute(self, entry: Running) -> None:
        row = entry.row
        try:
            error = await self._call(entry)
        finally:
            entry.handler_done = True
            self.executing -= 1
            took = time.monotonic() - entry.started
            avg = self.avg_handler
            self.avg_handler = took if avg is None else avg + (took - avg) / 8
            self._dispatch()
            if self._room():
                self.wake()
        try:
            outcome = "lost" if entry.lost else await self._finish(row, error)
        except psycopg.Error as exc:
            outcome = f"unrecorded ({exc}); the lease will expire and the job run again"
        finally:
            self.active.pop(row.id, None)
            if self.held_back:
                self.wake()
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
        mismatch = task.mismatch(row.payload)
        if mismatch is not None:
            return f"InvalidPayload: {mismatch}"
        context = contextvars.copy_context()
        context.run(set_current_job, row)
        try:
            if task.is_async:
                entry.task = asyncio.create_task(task.fn(**row.payload), context=context)
                await entry.task
            else:
                await self.threads.run(functools.partial(context.run, task.fn, **row.payload))
        except asyncio.CancelledError:
            if entry.lost:
                return "cancelled: lease lost"
            raise
        except (Exception, SystemExit) as exc:
            log.error("job %d task=%s raised", row.id, row.task, exc_info=exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    async def _finish(self, row: Job, error: str | None) -> str:
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
            elif entry.row.id in self.active and not entry.handler_done:
                # A finished handler's completion may simply have landed first.
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
        """Hand back jobs not started, let running ones finish within the
        timeout, then hand the rest back too."""
        while self.ready:
            entry = self.ready.popleft()
            if not entry.lost:
                await self._release(entry, "not started")
            self.active.pop(entry.row.id, None)
        if self.job_tasks:
            if self.executing:
                log.info("waiting for %d running jobs", self.executing)
            await asyncio.wait(set(self.job_tasks), timeout=self.options.shutdown_timeout)
        for entry in list(self.active.values()):
            if entry.lost or entry.handler_done:
                continue
            await self._release(entry, "unfinished")
            if entry.task is not None:
                entry.task.cancel()
        for job_task in self.job_tasks:
            job_task.cancel()
        await asyncio.gather(*self.job_tasks, return_exceptions=True)
        await self.finisher.flush()

    async def _release(self, entry: Running, why: str) -> None:
        entry.lost = True
        released = await self.finisher.driver.release(entry.row.id, entry.row.attempts)
        log.warning(
            "job %d task=%s attempt=%d: %s at shutdown, %s",
            entry.row.id,
            entry.row.task,
            entry.row.attempts,
            why,
            "returned to the queue" if released else "no longer ours",
        )
