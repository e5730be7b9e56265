"""Claiming past a position (what a worker does while a held snapshot makes
the head of the claim index expensive): the statement takes only what comes
after the position, and a worker claiming that way still runs every job
exactly once, including the jobs the position cannot see."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import Registry, claim_cursor, client, statements
from sqla_jobq.job import NewJob
from tests.support.inprocess import Side, running
from tests.support.rows import every_job
from tests.support.waiting import wait_until

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def claim_after(engine: Engine, table: Table, position: statements.Position, limit: int) -> list:
    priority, run_at, job_id = position
    stmt = statements.claim(table, limit=limit, after=True)
    params = {"after_priority": priority, "after_run_at": run_at, "after_id": job_id}
    with engine.begin() as conn:
        return list(conn.execute(stmt, params).mappings())


def test_claim_after_a_position_takes_only_later_jobs_of_its_priority_in_order(
    engine: Engine, table: Table
) -> None:
    with engine.begin() as conn:
        jobs = [
            NewJob("t", {"n": n}, run_at=T0 + timedelta(seconds=n % 5), priority=p)
            for n in range(20)
            for p in (0, 5)
        ]
        client.enqueue_many(conn, table, jobs)
        rows = conn.execute(table.select().order_by(table.c.priority.desc(), "run_at", "id"))
        ordered = list(rows.mappings())
    top = [r for r in ordered if r["priority"] == 5]
    pivot = top[7]
    taken = claim_after(engine, table, (5, pivot["run_at"], pivot["id"]), limit=5)
    assert [r["id"] for r in sorted(taken, key=lambda r: (r["run_at"], r["id"]))] == [
        r["id"] for r in top[8:13]
    ]
    assert {r["priority"] for r in taken} == {5}
    rest = claim_after(engine, table, (5, pivot["run_at"], pivot["id"]), limit=100)
    assert {r["id"] for r in rest} == {r["id"] for r in top[13:]}  # taken ones are running


def test_a_list_of_queues_cannot_claim_after_a_position(table: Table) -> None:
    with pytest.raises(ValueError, match="one queue"):
        statements.claim(table, queue=["a", "b"], after=True)


@pytest.fixture
def always_positional(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every claim from the head counts as slow: the worker claims past its
    position whenever it can, as it would under a held snapshot."""
    monkeypatch.setattr(claim_cursor, "SLOW_CLAIM", 0.0)
    yield


def recording_registry(table: Table, side: Side, pause: float = 0.0) -> Registry:
    registry = Registry(table)

    @registry.task(name="t")
    def t(n: int) -> None:
        side.record("ran")
        time.sleep(pause)

    return registry


def test_positional_claims_run_every_job_once_across_two_workers(
    always_positional: None, database_url: str, engine: Engine, table: Table, side: Side
) -> None:
    registry = recording_registry(table, side)
    with engine.begin() as conn:
        jobs = [NewJob("t", {"n": n}, priority=n % 3) for n in range(1500)]
        ids = client.enqueue_many(conn, table, jobs)
    options: dict[str, Any] = {"concurrency": 4, "poll_interval": 0.2}
    engaged: list[bool] = []

    def all_run() -> bool:
        engaged.append(first.worker.cursor.engaged or second.worker.cursor.engaged)
        return len(side.events()) >= len(ids)

    with (
        running(registry, database_url, **options) as first,
        running(registry, database_url, **options) as second,
    ):
        wait_until(all_run, 60, "every job run")
    assert any(engaged)  # the positional claims were used along the way
    ran = [e["job_id"] for e in side.events()]
    assert sorted(ran) == sorted(ids)
    with engine.connect() as conn:
        statuses = conn.exec_driver_sql(
            f"SELECT status, attempts FROM {every_job(table, 'status, attempts')}"
        )
        assert set(statuses) == {("done", 1)}


def test_jobs_behind_the_position_still_run(
    always_positional: None, database_url: str, engine: Engine, table: Table, side: Side
) -> None:
    """What a positional claim cannot see: a job due long ago (as a job put
    back keeps its run_at, or one whose transaction committed late), one of a
    higher priority and one of a lower priority, all enqueued while the
    worker claims past its position. The claim from the head, due at least
    every HEAD_EVERY seconds, takes them."""
    registry = recording_registry(table, side, pause=0.005)
    with engine.begin() as conn:
        client.enqueue_many(conn, table, [NewJob("t", {"n": n}) for n in range(300)])
    with running(registry, database_url, concurrency=2, poll_interval=30) as run:
        wait_until(lambda: len(side.events()) >= 50, 60, "the first jobs run")
        assert run.worker.cursor.engaged and run.worker.cursor.position is not None
        with engine.begin() as conn:
            behind = [
                client.enqueue(conn, table, "t", {"n": -1}, run_at=T0),
                client.enqueue(conn, table, "t", {"n": -2}, priority=9),
                client.enqueue(conn, table, "t", {"n": -3}, priority=-9),
            ]
        wait_until(lambda: len(side.events()) >= 303, 30, "the jobs behind the position")
    assert {e["job_id"] for e in side.events()} >= set(behind)


def test_stopping_while_sweeping_leaves_no_job_running_and_no_session_open(
    always_positional: None, database_url: str, engine: Engine, table: Table, side: Side
) -> None:
    """A sweep in flight at shutdown is waited for, and what it claimed is
    handed back with the other jobs not started; its connection is closed.
    The sweep is held for a moment after its claim committed (the window in
    which its rows are leased on the server and not yet in the worker's
    hands), and the worker is stopped inside that window."""
    registry = recording_registry(table, side, pause=0.002)
    with engine.begin() as conn:
        client.enqueue_many(conn, table, [NewJob("t", {"n": n}) for n in range(3000)])
    claimed_by_sweep = threading.Event()
    with running(registry, database_url, concurrency=4, poll_interval=0.2) as run:
        sweeper = run.worker.sweeper
        claim = sweeper.claim

        async def held_claim(limit: int, after: Any = None) -> list[dict[str, Any]]:
            rows = await claim(limit, after)
            if rows:
                claimed_by_sweep.set()
                await asyncio.sleep(0.5)
            return rows

        sweeper.claim = held_claim  # type: ignore[method-assign]
        wait_until(claimed_by_sweep.is_set, 60, "a sweep that claimed jobs")
        run.stop()
        assert run.join() == 0
    with engine.connect() as conn:
        statuses = dict(
            conn.exec_driver_sql(
                f"SELECT status, count(*) FROM {every_job(table, 'status')} GROUP BY status"
            ).all()
        )
        workers = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'jobq worker %%' "
            "AND datname = current_database()"
        ).scalar_one()
    assert "running" not in statuses, statuses
    assert statuses.get("done", 0) == len(side.events())
    assert workers == 0
