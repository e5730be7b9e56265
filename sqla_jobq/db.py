"""Database URLs and worker sessions: one place that turns what a user typed
into a SQLAlchemy URL or a psycopg conninfo, and that says how every worker
session is configured (internal)."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import ClauseElement
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

_SCHEMES = {"postgres", "postgresql", "postgresql+psycopg"}


class BadDatabaseURL(ValueError):
    """The URL is not a PostgreSQL URL this package can use."""


def parse_url(url: str) -> URL:
    """A `postgresql+psycopg` URL from any of the spellings users type."""
    try:
        parsed = make_url(url.strip())
    except ArgumentError:
        raise BadDatabaseURL(
            f"not a database URL: {url!r} (expected postgresql://user@host:port/dbname)"
        ) from None
    if parsed.drivername not in _SCHEMES:
        raise BadDatabaseURL(
            f"unsupported database URL scheme {parsed.drivername!r}: sqla_jobq needs "
            "PostgreSQL (postgresql:// or postgresql+psycopg://)"
        )
    return parsed.set(drivername="postgresql+psycopg")


def sqlalchemy_url(url: str) -> str:
    return parse_url(url).render_as_string(hide_password=False)


def conninfo(url: str) -> str:
    """The same URL as a libpq conninfo string for a raw psycopg connection."""
    return parse_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


# Nothing of ours may hold VACUUM back: a session left idle in a transaction
# (a bug, or a debugger) is ended by the server after a minute.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000
# No worker statement may wait long on a row lock another session holds:
# heartbeats, hand-backs and the reaper skip locked rows; outcomes wait this
# long (claimers hold a row they pass for a moment), then go round the row.
# The statements that may wait (outcomes, periodic fires) also carry it
# themselves as LOCK_TIMEOUT (`statements.waiting_at_most`): a
# transaction-mode pooler drops the startup options that set it here.
LOCK_TIMEOUT_MS = 200
LOCK_TIMEOUT = timedelta(milliseconds=LOCK_TIMEOUT_MS)
# A worker session that writes pages out of shared buffers (its VACUUM of a
# heap a held snapshot grew, claims evicting pages of a heap larger than
# shared_buffers) asks the kernel to write them back every this much, instead
# of leaving them dirty in the page cache (PostgreSQL's default is 0, never)
# until the next checkpoint's fsync writes them all at once while commits
# wait for the same disk. In the held-snapshot scene the checkpoints after the
# release synced 0.38 and 0.44 s, with the slowest seconds inside them; with
# this on the worker's sessions, 0.10 and 0.18 s, and set server-wide (which
# also covers autovacuum and the app's own sessions), 0.05 s at most
# (docs/benchmarks.md, twenty-third round).
BACKEND_FLUSH_AFTER = "256kB"


# Every worker connection that fails is retried after this, doubling up to
# RETRY_MAX seconds: claims, outcomes, hand-backs and the LISTEN connection.
RETRY_START = 0.1
RETRY_MAX = 5.0


async def close_quietly(conn: psycopg.AsyncConnection[Any] | None, log: logging.Logger) -> None:
    """Close a connection that may be broken already; a failure to close is no news."""
    if conn is None:
        return
    try:
        await conn.close()
    except psycopg.Error:
        log.debug("error while closing a broken connection", exc_info=True)


def worker_name() -> str:
    """`application_name` for our sessions, so `jobq doctor` can tell them apart."""
    return f"jobq worker {socket.gethostname()}:{os.getpid()}"[:63]


def connect_kwargs(prepared: bool, lock_timeout_ms: int = LOCK_TIMEOUT_MS) -> dict[str, Any]:
    """psycopg connection options shared by every worker session."""
    options = (
        f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_MS} "
        f"-c lock_timeout={lock_timeout_ms} "
        f"-c backend_flush_after={BACKEND_FLUSH_AFTER}"
    )
    return {
        "autocommit": True,
        "application_name": worker_name(),
        "options": options,
        # Behind a transaction-mode pooler that does not track prepared
        # statements (PgBouncer < 1.21), server-side preparation must be off.
        "prepare_threshold": 0 if prepared else None,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }


_DIALECT = pg_psycopg.dialect()  # type: ignore[no-untyped-call]

# A statement as psycopg takes it: SQL text and its parameters.
Query = tuple[str, dict[str, Any]]


def compiled(stmt: ClauseElement) -> Query:
    """Compile a Core statement once for raw psycopg connections (the worker's,
    the scheduler's, the worker registry's): no per-call compilation cost."""
    done = stmt.compile(dialect=_DIALECT)
    return done.string, dict(done.params)
