"""Workers vacuum the queue table when its dead tuples pile up (internal).

Every job leaves two dead row versions in the queue table (the claim and the
completion both change `status`, named by the partial indexes, so neither
update is HOT), and autovacuum visits a database at most once per
`autovacuum_naptime` (60 s by default, a server-wide setting the migration
cannot change). At thousands of jobs a second that is hundreds of thousands of
dead tuples between two visits, which every claim then steps over. So a busy
worker reads the table's dead-tuple count (from the statistics system, not the
table) every few seconds and, past `threshold`, runs `VACUUM (SKIP_LOCKED,
PARALLEL 0)` on a connection of its own, in the background: claims go on
meanwhile, and workers on other hosts, or autovacuum, already vacuuming the
table make it return at once. This is what PgQ's ticker does for its own tables.

It costs nothing when idle: a worker that has finished no job since its last
look sends no query. A VACUUM that removes little makes the next one wait
until what held the dead tuples back has gone: the snapshot of a transaction
open elsewhere (the oldest, as `pg_stat_activity` shows it), and the worker
vacuums at its first look after that transaction ends. Each VACUUM in between
would read the whole heap again, a heap the hold keeps growing, for nothing.
When no open transaction explains it (a replication slot or a standby's
feedback holds VACUUM back, which the count's query does not see), the next
one waits twice as long instead, up to a minute. A role that may not vacuum
the table (only its owner may) is told so by the server; the worker then logs
it once and leaves the table to autovacuum.
After a VACUUM that ran, the same task rebuilds indexes it left mostly empty
(see `reindexing`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
from sqlalchemy import Table

from .db import close_quietly, compiled, connect_kwargs, conninfo
from .reindexing import OLD_TRANSACTION_SECONDS, Reindexer
from .vacuum_statements import dead_tuples, vacuum

log = logging.getLogger("sqla_jobq.vacuum")

# How often a busy worker looks at the dead-tuple count.
CHECK_SECONDS = 2.0
# Waiting after a VACUUM that removed less than half of what it found.
BACKOFF_START = 2.0
BACKOFF_MAX = 60.0


class Vacuumer:
    """Decides when this worker vacuums the table, and runs it in the background."""

    def __init__(
        self,
        url: str,
        table: Table,
        threshold: int,
        prepared: bool,
        reindexer: Reindexer | None = None,
    ) -> None:
        self.url = conninfo(url)
        self.reindexer = reindexer
        self.threshold = threshold
        self.prepared = prepared
        self.count_sql = compiled(dead_tuples(table, OLD_TRANSACTION_SECONDS))
        self.vacuum_sql = compiled(vacuum(table))[0]
        self.qualified = table.fullname
        self.last_check = float("-inf")
        self.not_before = float("-inf")
        self.backoff = 0.0
        # The oldest open transaction's xmin when the last VACUUM removed little.
        self.held_by: str | None = None
        self.refused = False
        self.running: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.threshold > 0 and not self.refused

    def due(self, now: float) -> bool:
        """Time for a look at the count (the caller has finished jobs since the last)."""
        idle = self.running is None or self.running.done()
        return self.enabled and idle and now - self.last_check >= CHECK_SECONDS

    async def check(self, conn: psycopg.AsyncConnection[dict[str, object]]) -> None:
        """Read the count on `conn` (the claimer's: one more small statement
        on a connection that is open anyway) and start a VACUUM if it is due."""
        now = time.monotonic()
        self.last_check = now
        sql, params = self.count_sql
        rows = await (await conn.execute(sql, params)).fetchall()
        dead = int(str(rows[0]["dead"])) if rows else 0
        held_by = str(rows[0]["held_by"]) if rows and rows[0]["held_by"] is not None else None
        if dead >= self.threshold and self._may_vacuum(now, held_by):
            self.running = asyncio.create_task(self._vacuum(dead, held_by), name="vacuum")

    def _may_vacuum(self, now: float, held_by: str | None) -> bool:
        """Not while the transaction that held the last VACUUM back is open; at
        once when it has ended, however long the wait had grown."""
        if self.held_by is not None:
            if held_by == self.held_by:
                return False
            self.held_by = None  # an error or a skip now waits as any other
            return True
        return now >= self.not_before

    async def stop(self) -> None:
        task = self.running
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _vacuum(self, before: int, held_by: str | None) -> None:
        started = time.monotonic()
        notices: list[str] = []
        conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, **connect_kwargs(self.prepared)
            )
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            await conn.execute(self.vacuum_sql)
            rows = await (await conn.execute(*self.count_sql)).fetchall()
            after = int(str(rows[0][0])) if rows else 0
            if self._judge(before, after, notices, started, held_by) and self.reindexer is not None:
                await self.reindexer.run(conn)
        except psycopg.Error as exc:
            log.warning("could not vacuum %s: %s", self.qualified, exc)
            self.not_before = time.monotonic() + BACKOFF_MAX
        finally:
            await close_quietly(conn, log)

    def _judge(
        self, before: int, after: int, notices: list[str], started: float, held_by: str | None
    ) -> bool:
        """Log the outcome and set the next wait; False when no VACUUM ran."""
        took = time.monotonic() - started
        if any("only table or database owner" in n or "permission" in n for n in notices):
            self.refused = True
            log.info(
                "not vacuuming %s: this role may not (%s); autovacuum keeps it",
                self.qualified,
                notices[0],
            )
            return False
        if any("lock not available" in n for n in notices):
            log.debug("vacuum of %s skipped: another vacuum holds it", self.qualified)
            return False
        little = (before - after) * 2 < before
        self.held_by = held_by if little else None
        if little and self.held_by is None:
            self.backoff = min(max(self.backoff * 2, BACKOFF_START), BACKOFF_MAX)
        else:
            self.backoff = 0.0
        self.not_before = time.monotonic() + self.backoff
        log.info(
            "vacuumed %s in %.2fs: dead tuples %d -> %d%s",
            self.qualified,
            took,
            before,
            after,
            self._next(),
        )
        return True

    def _next(self) -> str:
        if self.held_by is not None:
            return (
                f"; a transaction open elsewhere (xmin {self.held_by}) holds them: "
                "next vacuum once it ends"
            )
        if self.backoff:
            return f"; a snapshot holds them? next vacuum in {self.backoff:.0f}s at the earliest"
        return ""
