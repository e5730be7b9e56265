"""Workers rebuild the queue table's indexes once VACUUM leaves them mostly empty
(internal).

VACUUM frees the entries of finished jobs but never shrinks an index: a
snapshot held while thousands of jobs a second come and go leaves each index
hundreds of megabytes for a few thousand entries (in bench.scenes
held-snapshot, 167 to 280 MB of indexes after a 3-minute hold, 5 to 12 MB
rebuilt),
and every later VACUUM of the table, every few seconds on a busy queue, reads
all of it. So right after its own VACUUM, which has just counted each index's
entries, a worker looks for indexes with fewer than `MAX_ENTRIES_PER_PAGE`
entries per page and rebuilds each with `REINDEX INDEX CONCURRENTLY`: claims,
enqueues and completions go on meanwhile. Oban's Reindexer plugin does the
same on a clock; here it is the measured sparseness that decides.

What it may cost, and the bounds on it:
- A rebuild holds the table's SHARE UPDATE EXCLUSIVE lock, so no VACUUM of
  the table runs meanwhile, and reads the heap twice. Tables whose heap is
  over `max_heap_bytes` are left to a rebuild by hand at a quiet time.
- It waits for transactions writing the table as it starts and for snapshots
  older than its build, so none starts while a transaction has been open for
  `OLD_TRANSACTION_SECONDS` (a held snapshot: then the indexes only look
  sparse, to an ANALYZE). `LOCK_TIMEOUT_MS` bounds each wait on one that
  began since; a rebuild that gives up leaves an invalid `_ccnew` index,
  which the next attempt drops first (every write would otherwise keep
  updating it).
- A worker that sees another session building an index of the table leaves
  it be. Two that start at the same moment collide: PostgreSQL ends one with
  a deadlock error, which may leave an invalid `_ccnew` index that the
  loser's next attempt drops. Neither blocks a claim.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Table

from .db import Query, close_quietly, compiled, connect_kwargs, conninfo
from .reindex_statements import (
    drop_index,
    index_bytes,
    leftover_indexes,
    reindex,
    sparse_indexes,
)
from .units import byte_size

log = logging.getLogger("sqla_jobq.reindex")

# Below this, an index is too small for its emptiness to cost anything.
DEFAULT_MIN_BYTES = 8 * 1024 * 1024
# A freshly built index of the queue table holds 150 to 400 entries per page.
MAX_ENTRIES_PER_PAGE = 10.0
# A rebuild reads the heap twice and holds VACUUM off meanwhile: past this, by hand.
DEFAULT_MAX_HEAP_BYTES = 1024 * 1024 * 1024
# Long enough for in-flight claims and enqueues, short enough that a long
# reader elsewhere costs a retry, not minutes without VACUUM.
LOCK_TIMEOUT_MS = 5_000
# A transaction older than this is not a claim, an enqueue or a completion:
# while one runs, no rebuild or drop starts (it would wait for it).
OLD_TRANSACTION_SECONDS = 1.0
# After a failed attempt, the next waits this long, doubling up to the maximum.
BACKOFF_START = 60.0
BACKOFF_MAX = 3600.0

Conn = psycopg.AsyncConnection[dict[str, Any]]


class Reindexer:
    """Rebuilds the table's sparse indexes; `run` after each VACUUM of this worker."""

    def __init__(
        self,
        url: str,
        table: Table,
        min_bytes: int,
        prepared: bool,
        max_heap_bytes: int = DEFAULT_MAX_HEAP_BYTES,
        lock_timeout_ms: int = LOCK_TIMEOUT_MS,
        old_transaction_seconds: float = OLD_TRANSACTION_SECONDS,
    ) -> None:
        self.url = conninfo(url)
        self.lock_timeout_ms = lock_timeout_ms
        self.min_bytes = min_bytes
        self.max_heap_bytes = max_heap_bytes
        self.prepared = prepared
        self.qualified = table.fullname
        old = old_transaction_seconds
        self.sparse_sql = compiled(sparse_indexes(table, min_bytes, MAX_ENTRIES_PER_PAGE, old))
        self.leftover_sql = compiled(leftover_indexes(table, old))
        self.backoff = 0.0
        self.not_before = float("-inf")
        self.refused = False
        self.told_too_large = False

    @property
    def enabled(self) -> bool:
        return self.min_bytes > 0 and not self.refused

    async def run(self, look: psycopg.AsyncConnection[Any]) -> None:
        """Read on `look` (the VACUUM's own connection, still open) what an
        earlier attempt left and which indexes are sparse; only when there is
        work, open a connection with a longer lock timeout and do it."""
        if not self.enabled or time.monotonic() < self.not_before:
            return
        try:
            left = await _rows(look, self.leftover_sql)
            sparse = [r for r in await _rows(look, self.sparse_sql) if self._small_enough(r)]
            if left or sparse:
                await self._work(left, sparse)
            self.backoff = 0.0
        except psycopg.errors.InsufficientPrivilege as exc:
            self.refused = True
            log.info("not rebuilding indexes of %s: this role may not (%s)", self.qualified, exc)
        except psycopg.Error as exc:
            self.backoff = min(max(self.backoff * 2, BACKOFF_START), BACKOFF_MAX)
            self.not_before = time.monotonic() + self.backoff
            log.warning(
                "could not rebuild an index of %s (%s); next attempt in %.0fs",
                self.qualified,
                str(exc).strip().splitlines()[0],
                self.backoff,
            )

    async def _work(self, left: list[dict[str, Any]], sparse: list[dict[str, Any]]) -> None:
        """Drop the leftovers first: every write keeps updating them."""
        conn: Conn | None = None
        try:
            options = connect_kwargs(self.prepared, self.lock_timeout_ms)
            conn = await psycopg.AsyncConnection.connect(self.url, row_factory=dict_row, **options)
            for row in left:
                await conn.execute(*compiled(drop_index(str(row["qualified"]))))
                log.info("dropped %s, left invalid by an earlier rebuild", row["qualified"])
            await self._rebuild(conn, sparse)
        finally:
            await close_quietly(conn, log)

    async def _rebuild(self, conn: Conn, sparse: list[dict[str, Any]]) -> None:
        for row in sparse:
            started = time.monotonic()
            await conn.execute(*compiled(reindex(str(row["qualified"]))))
            log.info(
                "rebuilt %s in %.2fs: %s entries in %s -> %s",
                row["qualified"],
                time.monotonic() - started,
                f"{int(row['entries']):,}",
                byte_size(int(row["bytes"])),
                byte_size(await _size(conn, str(row["qualified"]))),
            )

    def _small_enough(self, row: dict[str, Any]) -> bool:
        """A heap this worker may read twice; else say once how to do it by hand."""
        if int(row["heap_bytes"]) <= self.max_heap_bytes:
            return True
        if not self.told_too_large:
            self.told_too_large = True
            log.warning(
                "%s is %s for %s entries, but a rebuild would read a %s heap twice "
                "with VACUUM held off: at a quiet time, REINDEX INDEX CONCURRENTLY %s",
                row["qualified"],
                byte_size(int(row["bytes"])),
                f"{int(row['entries']):,}",
                byte_size(int(row["heap_bytes"])),
                row["qualified"],
            )
        return False


async def _rows(conn: psycopg.AsyncConnection[Any], query: Query) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    return await (await cur.execute(*query)).fetchall()


async def _size(conn: Conn, qualified: str) -> int:
    row = await (await conn.execute(*compiled(index_bytes(qualified)))).fetchone()
    return int(row["bytes"]) if row and row["bytes"] is not None else 0

