"""The lease keeper: heartbeats on a connection of their own (internal).

A lease is what keeps a job ours while its handler runs, so extending it must
never wait behind anything: not behind a batch of completions (they have
their own connection), not behind a row another session holds locked (the
extension skips that row and tries it again next tick, while its lease still
has two thirds to run). An extension that matches a row no longer ours means
the job was taken away: the attempt is reported lost, and the worker stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

    def check_now(self) -> None:
        """Look at every lease now (a cancel was announced), not at the next tick."""
        self.poke.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick):
                    await self.poke.wait()
            everyone = self.poke.is_set()
            self.poke.clear()
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
            self.lost(attempt, attempt.key in fates.cancelled)
