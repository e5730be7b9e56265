"""Recording outcomes: batched fenced completions, failures, retries (internal).

A completion is one fenced statement whatever the batch size, so while one
flush is in flight the next completions wait and go together, and while they
keep coming the next flush waits for `FLUSH_BATCH` of them, or `FLUSH_GAP`
after the one before began: the busier the worker, the fewer round trips per
job.

An outcome is kept and retried for as long as its attempt's lease may still
be valid: across a lost connection or a restarting server, and past a row
another session holds locked (the batch skips that row and retries it alone).
Only when the lease has run out is an outcome given up: by then the reaper may
have handed the job to someone else, and the fence would refuse it anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import psycopg

from .attempt import Attempt, Key, State
from .db import RETRY_MAX, RETRY_START
from .driver import Driver
from .job import InvalidJob, encode_result

log = logging.getLogger("sqla_jobq.finisher")

# A row another session holds locked is tried again this often.
BUSY_RETRY = 0.2
# While outcomes keep arriving, the next flush starts when FLUSH_BATCH of
# them wait, or FLUSH_GAP after the one before it began, whichever is first,
# so one statement records what finished in between. Each statement costs
# the worker's loop hundreds of microseconds of driver work: flushing at once
# after each round trip, `--burst -c 8` recorded no-op jobs 18 at a time on a
# slow VM; with a 5 ms gap, 46, and drained 1.2x faster. But an unrecorded
# outcome still counts against what the worker may hold (twice its
# capacity), so on a machine three times as fast the gap alone held claims
# back: there a 2 ms gap drained 1.4x faster than 5 ms, and a 10 ms one 0.6x
# as fast. A batch's worth is reached in about 2 ms on the fast machine and
# takes the whole gap on the slow one (60,000 no-op jobs, 4 interleaved
# rounds: 1.49x the 5 ms gap alone). A lone outcome is flushed at once.
FLUSH_GAP = 0.005
FLUSH_BATCH = 48

# After a completion into the archive found something locked in its way,
# completions are recorded in place this long before the archive is tried again.
ARCHIVE_REST = 5.0

# (attempt, what happened as a log phrase, its kind: done, retry, failed,
# cancelled or lost).
Settled = Callable[[Attempt, str, str], None]


class Finisher:
    """Records the outcomes of finished attempts and reports each one settled."""

    def __init__(self, driver: Driver, settled: Settled, *, archive: bool = False) -> None:
        self.driver = driver
        self.settled = settled
        self.archive = archive  # completions move their jobs to the archive
        self.archive_rest_until = 0.0  # until then, complete in place (see `_done`)
        self.pending: dict[Key, Attempt] = {}
        self.not_before: dict[Key, float] = {}  # busy rows and failed round trips
        self.delay = RETRY_START
        self.kick = asyncio.Event()
        self.full = asyncio.Event()  # FLUSH_BATCH outcomes are waiting
        self.flushing = asyncio.Lock()  # `run` and `drain` both flush

    def add(self, attempt: Attempt) -> None:
        self.pending[attempt.key] = attempt
        self.kick.set()
        if len(self.pending) >= FLUSH_BATCH:
            self.full.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_try()):
                    await self.kick.wait()
            self.kick.clear()
            started = time.monotonic()
            await self.flush()
            if self.pending:
                await self._gap(started)

    async def _gap(self, started: float) -> None:
        """Wait for a batch's worth of outcomes, but not past FLUSH_GAP after `started`."""
        self.full.clear()
        if len(self.pending) >= FLUSH_BATCH:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_GAP - (time.monotonic() - started)):
                await self.full.wait()

    async def drain(self) -> None:
        """Flush until every outcome is recorded or its lease has run out."""
        while self.pending:
            await self.flush(final=True)
            if self.pending:
                await asyncio.sleep(self._next_try() or 0)

    def _next_try(self) -> float | None:
        if not self.pending:
            return None
        now = time.monotonic()
        soonest = min((self.not_before.get(k, now) for k in self.pending), default=now)
        return max(0.0, soonest - now)

    async def flush(self, *, final: bool = False) -> None:
        async with self.flushing:
            await self._flush(final)

    async def _flush(self, final: bool) -> None:
        now = time.monotonic()
        due = [a for k, a in self.pending.items() if self.not_before.get(k, 0.0) <= now]
        # A row locked by someone else is still ours (the fence will say when
        # it is not): keep trying it. An outcome the database cannot take is
        # given up once its lease may have gone to someone else.
        if final or self.delay > RETRY_START:
            for attempt in due:
                if not attempt.lease_valid(now):
                    self._give_up(attempt)
        due = [a for a in due if a.state is State.FINISHED]
        try:
            await self._complete([a for a in due if a.outcome and a.outcome.ok])
            for attempt in due:
                if attempt.outcome and not attempt.outcome.ok:
                    await self._fail(attempt)
        except psycopg.OperationalError as exc:
            self._back_off(exc)
            return
        self.delay = RETRY_START

    async def _complete(self, batch: list[Attempt]) -> None:
        if not batch:
            return
        results = [_result_of(a) for a in batch]
        keys = [a.key for a in batch]
        given = results if any(r is not None for r in results) else None
        done = await self._done(keys, given)
        for attempt in batch:
            if attempt.key in done:
                self._record(attempt, "done", "done")
        await self._sort_out([a for a in batch if a.key not in done], "not completed")

    async def _done(self, keys: list[Key], results: list[str | None] | None) -> set[Key]:
        """Complete a batch: moved to the archive when the worker archives at
        completion and nothing is in the way, else in place (the archiver
        moves those later)."""
        if self.archive and time.monotonic() >= self.archive_rest_until:
            try:
                return await self.driver.complete_many(keys, results, archive=True)
            except psycopg.errors.InsufficientPrivilege as exc:
                self.archive = False
                log.info(
                    "completing jobs in place: this role may not move them to the archive (%s)",
                    " ".join(str(exc).split()),
                )
            except psycopg.errors.LockNotAvailable:
                # A job's row or the archive table is held by another session
                # (an admin's transaction, DDL on the archive): complete in
                # place for a while rather than wait on it batch after batch.
                self.archive_rest_until = time.monotonic() + ARCHIVE_REST
            return await self.driver.complete_many(keys, results, skip_locked=True)
        try:
            return await self.driver.complete_many(keys, results)
        except psycopg.errors.LockNotAvailable:
            # A row held longer than claimers hold one: record the rest now.
            return await self.driver.complete_many(keys, results, skip_locked=True)

    async def _fail(self, attempt: Attempt) -> None:
        assert attempt.outcome is not None and attempt.outcome.error is not None
        error = attempt.outcome.error
        try:
            result = await self.driver.fail(attempt.key, error)
        except psycopg.errors.LockNotAvailable:
            self._busy(attempt)
            return
        if result is None:
            await self._sort_out([attempt], "failure not recorded")
            return
        status, retry_in = result
        if status == "failed":
            self._record(attempt, f"failed ({error})", "failed")
        else:
            self._record(attempt, f"retry in {retry_in:.0f}s ({error})", "retry")

    async def _sort_out(self, unmatched: list[Attempt], what: str) -> None:
        """A fenced statement matched nothing: busy (locked by someone),
        cancelled, or lost."""
        fates = await self.driver.fates([a.key for a in unmatched])
        for attempt in unmatched:
            if attempt.key in fates.busy:
                self._busy(attempt)
                continue
            attempt.lose()
            if attempt.key in fates.cancelled:
                self._settle(attempt, f"cancelled ({what})", "cancelled")
            else:
                self._settle(attempt, f"lost (no longer ours; {what})", "lost")

    def _busy(self, attempt: Attempt) -> None:
        self.not_before[attempt.key] = time.monotonic() + BUSY_RETRY

    def _record(self, attempt: Attempt, outcome: str, kind: str) -> None:
        attempt.recorded()
        self._settle(attempt, outcome, kind)

    def _give_up(self, attempt: Attempt) -> None:
        attempt.lose()
        text = "unrecorded (its lease ran out first); the job will be reaped and run again"
        self._settle(attempt, text, "lost")

    def _settle(self, attempt: Attempt, outcome: str, kind: str) -> None:
        self.pending.pop(attempt.key, None)
        self.not_before.pop(attempt.key, None)
        self.settled(attempt, outcome, kind)

    def _back_off(self, exc: Exception) -> None:
        log.warning("could not record outcomes (%s); retrying in %.1fs", exc, self.delay)
        later = time.monotonic() + self.delay
        for key in self.pending:
            self.not_before[key] = max(self.not_before.get(key, 0.0), later)
        self.delay = min(self.delay * 2, RETRY_MAX)


def _result_of(attempt: Attempt) -> str | None:
    """The handler's return value as JSON text, or None (nothing, or not JSON)."""
    value = attempt.outcome.result if attempt.outcome is not None else None
    if value is None:
        return None
    try:
        return encode_result(value)
    except InvalidJob as exc:
        log.warning("%s: result not stored: %s", attempt.describe(), exc)
        return None
