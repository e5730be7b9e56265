"""What the tests of the worker's table upkeep (vacuuming, reindexing) share:
a registry of one no-op task, the count of done jobs, a role that may work
the queue but does not own its table, and another session's held snapshot."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import Table
from sqlalchemy.engine import make_url

from sqla_jobq import Registry
from sqla_jobq.db import conninfo
from tests.support.faultqueue import drop_role
from tests.support.rows import every_job

Raw = psycopg.Connection[Any]


def noop_registry(table: Table) -> Registry:
    registry = Registry(table)

    @registry.task(name="noop")
    def noop() -> None:
        return None

    return registry


def done(raw: Raw, table: Table) -> int:
    """Done jobs, in the jobs table or already in its archive."""
    row = raw.execute(
        f"SELECT count(*) FROM {every_job(table, 'status')} WHERE status = 'done'"
    ).fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def dml_role(raw: Raw, database_url: str, table: Table, prefix: str) -> Iterator[str]:
    """The URL of a login role with DML on the queue table and nothing more:
    only a table's owner may VACUUM or REINDEX it."""
    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    raw.execute(f"CREATE ROLE {role} LOGIN".encode())
    raw.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table.name}" TO {role}'.encode())
    try:
        yield make_url(database_url).set(username=role).render_as_string(hide_password=False)
    finally:
        drop_role(raw, role, owned=True)


@contextmanager
def snapshot_held(database_url: str) -> Iterator[Raw]:
    """Another session holding a REPEATABLE READ snapshot until the block ends
    (or the caller rolls it back): VACUUM must keep what it may still read."""
    with psycopg.connect(conninfo(database_url)) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1")
        yield conn
        conn.rollback()
