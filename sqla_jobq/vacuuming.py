"""Workers vacuum the queue table when its dead tuples pile up (internal).

Every job leaves two dead row versions in the queue table (the claim and the
completion both change `status`, named by the partial indexes, so neither
update is HOT), and autovacuum visits a database at most once per
`autovacuum_naptime` (60 s by default, a server-wide setting the migration
cannot change). At thousands of jobs a second that is hundreds of thousands of
dead tuples between two visits, which every claim then steps over. So a busy
worker reads the table's dead-tuple count (from the statistics system, not the
table) every few seconds and, past `threshold`, runs `VACUUM (SKIP_LOCKED)` on
a connection of its own, in the background: claims go on meanwhile, and
workers on other hosts, or autovacuum, already vacuuming the table make it
return at once. This is what PgQ's ticker does for its own tables.

It costs nothing when idle: a worker that has finished no job since its last
look sends no query. A VACUUM that removes little (a snapshot held somewhere
keeps the dead tuples needed) makes the next one wait twice as long, up to a
minute. A role that may not vacuum the table (only its owner may) is told so
by the server; the worker then logs it once and leaves the table to autovacuum.

A heap a held snapshot let grow, and that VACUUM has since emptied, gets one
`VACUUM (TRUNCATE)` (see SPARSE_PAGES): autovacuum never truncates the jobs
table (schema step 8), and left that large it no longer fits shared_buffers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import psycopg
from sqlalchemy import Table

from .db import close_quietly, compiled, connect_kwargs, conninfo
from .vacuum_statements import dead_tuples, vacuum

log = logging.getLogger("sqla_jobq.vacuum")

# How often a busy worker looks at the dead-tuple count.
CHECK_SECONDS = 2.0
# A heap at least this large (8 KB pages: 64 MB) holding fewer live rows than
# pages is mostly empty space: what a snapshot held elsewhere for minutes
# leaves once VACUUM has run. Autovacuum never gives it back (schema step 8),
# and new rows then spread over all of it: a 400 MB heap no longer fits the
# default 128 MB of shared_buffers, every page a job lands on is read in and
# written out again, and pickup p99 stayed 1.4x its clean value minutes after
# the release (bench.scenes held-snapshot; with shared_buffers at 1 GB it was
# back at once). So the worker then runs one `VACUUM (TRUNCATE)`, whatever
# the dead tuples, at most every TRUNCATE_EVERY seconds (its tail may still
# hold live rows; they leave within seconds).
SPARSE_PAGES = 8192
TRUNCATE_EVERY = 60.0
# Waiting after a VACUUM that removed less than half of what it found.
BACKOFF_START = 2.0
BACKOFF_MAX = 60.0


class Vacuumer:
    """Decides when this worker vacuums the table, and runs it in the background."""

    def __init__(self, url: str, table: Table, threshold: int, prepared: bool) -> None:
        self.url = conninfo(url)
        self.threshold = threshold
        self.prepared = prepared
        self.count_sql = compiled(dead_tuples(table))
        self.vacuum_sql = compiled(vacuum(table))[0]
        self.truncate_sql = compiled(vacuum(table, truncate=True))[0]
        self.next_truncate = float("-inf")
        self.qualified = table.fullname
        self.last_check = float("-inf")
        self.not_before = float("-inf")
        self.backoff = 0.0
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
        dead, pages, live = _state(rows[0].values() if rows else None)
        shrink = sparse(pages, live) and now >= self.next_truncate
        if (dead >= self.threshold or shrink) and now >= self.not_before:
            if shrink:
                self.next_truncate = now + TRUNCATE_EVERY
            self.running = asyncio.create_task(self._vacuum(dead, pages, shrink), name="vacuum")

    async def stop(self) -> None:
        task = self.running
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _vacuum(self, before: int, pages: int, truncate: bool) -> None:
        started = time.monotonic()
        notices: list[str] = []
        conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, **connect_kwargs(self.prepared)
            )
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            await conn.execute(self.truncate_sql if truncate else self.vacuum_sql)
            rows = await (await conn.execute(*self.count_sql)).fetchall()
        except psycopg.Error as exc:
            log.warning("could not vacuum %s: %s", self.qualified, exc)
            self.not_before = time.monotonic() + BACKOFF_MAX
            return
        finally:
            await close_quietly(conn, log)
        after, pages_after, _ = _state(rows[0] if rows else None)
        shrunk = f"; heap {pages:,} pages -> {pages_after:,}" if truncate else ""
        self._judge(before, after, notices, started, shrunk)

    def _judge(
        self, before: int, after: int, notices: list[str], started: float, shrunk: str = ""
    ) -> None:
        took = time.monotonic() - started
        if any("only table or database owner" in n or "permission" in n for n in notices):
            self.refused = True
            log.info(
                "not vacuuming %s: this role may not (%s); autovacuum keeps it",
                self.qualified,
                notices[0],
            )
            return
        if any("lock not available" in n for n in notices):
            log.debug("vacuum of %s skipped: another vacuum holds it", self.qualified)
            return
        removed = before - after
        if removed * 2 < before:
            self.backoff = min(max(self.backoff * 2, BACKOFF_START), BACKOFF_MAX)
        else:
            self.backoff = 0.0
        self.not_before = time.monotonic() + self.backoff
        log.info(
            "vacuumed %s in %.2fs: dead tuples %d -> %d%s%s",
            self.qualified,
            took,
            before,
            after,
            shrunk,
            f"; a snapshot holds them? next vacuum in {self.backoff:.0f}s at the earliest"
            if self.backoff
            else "",
        )


def sparse(pages: int, live: int) -> bool:
    """A large heap with fewer live rows than pages (`live` -1: never counted)."""
    return pages >= SPARSE_PAGES and 0 <= live < pages


def _state(row: Iterable[object] | None) -> tuple[int, int, int]:
    """`dead_tuples`' row as (dead, pages, live); zeros before statistics exist."""
    if row is None:
        return 0, 0, -1
    dead, pages, live = row
    return int(str(dead)), int(str(pages)), int(float(str(live)))
