"""The worker: claim, run, record, and hand back what it cannot finish.

One asyncio loop drives everything. Claims are committed the moment they are
made (autocommit), so no transaction is open while a handler runs; `async def`
handlers run as tasks, plain functions on handler threads.

Each claimed attempt is an `Attempt` keyed by `(id, attempts)` that owns its
lifecycle (attempt.py). Three connections, each with one job, so none can
stall another: the claimer (claims, reaping, pruning, hand-backs), the
finisher (outcomes, finisher.py) and the lease keeper (heartbeats, leases.py);
a fourth listens for notifications (notify.py). A handler's every outcome is
captured as a value and recorded through one function (execute.py); shutdown
runs in `finally`, hands back what never started with its attempt refunded,
and flushes every outcome its handlers produced.

Round trips per job, not SQL, set the pace, so the hot path is batched end to
end: claims come in batches (with a small prefetch buffer while jobs are
short), finished sync handlers come back to the loop in batches, and
completions go out in batches.
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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from .archiving import Archiver, at_completion
from .attempt import Attempt, Cancel, Key, Outcome, State
from .capture import Captured
from .claim_cursor import ClaimCursor
from .db import RETRY_MAX, RETRY_START, sqlalchemy_url
from .direct import Numbered
from .driver import Driver, claim_statements, lifecycle_statements
from .execute import OnThread, Runner, Started, outcome_now, timed_out
from .finisher import Finisher
from .joblog import JobLog
from .leases import LeaseKeeper
from .loop_watch import LoopWatch
from .migrations.check import check_schema
from .notify import Listener
from .observe import Observer
from .pickup import IdlePickup, Picked, Starter
from .presence import Presence, WorkerInfo
from .ready import ReadyQueue
from .registry import Registry
from .reindexing import DEFAULT_MIN_BYTES, Reindexer
from .scheduler import Scheduler
from .statements import DEFAULT_LEASE, REAP_BATCH
from .threads import Follow, HandlerThreads
from .transactions import Transactions
from .vacuuming import Vacuumer

log = logging.getLogger("sqla_jobq.worker")

PRUNE_BATCH = 10_000
# The prefetch buffer holds about this much work (estimated from a moving
# average of handler durations, or from the longest running handler when that
# is longer), so a prefetched job waits about this long for a slot: for no-op
# jobs that is the `prefetch` cap, for 10 ms jobs five per slot, and jobs
# longer than 50 ms are not prefetched at all (a claim's round trip is noise
# next to them). Half the buffer is the size of a claim, and handler durations
# measured on a busy machine include the wait for the GIL: at 10 ms, four
# `-c 8` workers on 2 cores claimed 22 jobs at a time against one `-c 32`
# worker's 79, and drained 0.79x as fast; at 50 ms they drained 1.03x as fast,
# and the single worker itself 1.12x faster than at 10 ms.
PREFETCH_SECONDS = 0.05
# The cap on that buffer. For very short jobs it sets the batch sizes of
# claims and completions, and each statement costs the driver about as much
# CPU as dozens of no-op jobs: at 128 rather than 64, `--burst -c 8` drained
# no-op jobs 1.55x faster (median of 4 interleaved rounds, 2 cores). The
# cost is a larger share of a burst held by one worker, given back after
# STALL_SECONDS if it cannot run it.
DEFAULT_PREFETCH = 128
# A prefetched job still waiting this long is behind a slow one: it goes back
# to the queue (its attempt refunded) for a worker with a free slot.
STALL_SECONDS = 0.25
# How long a worker shutting down retries handing back a job whose row
# another session holds locked, before leaving it to the reaper.
HAND_BACK_PATIENCE = 5.0
HANDOFF_SECONDS = 0.0005
# An empty claim while the next job is "due now" means its row is locked by
# another session, or its queue is at its concurrency limit: back off from
# this, doubling up to EMPTY_BACKOFF_MAX (a freed slot is not announced).
EMPTY_BACKOFF_START = 0.05
EMPTY_BACKOFF_MAX = 1.0
# `--reconnect` defaults to lazy for polls at least this long (serverless).
LAZY_RECONNECT_POLL = 60.0
# Two to three seconds of dead tuples at full speed on a small machine (two
# per job); autovacuum's own threshold on the table is 5,000 (schema step 6).
DEFAULT_VACUUM_DEAD_TUPLES = 20_000
# Done jobs move to the archive as they complete, in the completion's own
# statement (see `archiving.at_completion`): the jobs table holds the work in
# flight and nothing else, so a snapshot held elsewhere lets it grow by one
# row version per job, not two, and no pass reads it every few seconds
# (bench.scenes held-snapshot and bloat-at-peak). `wait_for` and the
# dashboard read the archive too.
DEFAULT_ARCHIVE_AFTER = timedelta(0)


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
    # "eager", "lazy", or None for the default (see LAZY_RECONNECT_POLL).
    reconnect: str | None = None
    # VACUUM the queue table once it has this many dead tuples (see
    # `vacuuming`); 0 leaves it to autovacuum alone.
    vacuum_dead_tuples: int = DEFAULT_VACUUM_DEAD_TUPLES
    # After its VACUUM, rebuild an index of at least this many bytes that is
    # nearly empty (see `reindexing`); 0 never does.
    reindex_sparse_bytes: int = DEFAULT_MIN_BYTES
    # Move `done` jobs finished this long ago to `<table>_archive`, in the
    # background (see `archiving`); None keeps them in the jobs table.
    archive_after: timedelta | None = DEFAULT_ARCHIVE_AFTER

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must not be negative, got {self.prefetch}")
        if self.vacuum_dead_tuples < 0:
            given = self.vacuum_dead_tuples
            raise ValueError(f"vacuum-dead-tuples must not be negative, got {given}")
        if self.reindex_sparse_bytes < 0:
            given = self.reindex_sparse_bytes
            raise ValueError(f"reindex-sparse-bytes must not be negative, got {given}")
        for what in ("poll_interval", "shutdown_timeout", "reap_interval", "prune_interval"):
            if getattr(self, what) < 0:
                raise ValueError(f"{what.replace('_', '-')} must not be negative")
        if self.archive_after is not None and self.archive_after < timedelta(0):
            raise ValueError(f"archive-after must not be negative, got {self.archive_after}")
        if self.reconnect not in (None, "eager", "lazy"):
            raise ValueError(f"reconnect must be eager or lazy, got {self.reconnect!r}")

    @property
    def eager_reconnect(self) -> bool:
        if self.reconnect is None:
            return self.poll_interval < LAZY_RECONNECT_POLL
        return self.reconnect == "eager"


class Worker:
    def __init__(
        self, registry: Registry, options: WorkerOptions, observers: Sequence[Observer] = ()
    ) -> None:
        self.registry = registry
        self.options = options
        self.observers = list(observers)
        self.queues = list(options.queues) or registry.queues or ["default"]
        leases = [t.lease for t in registry.tasks.values()] or [DEFAULT_LEASE]
        self.claim_lease = min(leases)
        self.sql = lifecycle_statements(registry.table, self.queues, self.claim_lease)
        self.claimer = self._driver()
        at_once = at_completion(options.archive_after)
        self.finisher = Finisher(self._driver(), self._settled, archive=at_once)
        self.leases = LeaseKeeper(
            self._driver(),
            self._unsettled,
            self._lost,
            tick=max(0.05, min(5.0, self.claim_lease.total_seconds() / 6)),
        )
        self.threads = HandlerThreads(options.concurrency)
        self.transactions = (
            Transactions(options.database_url, options.concurrency)
            if any(t.transactional for t in registry.tasks.values())
            else None
        )
        self.runner = Runner(registry, self.threads, self.observers, self.transactions)
        self.threads.follow = self._follow
        # Set by `run`: the loop, and the context a thread's start runs its handler in.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.context: contextvars.Context | None = None
        self.scheduler = Scheduler(registry) if registry.schedules else None
        self.next_fire: datetime | None = None
        self.listener: Listener | None = None
        self.pickup: IdlePickup | None = None
        self.last_picked: Picked | None = None  # the idle claim made while the loop slept
        longest = max(leases)
        info = WorkerInfo.here(self.queues, options.concurrency, options.poll_interval, longest)
        self.presence = Presence(registry.table, info)
        self.leases.sent = self._beat_after_extension
        # Jobs running per queue, kept as they start and end (observers read it).
        self.running_counts: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.attempts: dict[Key, Attempt] = {}  # every attempt not settled yet
        self.ready = ReadyQueue()  # claimed, waiting for a slot
        self.running: dict[Key, Attempt] = {}  # started, oldest first
        self.avg_handler: float | None = None  # seconds, moving average
        # Claimed and not yet recorded, at most (see _room); held_back says
        # that limit is what keeps the claim loop waiting.
        self.max_held = 2 * (options.concurrency + options.prefetch)
        self.held_back = False
        self.event = asyncio.Event()
        self.stopping = False
        self.stall_check: asyncio.TimerHandle | None = None
        self.handing_back = 0  # hand-backs in progress (a burst waits for them)
        self.limited = False  # one of our queues has a concurrency limit: no prefetch
        self.drained = False  # the last claim found no more: asleep until the next one
        self.last_reap = float("-inf")
        self.last_prune = float("-inf")
        self.job_tasks: set[asyncio.Task[None]] = set()
        self.on_threads: set[asyncio.Future[Captured]] = set()  # plain handlers running
        self.processed = 0
        self.job_log = JobLog()
        self.vacuumer = Vacuumer(
            options.database_url,
            registry.table,
            options.vacuum_dead_tuples,
            options.prepared,
            Reindexer(
                options.database_url,
                registry.table,
                options.reindex_sparse_bytes,
                options.prepared,
            ),
        )
        self.vacuum_seen = 0  # `processed` at the last look at the dead tuples
        self.archiver = Archiver(
            options.database_url,
            registry.table,
            options.archive_after,
            options.prepared,
            lambda: self.processed,
        )
        self.cursor = ClaimCursor(enabled=len(self.queues) == 1)
        self.sweeper = self._driver()  # connects on its first sweep only
        self.sweep: asyncio.Task[None] | None = None

    def _driver(self) -> Driver:
        return Driver(self.options.database_url, self.sql, self.options.prepared)

    async def run(self, *, handle_signals: bool = True) -> int:
        """Work until stopped (or, with `burst`, until nothing is ready); exit status.

        With `handle_signals`, SIGTERM/SIGINT stop the worker gracefully and a
        second one exits the process at once; an app embedding the worker in
        another thread passes False and calls `stop()` instead.
        """
        channel = await asyncio.to_thread(self._check_schema)
        await self._presence(self.claimer, self.presence.register)
        loop = self.loop = asyncio.get_running_loop()
        self.context = contextvars.copy_context()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal)
        self.leases.each_tick = LoopWatch(loop, self._async_running).check
        self.leases.start()
        helpers = [asyncio.create_task(self.finisher.run(), name="finisher")]
        self.archiver.start()
        if not self.options.burst:
            claims = claim_statements(self.registry.table, self.queues, self.claim_lease)
            self.pickup = IdlePickup(
                self.options.database_url,
                {name: Numbered.of(stmt) for name, stmt in claims.items()},
                self.options.prepared,
                Starter(self.registry, self.runner, self.claim_lease, loop, lambda: self.stopping),
                functools.partial(_call_soon, loop, self._picked),
            )
            self.listener = Listener(
                self.options.listen_url or self.options.database_url,
                channel,
                self.queues,
                self.wake,
                eager=self.options.eager_reconnect,
                hint=self._hint,
                pickup=self.pickup,
            )
            helpers.append(asyncio.create_task(self.listener.run(), name="listener"))
        log.info(
            "worker started: queues=%s concurrency=%d%s",
            ",".join(self.queues),
            self.options.concurrency,
            " burst" if self.options.burst else "",
        )
        try:
            await self._claim_loop()
        finally:
            try:
                await self._shutdown()
            finally:
                await self._teardown(helpers)
                for sig in signals:
                    loop.remove_signal_handler(sig)
        self.job_log.flush()
        log.info("worker stopped after %d jobs", self.processed)
        return 0

    def _check_schema(self) -> str:
        """Refuse a missing or outdated table (SchemaError, one line) before
        claiming anything; the channel its triggers announce jobs on."""
        engine = create_engine(sqlalchemy_url(self.options.database_url), poolclass=NullPool)
        try:
            with engine.connect() as conn:
                return check_schema(conn, self.registry.table)
        finally:
            engine.dispose()

    def wake(self) -> None:
        self.event.set()

    async def _presence(
        self, driver: Driver, call: Callable[[psycopg.AsyncConnection[Any]], Awaitable[object]]
    ) -> None:
        """Keep the worker registry row on a connection the worker uses anyway;
        the registry is for people watching, so a failure here is only logged."""
        try:
            await call(await driver.connection())
        except psycopg.Error as exc:
            log.debug("worker registry skipped: %s", exc)

    async def _beat(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self.presence.beat(conn, self.processed)

    async def _beat_after_extension(self) -> None:
        await self._presence(self.leases.driver, self._beat)

    def _hint(self, payload: str) -> None:
        """A notification that is not a queue's: a running job was cancelled."""
        if payload.startswith("#cancel ") and self.attempts:
            self.leases.check_now()

    def stop(self) -> None:
        """Stop claiming; running jobs get `shutdown_timeout` to finish."""
        if not self.stopping:
            log.info("stopping: no new claims; waiting up to %ss", self.options.shutdown_timeout)
        self.stopping = True
        self.ready.close()
        self.wake()

    def _on_signal(self) -> None:
        if self.stopping:
            log.warning("second signal: exiting now; unfinished leases will expire and be reaped")
            logging.shutdown()
            os._exit(1)
        self.stop()

    # -- claiming ---------------------------------------------------------

    def _room(self) -> int:
        """How many jobs to claim now (0: wait until running jobs make room).

        Idle slots are filled at once. Beyond them, while jobs are short,
        about PREFETCH_SECONDS of work (at most `prefetch` jobs) is claimed
        ahead, so the next batch is in flight while this one runs and claims
        come in batches of dozens; that top-up waits until it is worth a
        round trip (half the capacity). A handler running long counts as
        long as it has run so far, so a slow job stops prefetching at once.

        Jobs whose outcome is not recorded yet count too: the worker holds at
        most twice its capacity, so when completions fall behind (a slow or
        lost database), claiming waits for them instead of piling up every
        job of the queue in memory.
        """
        concurrency = self.options.concurrency
        free = concurrency - self._busy() - len(self.ready)
        extra = 0
        if self.avg_handler is not None and not self.limited:
            per_job = max(self.avg_handler, self._longest_running(), 1e-6)
            extra = min(self.options.prefetch, int(concurrency * PREFETCH_SECONDS / per_job))
        unheld = self.max_held - len(self.attempts)
        room = min(free + extra, unheld)
        self.held_back = unheld < free + extra
        if room <= 0:
            return 0
        if free > 0 and not self.ready:
            return room
        return room if room >= (concurrency + extra) // 2 else 0

    def _longest_running(self) -> float:
        oldest = next(iter(self.running.values()), None)
        if oldest is None or oldest.started_at is None:
            return 0.0
        return time.monotonic() - oldest.started_at

    async def _claim_loop(self) -> None:
        delay = RETRY_START
        empty = 0  # claims in a row that found nothing
        while not self.stopping:
            self.drained = False
            want = self._room()
            if want <= 0:
                await self._wait(None)
                continue
            self.event.clear()
            try:
                await self._maintain()
                rows = await self._claim(want)
            except psycopg.Error as exc:
                log.warning("claim failed (%s); retrying in %.1fs", exc, delay)
                await self._wait(delay, interruptible=False)
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY_START
            self._take(rows)
            await self._presence(self.claimer, self._beat)  # after: jobs first
            if self.listener is not None:
                self.listener.poke()
            if len(rows) == want:
                empty = 0
                continue
            empty = 0 if rows else empty + 1
            if self.options.burst:
                if not (self._busy() or rows or self.ready or self.handing_back):
                    if not await self._burst_waits(empty):
                        return
                    continue
                await self._wait(None)
                continue
            self.drained = True
            if rows:
                # Block briefly first: the jobs just started get their handler
                # threads going while this thread waits, not after the lookup.
                await asyncio.sleep(HANDOFF_SECONDS)
            picked = await self._sleep(empty)
            while picked is not None and picked.drained and not self.stopping:
                # The listener's thread claimed for us, and found the queue
                # drained: so would a claim now. Do what follows a claim, and
                # sleep again.
                try:
                    await self._maintain()
                except psycopg.Error:
                    break  # the claim that follows meets it too, and backs off
                await self._presence(self.claimer, self._beat)
                picked = await self._sleep(0)

    async def _sleep(self, empty: int) -> Picked | None:
        """Wait to be woken; the idle claim the listener's thread made meanwhile, if any.

        Armed before the idle timeout is looked up: that is a round trip, and
        a job announced during it would otherwise wait for the loop."""
        self.last_picked = None
        self._arm()
        await self._wait(await self._idle_timeout(empty))
        await self._disarm()
        picked, self.last_picked = self.last_picked, None
        return picked

    def _arm(self, *, again: bool = False) -> None:
        """Going to sleep with free slots: let the listener's thread claim the
        next announced job itself (see `pickup`), where the loop's next claim
        would start. Not while a sweep is out: its rows are not counted yet.
        `again`: only update an arming still in place, for a slot freed since."""
        if self.pickup is None or self.stopping or self.sweep is not None:
            return
        room = self._room()
        if room > 0:
            free = self._busy() + len(self.ready) < self.options.concurrency
            self.pickup.arm(room, may_start=free, after=self.cursor.after(), again=again)

    async def _disarm(self) -> None:
        """Awake: claims are the loop's again; one already made on the
        listener's thread is waited for, never claimed beside."""
        if self.pickup is None:
            return
        while not self.pickup.disarm():
            await self._wait(None)

    def _picked(self, picked: Picked) -> None:
        """An idle claim made on the listener's thread: ours from now on, as
        if the loop had claimed it."""
        assert self.pickup is not None
        self.pickup.delivered()
        now = time.monotonic()
        self.cursor.claimed(picked.rows, picked.seconds, from_head=picked.from_head, now=now)
        self._take(picked.rows, picked.started)
        self.last_picked = picked
        self.wake()

    async def _claim(self, want: int) -> list[dict[str, Any]]:
        """One claim, from the head of the queue or past the cursor's position
        (then with a sweep from the head beside it when one is due)."""
        started = time.monotonic()
        after = self.cursor.after()
        if after is not None and self.sweep is None and self.cursor.sweep_due(started):
            self.sweep = asyncio.create_task(self._sweep(), name="sweep")
        rows = await self.claimer.claim(want, after)
        now = time.monotonic()
        self.cursor.claimed(rows, now - started, from_head=after is None, now=now)
        return rows

    async def _sweep(self) -> None:
        """A claim from the head on a connection of its own, so the positional
        claims go on while it steps over what they skip (see `claim_cursor`)."""
        want = max(1, min(self.options.concurrency, self.max_held - len(self.attempts)))
        started = time.monotonic()
        try:
            rows = await self.sweeper.claim(want)
        except psycopg.Error as exc:
            log.warning("sweep claim failed (%s); positional claims go on", exc)
            self.cursor.head_due = time.monotonic() + RETRY_MAX
            return
        finally:
            self.sweep = None
        now = time.monotonic()
        self.cursor.claimed(rows, now - started, from_head=True, now=now)
        self._take(rows)
        if rows:
            self.wake()

    async def _idle_timeout(self, empty: int) -> float:
        """Sleep until the next scheduled job is due, or the poll interval; after
        empty claims, at least a backoff (the due job is locked by someone).
        While the cursor claims past a position, wake for its next claim from
        the head, and look only at jobs due later (see `claim_cursor`)."""
        poll = self.options.poll_interval
        try:
            due = await self.claimer.seconds_until_next(future_only=self.cursor.engaged)
        except psycopg.Error as exc:
            # Lazy: a connection lost while going to sleep comes back at the
            # next poll, like any other lost while idle.
            log.warning("could not look up the next scheduled job: %s", exc)
            return min(poll, RETRY_MAX) if self.options.eager_reconnect else poll
        timeout = poll if due is None else min(poll, due)
        if self.next_fire is not None:
            timeout = min(timeout, max(0.0, (self.next_fire - datetime.now(UTC)).total_seconds()))
        if empty:
            timeout = max(timeout, min(poll, _empty_backoff(empty)))
        head = self.cursor.wake_by(time.monotonic())
        return timeout if head is None else min(timeout, head)

    async def _burst_waits(self, empty: int) -> bool:
        """A burst worker found nothing to claim: wait and claim again while
        jobs are due now that it could not take (locked by another session,
        or their queue at its limit), for up to a poll interval; else done."""
        waited = sum(_empty_backoff(n) for n in range(1, empty))
        if waited >= self.options.poll_interval:
            return False
        try:
            due = await self.claimer.seconds_until_next()
        except psycopg.Error:
            return False
        if due is None or due > 0:
            return False
        await self._wait(_empty_backoff(empty), interruptible=False)
        return True

    async def _wait(self, timeout: float | None, *, interruptible: bool = True) -> None:
        if not interruptible:
            await asyncio.sleep(timeout or 0)
            return
        # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of
        # its own, a turn of the loop more between a notification and the claim.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.event.wait()
        self.event.clear()

    async def _maintain(self) -> None:
        """Reap, prune and look at the dead tuples when due, piggybacked on claims.

        Riding on the claim loop means an idle worker runs them only when it
        wakes anyway, so maintenance never keeps a serverless compute awake.
        Archiving runs in a task of its own (started with the worker), and
        is as quiet when idle (see `archiving`).
        """
        if self.scheduler is not None and self._fire_due():
            self.next_fire = await self.scheduler.tick(await self.claimer.connection())
        now = time.monotonic()
        if now - self.last_reap >= self.options.reap_interval:
            self.last_reap = now
            await self._reap()
            self.limited = await self.claimer.limited()
        older_than = self.options.prune_older_than
        if older_than is not None and now - self.last_prune >= self.options.prune_interval:
            self.last_prune = now
            await self._prune(older_than)
        if self.processed != self.vacuum_seen and self.vacuumer.due(now):
            self.vacuum_seen = self.processed
            await self.vacuumer.check(await self.claimer.connection())

    def _fire_due(self) -> bool:
        return self.next_fire is None or self.next_fire <= datetime.now(UTC)

    async def _reap(self) -> None:
        while True:
            rows = await self.claimer.reap()
            for row in rows:
                log.warning(
                    "reaped job %d (attempt %d, lease expired): now %s",
                    row["id"],
                    row["attempts"],
                    row["status"],
                )
            if len(rows) < REAP_BATCH:
                return

    async def _prune(self, older_than: timedelta) -> None:
        total = 0
        while (count := await self.claimer.prune(older_than, PRUNE_BATCH)) > 0:
            total += count
            if count < PRUNE_BATCH:
                break
        if total:
            log.info("pruned %d finished jobs older than %s", total, older_than)

    def _take(
        self, rows: list[dict[str, Any]], started: tuple[Attempt, OnThread] | None = None
    ) -> None:
        """Claimed attempts: ours from now on (their leases are kept), queued
        for a slot and started while slots are free; `started` is the first
        row's, already running (an idle claim's: see `pickup`)."""
        if started is not None:
            attempt, on_thread = started
            self.attempts[attempt.key] = attempt
            self.running[attempt.key] = attempt
            self._observe_start(attempt)
            self._await(attempt, on_thread, self._start_timeout(attempt))
            rows = rows[1:]
        for row in rows:
            task = self.registry.get(row["task"])
            lease = task.lease if task is not None else self.claim_lease
            attempt = Attempt.claimed(row, lease, self.claim_lease)
            self.attempts[attempt.key] = attempt
            self.ready.append(attempt)
        self._dispatch()

    # -- running ----------------------------------------------------------

    def _dispatch(self) -> None:
        """Start waiting attempts while slots are free. One whose lease ran
        out while it waited (no heartbeat got through) may have been reaped
        and claimed by another worker already: it is handed back, never
        started, so the database decides whether it is still ours."""
        now = time.monotonic()
        lapsed: list[Attempt] = []
        while self._busy() < self.options.concurrency and not self.stopping:
            attempt = self.ready.start_next(now, lapsed)
            if attempt is None:
                break
            self.running[attempt.key] = attempt
            self._observe_start(attempt)
            self._await(attempt, self._start(attempt), self._start_timeout(attempt))
        if self.ready and self.stall_check is None and not self.stopping:
            loop = asyncio.get_running_loop()
            self.stall_check = loop.call_later(STALL_SECONDS, self._check_stall)
        if lapsed:
            self._hand_back_soon(lapsed, "whose leases ran out while they waited")

    def _busy(self) -> int:
        """Slots taken: jobs running, and jobs threads started that the loop
        has not heard of yet (their slots' last jobs may have left already)."""
        return len(self.running) + self.ready.in_transit

    def _follow(self) -> Follow | None:
        """On a handler thread whose job just finished: the next waiting
        attempt, started in the slot it freed (see `ready`), if its task is
        a plain function; the loop hears of it through `_arrived`."""
        attempt = self.ready.start_here(time.monotonic(), self._runs_here)
        if attempt is None:
            return None
        assert self.loop is not None and self.context is not None
        try:
            prepared = self.runner.start_plain(
                attempt.row, attempt.cancel_event, self.context, self.loop
            )
        except Exception:  # the loop's `_start` meets it again, and records it
            prepared = None
        if prepared is None:  # refused: the loop records why
            return functools.partial(self._arrived, attempt, None), None
        on_thread, call = prepared
        return functools.partial(self._arrived, attempt, on_thread), (on_thread.future, call)

    def _runs_here(self, attempt: Attempt) -> bool:
        task = self.registry.get(attempt.task_name)
        return task is not None and not task.is_async

    def _arrived(self, attempt: Attempt, on_thread: OnThread | None) -> None:
        """An attempt a handler thread started: running, as if the loop had
        started it (right after the job whose slot it took has left)."""
        self.ready.arrived()
        self.running[attempt.key] = attempt
        self._observe_start(attempt)
        started = on_thread if on_thread is not None else self._start(attempt)
        self._await(attempt, started, self._start_timeout(attempt))

    def _start(self, attempt: Attempt) -> Started:
        try:
            return self.runner.start(attempt)
        except Exception as exc:
            return outcome_now(_internal_error(attempt, exc))

    def _await(self, attempt: Attempt, started: Started, timer: asyncio.TimerHandle | None) -> None:
        """Wait for the attempt's outcome: on a plain handler's thread with a
        callback, anything else in a task. No task per plain job: creating and
        stepping one was a tenth of the worker's CPU on no-op jobs."""
        if isinstance(started, OnThread):
            self.on_threads.add(started.future)
            done = functools.partial(self._thread_done, attempt, started, timer)
            started.future.add_done_callback(done)
            return
        job_task = asyncio.create_task(self._execute(attempt, started, timer))
        self.job_tasks.add(job_task)
        job_task.add_done_callback(self.job_tasks.discard)

    def _thread_done(
        self,
        attempt: Attempt,
        on_thread: OnThread,
        timer: asyncio.TimerHandle | None,
        future: asyncio.Future[Captured],
    ) -> None:
        self.on_threads.discard(future)
        if future.cancelled():  # torn down at shutdown: nothing to record
            self._finished(attempt, None, timer)
            return
        try:
            after = self.runner.after_thread(attempt, on_thread)
        except Exception as exc:
            after = _internal_error(attempt, exc)
        if isinstance(after, Outcome):
            self._finished(attempt, after, timer)
        else:
            self._await(attempt, after, timer)

    async def _execute(
        self,
        attempt: Attempt,
        started: Callable[[], Awaitable[Outcome]],
        timer: asyncio.TimerHandle | None,
    ) -> None:
        outcome: Outcome | None = None
        try:
            outcome = await started()
        except Exception as exc:
            outcome = _internal_error(attempt, exc)
        finally:
            self._finished(attempt, outcome, timer)

    def _finished(
        self, attempt: Attempt, outcome: Outcome | None, timer: asyncio.TimerHandle | None
    ) -> None:
        """The handler is over: free its slot, start what waits for one, and
        record the outcome (None: cancelled at shutdown, nothing to record)."""
        if timer is not None:
            timer.cancel()
        self.running.pop(attempt.key, None)
        self.running_counts[attempt.row["queue"]] -= 1
        self._observe_running()
        assert attempt.started_at is not None
        took = time.monotonic() - attempt.started_at
        avg = self.avg_handler
        self.avg_handler = took if avg is None else avg + (took - avg) / 8
        self._dispatch()
        if self.drained and not self.limited:
            self._arm(again=True)  # a claim for the free slot would find nothing new
        elif not self.event.is_set() and self._room():  # set: the claim loop wakes anyway
            self.wake()
        if outcome is None:
            return
        if attempt.finish(outcome):
            self._record(attempt, outcome)
        elif attempt.state in (State.LOST, State.HANDED_BACK):
            # Settled while it ran; what it did now counts for nothing.
            cancelled = attempt.cancelled is Cancel.CANCELLED
            self._log_job(attempt, "cancelled" if cancelled else attempt.state.value)

    def _record(self, attempt: Attempt, outcome: Outcome) -> None:
        """Hand the outcome to the finisher, unless a transactional task's own
        transaction settled it already (completed, or found it lost)."""
        if outcome.settled == "done":
            attempt.recorded()
            self._settled(attempt, "done (in its own transaction)", "done")
        elif outcome.settled == "lost":
            attempt.lose()
            self._settled(attempt, "lost (no longer ours; its transaction rolled back)", "lost")
        else:
            self.finisher.add(attempt)

    def _start_timeout(self, attempt: Attempt) -> asyncio.TimerHandle | None:
        """The task's timeout, counted from the handler's start (a thread's
        start reaches the loop a little later)."""
        task = self.registry.get(attempt.task_name)
        if task is None or task.timeout is None:
            return None
        assert attempt.started_at is not None
        left = task.timeout.total_seconds() - (time.monotonic() - attempt.started_at)
        return asyncio.get_running_loop().call_later(max(0.0, left), self._time_out, attempt)

    def _time_out(self, attempt: Attempt) -> None:
        """An async handler is cancelled; a sync one cannot be stopped, so its
        attempt is recorded as failed now and whatever it does later is dropped."""
        if attempt.state is not State.STARTED:
            return
        log.warning("%s: timed out; recorded as failed", attempt.describe())
        if attempt.handler is not None:
            attempt.cancel(Cancel.TIMEOUT)
        elif attempt.finish(timed_out(attempt)):
            attempt.cancel_event.set()
            self.finisher.add(attempt)

    def _observe_start(self, attempt: Attempt) -> None:
        queue = attempt.row["queue"]
        self.running_counts[queue] = self.running_counts.get(queue, 0) + 1
        if not self.observers:
            return
        run_at = attempt.row.get("run_at")
        delay = None if run_at is None else (datetime.now(UTC) - run_at).total_seconds()
        for observer in self.observers:
            _quietly(observer.started, attempt.row["queue"], attempt.task_name, delay)
        self._observe_running()

    def _observe_running(self) -> None:
        for observer in self.observers:
            _quietly(observer.running, self.running_counts)

    def _check_stall(self) -> None:
        """Prefetched attempts stuck behind busy slots go back to the queue."""
        self.stall_check = None
        oldest = self.ready.oldest_claimed_at()
        if oldest is None or self.stopping:
            return
        if time.monotonic() - oldest < STALL_SECONDS:
            self.stall_check = asyncio.get_running_loop().call_later(
                STALL_SECONDS, self._check_stall
            )
            return
        self._hand_back_soon(self.ready.take(), "stuck behind busy slots")

    def _hand_back_soon(self, attempts: list[Attempt], why: str) -> None:
        """Hand back attempts that never started (refunded), in a task."""
        task = asyncio.create_task(self._hand_back(attempts, refund=True, why=why))
        self.job_tasks.add(task)
        task.add_done_callback(self.job_tasks.discard)

    # -- settling ---------------------------------------------------------

    def _unsettled(self) -> Iterable[Attempt]:
        # One C-level copy, atomic under the GIL: the lease keeper's thread
        # reads it while this loop changes the dict.
        return list(self.attempts.values())

    def _settled(self, attempt: Attempt, outcome: str, kind: str) -> None:
        self.attempts.pop(attempt.key, None)
        self._log_job(attempt, outcome, kind)
        if self.held_back:
            self.wake()

    def _log_job(self, attempt: Attempt, outcome: str, kind: str | None = None) -> None:
        self.processed += 1
        started = attempt.started_at or attempt.claimed_at
        took = time.monotonic() - started
        self.job_log.add(attempt, took, outcome)
        for observer in self.observers:
            queue = attempt.row["queue"]
            _quietly(observer.settled, queue, attempt.task_name, kind or outcome, took)

    def _async_running(self) -> list[str]:
        return [a.describe() for a in list(self.running.values()) if a.handler is not None]

    def _lost(self, attempt: Attempt, cancelled: bool = False) -> None:
        """The attempt's row is not ours any more: stop it, touch nothing. A
        cancelled job is stopped the same way; only the words differ."""
        was = self.ready.lose(attempt)  # under its lock: no thread starts it now
        self.attempts.pop(attempt.key, None)
        if cancelled:
            log.info("%s: cancelled; stopping it", attempt.describe())
        else:
            log.warning(
                "%s: lease lost (reaped or taken over); it will not be completed by this worker",
                attempt.describe(),
            )
        if was is State.STARTED:
            attempt.cancel(Cancel.CANCELLED if cancelled else Cancel.LOST)
        else:
            self._log_job(attempt, "cancelled" if cancelled else "lost")

    async def _hand_back(self, attempts: list[Attempt], *, refund: bool, why: str) -> None:
        """Return attempts to the queue in one statement, retried until the
        database says each is handed back or no longer ours; one summary line.

        A row another session holds locked is skipped and tried again, however
        long it takes: a local lease that runs out meanwhile proves nothing
        (the lease keeper renews it once the lock goes), and an attempt dropped
        here but still held would stay `running`, renewed, never run. Only a
        worker shutting down gives up, after HAND_BACK_PATIENCE: it stops
        renewing the rest and leaves them to the reaper.
        """
        remaining = [a for a in attempts if a.state in (State.CLAIMED, State.STARTED)]
        back: list[Attempt] = []
        delay = RETRY_START
        give_up_at: float | None = None
        self.handing_back += 1
        try:
            while remaining:
                remaining = await self._hand_back_once(remaining, refund, back)
                if self.stopping and give_up_at is None:
                    give_up_at = time.monotonic() + HAND_BACK_PATIENCE
                if remaining and give_up_at is not None and time.monotonic() >= give_up_at:
                    self._leave_to_reaper(remaining)
                    break
                if remaining:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX)
                    remaining = [a for a in remaining if not a.state.settled]
        finally:
            self.handing_back -= 1
            self.wake()  # a burst worker waits for what comes back to claim it
        if back:
            ids = ", ".join(str(a.key[0]) for a in back[:10])
            more = f" and {len(back) - 10} more" if len(back) > 10 else ""
            refunded = " (attempts refunded: they never started)" if refund else ""
            log.warning(
                "%d jobs %s, returned to the queue%s: %s%s", len(back), why, refunded, ids, more
            )

    async def _hand_back_once(
        self, attempts: list[Attempt], refund: bool, back: list[Attempt]
    ) -> list[Attempt]:
        """One try: the attempts handed back join `back`; those whose rows are
        no longer ours are stopped; returns those still to try (row locked,
        or the database out of reach)."""
        try:
            done = await self.claimer.hand_back([a.key for a in attempts], refund=refund)
            missed = [a for a in attempts if a.key not in done]
            fates = await self.claimer.fates([a.key for a in missed])
        except psycopg.Error as exc:
            log.warning("could not hand back %d jobs (%s); retrying", len(attempts), exc)
            return attempts
        for attempt in attempts:
            if attempt.key in done:
                attempt.handed_back()
                self.attempts.pop(attempt.key, None)
                back.append(attempt)
            elif attempt.key not in fates.busy and not attempt.state.settled:
                self._lost(attempt, attempt.key in fates.cancelled)
        return [a for a in missed if a.key in fates.busy and not a.state.settled]

    def _leave_to_reaper(self, attempts: list[Attempt]) -> None:
        """Shutting down with rows still locked by another session: stop
        holding them, so their leases run out and a reaper returns them."""
        for attempt in attempts:
            attempt.lose()
            self.attempts.pop(attempt.key, None)
        log.warning(
            "%d jobs could not be handed back (their rows stayed locked by another "
            "session); a reaper returns them when their leases run out: %s",
            len(attempts),
            ", ".join(str(a.key[0]) for a in attempts),
        )

    # -- stopping ---------------------------------------------------------

    async def _shutdown(self) -> None:
        """Hand back attempts not started (refunded), give running ones
        `shutdown_timeout`, hand back the rest, then record every outcome."""
        self.stopping = True
        self.ready.close()
        await self._close_pickup()
        if self.stall_check is not None:
            self.stall_check.cancel()
        if self.sweep is not None:  # its rows join the ready ones handed back below
            await asyncio.gather(self.sweep, return_exceptions=True)
        while self.ready.in_transit:  # started on threads: let the loop hear of them
            await asyncio.sleep(0.001)
        await self._hand_back(self.ready.take(), refund=True, why="not started at shutdown")
        if self.running:
            log.info("waiting for %d running jobs", len(self.running))
            await self._join_jobs(self.options.shutdown_timeout)
        unfinished = [a for a in self.running.values() if a.state is State.STARTED]
        await self._hand_back(unfinished, refund=False, why="unfinished at shutdown")
        for attempt in unfinished:
            attempt.cancel(Cancel.SHUTDOWN)
        await self._join_jobs(1.0)
        await self.finisher.drain()

    async def _close_pickup(self) -> None:
        """No more idle claims; one in flight is waited for (its rows are then
        handed back with the rest), but not for ever: a claim stuck on a dead
        connection leaves its rows to the reaper."""
        if self.pickup is None or not self.pickup.close():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HAND_BACK_PATIENCE):
                while self.pickup.claiming:
                    await self._wait(None)
        if self.pickup.claiming:
            log.warning(
                "an idle claim did not return within %ss; its jobs go to the reaper",
                HAND_BACK_PATIENCE,
            )

    def _jobs(self) -> set[asyncio.Future[Any]]:
        """What stands for each running job: its task, or its handler thread's future."""
        return {*self.job_tasks, *self.on_threads}

    async def _join_jobs(self, timeout: float) -> None:
        # Again while new ones appear: a plain handler that returned an
        # awaitable goes on in a task created when its thread is done.
        deadline = time.monotonic() + timeout
        while (pending := self._jobs()) and time.monotonic() < deadline:
            await asyncio.wait(pending, timeout=deadline - time.monotonic())

    async def _teardown(self, helpers: list[asyncio.Task[None]]) -> None:
        await self.leases.stop()
        await self.vacuumer.stop()
        await self.archiver.stop(first_pass=self.options.burst)
        jobs = self._jobs()
        for task in [*helpers, *jobs]:
            task.cancel()
        await asyncio.gather(*helpers, *jobs, return_exceptions=True)
        await self._presence(self.claimer, self.presence.leave)
        if self.listener is not None:
            await self.listener.stop()
        if self.pickup is not None:
            await asyncio.to_thread(self.pickup.disconnect)
        for driver in (self.claimer, self.sweeper, self.finisher.driver):
            await driver.close()
        if self.transactions is not None:
            await self.transactions.dispose()
        self.threads.shutdown()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[Picked], None], arg: Picked) -> None:
    """From another thread; a loop already closed has nobody left to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, arg)


def _internal_error(attempt: Attempt, exc: Exception) -> Outcome:
    """A bug of ours, while running a job: still this attempt's failure alone."""
    log.exception("%s: internal error", attempt.describe())
    return Outcome(error=f"{type(exc).__name__}: {exc}", exc=exc)


def _empty_backoff(empty: int) -> float:
    """The wait after `empty` claims in a row found nothing although a job was due."""
    backoff: float = EMPTY_BACKOFF_START * 2 ** min(empty - 1, 30)
    return min(EMPTY_BACKOFF_MAX, backoff)


def _quietly(hook: Callable[..., None], *args: object) -> None:
    """Call an observer's hook; a hook that raises is logged, never fatal."""
    try:
        hook(*args)
    except Exception:
        log.exception("observer hook %s raised; ignored", getattr(hook, "__qualname__", hook))
