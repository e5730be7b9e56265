"""The worker's statements, compiled once, on raw psycopg (internal).

The worker runs the same Core statements an app imports, but compiles each
once and executes it on an autocommit psycopg connection: a claim or a fenced
completion is a single atomic statement, so wrapping it in BEGIN/COMMIT would
only add two round trips, and compiling it per call would only add CPU. A lost
connection is dropped and reopened on the next call, never before: a worker
that has nothing to say to the database opens nothing (a suspended serverless
compute stays asleep).

Each `Driver` is one connection with one job; the worker keeps three (claims,
outcomes, leases) so that none of them can stall another.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads
from sqlalchemy import ClauseElement, Table

from . import queue_statements, statements
from .db import LOCK_TIMEOUT, close_quietly, compiled, connect_kwargs, conninfo
from .job import error_text

log = logging.getLogger("sqla_jobq.driver")


Key = tuple[int, int]
Row = dict[str, Any]


def raw_json(data: str | bytes) -> str:
    """Keep jsonb as text: payloads are decoded per job, inside that job's
    error boundary, so one payload Python cannot decode fails alone."""
    return data.decode() if isinstance(data, bytes) else data


@dataclass(frozen=True)
class Compiled:
    sql: str
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, stmt: ClauseElement) -> Compiled:
        return cls(*compiled(stmt))

    def params(self, **values: Any) -> dict[str, Any]:
        return {**self.defaults, **values}


@dataclass(frozen=True)
class Fates:
    """Attempts a fenced batch statement skipped or missed, sorted: `busy` are
    still running and ours (another session holds the row: try again),
    `cancelled` were cancelled; any other was taken away (reclaimed)."""

    busy: frozenset[Key]
    cancelled: frozenset[Key]


def _pairs(keys: Sequence[Key], results: Sequence[str | None] | None = None) -> dict[str, str]:
    """The keys as two array literals (`{1,2,3}`), cast by the statements,
    and `results` as a third beside them: psycopg dumps a list of ints element
    by element in Python, about 3.5 us a job in a batch of 64, against 0.5 us
    for this join. In the order the statements look pairs up in
    (`statements.newest_first`)."""
    keys, results = statements.newest_first(keys, results)
    ids = ",".join([str(k[0]) for k in keys])
    attempts = ",".join([str(k[1]) for k in keys])
    arrays = {"ids": f"{{{ids}}}", "attempts": f"{{{attempts}}}"}
    if results is not None:
        arrays["results"] = _text_array(results)
    return arrays


def _text_array(values: Sequence[str | None]) -> str:
    """Texts (None for NULL) as one array literal, cast by the statement: as
    a list, psycopg took about 380 us more per statement of 64 results; this
    literal takes 18 us to build. Every text is quoted, so none can read as
    NULL or split the array."""
    quoted = [
        "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for v in values
    ]
    return "{" + ",".join(quoted) + "}"


def claim_statements(
    table: Table, queues: Sequence[str], lease: timedelta
) -> dict[str, ClauseElement]:
    """A worker's claims: from the head of its queues, and, for one queue,
    past a position (see `claim_cursor`)."""
    queue: statements.Queues = queues[0] if len(queues) == 1 else list(queues)
    claims: dict[str, ClauseElement] = {"claim": statements.claim(table, queue=queue, lease=lease)}
    if isinstance(queue, str):
        claims["claim_after"] = statements.claim(table, queue=queue, lease=lease, after=True)
    return claims


def lifecycle_statements(
    table: Table, queues: Sequence[str], lease: timedelta
) -> dict[str, Compiled]:
    """Every statement a worker's drivers run, compiled once for all of them."""
    queue: statements.Queues = queues[0] if len(queues) == 1 else list(queues)
    none: list[Key] = []
    claims = claim_statements(table, queues, lease)
    sql = {
        **{name: Compiled.of(stmt) for name, stmt in claims.items()},
        "next_run_at_future": Compiled.of(
            statements.next_run_at(table, queue=queue, future_only=True)
        ),
        **_completions(table),
        "fates": Compiled.of(statements.fates(table, none)),
        "fail": Compiled.of(statements.fail(table, 0, 0, "", lock_timeout=LOCK_TIMEOUT)),
        "extend_leases": Compiled.of(statements.extend_leases(table, none, lease)),
        "hand_back": Compiled.of(statements.release_many(table, none, refund=False)),
        "refund": Compiled.of(statements.release_many(table, none, refund=True)),
        "reap": Compiled.of(statements.reap(table)),
        "next_run_at": Compiled.of(statements.next_run_at(table, queue=queue)),
        # SKIP LOCKED: it runs on the claimer's connection, whose 200 ms lock
        # timeout would turn a row someone holds into a failed claim.
        "prune": Compiled.of(statements.prune(table, older_than=timedelta(0), skip_locked=True)),
        "limited": Compiled.of(queue_statements.limited(table, list(queues))),
    }
    return sql


def _completions(table: Table) -> dict[str, Compiled]:
    """Each form of the batch completion `Driver.complete_many` picks from:
    in place or into the archive, with or without results, waiting on a
    locked row or skipping it."""
    none: list[Key] = []
    builds = (("", statements.complete_many), ("_archiving", statements.complete_to_archive))
    given: tuple[tuple[str, list[str | None] | None], ...] = (("", None), ("_results", []))
    return {
        "complete" + where + results + skipping: Compiled.of(
            build(table, none, values, skip_locked=bool(skipping), lock_timeout=LOCK_TIMEOUT)
        )
        for (where, build), (results, values), skipping in product(
            builds, given, ("", "_skipping")
        )
    }


