"""The idle worker's claim on its listening thread (sqla_jobq/pickup.py).

An idle worker claims an announced job on the thread that heard the
notification and runs the first plain handler right there, while its partner
thread goes on listening. Everything that can meet that path: the loop's own
claims racing it, a stop while its claim waits, a dropped connection, async
handlers, cancels and new jobs announced while a handler runs on a listening
thread, leases, and handlers that raise. Workers run in-process so the tests
can see which thread ran a handler; outcomes are read from the database.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import Registry, client, current_job, queue_statements, statements
from sqla_jobq.db import conninfo, worker_name
from sqla_jobq.observe import Observer
from tests.support.inprocess import Side, running
from tests.support.rows import enqueue, every_job
from tests.support.rows import job_row as row
from tests.support.waiting import wait_until

Raw = psycopg.Connection[Any]
LISTENING = "jobq_listener"


def _threads_of(side: Side) -> list[str]:
    return [str(e["event"]) for e in side.events()]


def _recording(table: Table, side: Side) -> Registry:
    """Tasks that record the thread they ran on."""
    registry = Registry(table)

    @registry.task(name="where")
    def where() -> None:
        side.record(threading.current_thread().name)

    @registry.task(name="where_async")
    async def where_async() -> None:
        asyncio.get_running_loop()
        side.record(threading.current_thread().name)

    return registry


def _failed(raw: Raw, table: Table, job_id: int) -> dict[str, Any] | None:
    found = row(raw, table, job_id)
    return found if found["status"] == "failed" else None


def _done_once(raw: Raw, table: Table, job_id: int) -> bool:
    found = row(raw, table, job_id)
    return found["status"] == "done" and found["attempts"] == 1


def test_an_idle_worker_runs_an_announced_plain_job_on_its_listening_thread(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    side = Side(database_url, f"side_{table.name}")
    with running(_recording(table, side), database_url, poll_interval=60) as run:
        wait_until(lambda: run.worker.pickup is not None, 10, "the worker to start listening")
        time.sleep(0.5)
        ids = []
        for _ in range(3):
            ids.append(enqueue(engine, table, "where"))
            wait_until(lambda: _done_once(raw, table, ids[-1]), 10, "the job to finish")
        assert run.worker.pickup is not None and run.worker.pickup.picked >= 3
    assert all(name.startswith(LISTENING) for name in _threads_of(side)), _threads_of(side)


def test_an_idle_worker_of_two_queues_claims_for_either_on_its_listening_thread(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    """Its claim takes the queues as an array parameter, dumped by the loop."""
    side = Side(database_url, f"side_{table.name}")
    registry = _recording(table, side)
    with running(registry, database_url, poll_interval=60, queues=["a", "b"]) as run:
        wait_until(lambda: run.worker.pickup is not None, 10, "the worker to start listening")
        time.sleep(0.5)
        ids = []
        for queue in ("a", "b", "a"):
            ids.append(enqueue(engine, table, "where", queue=queue))
            wait_until(lambda: _done_once(raw, table, ids[-1]), 10, "the job to finish")
        assert run.worker.pickup is not None and run.worker.pickup.picked >= 3
    assert all(name.startswith(LISTENING) for name in _threads_of(side)), _threads_of(side)


def test_an_async_job_heard_while_idle_runs_on_the_worker_loop(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    side = Side(database_url, f"side_{table.name}")
    with running(_recording(table, side), database_url, poll_interval=60):
        time.sleep(0.5)
        job_id = enqueue(engine, table, "where_async")
        wait_until(lambda: _done_once(raw, table, job_id), 10, "the async job to finish")
    [name] = _threads_of(side)
    assert not name.startswith(LISTENING)


def test_idle_claims_racing_the_loop_never_run_more_jobs_at_once_than_its_concurrency(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    """A poll of a few milliseconds keeps the loop waking while jobs are
    announced two at a time to a one-slot worker: the listening thread takes
    one of each pair, and a loop claiming beside it would take and start the
    other at once. Each claim must be the loop's or the thread's, never both."""
    side = Side(database_url, f"side_{table.name}")
    registry = Registry(table)
    lock = threading.Lock()
    now = [0]
    peak = [0]

    @registry.task(name="counted")
    def counted() -> None:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        side.record("ran")
        time.sleep(0.003)
        with lock:
            now[0] -= 1

    class Peak(Observer):
        most = 0

        def running(self, counts: dict[str, int]) -> None:
            Peak.most = max(Peak.most, sum(counts.values()))

    pairs = 60
    options: dict[str, Any] = {"concurrency": 1, "prefetch": 0, "poll_interval": 0.003}
    with running(registry, database_url, [Peak()], **options) as run:
        time.sleep(0.5)
        for _ in range(pairs):
            with engine.begin() as conn:
                for _ in range(2):
                    client.enqueue(conn, table, "counted", {})
            time.sleep(0.015)
        wait_until(
            lambda: (
                raw.execute(
                    f"SELECT count(*) FROM {every_job(table, 'status')} WHERE status = 'done'"
                ).fetchone()
                == (2 * pairs,)
            ),
            60,
            "every job to finish",
        )
        assert run.worker.pickup is not None and run.worker.pickup.picked > 0
    assert peak[0] == 1 and Peak.most == 1, (peak[0], Peak.most)
    attempts = raw.execute(
        f"SELECT DISTINCT attempts FROM {every_job(table, 'attempts')}"
    ).fetchall()
    assert attempts == [(1,)]
    ran = raw.execute(f'SELECT job_id, count(*) FROM "{side.name}" GROUP BY job_id').fetchall()
    assert len(ran) == 2 * pairs and {n for _, n in ran} == {1}


@contextmanager
def _queue_turn_held(database_url: str, table: Table) -> Iterator[Raw]:
    """Hold the advisory lock a claim of a limited queue takes its turn on
    (see `claim_slots`), so a claim of `default` waits for it."""
    with psycopg.connect(conninfo(database_url), autocommit=True) as holder:
        holder.execute(
            "SELECT pg_advisory_lock(hashtext(%s), hashtext('default'))", (f'"{table.name}"',)
        )
        try:
            yield holder
        finally:
            holder.execute("SELECT pg_advisory_unlock_all()")


def _claim_waiting(raw: Raw) -> bool:
    found = raw.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
        "AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
        (worker_name(),),
    ).fetchone()
    return bool(found and found[0])


def _cancel_run(run: Any) -> None:
    """Cancel the task running `Worker.run`, as an app embedding it may."""

    def cancel() -> None:
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__.endswith("main"):  # type: ignore[union-attr]
                task.cancel()

    run.call(cancel)


@pytest.mark.parametrize("how", ["stop", "cancel"])
def test_a_worker_stopped_while_its_idle_claim_waits_hands_that_job_back(
    engine: Engine, table: Table, database_url: str, raw: Raw, how: str
) -> None:
    """The claim returns after the worker began to stop (asked to, or its task
    cancelled): its job is handed back with its attempt refunded, not left
    `running` until its lease ends."""
    side = Side(database_url, f"side_{table.name}")
    with engine.begin() as conn:
        conn.execute(queue_statements.set_concurrency_limit(table, "default", 5))
    with running(_recording(table, side), database_url, poll_interval=60) as run:
        time.sleep(0.5)
        with _queue_turn_held(database_url, table) as holder:
            job_id = enqueue(engine, table, "where")
            wait_until(lambda: _claim_waiting(raw), 5, "the idle claim to wait", interval=0.005)
            run.stop() if how == "stop" else _cancel_run(run)
            time.sleep(0.03)
            holder.execute("SELECT pg_advisory_unlock_all()")
        run.thread.join(30)
        assert not run.thread.is_alive()
    found = row(raw, table, job_id)
    # Refunded: attempts never go down (they fence outcomes), max_attempts goes up.
    assert found["status"] == "queued", found
    assert found["max_attempts"] - found["attempts"] == 5, found
    assert _threads_of(side) == []


def _terminate_all_but_listen(raw: Raw) -> int:
    rows = raw.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s "
        "AND query NOT ILIKE 'LISTEN%%' AND pid <> pg_backend_pid()",
        (worker_name(),),
    ).fetchall()
    return len(rows)


def test_an_idle_claim_on_a_dropped_connection_leaves_the_claim_to_the_loop(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    side = Side(database_url, f"side_{table.name}")
    with running(_recording(table, side), database_url, poll_interval=60) as run:
        time.sleep(0.5)
        first = enqueue(engine, table, "where")
        wait_until(lambda: _done_once(raw, table, first), 10, "the first job")
        wait_until(lambda: run.worker.attempts == {}, 10, "its completion to be recorded")
        assert _terminate_all_but_listen(raw) >= 2
        second = enqueue(engine, table, "where")
        # The poll is a minute away: the job runs this soon only if a claim
        # is made at once on a connection of its own after the idle claim
        # found its connection gone.
        wait_until(lambda: _done_once(raw, table, second), 10, "the job after the drop")


def test_jobs_announced_while_one_runs_on_a_listening_thread_start_at_once(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    """One thread listens while the other runs a handler, and never both run
    one: with a one-minute poll, the later jobs can only start this soon if
    they were heard."""
    registry = Registry(table)
    release = threading.Event()
    names: list[str] = []

    @registry.task(name="held")
    def held() -> None:
        names.append(threading.current_thread().name)
        release.wait(20)

    @registry.task(name="quick")
    def quick() -> None:
        names.append(threading.current_thread().name)

    with running(registry, database_url, poll_interval=60, concurrency=3):
        time.sleep(0.5)
        slow = [enqueue(engine, table, "held")]
        wait_until(lambda: len(names) == 1, 10, "the first held job to start")
        slow.append(enqueue(engine, table, "held"))
        wait_until(lambda: len(names) == 2, 10, "the second held job to start")
        fast = enqueue(engine, table, "quick")
        wait_until(lambda: _done_once(raw, table, fast), 10, "the quick job")
        release.set()
        wait_until(lambda: all(_done_once(raw, table, j) for j in slow), 10, "the held jobs")
    assert names[0].startswith(LISTENING)
    assert not names[1].startswith(LISTENING)


def test_a_job_on_a_listening_thread_hears_its_cancel(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    registry = Registry(table)
    started = threading.Event()
    saw: list[bool] = []

    @registry.task(name="patient", lease=timedelta(minutes=5))
    def patient() -> None:
        started.set()
        job = current_job()
        deadline = time.monotonic() + 20
        while not job.cancel_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        saw.append(job.cancel_requested)

    with running(registry, database_url, poll_interval=60):
        time.sleep(0.5)
        job_id = enqueue(engine, table, "patient")
        assert started.wait(10)
        with engine.begin() as conn:
            conn.execute(statements.cancel(table, job_id))
        wait_until(lambda: saw, 10, "the handler to see its cancel")
    assert saw == [True]
    assert row(raw, table, job_id)["status"] == "cancelled"


def test_a_long_job_on_a_listening_thread_keeps_its_lease_and_runs_once(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    side = Side(database_url, f"side_{table.name}")
    registry = Registry(table)

    @registry.task(name="long", lease=timedelta(seconds=1))
    def long() -> None:
        side.record(threading.current_thread().name)
        time.sleep(3)

    with running(registry, database_url, poll_interval=60, reap_interval=0.2):
        time.sleep(0.5)
        job_id = enqueue(engine, table, "long")
        wait_until(lambda: _done_once(raw, table, job_id), 15, "the long job")
    [name] = _threads_of(side)
    assert name.startswith(LISTENING)


def test_a_handler_raising_on_a_listening_thread_fails_alone_and_listening_goes_on(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    registry = Registry(table)

    @registry.task(name="stop_iteration")
    def stop_iteration() -> None:
        next(iter([]))

    @registry.task(name="system_exit")
    def system_exit() -> None:
        raise SystemExit(3)

    @registry.task(name="fine")
    def fine() -> None:
        pass

    with running(registry, database_url, poll_interval=60) as run:
        time.sleep(0.5)
        for task, error in (("stop_iteration", "StopIteration"), ("system_exit", "SystemExit")):
            bad = enqueue(engine, table, task, max_attempts=1)
            found = wait_until(lambda: _failed(raw, table, bad), 10, f"{task} to fail")  # noqa: B023
            assert found["last_error"].startswith(error)
        good = enqueue(engine, table, "fine")
        wait_until(lambda: _done_once(raw, table, good), 10, "the next job")
        assert run.worker.pickup is not None and run.worker.pickup.picked >= 3


def test_shutdown_waits_for_a_job_running_on_a_listening_thread_and_records_it(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    registry = Registry(table)
    started = threading.Event()

    @registry.task(name="finishing")
    def finishing() -> None:
        started.set()
        time.sleep(1.0)

    with running(registry, database_url, poll_interval=60, shutdown_timeout=10) as run:
        time.sleep(0.5)
        job_id = enqueue(engine, table, "finishing")
        assert started.wait(10)
        run.stop()
        run.join(30)
    assert _done_once(raw, table, job_id)


def test_a_handler_finishing_on_a_drained_idle_worker_claims_nothing_more(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    """The loop slept because its last claim found the queue drained; a slot
    freed since finds nothing new there. A claim then is a wasted round trip,
    with the idle claim disarmed throughout it, so a job announced meanwhile
    waits for the loop: at 200 jobs a second that was most of them."""
    side = Side(database_url, f"side_{table.name}")
    with running(_recording(table, side), database_url, poll_interval=60) as run:
        wait_until(lambda: run.worker.pickup is not None, 10, "the worker to start listening")
        time.sleep(0.5)
        loop_claims: list[int] = []
        claim = run.worker.claimer.claim

        async def counted(limit: int, after: statements.Position | None = None) -> Any:
            loop_claims.append(limit)
            return await claim(limit, after)

        run.worker.claimer.claim = counted  # type: ignore[method-assign]
        for _ in range(3):
            job_id = enqueue(engine, table, "where")
            wait_until(lambda: _done_once(raw, table, job_id), 10, "the job to finish")  # noqa: B023
            time.sleep(0.2)
        assert run.worker.pickup is not None and run.worker.pickup.picked >= 3
    assert loop_claims == []


def test_a_job_held_by_its_queues_limit_starts_when_the_running_one_finishes(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    """With a concurrency limit, a partial claim does not mean a drained
    queue: the job left behind waits for the limit, not for a notification,
    so it must start once the running one finishes, a minute before the poll.
    (Two paths see to it: the slot freed wakes a limited worker's loop, and
    the loop, told a job is due now, claims again after a short backoff.)"""
    registry = Registry(table)

    @registry.task(name="brief")
    def brief() -> None:
        time.sleep(0.3)

    with engine.begin() as conn:
        conn.execute(queue_statements.set_concurrency_limit(table, "default", 1))
    with running(registry, database_url, concurrency=2, poll_interval=60) as run:
        wait_until(lambda: run.worker.limited, 10, "the worker to read the limit")
        time.sleep(0.5)
        with engine.begin() as conn:  # one commit, one notification
            first, second = (client.enqueue(conn, table, "brief", {}) for _ in range(2))
        wait_until(lambda: _done_once(raw, table, first), 10, "the first job")
        wait_until(lambda: _done_once(raw, table, second), 10, "the second job, after the first")
