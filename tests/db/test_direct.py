"""The idle claim on libpq directly (sqla_jobq/direct.py) returns what the
worker's psycopg claim returns, and survives what a connection meets: its
prepared statement keyed by parameter types, a pooler that keeps none, a
terminated session, a table gone from under it."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table, func, select
from sqlalchemy import table as sql_table

from sqla_jobq.direct import DirectConnection, Numbered
from sqla_jobq.driver import Driver, claim_statements, lifecycle_statements
from tests.support.rows import Raw, enqueue

LEASE = timedelta(minutes=5)


def _claims(table: Table) -> dict[str, Numbered]:
    return {k: Numbered.of(s) for k, s in claim_statements(table, ["default"], LEASE).items()}


def _psycopg_claim(database_url: str, table: Table) -> list[dict[str, Any]]:
    async def claim() -> list[dict[str, Any]]:
        driver = Driver(database_url, lifecycle_statements(table, ["default"], LEASE), True)
        try:
            return await driver.claim(1)
        finally:
            await driver.close()

    return asyncio.run(claim())


def test_a_direct_claim_returns_the_same_columns_and_types_as_the_psycopg_claim(
    database_url: str, engine: Engine, table: Table
) -> None:
    at = datetime.now(UTC) - timedelta(seconds=5)
    extra: dict[str, Any] = {"run_at": at, "unique_key": None}
    enqueue(engine, table, "t", {"n": 1, "s": "é"}, priority=3, **extra)
    enqueue(engine, table, "t", {"n": 1, "s": "é"}, priority=3, **extra)
    conn = DirectConnection(database_url, prepared=True)
    try:
        (direct,) = conn.run(_claims(table)["claim"].bind(limit=1))
    finally:
        conn.close()
    (through_psycopg,) = _psycopg_claim(database_url, table)
    assert {k: type(v) for k, v in direct.items()} == {
        k: type(v) for k, v in through_psycopg.items()
    }
    assert json.loads(direct["payload"]) == {"n": 1, "s": "é"}  # raw JSON text, as the worker's
    assert direct["run_at"] == at and direct["run_at"].tzinfo is not None
    same = {"task", "queue", "payload", "attempts", "max_attempts", "priority", "run_at"}
    assert {k: direct[k] for k in same} == {k: through_psycopg[k] for k in same}


def test_one_statement_bound_with_ints_of_different_sizes_runs_on_one_connection(
    database_url: str, engine: Engine, table: Table
) -> None:
    """A small int is dumped as int2 and a large one as int8: one prepared
    statement for both would refuse the second's binary value."""
    for _ in range(3):
        enqueue(engine, table, "t", {})
    after = _claims(table)["claim_after"]
    now = datetime.now(UTC)
    small = after.bind(limit=1, **_after(now - timedelta(days=1), 1))
    huge = after.bind(limit=1, **_after(now + timedelta(days=1), 2**40))
    assert small.types != huge.types
    conn = DirectConnection(database_url, prepared=True)
    try:
        assert len(conn.run(small)) == 1
        assert conn.run(huge) == []  # past every job: nothing, and no error
        assert len(conn.run(after.bind(limit=5, **_after(now - timedelta(days=1), 1)))) == 2
    finally:
        conn.close()


def _after(run_at: datetime, job_id: int) -> dict[str, Any]:
    return {"after_priority": 0, "after_run_at": run_at, "after_id": job_id}


def test_without_prepared_statements_the_session_prepares_nothing(
    database_url: str, engine: Engine, table: Table
) -> None:
    enqueue(engine, table, "t", {})
    conn = DirectConnection(database_url, prepared=False)
    try:
        assert len(conn.run(_claims(table)["claim"].bind(limit=1))) == 1
        assert conn.run(Numbered.of(_prepared_statements()).bind()) == [{"count": 0}]
    finally:
        conn.close()


def _prepared_statements() -> Any:
    return select(func.count().label("count")).select_from(sql_table("pg_prepared_statements"))


def test_a_terminated_session_raises_once_and_the_next_claim_reconnects(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    enqueue(engine, table, "t", {})
    claim = _claims(table)["claim"].bind(limit=1)
    conn = DirectConnection(database_url, prepared=True)
    try:
        assert conn.run(claim) != []
        pid = _pid(conn)
        raw.execute("SELECT pg_terminate_backend(%s)", [pid])
        enqueue(engine, table, "t", {})
        with pytest.raises(psycopg.OperationalError):
            conn.run(claim)
        assert len(conn.run(claim)) == 1  # a new session, its statement prepared again
        assert _pid(conn) != pid
    finally:
        conn.close()


def test_a_claim_on_a_dropped_table_raises_the_server_error_and_loses_no_session(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    claim = _claims(table)["claim"].bind(limit=1)
    conn = DirectConnection(database_url, prepared=True)
    try:
        assert conn.run(claim) == []
        raw.execute(f'ALTER TABLE "{table.name}" RENAME TO "{table.name}_away"')
        try:
            with pytest.raises(psycopg.errors.UndefinedTable):
                conn.run(claim)
        finally:
            raw.execute(f'ALTER TABLE "{table.name}_away" RENAME TO "{table.name}"')
        enqueue(engine, table, "t", {})
        assert len(conn.run(claim)) == 1
    finally:
        conn.close()


def _pid(conn: DirectConnection) -> int:
    (found,) = conn.run(Numbered.of(select(func.pg_backend_pid().label("pid"))).bind())
    return int(found["pid"])
