"""sqla_jobq.testing: drain, enqueued_jobs, assert_enqueued and the pytest
plugin's fixtures, inside outer transactions rolled back at the end (nothing
is left behind), sync and async, on real queue SQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, Table, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sqla_jobq import Registry, client, current_job, statements
from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.testing import Harness, assert_enqueued, drain, drain_async, enqueued_jobs
from sqla_jobq.testing import plugin as testing_plugin

Raw = psycopg.Connection[Any]


@pytest.fixture
def registry(table: Table) -> Registry:
    reg = Registry(table)

    @reg.task(name="double")
    def double(n: int) -> dict[str, int]:
        return {"n": n, "double": 2 * n, "attempt": current_job().attempts}

    @reg.task(name="adouble", queue="async")
    async def adouble(n: int) -> int:
        return 2 * n

    @reg.task(name="flaky", max_attempts=3)
    def flaky() -> str:
        if current_job().attempts < 2:
            raise RuntimeError("first attempt fails")
        return "ok"

    @reg.task(name="broken", max_attempts=2)
    def broken() -> None:
        raise ValueError("always broken")

    @reg.task(name="chain", transactional=True)
    def chain(conn: Connection, left: int) -> None:
        if left:
            reg.tasks["chain"].enqueue(conn, left=left - 1)

    @reg.task(name="record", transactional=True)
    def record(conn: Connection, note: str, fail: bool = False) -> None:
        conn.execute(text(f'INSERT INTO "{table.name}_notes" (note) VALUES (:n)'), {"n": note})
        if fail:
            conn.execute(text("SELECT 1 / 0"))

    return reg


@pytest.fixture
def notes(raw: Raw, table: Table) -> Iterator[str]:
    name = f"{table.name}_notes"
    raw.execute(f'CREATE TABLE "{name}" (id serial PRIMARY KEY, note text NOT NULL)')
    yield name
    raw.execute(f'DROP TABLE "{name}"')


# The plugin's fixtures, pointed at this test's queue table and registry.
@pytest.fixture
def jobq_registry(registry: Registry) -> Registry:
    return registry


@pytest.fixture
def jobq_engine(engine: Engine) -> Engine:
    return engine


def count(raw: Raw, table: Table) -> int:
    row = raw.execute(f'SELECT count(*) FROM "{table.name}"').fetchone()
    assert row is not None
    return int(row[0])


def later(**delta: float) -> datetime:
    return datetime.now(UTC) + timedelta(**delta)


def test_drain_runs_every_ready_job_in_the_outer_transaction_and_leaves_nothing_behind(
    engine: Engine, registry: Registry, raw: Raw, table: Table
) -> None:
    with engine.connect() as conn:
        outer = conn.begin()
        first = registry.tasks["double"].enqueue(conn, n=2)
        second = registry.tasks["adouble"].enqueue(conn, n=5)
        ran = drain(conn, registry)
        stored = conn.execute(statements.job_outcome(table, first)).one()
        outer.rollback()
    assert [(r.id, r.task, r.outcome, r.attempt) for r in ran] == [
        (first, "double", "done", 1),
        (second, "adouble", "done", 1),
    ]
    assert ran[0].result == {"n": 2, "double": 4, "attempt": 1}
    assert ran[1].result == 10
    assert (stored.status, stored.result) == ("done", {"n": 2, "double": 4, "attempt": 1})
    assert count(raw, table) == 0


def test_drain_runs_jobs_its_handlers_enqueue_until_none_is_ready(
    jobq: Harness, registry: Registry
) -> None:
    registry.tasks["chain"].enqueue(jobq.conn, left=2)
    assert [r.outcome for r in jobq.drain()] == ["done", "done", "done"]
    assert jobq.enqueued() == []


def test_drain_runs_only_the_queues_it_is_given(jobq: Harness, registry: Registry) -> None:
    registry.tasks["double"].enqueue(jobq.conn, n=1)
    registry.tasks["adouble"].enqueue(jobq.conn, n=1)
    assert [r.task for r in jobq.drain(queues="async")] == ["adouble"]
    assert [j.task for j in jobq.enqueued()] == ["double"]


def test_a_failed_attempt_is_retried_once_now_is_moved_past_its_backoff(
    jobq: Harness, registry: Registry
) -> None:
    job_id = registry.tasks["flaky"].enqueue(jobq.conn)
    [first] = jobq.drain()
    assert (first.outcome, first.error) == ("retry", "RuntimeError: first attempt fails")
    assert first.retry_at is not None
    assert jobq.drain() == []  # its backoff has not passed
    [second] = jobq.drain(now=first.retry_at)
    assert (second.id, second.attempt, second.outcome, second.result) == (job_id, 2, "done", "ok")


def test_a_scheduled_job_runs_only_when_now_reaches_its_time(
    jobq: Harness, registry: Registry
) -> None:
    registry.tasks["double"].enqueue(jobq.conn, n=3, delay=timedelta(hours=1))
    assert jobq.drain() == []
    assert jobq.drain(now=later(minutes=59)) == []
    [ran] = jobq.drain(now=later(hours=1, minutes=1))
    assert (ran.outcome, ran.result["double"]) == ("done", 6)


def test_a_handler_that_keeps_failing_ends_failed_with_its_error_recorded(
    jobq: Harness, registry: Registry, table: Table
) -> None:
    job_id = registry.tasks["broken"].enqueue(jobq.conn)
    ran = jobq.drain(now=later(days=1))
    assert [(r.attempt, r.outcome) for r in ran] == [(1, "retry"), (2, "failed")]
    stored = jobq.conn.execute(statements.job_outcome(table, job_id)).one()
    assert (stored.status, stored.last_error) == ("failed", "ValueError: always broken")


def test_a_job_of_an_unknown_task_fails_as_the_worker_fails_it(
    jobq: Harness, table: Table
) -> None:
    client.enqueue(jobq.conn, table, "nobody_knows", {}, max_attempts=1)
    [ran] = jobq.drain()
    assert ran.outcome == "failed"
    assert ran.error is not None and ran.error.startswith("UnknownTask:")


def test_a_handler_breaking_the_transaction_fails_alone_and_its_writes_roll_back(
    notes: str, jobq: Harness, registry: Registry
) -> None:
    # `notes` first: set up before the outer transaction, dropped after it.
    record = registry.tasks["record"]
    record.enqueue(jobq.conn, note="kept")
    record.enqueue(jobq.conn, note="rolled back", fail=True)
    registry.tasks["double"].enqueue(jobq.conn, n=1)
    ran = jobq.drain()
    assert [(r.task, r.outcome) for r in ran] == [
        ("record", "done"),
        ("record", "retry"),
        ("double", "done"),
    ]
    assert ran[1].error is not None and "DivisionByZero" in ran[1].error
    kept = jobq.conn.execute(text(f'SELECT note FROM "{notes}"')).scalars().all()
    assert kept == ["kept"]


def test_drain_skips_a_job_another_session_holds_locked(
    engine: Engine, registry: Registry, database_url: str, table: Table
) -> None:
    with engine.begin() as conn:
        locked = registry.tasks["double"].enqueue(conn, n=1)
        free = registry.tasks["double"].enqueue(conn, n=2)
    with psycopg.connect(conninfo(database_url)) as other:
        other.execute(f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE', (locked,))
        with engine.connect() as conn:
            outer = conn.begin()
            ran = drain(conn, registry)
            outer.rollback()
    assert [r.id for r in ran] == [free]


def test_enqueued_jobs_lists_queued_jobs_soonest_first_filtered_by_task(
    jobq: Harness, registry: Registry
) -> None:
    double = registry.tasks["double"]
    late = double.enqueue(jobq.conn, n=1, delay=timedelta(hours=1))
    soon = double.enqueue(jobq.conn, n=2)
    other = registry.tasks["adouble"].enqueue(jobq.conn, n=3)
    assert [j.id for j in enqueued_jobs(jobq.conn, registry, double)] == [soon, late]
    assert [j.id for j in jobq.enqueued("adouble")] == [other]
    assert jobq.enqueued(double)[0].payload == {"n": 2}


def test_assert_enqueued_matches_a_payload_subset_and_lists_the_queue_when_nothing_does(
    jobq: Harness, registry: Registry, table: Table
) -> None:
    double = registry.tasks["double"]
    job_id = double.enqueue(jobq.conn, n=7)
    [found] = assert_enqueued(jobq.conn, table, double, n=7)
    assert found.id == job_id
    with pytest.raises(AssertionError) as failed:
        jobq.assert_enqueued("double", n=8)
    message = str(failed.value)
    assert "no queued job of task double with payload including {'n': 8}" in message
    assert f"#{job_id} double({{'n': 7}})" in message


def test_the_plugin_is_registered_by_the_entry_point(request: pytest.FixtureRequest) -> None:
    assert request.config.pluginmanager.get_plugin("sqla_jobq") is testing_plugin


def test_drain_works_on_a_session_joined_to_the_outer_transaction(
    engine: Engine, registry: Registry, raw: Raw, table: Table
) -> None:
    with engine.connect() as conn:
        outer = conn.begin()
        with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
            registry.tasks["double"].enqueue(session, n=4)
            session.commit()  # a savepoint released: the outer transaction goes on
            [ran] = drain(session, registry)
        outer.rollback()
    assert (ran.outcome, ran.result["double"]) == ("done", 8)
    assert count(raw, table) == 0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    yield eng
    await eng.dispose()


@pytest.fixture
async def async_conn(async_engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    async with async_engine.connect() as conn:
        outer = await conn.begin()
        yield conn
        await outer.rollback()


@pytest.mark.anyio
async def test_drain_async_awaits_async_handlers_and_calls_sync_ones(
    registry: Registry, async_conn: AsyncConnection
) -> None:
    # `registry` (and its table) first: set up before the outer transaction.
    await registry.tasks["adouble"].enqueue(async_conn, n=21)
    await registry.tasks["double"].enqueue(async_conn, n=1)
    await registry.tasks["flaky"].enqueue(async_conn)
    ran = await drain_async(async_conn, registry)
    assert [(r.task, r.outcome, r.result) for r in ran] == [
        ("adouble", "done", 42),
        ("double", "done", {"n": 1, "double": 2, "attempt": 1}),
        ("flaky", "retry", None),
    ]
    [again] = await drain_async(async_conn, registry, now=ran[2].retry_at)
    assert (again.task, again.outcome) == ("flaky", "done")
    queued = await async_conn.run_sync(enqueued_jobs, registry)
    assert queued == []


@pytest.mark.anyio
async def test_drain_async_leaves_nothing_behind_after_the_rollback(
    async_engine: AsyncEngine, registry: Registry, raw: Raw, table: Table
) -> None:
    async with async_engine.connect() as conn:
        outer = await conn.begin()
        await registry.tasks["adouble"].enqueue(conn, n=1)
        [ran] = await drain_async(conn, registry, queues=["async"])
        await outer.rollback()
    assert ran.outcome == "done"
    assert count(raw, table) == 0
