"""Enqueue periodic tasks on time: the runner a worker calls between claims (internal).

`Scheduler.tick` enqueues every fire time that is due and returns the next
one, so an idle worker sleeps until then at most. Any number of workers may
tick at once: each fire is one `schedule_statements.fire` statement, which
only the first of them gets to insert. Between fires a tick costs no query at
all: the first tick reads each schedule's last fire time, and after that the
scheduler knows when each schedule is next due, so an idle serverless
database is left asleep until a fire time comes.

The logic is written once, as a generator of statements (it yields each query
and is sent its rows back), and run by `tick` on an async connection and by
`tick_sync` on a sync one.

A fire waits at most `db.LOCK_TIMEOUT` for its schedule's row, which
another worker's fire holds for a moment and another session (an admin's
open transaction on the schedules table) may hold for long. Past that, the
fire is left for HELD_RETRY and the tick goes on with the other schedules:
the worker ticks on its claim connection, between claims, and a tick that
failed would fail the claim after it, turn after turn.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from . import periodic, schedule_statements
from .db import LOCK_TIMEOUT, Query, compiled
from .registry import Registry

log = logging.getLogger("sqla_jobq.scheduler")

# A schedule row another worker created after our load's snapshot is missing
# from its result; the next load sees it.
LOAD_ATTEMPTS = 3
# When a fire that gave up on a held schedule row is tried again.
HELD_RETRY = timedelta(seconds=1)

Rows = list[tuple[Any, ...]]
Steps = Generator[Query, Rows, datetime | None]


class Scheduler:
    """The periodic tasks of one Registry, and when each is next due."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._last: dict[str, datetime] = {}
        self._next: dict[str, datetime] = {}

    async def tick(
        self, conn: psycopg.AsyncConnection[Any], now: datetime | None = None
    ) -> datetime | None:
        """Enqueue every due fire time; the next fire time of any schedule
        (None without schedules). `conn` must be in autocommit mode: each
        statement is atomic on its own and must commit at once."""
        _check_autocommit(conn.autocommit)
        steps = self._steps(now or datetime.now(UTC))
        try:
            query = next(steps)
            while True:
                cur = conn.cursor(row_factory=tuple_row)
                try:
                    await cur.execute(*query)
                except psycopg.errors.LockNotAvailable as held:
                    query = steps.throw(held)
                    continue
                query = steps.send(await cur.fetchall())
        except StopIteration as done:
            result: datetime | None = done.value
            return result

    def tick_sync(
        self, conn: psycopg.Connection[Any], now: datetime | None = None
    ) -> datetime | None:
        """`tick` on a sync connection (the CLI, tests, a sync host)."""
        _check_autocommit(conn.autocommit)
        steps = self._steps(now or datetime.now(UTC))
        try:
            query = next(steps)
            while True:
                cur = conn.cursor(row_factory=tuple_row)
                try:
                    cur.execute(*query)
                except psycopg.errors.LockNotAvailable as held:
                    query = steps.throw(held)
                    continue
                query = steps.send(cur.fetchall())
        except StopIteration as done:
            result: datetime | None = done.value
            return result

    def _steps(self, now: datetime) -> Steps:
        schedules = self.registry.schedules
        if not schedules:
            return None
        if any(name not in self._last for name in schedules):
            yield from self._load(now)
        for schedule in schedules.values():
            if self._next.get(schedule.name, now) <= now:
                try:
                    yield from self._fire(schedule, now)
                except psycopg.errors.LockNotAvailable as held:
                    self._next[schedule.name] = now + HELD_RETRY
                    log.warning(
                        "periodic task %s: its schedule row is held by another session (%s); "
                        "firing again in %.0fs",
                        schedule.name,
                        " ".join(str(held).split()),
                        HELD_RETRY.total_seconds(),
                    )
        return min(self._next.values())

    def _load(self, now: datetime) -> Generator[Query, Rows, None]:
        names = list(self.registry.schedules)
        stmt = schedule_statements.load(self.registry.table, names, now)
        for _ in range(LOAD_ATTEMPTS):
            rows = yield compiled(stmt)
            self._last.update({name: last_fire for name, last_fire in rows})
            if all(name in self._last for name in names):
                return
        raise RuntimeError(f"schedule rows of {names} still missing after {LOAD_ATTEMPTS} loads")

    def _fire(self, schedule: periodic.Schedule, now: datetime) -> Generator[Query, Rows, None]:
        task = self.registry.tasks[schedule.name]
        plan = periodic.plan(schedule, self._last[schedule.name], now)
        for at in plan.due:
            stmt = schedule_statements.fire(
                self.registry.table,
                schedule.name,
                at,
                task=task.name,
                payload=schedule.payload,
                queue=task.queue,
                priority=task.priority,
                max_attempts=task.max_attempts,
                lock_timeout=LOCK_TIMEOUT,
            )
            rows = yield compiled(stmt)
            # Ours or another worker's, this fire time is settled either way.
            self._last[schedule.name] = at
            if rows:
                log.info(
                    "periodic task %s: fire time %s enqueued as job %s", task.name, at, rows[0][0]
                )
        self._next[schedule.name] = plan.next


def _check_autocommit(autocommit: bool) -> None:
    if not autocommit:
        raise ValueError(
            "Scheduler.tick needs an autocommit connection: each fire must commit at once"
        )
