"""Transactional completion: a task's database work and its job's completion
commit together, or not at all (a stale worker's writes are rolled back)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy.ext.asyncio import AsyncConnection

from sqla_jobq import LeaseLost, Registry, client, current_job, statements
from sqla_jobq.db import conninfo
from sqla_jobq.job import Job
from tests.support.inprocess import burst

Raw = psycopg.Connection[Any]


@pytest.fixture
def app_table(raw: Raw, table: Table) -> Iterator[str]:
    name = f"{table.name}_app"
    raw.execute(f'CREATE TABLE "{name}" (id serial PRIMARY KEY, note text NOT NULL)')
    yield name
    raw.execute(f'DROP TABLE "{name}"')


def enqueue(engine: Engine, table: Table, task: str, payload: Any = None) -> int:
    with engine.begin() as conn:
        return client.enqueue(conn, table, task, payload or {})


def job(raw: Raw, table: Table, job_id: int) -> dict[str, Any]:
    with raw.cursor(row_factory=dict_row) as cur:
        found = cur.execute(f'SELECT * FROM "{table.name}" WHERE id = %s', (job_id,)).fetchone()
    assert found is not None
    return found


def notes(raw: Raw, app_table: str) -> list[str]:
    return [str(r[0]) for r in raw.execute(f'SELECT note FROM "{app_table}" ORDER BY id')]


def steal(url: str, table: Table, job_id: int) -> None:
    """Another worker takes the job: its lease expires, it is reaped and claimed again."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{table.name}" SET locked_until = now() - interval \'1 s\' WHERE id = %s',
            (job_id,),
        )
        conn.execute(
            f'UPDATE "{table.name}" SET status = \'running\', attempts = attempts + 1, '
            "locked_until = now() + interval '1 h' WHERE id = %s",
            (job_id,),
        )


def registry_for(table: Table, app_table: str, url: str) -> Registry:
    registry = Registry(table)
    insert = text(f'INSERT INTO "{app_table}" (note) VALUES (:note)')

    @registry.task(name="write", transactional=True)
    def write(conn: Connection, note: str, stale: bool = False) -> str:
        conn.execute(insert, {"note": note})
        if stale:
            steal(url, table, current_job().id)
        return note.upper()

    @registry.task(name="write_async", transactional=True)
    async def write_async(conn: AsyncConnection, note: str, stale: bool = False) -> str:
        await conn.execute(insert, {"note": note})
        if stale:
            await asyncio.to_thread(steal, url, table, current_job().id)
        return note.upper()

    @registry.task(name="write_then_fail", transactional=True)
    def write_then_fail(conn: Connection, note: str) -> None:
        conn.execute(insert, {"note": note})
        raise ValueError("after writing")

    return registry


@pytest.mark.parametrize("task", ["write", "write_async"])
def test_live_worker_commits_its_app_row_and_done_together(
    task: str, engine: Engine, table: Table, raw: Raw, app_table: str, database_url: str
) -> None:
    job_id = enqueue(engine, table, task, {"note": "paid"})
    assert burst(registry_for(table, app_table, database_url), database_url) == 0
    found = job(raw, table, job_id)
    assert (found["status"], found["result"]) == ("done", "PAID")
    assert notes(raw, app_table) == ["paid"]


@pytest.mark.parametrize("task", ["write", "write_async"])
def test_stale_worker_app_row_is_rolled_back_with_its_refused_completion(
    task: str, engine: Engine, table: Table, raw: Raw, app_table: str, database_url: str
) -> None:
    job_id = enqueue(engine, table, task, {"note": "twice?", "stale": True})
    assert burst(registry_for(table, app_table, database_url), database_url) == 0
    found = job(raw, table, job_id)
    # The new owner (attempt 2) still holds it; the stale attempt wrote nothing.
    assert (found["status"], found["attempts"]) == ("running", 2)
    assert notes(raw, app_table) == []


def test_handler_raising_rolls_back_its_writes_and_records_the_failure(
    engine: Engine, table: Table, raw: Raw, app_table: str, database_url: str
) -> None:
    job_id = enqueue(engine, table, "write_then_fail", {"note": "half"})
    assert burst(registry_for(table, app_table, database_url), database_url) == 0
    found = job(raw, table, job_id)
    assert (found["status"], found["last_error"]) == ("queued", "ValueError: after writing")
    assert notes(raw, app_table) == []


def test_complete_in_raises_lease_lost_for_a_job_no_longer_ours(
    engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    job_id = enqueue(engine, table, "t")
    with engine.begin() as conn:
        row = conn.execute(statements.claim(table)).one()
    claimed = Job.from_row(row._mapping)
    steal(database_url, table, job_id)
    with pytest.raises(LeaseLost), engine.begin() as conn:
        client.complete_in(conn, table, claimed, result={"x": 1})
    assert job(raw, table, job_id)["status"] == "running"


def test_transactional_task_must_take_conn() -> None:
    registry = Registry()
    with pytest.raises(ValueError, match="takes no `conn` parameter"):

        @registry.task(name="no_conn", transactional=True)
        def no_conn() -> None:
            pass
