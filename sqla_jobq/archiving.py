"""Finished jobs leave the hot table: workers move `done` jobs into `<table>_archive` (internal).

A queue table that keeps every job it ever ran grows with its history: its
heap, its primary key and every pass of VACUUM grow with the jobs processed,
not with the work in flight. So, as River's job cleaner and Oban's pruner do
by default, each worker moves `done` jobs out of it: as they complete, in
the completion statement itself (`archive_after` 0, the default; see
`at_completion`), and otherwise once they finished more than `archive_after`
ago, with `statements.archive_done(..., skip_locked=True)`: one statement per
batch of at most `BATCH` jobs, each its own transaction, each starting past
the last id the batch before it moved, looping until a batch comes back
short. A pass walks the done index (schema version 9), so it reads the done
jobs it moves and not the rest of the table. Moved, not deleted: the
archive keeps the history (`wait_for` and the dashboard read it), `jobq
prune` trims it. Failed and cancelled jobs stay, since they are rare and
they are what people act on.

It runs on a connection of its own, in a task of its own, so claims never
wait for it; `SKIP LOCKED` lets every worker on every host archive at once
without waiting on each other or on a row another session holds.

It costs nothing on an idle worker: its loop wakes every INTERVAL seconds
on a local timer and sends a query only if the worker finished a job since
the last pass, and once more when those last jobs are old enough to move.
Its first pass, at start, moves what the table already holds (the history a
table kept before this default: in batches, in the background). A database
error is one line and a wait (doubling up to a minute); a role that may not
delete from the table is told so once and the archiver stops for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Table

from .db import close_quietly, compiled, connect_kwargs, conninfo
from .statements import FIRST_ID, archive_done

log = logging.getLogger("sqla_jobq.archive")

# Jobs per batch: each batch is one statement, its own transaction, and
# locks only its rows (done rows, which nothing but another archiver or
# pruner touches). At about 8 us a job moved (local PostgreSQL 15, 2 cores),
# a batch takes some 40 ms.
BATCH = 5_000
# Between two passes of a worker that keeps finishing jobs: a done job stays
# in the jobs table at most `archive_after` plus this. Shorter for a short
# `archive_after`, never under MIN_INTERVAL (0 is SWEEP_INTERVAL, below). Each
# pass leaves a dead row version per job it moved, all at once, until the
# next VACUUM: at 9,000 jobs/s 5 s of jobs is 45,000 of them (bench.scenes
# bloat-at-peak), 10 s would double that.
INTERVAL = 5.0
MIN_INTERVAL = 1.0
# Between two passes when the worker's completions move its jobs themselves
# (`archive_after` 0: `statements.complete_to_archive`): a pass then only
# sweeps up what finished otherwise (jobs someone waited on, completed in
# place so their row trigger fires; jobs completed by an app's own
# statements), found through the done index.
SWEEP_INTERVAL = 30.0
# After a pass that failed: the first wait, doubling up to BACKOFF_MAX.
BACKOFF_START = 2.0
BACKOFF_MAX = 60.0
# The last jobs a worker finished are `archive_after` old this long after it
# last noticed finishing any (their finished_at is the transaction start of
# their completion, on the server's clock).
SLACK = 1.0
# At shutdown, how long a batch under way may take to commit before it is
# cancelled (rolled back: no job half moved either way).
STOP_PATIENCE = 5.0


def at_completion(after: timedelta | None) -> bool:
    """`archive_after` 0: the worker's completions move its jobs themselves
    (`statements.complete_to_archive`), and passes only sweep (SWEEP_INTERVAL)."""
    return after == timedelta(0)


class Archiver:
    """One worker's archiving loop. `finished()` is the worker's count of
    jobs it finished: unchanged since the last pass means idle."""

    def __init__(
        self,
        url: str,
        table: Table,
        after: timedelta | None,
        prepared: bool,
        finished: Callable[[], int],
    ) -> None:
        self.url = conninfo(url)
        self.after = after
        self.prepared = prepared
        self.finished = finished
        self.qualified = table.fullname
        self.sql, self.params = compiled(
            archive_done(table, older_than=timedelta(0), skip_locked=True)
        )
        seconds = 0.0 if after is None else after.total_seconds()
        self.interval = (
            SWEEP_INTERVAL if at_completion(after) else min(INTERVAL, max(MIN_INTERVAL, seconds))
        )
        self.refused = False
        self.seen: int | None = None  # `finished()` at the last pass; None: pass due
        self.tail_at: float | None = None  # one more pass then, for the last jobs
        self.passes = 0  # passes that ran to the end, and their batches (tests look)
        self.batches = 0
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.stopping = asyncio.Event()
        self.first_done = asyncio.Event()  # the pass at start has ended (or never will)

    @property
    def enabled(self) -> bool:
        return self.after is not None and not self.refused

    def start(self) -> None:
        """Begin the loop (once; nothing when archiving is off)."""
        if self.task is None and self.enabled:
            self.task = asyncio.create_task(self._run(), name="archive")

    async def stop(self, *, first_pass: bool = False) -> None:
        """End the loop: between passes at once; during one, after its
        current batch commits (or STOP_PATIENCE, then it is rolled back).

        `first_pass` (a burst worker) lets the pass at start run to its end
        first: a worker started from cron every few minutes then moves what
        the runs before it finished, however short its own run."""
        if first_pass and self.task is not None and not self.task.done():
            await self.first_done.wait()
        self.stopping.set()
        task = self.task
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), STOP_PATIENCE)
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._close()

    async def _run(self) -> None:
        try:
            await self._loop()
        finally:
            self.first_done.set()
            await self._close()

    async def _loop(self) -> None:
        delay = 0.0  # the first pass at once, for what the table held before this worker
        backoff = 0.0
        while self.enabled and not await self._sleep(delay):
            delay = self.interval
            if self._due(time.monotonic()):
                try:
                    await self._pass()
                    backoff = 0.0
                except psycopg.errors.InsufficientPrivilege as exc:
                    self.refused = True
                    log.info(
                        "not archiving finished jobs of %s: this role may not (%s); they "
                        "stay in the jobs table (`jobq prune` removes them)",
                        self.qualified,
                        _one_line(exc),
                    )
                except psycopg.Error as exc:
                    backoff = min(max(backoff * 2, BACKOFF_START), BACKOFF_MAX)
                    delay = backoff
                    self.seen = None  # the pass is still due
                    log.warning(
                        "could not archive finished jobs of %s (%s); trying again in %.0fs",
                        self.qualified,
                        _one_line(exc),
                        backoff,
                    )
                    await self._close()
            self.first_done.set()

    async def _sleep(self, seconds: float) -> bool:
        """Wait on the local clock; True once the worker is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
        return self.stopping.is_set()

    def _due(self, now: float) -> bool:
        """A pass if jobs were finished since the last one; else only the one
        pass their last ones still need once they are old enough (none at
        completion: a sweep takes every done job, whatever its age)."""
        count = self.finished()
        if self.seen is not None and count == self.seen:
            if self.tail_at is None or now < self.tail_at:
                return False
            self.tail_at = None
        elif not at_completion(self.after):
            assert self.after is not None
            self.tail_at = now + self.after.total_seconds() + SLACK
        self.seen = count
        return True

    async def _pass(self) -> None:
        conn = await self._connection()
        params = {**self.params, "older_than": self.after, "limit": BATCH}
        started = time.monotonic()
        total = 0
        reached: int | None = FIRST_ID
        while True:
            cur = await conn.execute(self.sql, {**params, "after_id": reached})
            row = await cur.fetchone()
            assert row is not None  # an aggregate: always one row
            count, reached = row
            total += count
            self.batches += 1
            if count < BATCH or self.stopping.is_set():
                break
        self.passes += 1
        if total:
            log.info(
                "archived %s done jobs of %s in %.2fs",
                f"{total:,}",
                self.qualified,
                time.monotonic() - started,
            )

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self.conn is None or self.conn.closed:
            self.conn = await psycopg.AsyncConnection.connect(
                self.url, **connect_kwargs(self.prepared)
            )
        return self.conn

    async def _close(self) -> None:
        conn, self.conn = self.conn, None
        await close_quietly(conn, log)


def _one_line(exc: BaseException) -> str:
    """A server error as one line (a lost connection's message has several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