class Driver:
    """One autocommit connection running the compiled lifecycle statements
    (`lifecycle_statements`, shared by a worker's drivers)."""

    def __init__(self, url: str, sql: Mapping[str, Compiled], prepared: bool) -> None:
        self.url = conninfo(url)
        self.prepared = prepared
        self._conn: psycopg.AsyncConnection[Row] | None = None
        self.sql = sql

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def connection(self) -> psycopg.AsyncConnection[Row]:
        """The connection itself (opened if needed), for statements run elsewhere."""
        return await self._connection()

    async def _connection(self) -> psycopg.AsyncConnection[Row]:
        if self._conn is None or self._conn.closed:
            conn = await psycopg.AsyncConnection.connect(
                self.url, row_factory=dict_row, **connect_kwargs(self.prepared)
            )
            set_json_loads(raw_json, conn)
            self._conn = conn
        return self._conn

    async def _execute(self, name: str, **values: Any) -> psycopg.AsyncCursor[Row]:
        """Run one compiled statement; a connection it finds broken is dropped."""
        stmt = self.sql[name]
        conn = await self._connection()
        try:
            return await conn.execute(stmt.sql, stmt.params(**values))
        except psycopg.Error:
            await self._drop_if_broken()
            raise

    async def _rows(self, name: str, **values: Any) -> list[Row]:
        cur = await self._execute(name, **values)
        return await cur.fetchall() if cur.description else []

    async def _drop_if_broken(self) -> None:
        """A statement refused (a lock timeout) leaves an autocommit session
        usable; only a broken one is closed, to be reopened on next use."""
        conn = self._conn
        if conn is not None and (conn.broken or conn.pgconn.status != psycopg.pq.ConnStatus.OK):
            await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        await close_quietly(conn, log)

    async def claim(self, limit: int, after: statements.Position | None = None) -> list[Row]:
        """Claimed rows, payload still as JSON text (see `raw_json`); past
        `after` in claim order if given (see `claim_cursor`)."""
        if after is None:
            return await self._rows("claim", limit=limit)
        priority, run_at, job_id = after
        return await self._rows(
            "claim_after",
            limit=limit,
            after_priority=priority,
            after_run_at=run_at,
            after_id=job_id,
        )

    async def complete_many(
        self,
        keys: Sequence[Key],
        results: Sequence[str | None] | None = None,
        *,
        skip_locked: bool = False,
        archive: bool = False,
    ) -> set[Key]:
        """Complete a batch; `results` (JSON text or None per key) are stored
        with it, by a second compiled form so result-less batches stay lean;
        `archive` moves the jobs to the archive as it completes them
        (`statements.complete_to_archive`)."""
        name = "complete" + ("_archiving" if archive else "")
        name += "" if results is None else "_results"
        name += "_skipping" if skip_locked else ""
        return await self._matched(name, keys, **_pairs(keys, results))

    async def _matched(self, name: str, keys: Sequence[Key], **values: Any) -> set[Key]:
        """The keys a fenced batch statement matched. Each key matches at most
        its one row, so when the row count is the batch size every key
        matched and the returned rows are not read: reading them (a dict per
        row) and dumping the keys element by element (see `_pairs`) made
        completions a quarter of a no-op drain's client CPU; without both, a
        `--burst -c 8` worker drained 1.26x faster (4 interleaved rounds)."""
        cur = await self._execute(name, **values)
        if cur.rowcount == len(keys):
            return set(keys)
        return {(r["id"], r["attempts"]) for r in await cur.fetchall()}

    async def fates(self, keys: Sequence[Key]) -> Fates:
        """What became of attempts a fenced batch statement did not match."""
        if not keys:
            return Fates(frozenset(), frozenset())
        rows = await self._rows("fates", **_pairs(keys))
        status = {(r["id"], r["attempts"]): r["status"] for r in rows}
        return Fates(
            busy=frozenset(k for k, s in status.items() if s == "running"),
            cancelled=frozenset(k for k, s in status.items() if s == "cancelled"),
        )

    async def fail(self, key: Key, error: str) -> tuple[str, float] | None:
        """The job's new status and seconds until its retry, or None if not done."""
        rows = await self._rows("fail", id=key[0], attempts=key[1], error=error_text(error))
        if not rows:
            return None
        return str(rows[0]["status"]), max(rows[0]["retry_in"].total_seconds(), 0.0)

    async def extend_leases(self, keys: Sequence[Key], lease: timedelta) -> set[Key]:
        return await self._matched("extend_leases", keys, lease=lease, **_pairs(keys))

    async def hand_back(self, keys: Sequence[Key], *, refund: bool) -> set[Key]:
        return await self._matched("refund" if refund else "hand_back", keys, **_pairs(keys))

    async def reap(self) -> list[Row]:
        return await self._rows("reap")

    async def prune(self, older_than: timedelta, limit: int) -> int:
        """One batch of finished jobs deleted, in its own (autocommit) transaction."""
        cur = await self._execute("prune", older_than=older_than, limit=limit)
        return cur.rowcount

    async def limited(self) -> bool:
        """Whether any of the worker's queues has a concurrency limit now."""
        return bool(await self._rows("limited"))

    async def seconds_until_next(self, future_only: bool = False) -> float | None:
        """Seconds until the earliest queued job is due (server clock), or None;
        `future_only` looks only past now (see `statements.next_run_at`)."""
        rows = await self._rows("next_run_at_future" if future_only else "next_run_at")
        if not rows:
            return None
        due, now = rows[0].values()
        if due is None:
            return None
        seconds: float = (due - now).total_seconds()
        return max(seconds, 0.0)
