"""The idle worker's claim: made on the listener's thread the moment a job is announced (internal).

A worker whose event loop is asleep used to answer a notification with four
hand-overs: the loop noticed the LISTEN socket, woke its claim loop, waited
on the claim's socket, then woke a handler thread. Each cost about a tenth of
a millisecond, a third again on top of the least any worker that claims can
do (a blocking listener that claims at once). So while the loop sleeps with
free slots, it *arms* this object with how many jobs it may take, and the
listener's thread, already awake with the notification, claims on a blocking
connection of its own (on libpq directly, its parameters dumped when the
loop armed it: see `direct`) and runs the first plain (sync) job's handler
itself, once it has handed listening to its partner thread (see `notify`);
the claimed rows go to the loop, which owns them from there exactly as if it
had claimed them itself (leases, outcomes, shutdown).

Only one side claims at a time. Arming is taken back by the first side to
act: the listener's thread disarms before it claims, and the loop disarms
before it claims itself; a loop that finds a claim in flight waits for its
rows instead of claiming beside it, so the worker never holds more than it
asked for. Everything here that touches the database is the claim statement
itself, so a pause, a concurrency limit or another session's row lock holds
here as it does for the loop's claims.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import psycopg

from .attempt import Attempt
from .direct import Bound, DirectConnection, Numbered
from .driver import Row
from .execute import OnThread, Runner
from .job import CancelSignal
from .notify import Handover
from .registry import Registry
from .statements import Position

log = logging.getLogger("sqla_jobq.worker")


# A job made ready on the listener's thread: its `Attempt` (built, started,
# only when the loop is told, off the handler's way), what the loop awaits,
# and the call that runs its handler there.
Started = tuple[Callable[[], Attempt], OnThread, Callable[[], None]]


@dataclass(frozen=True)
class Picked:
    """What the listener's thread claimed: rows for the loop, the first one
    already running on that thread if it was plain."""

    rows: list[Row]
    started: tuple[Attempt, OnThread] | None
    seconds: float  # the claim's round trip, for the claim cursor
    asked: int
    from_head: bool  # or past the claim cursor's position
    failed: bool  # the database could not be asked: the loop claims itself

    @property
    def drained(self) -> bool:
        """Fewer jobs were ready than asked for: a claim now would find none."""
        return not self.failed and len(self.rows) < self.asked


class Starter:
    """On the listener's thread: the first job of an idle claim, if its task is
    a plain function, made ready to run there, in a copy of the context the
    worker was started in. Its `Attempt` is built later, when the loop is
    told, so that the handler starts first."""

    def __init__(
        self,
        registry: Registry,
        runner: Runner,
        claim_lease: timedelta,
        loop: asyncio.AbstractEventLoop,
        stopping: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self.runner = runner
        self.claim_lease = claim_lease
        self.loop = loop
        self.stopping = stopping
        self.context = contextvars.copy_context()

    def __call__(self, row: Row) -> Started | None:
        at = time.monotonic()  # the claim's time: the lease runs from it
        if self.stopping():
            return None
        task = self.registry.get(row["task"])
        if task is None or task.is_async:
            return None
        signal = CancelSignal()
        ready = self.runner.start_plain(row, signal, self.context, self.loop)
        if ready is None:
            return None
        attempt = functools.partial(self._attempt, row, task.lease, signal, at)
        on_thread, call = ready
        run_here = functools.partial(self.runner.threads.run_here, on_thread.future, call)
        return attempt, on_thread, run_here

    def _attempt(self, row: Row, lease: timedelta, signal: CancelSignal, at: float) -> Attempt:
        attempt = Attempt.claimed(row, lease, self.claim_lease, at=at, cancel_event=signal)
        attempt.start(at)
        return attempt


class IdlePickup:
    """Claims for a sleeping worker on the listener's thread (see the module docstring)."""

    def __init__(
        self,
        url: str,
        claims: Mapping[str, Numbered],
        prepared: bool,
        start: Callable[[Row], Started | None],
        deliver: Callable[[Picked], None],
    ) -> None:
        self.claims = claims  # `claim`, and `claim_after` (see `claim_cursor`)
        self.conn = DirectConnection(url, prepared)
        self.start = start  # on this thread: the first row's handler, made ready to run here
        self.deliver = deliver  # on this thread: hand the claim to the worker's loop
        self.lock = threading.Lock()
        self.limit = 0  # armed: how many jobs the worker may take now (under lock)
        self.may_start = False  # armed with a free slot: the first job may start here
        self.query: Bound | None = None  # armed: the claim, its parameters dumped
        self.from_head = True  # armed to claim from the head, not past a position
        self._bound: tuple[int, Position | None, Bound] | None = None  # the loop's last
        self.claiming = False  # a claim is on its way to the loop (under lock)
        self.closed = False
        self.picked = 0  # claims made here, for tests and the curious

    # -- the loop's side --------------------------------------------------

    def arm(
        self, limit: int, *, may_start: bool, after: Position | None, again: bool = False
    ) -> None:
        """Let the listener's thread claim up to `limit` jobs (past `after`, as
        the loop's next claim would), and start the first there if
        `may_start` (a slot is free: `limit` may count prefetched jobs).
        `again`: only if still armed (the loop asleep, nothing heard yet).
        The claim's parameters are dumped here, off the listener's way."""
        query = self._statement(limit, after)
        with self.lock:
            if not self.closed and not self.claiming and (self.limit > 0 or not again):
                self.limit = limit
                self.may_start = may_start
                self.query = query
                self.from_head = after is None

    def disarm(self) -> bool:
        """Take arming back; False while a claim made here has not reached the
        loop yet (then wait for `delivered` before claiming)."""
        with self.lock:
            self.limit = 0
            return not self.claiming

    def delivered(self) -> None:
        """The loop has taken the rows of the claim in flight."""
        with self.lock:
            self.claiming = False

    def close(self) -> bool:
        """No more claims here; True while one is still on its way to the loop."""
        with self.lock:
            self.closed = True
            self.limit = 0
            return self.claiming

    def disconnect(self) -> None:
        """Close the connection (blocking; after `close`, with no claim in flight)."""
        self.conn.close()

    # -- the listener's thread ----------------------------------------------

    def heard(self, *, here: bool) -> Handover | bool:
        """For a notification of one of our queues: False if not armed (wake
        the loop); True once the claim is made and delivered. If `here` (the
        listener has another thread to go on listening) and a slot is free,
        the first job is made ready to run on this thread instead: then the
        delivery is left to the other thread too (`Handover`), so that the
        loop, woken by it, does not take the GIL from the handler's start."""
        with self.lock:
            limit, self.limit = self.limit, 0
            if limit <= 0 or self.closed:
                return False
            self.claiming = True
            may_start, query, from_head = self.may_start, self.query, self.from_head
        rows: list[Row] | None = None
        took = 0.0
        first: Started | None = None
        try:
            assert query is not None  # armed with a limit: armed with its claim
            rows, took = self._claim(query)
            first = self._start_first(rows or []) if may_start and here else None
        finally:
            # Always, whatever went wrong: the loop waits for this delivery
            # before it claims again, and owns every row in it.
            self.picked += 1
            found = Picked(rows or [], None, took, limit, from_head, failed=rows is None)
            if first is None:
                self.deliver(found)
        if first is None:
            return True
        attempt, on_thread, run = first
        return Handover(functools.partial(self._deliver_started, found, attempt, on_thread), run)

    def _deliver_started(
        self, found: Picked, attempt: Callable[[], Attempt], on_thread: OnThread
    ) -> None:
        """On the partner thread: the claim, with the running job's `Attempt`.
        It is delivered whatever happens, or the loop would wait for ever."""
        try:
            found = dataclasses.replace(found, started=(attempt(), on_thread))
        except Exception:  # a bug of ours: its lease runs out and a reaper returns it
            log.exception("job %s: could not track it as running", found.rows[0]["id"])
            found = dataclasses.replace(found, rows=found.rows[1:])  # never started twice
        self.deliver(found)

    def _start_first(self, rows: list[Row]) -> Started | None:
        if not rows:
            return None
        try:
            return self.start(rows[0])
        except Exception:  # a bug of ours: the loop starts the job as usual
            log.exception("job %s: could not start it on the listener's thread", rows[0]["id"])
            return None

    def _claim(self, query: Bound) -> tuple[list[Row] | None, float]:
        """The rows claimed, or None if the database could not be asked (the
        loop, woken by the delivery anyway, then claims and retries itself);
        and the statement's round trip, without connecting: the claim cursor
        takes a slow claim for a sign of dead index entries."""
        try:
            self.conn.connect()
            started = time.monotonic()
            rows = self.conn.run(query)
            return rows, time.monotonic() - started
        except psycopg.Error as exc:
            log.info("idle claim failed (%s); the worker claims instead", exc)
            return None, 0.0

    def _statement(self, limit: int, after: Position | None) -> Bound:
        """The claim, bound; the loop's last one again if nothing changed: it
        arms with the same values before every sleep, and again for every
        slot a handler frees while it sleeps."""
        if self._bound is not None and self._bound[:2] == (limit, after):
            return self._bound[2]
        if after is None:
            query = self.claims["claim"].bind(limit=limit)
        else:
            priority, run_at, job_id = after
            query = self.claims["claim_after"].bind(
                limit=limit, after_priority=priority, after_run_at=run_at, after_id=job_id
            )
        self._bound = (limit, after, query)
        return query
