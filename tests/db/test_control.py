"""Cancelling running jobs, timeouts, periodic tasks and results, through real
workers (in-process, tests/support/inprocess.py) on real PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Engine, Table

from sqla_jobq import Registry, client, current_job, queue_statements, statements
from tests.support.inprocess import Side, burst, running
from tests.support.rows import enqueue, every_job
from tests.support.rows import job_row as row
from tests.support.waiting import wait_until

Raw = psycopg.Connection[Any]


def cancel(engine: Engine, table: Table, job_id: int) -> None:
    with engine.begin() as conn:
        assert conn.execute(statements.cancel(table, job_id)).first() is not None


# --------------------------------------------------------------------------- cancel


def test_cancelling_a_running_async_job_cancels_its_handler_and_it_ends_cancelled(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="waits")
    async def waits() -> None:
        side.record("started")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            side.record("cancelled inside")
            raise

    job_id = enqueue(engine, table, "waits")
    with running(registry, database_url, poll_interval=30):
        wait_until(lambda: side.events(job_id), 10, "the handler to start")
        cancel(engine, table, job_id)
        # Learned by NOTIFY long before the 5-minute lease's first heartbeat.
        wait_until(lambda: len(side.events(job_id)) == 2, 10, "the handler to be cancelled")
    assert [e["event"] for e in side.events(job_id)] == ["started", "cancelled inside"]
    found = row(raw, table, job_id)
    assert (found["status"], found["attempts"]) == ("cancelled", 1)


def test_a_sync_handler_sees_its_cancel_and_its_completion_is_refused(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="steps")
    def steps() -> str:
        side.record("started")
        for _ in range(200):
            if current_job().cancel_requested:
                side.record("saw the cancel")
                break
            time.sleep(0.05)
        return "finished anyway"

    job_id = enqueue(engine, table, "steps")
    with running(registry, database_url, poll_interval=30):
        wait_until(lambda: side.events(job_id), 10, "the handler to start")
        cancel(engine, table, job_id)
        wait_until(lambda: len(side.events(job_id)) == 2, 10, "the handler to see it")
        time.sleep(0.5)  # its return goes to the fence, which refuses it
    found = row(raw, table, job_id)
    assert (found["status"], found["result"]) == ("cancelled", None)


# --------------------------------------------------------------------------- timeouts


def test_an_async_attempt_past_its_timeout_is_cancelled_and_retried(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="slow", timeout=timedelta(seconds=0.3))
    async def slow() -> None:
        side.record("started")
        await asyncio.sleep(30)

    job_id = enqueue(engine, table, "slow")
    assert burst(registry, database_url) == 0
    found = row(raw, table, job_id)
    assert (found["status"], found["attempts"]) == ("queued", 1)
    assert found["last_error"] == "TimeoutError: slow ran longer than its timeout"


def test_a_sync_attempt_past_its_timeout_is_recorded_at_once_and_its_late_end_dropped(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    registry = Registry(table)
    release = threading.Event()

    @registry.task(name="stuck", timeout=timedelta(seconds=0.3), max_attempts=1)
    def stuck() -> str:
        release.wait(30)
        side.record("ended late")
        return "too late"

    job_id = enqueue(engine, table, "stuck", max_attempts=1)
    with running(registry, database_url, poll_interval=30):
        wait_until(lambda: row(raw, table, job_id)["status"] == "failed", 10, "timed out")
        release.set()
        wait_until(lambda: side.events(job_id), 10, "the thread to end")
        time.sleep(0.3)
    found = row(raw, table, job_id)
    assert (found["status"], found["result"]) == ("failed", None)
    assert found["last_error"].startswith("TimeoutError")


# --------------------------------------------------------------------------- periodic


def test_two_workers_enqueue_each_fire_time_once_and_pass_it_to_the_handler(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    registry = Registry(table)
    seen: list[Any] = []

    @registry.task(name="tick", every=timedelta(seconds=1))
    def tick() -> None:
        seen.append(current_job().scheduled_for)

    with (
        running(registry, database_url, poll_interval=30),
        running(registry, database_url, poll_interval=30),
    ):
        wait_until(lambda: len(seen) >= 3, 15, "three fires")
    fires = raw.execute(
        "SELECT scheduled_for, count(*) "
        f"FROM {every_job(table, 'scheduled_for, task')} WHERE task = %s GROUP BY 1",
        ("tick",),
    ).fetchall()
    assert fires and all(n == 1 for _, n in fires), fires
    assert all(s is not None for s in seen)
    assert len(set(seen)) == len(seen)


# --------------------------------------------------------------------------- results


def test_return_values_are_stored_with_the_job_and_unserialisable_ones_are_not(
    engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="answer")
    def answer(n: int) -> Any:
        return {"n": n, "double": 2 * n} if n >= 0 else object()

    good = [enqueue(engine, table, "answer", {"n": n}) for n in range(5)]
    bad = enqueue(engine, table, "answer", {"n": -1})
    assert burst(registry, database_url) == 0
    assert [row(raw, table, j)["result"] for j in good] == [
        {"n": n, "double": 2 * n} for n in range(5)
    ]
    assert (row(raw, table, bad)["status"], row(raw, table, bad)["result"]) == ("done", None)


# --------------------------------------------------------------------------- limits


def test_a_burst_worker_drains_a_limited_queue_instead_of_leaving_at_its_cap(
    engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    """An empty claim caused by the limit is not an empty queue: the burst
    worker waits for slots while jobs are due, and never prefetches past it."""
    registry = Registry(table)

    @registry.task(name="brief")
    def brief() -> None:
        time.sleep(0.02)

    with engine.begin() as conn:
        conn.execute(queue_statements.set_concurrency_limit(table, "default", 2))
        ids = [client.enqueue(conn, table, "brief", {}) for _ in range(30)]
    assert burst(registry, database_url, concurrency=4) == 0
    assert all(row(raw, table, j)["status"] == "done" for j in ids)


# --------------------------------------------------------------------------- registry


def test_a_worker_registers_itself_while_it_runs_and_leaves_on_a_clean_stop(
    table: Table, raw: Raw, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="noop")
    def noop() -> None:
        pass

    workers = f'"{table.name}_workers"'
    with running(registry, database_url, concurrency=3, poll_interval=30):
        rows = wait_until(
            lambda: raw.execute(f"SELECT pid, concurrency, queues FROM {workers}").fetchall(),
            10,
            "the worker's row",
        )
        assert [(r[1], r[2]) for r in rows] == [(3, ["default"])]
    assert raw.execute(f"SELECT count(*) FROM {workers}").fetchone() == (0,)
