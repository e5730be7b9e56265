"""The lease keeper: heartbeats on a connection, a thread and an event loop
of their own (internal).

A lease is what keeps a job ours while its handler runs, so extending it must
never wait behind anything: not behind the worker's event loop (an `async
def` handler calling blocking code stops that loop; were the heartbeats on
it, every job the worker holds would be reaped and run again elsewhere), not
behind a batch of completions (they have their own connection), not behind a
row another session holds locked (the
extension skips that row and tries it again next tick, while its lease still
has two thirds to run). An extension that matches a row no longer ours means
the job was taken away: the attempt is reported lost, and the worker stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta

import psycopg

from .attempt import Attempt, State
from .driver import Driver

log = logging.getLogger("sqla_jobq.leases")

_RUNNABLE = (State.CLAIMED, State.STARTED)


class LeaseKeeper:
    """Extends the leases of the attempts `attempts()` lists, from `start()`
    to `stop()` on its own thread. `attempts` (which must return a snapshot),
    `sent` and `each_tick` are called on that thread; `lost` on the loop that
    called `start()`, the worker's, whose state it changes."""

    def __init__(
        self,
        driver: Driver,
        attempts: Callable[[], Iterable[Attempt]],
        lost: Callable[[Attempt, bool], None],
        tick: float,
    ) -> None:
        self.driver = driver
        self.attempts = attempts
        self.lost = lost  # (attempt, whether it was cancelled rather than taken away)
        self.tick = tick
        self.poke = asyncio.Event()
        # Called after each extension that reached the database (the worker
        # refreshes its registry row on that round trip's connection).
        self.sent: Callable[[], Awaitable[None]] | None = None
        # Called on this thread at each tick (the worker watches its own loop).
        self.each_tick: Callable[[], None] | None = None
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._serve()), name="jobq-leases", daemon=True
        )
        self._home: asyncio.AbstractEventLoop | None = None  # where `lost` runs
        self._task: asyncio.Task[None] | None = None  # on the keeper's own loop
        self._started = threading.Event()

    def start(self) -> None:
        """From the worker's loop: run on a thread of its own until `stop()`."""
        self._home = asyncio.get_running_loop()
        self._thread.start()
        self._started.wait()

    async def stop(self) -> None:
        """Stop extending, close the connection, and wait for the thread."""
        if self._task is None:
            return
        self._on_own_loop(self._task.cancel)
        await asyncio.to_thread(self._thread.join)

    def check_now(self) -> None:
        """Look at every lease now (a cancel was announced), not at the next
        tick. Safe to call from any thread."""
        self._on_own_loop(self.poke.set)

    def _on_own_loop(self, call: Callable[[], object]) -> None:
        if self._task is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop is closed: the keeper stopped
            self._task.get_loop().call_soon_threadsafe(call)

    def _report_lost(self, attempt: Attempt, cancelled: bool) -> None:
        """On the worker's loop: unless it finished or settled meanwhile."""
        if attempt.state in _RUNNABLE:
            self.lost(attempt, cancelled)

    async def _serve(self) -> None:
        self._task = asyncio.current_task()
        self._started.set()
        try:
            await self.run()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("the lease keeper stopped; leases will run out and be reaped")
        finally:
            await self.driver.close()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick):
                    await self.poke.wait()
            everyone = self.poke.is_set()
            self.poke.clear()
            if self.each_tick is not None:
                self.each_tick()
            await self.beat(everyone=everyone)

    async def beat(self, *, everyone: bool = False) -> None:
        """Extend every lease a third of the way through (`everyone`: all of
        them, to learn of a cancel now), one statement per lease length."""
        now = time.monotonic()
        due: dict[timedelta, list[Attempt]] = defaultdict(list)
        for attempt in self.attempts():
            if not attempt.state.settled and (everyone or attempt.lease_due(now)):
                due[attempt.lease].append(attempt)
        for lease, batch in due.items():
            try:
                await self._extend(lease, batch, now)
            except psycopg.Error as exc:
                log.warning("could not extend %d leases (%s); will retry", len(batch), exc)

    async def _extend(self, lease: timedelta, batch: list[Attempt], sent: float) -> None:
        extended = await self.driver.extend_leases([a.key for a in batch], lease)
        if self.sent is not None:
            await self.sent()
        for attempt in batch:
            if attempt.key in extended:
                attempt.extended(sent)
        missed = [a for a in batch if a.key not in extended and not a.state.settled]
        fates = await self.driver.fates([a.key for a in missed])
        for attempt in missed:
            # Locked by another session right now: try again next tick. A
            # finished attempt's fate is the finisher's to tell (its completion
            # may simply have landed first).
            if attempt.key in fates.busy or attempt.state not in _RUNNABLE:
                continue
            assert self._home is not None  # set by start()
            self._home.call_soon_threadsafe(
                self._report_lost, attempt, attempt.key in fates.cancelled
            )
