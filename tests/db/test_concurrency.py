"""Races, reproduced with real concurrent connections.

Each blocking scenario checks in pg_stat_activity that the second session
really is waiting on a lock before the first one commits, so the outcome is
deterministic rather than a matter of timing. Every connection that may block
carries a lock_timeout, so a broken test fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
import pytest
from sqlalchemy import Connection, Engine, Table, func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from sqla_jobq import client, statements
from sqla_jobq.db import sqlalchemy_url
from sqla_jobq.statements import NewJob

T = TypeVar("T")
SAFETY_LOCK_TIMEOUT = "10s"


@contextmanager
def session(engine: Engine, *, autocommit: bool = False) -> Iterator[Connection]:
    with engine.connect() as conn:
        if autocommit:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql(f"SET lock_timeout = '{SAFETY_LOCK_TIMEOUT}'")
        if not autocommit:
            conn.commit()
        yield conn


def backend_pid(conn: Connection) -> int:
    pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        conn.commit()
    return int(pid)


def wait_until_blocked(raw: psycopg.Connection[Any], pid: int, timeout: float = 5.0) -> str:
    """Wait until backend `pid` waits on a heavyweight lock; returns the wait event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = raw.execute(
            "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()
        if row and row[0] == "Lock":
            return str(row[1])
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never blocked on a lock")


def in_background(pool: ThreadPoolExecutor, fn: Callable[[], T]) -> Future[T]:
    return pool.submit(fn)


def enqueue_in_order(engine: Engine, table: Table, n: int) -> list[int]:
    """n jobs whose run_at strictly increases, so ORDER BY run_at is deterministic."""
    base = datetime.now(UTC) - timedelta(minutes=1)
    rows = [NewJob("t", {"n": i}, run_at=base + timedelta(seconds=i)) for i in range(n)]
    with session(engine, autocommit=True) as conn:
        return client.enqueue_many(conn, table, rows)


def status_counts(conn: Connection, table: Table) -> dict[str, tuple[int, int]]:
    c = table.c
    rows = conn.execute(
        select(c.status, func.count(), func.max(c.attempts)).group_by(c.status)
    ).all()
    return {status: (n, top) for status, n, top in rows}


# --- the article's bug, and the fix ---------------------------------------------


def test_unlocked_subquery_claim_hands_one_job_to_two_sessions(
    engine: Engine, table: Table, raw: psycopg.Connection[Any]
) -> None:
    ids = enqueue_in_order(engine, table, 10)
    naive = (
        f"UPDATE \"{table.name}\" SET status = 'running', attempts = attempts + 1 "
        f"WHERE id = (SELECT id FROM \"{table.name}\" WHERE status = 'queued' "
        "ORDER BY run_at LIMIT 1) RETURNING id, attempts"
    )
    with session(engine) as a, session(engine) as b, ThreadPoolExecutor(1) as pool:
        b_pid = backend_pid(b)
        got_a = tuple(a.exec_driver_sql(naive).one())  # A's transaction stays open

        def session_b() -> tuple[Any, ...]:
            row = tuple(b.exec_driver_sql(naive).one())
            b.commit()
            return row

        got_b = in_background(pool, session_b)
        try:
            assert wait_until_blocked(raw, b_pid) == "transactionid"
        finally:
            a.commit()
        assert got_a == (ids[0], 1)
        assert got_b.result(timeout=10) == (ids[0], 2)  # the same job, taken twice
    with session(engine) as conn:
        assert status_counts(conn, table) == {"running": (1, 2), "queued": (9, 0)}


def test_skip_locked_claim_hands_each_of_10000_jobs_to_exactly_one_of_8_workers(
    engine: Engine, table: Table
) -> None:
    with session(engine, autocommit=True) as conn:
        client.enqueue_many(conn, table, [NewJob("t", {"n": i}) for i in range(10_000)])
    workers = 8
    start = threading.Barrier(workers)
    claimed: list[list[int]] = [[] for _ in range(workers)]

    def work(i: int) -> int:
        completed = 0
        with session(engine, autocommit=True) as conn:
            start.wait(timeout=10)
            while rows := conn.execute(statements.claim(table, limit=10)).all():
                claimed[i].extend(r.id for r in rows)
                assert all(r.attempts == 1 for r in rows)
                if i % 2:
                    done = statements.complete_many(table, [(r.id, r.attempts) for r in rows])
                    completed += len(conn.execute(done).all())
                else:
                    for r in rows:
                        completed += conn.execute(
                            statements.complete(table, r.id, r.attempts)
                        ).rowcount
        return completed

    with ThreadPoolExecutor(workers) as pool:
        completed = [f.result(timeout=60) for f in [pool.submit(work, i) for i in range(workers)]]

    everything = [job_id for ids in claimed for job_id in ids]
    assert len(everything) == 10_000
    assert len(set(everything)) == 10_000  # no job went to two workers
    assert sum(completed) == 10_000  # every fenced completion matched
    assert sum(1 for ids in claimed if ids) >= 2  # the workers really did share the queue
    with session(engine) as conn:
        assert status_counts(conn, table) == {"done": (10_000, 1)}


def test_for_update_without_skip_locked_blocks_while_claim_takes_the_next_job(
    engine: Engine, table: Table, raw: psycopg.Connection[Any]
) -> None:
    ids = enqueue_in_order(engine, table, 3)
    name = table.name
    locked_claim = f"""
        WITH next AS (
          SELECT id FROM "{name}"
          WHERE queue = 'default' AND status = 'queued' AND run_at <= now()
          ORDER BY run_at LIMIT 1
          FOR UPDATE
        )
        UPDATE "{name}" j SET status = 'running', attempts = j.attempts + 1
        FROM next WHERE j.id = next.id
        RETURNING j.id"""
    with (
        session(engine) as a,
        session(engine) as b,
        session(engine) as impatient,
        session(engine, autocommit=True) as c,
        ThreadPoolExecutor(1) as pool,
    ):
        b_pid = backend_pid(b)
        try:
            assert a.exec_driver_sql(locked_claim).scalar_one() == ids[0]  # open transaction

            # A claimer that will not wait shows the lock at once...
            impatient.exec_driver_sql("SET lock_timeout = '100ms'")
            with pytest.raises(OperationalError) as exc:
                impatient.exec_driver_sql(locked_claim)
            assert isinstance(exc.value.orig, psycopg.errors.LockNotAvailable)
            impatient.rollback()

            # ...and one that will, queues up behind A.
            def session_b() -> int:
                job_id = b.exec_driver_sql(locked_claim).scalar_one()
                b.commit()
                return int(job_id)

            got_b = in_background(pool, session_b)
            assert wait_until_blocked(raw, b_pid) == "transactionid"

            # claim (SKIP LOCKED) neither waits nor takes A's job.
            c.exec_driver_sql("SET lock_timeout = '100ms'")
            started = time.monotonic()
            rows = c.execute(statements.claim(table, limit=1)).all()
            assert time.monotonic() - started < 1.0
            assert [(r.id, r.attempts) for r in rows] == [(ids[1], 1)]
            assert not got_b.done()  # B is still stuck behind A
        finally:
            a.commit()
        # Once A commits, B re-checks job 1 (no longer queued), skips job 2
        # (claimed meanwhile) and takes job 3: correct, but it waited all along.
        assert got_b.result(timeout=10) == ids[2]


# --- fenced transitions racing each other -----------------------------------------


def expired_claim(engine: Engine, table: Table) -> Any:
    """A job claimed with a lease that has already run out."""
    with session(engine, autocommit=True) as conn:
        client.enqueue(conn, table, "t", {})
        row = conn.execute(statements.claim(table, limit=1)).one()
        conn.execute(
            update(table)
            .where(table.c.id == row.id)
            .values(locked_until=func.now() - timedelta(seconds=1))
        )
    return row


def blocked_behind(
    engine: Engine,
    raw: psycopg.Connection[Any],
    hold: Callable[[Connection], object],
    blocked: Callable[[Connection], T],
) -> T:
    """Run `hold` in an open transaction on one session, then `blocked` on a
    second session in the background; once the second really waits on the
    first's lock, commit the first. Returns `blocked`'s result, committed."""
    with session(engine) as holder, session(engine) as waiter, ThreadPoolExecutor(1) as pool:
        waiter_pid = backend_pid(waiter)
        try:
            hold(holder)

            def run() -> T:
                result = blocked(waiter)
                waiter.commit()
                return result

            outcome = in_background(pool, run)
            wait_until_blocked(raw, waiter_pid)
        finally:
            holder.commit()
        return outcome.result(timeout=10)


def test_finisher_blocked_behind_a_reaper_matches_nothing_once_the_reap_commits(
    engine: Engine, table: Table, raw: psycopg.Connection[Any]
) -> None:
    row = expired_claim(engine, table)

    def reap(reaper: Connection) -> None:
        assert [r.id for r in reaper.execute(statements.reap(table))] == [row.id]

    def finish(worker: Connection) -> int:
        return worker.execute(statements.complete(table, row.id, row.attempts)).rowcount

    assert blocked_behind(engine, raw, hold=reap, blocked=finish) == 0
    with session(engine) as conn:
        assert status_counts(conn, table) == {"queued": (1, 1)}


def test_reaper_skips_a_row_a_late_finisher_holds_and_never_waits(
    engine: Engine, table: Table
) -> None:
    """The reaper locks expired rows with SKIP LOCKED: a row another session
    holds (here a late finisher mid-transaction) is left alone, not waited on,
    so a reaper sharing a connection with claims can never stall them."""
    row = expired_claim(engine, table)
    with session(engine) as finisher, session(engine) as reaper:
        # a late finisher whose lease ran out but whose job nobody took yet
        assert finisher.execute(statements.complete(table, row.id, row.attempts)).rowcount == 1
        assert reaper.execute(statements.reap(table)).all() == []
        reaper.commit()
        finisher.commit()
    with session(engine) as conn:
        assert status_counts(conn, table) == {"done": (1, 1)}


def test_two_reapers_return_an_expired_job_once(
    engine: Engine, table: Table
) -> None:
    row = expired_claim(engine, table)
    with session(engine) as first, session(engine) as second:
        assert [r.id for r in first.execute(statements.reap(table))] == [row.id]
        assert second.execute(statements.reap(table)).all() == []  # skipped, not waited on
        first.commit()
        second.commit()
        assert second.execute(statements.reap(table)).all() == []  # not expired any more
        second.commit()


def second_session(
    engine: Engine, database_url: str, mode: str, work: Callable[[Any], Any]
) -> Callable[[queue.Queue[int]], Any]:
    """Run `work(conn)` (a coroutine function in async mode) on a new session
    in its own transaction, committing after; reports the backend pid first."""

    def sync(pids: queue.Queue[int]) -> Any:
        with session(engine) as conn:
            pids.put(backend_pid(conn))
            result = work(conn)
            conn.commit()
            return result

    def in_asyncio(pids: queue.Queue[int]) -> Any:
        async def main() -> Any:
            aengine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
            try:
                async with aengine.connect() as conn:
                    await conn.exec_driver_sql(f"SET lock_timeout = '{SAFETY_LOCK_TIMEOUT}'")
                    pid = (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one()
                    await conn.commit()
                    pids.put(int(pid))
                    result = await work(conn)
                    await conn.commit()
                    return result
            finally:
                await aengine.dispose()

        return asyncio.run(main())

    return sync if mode == "sync" else in_asyncio


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("first_commits", [True, False], ids=["commit", "rollback"])
def test_concurrent_enqueues_of_one_unique_key_end_with_one_job(
    engine: Engine,
    database_url: str,
    table: Table,
    raw: psycopg.Connection[Any],
    first_commits: bool,
    mode: str,
) -> None:
    """B blocks on A's uncommitted key; if A commits, B's first attempt (whose
    snapshot predates the commit) selects nothing and the retry in
    client.enqueue returns A's job; if A rolls back, B inserts its own."""
    enqueue = client.enqueue if mode == "sync" else client.enqueue_async
    pids: queue.Queue[int] = queue.Queue()
    run_b = second_session(
        engine,
        database_url,
        mode,
        lambda conn: enqueue(conn, table, "t", {"by": "b"}, unique_key="k"),
    )
    with session(engine) as a, ThreadPoolExecutor(1) as pool:
        try:
            first = client.enqueue(a, table, "t", {"by": "a"}, unique_key="k")
            second = in_background(pool, lambda: run_b(pids))
            assert wait_until_blocked(raw, pids.get(timeout=10)) == "transactionid"
        finally:
            if first_commits:
                a.commit()
            else:
                a.rollback()
        second_id = second.result(timeout=10)
    with session(engine) as conn:
        rows = [tuple(r) for r in conn.execute(select(table.c.id, table.c.payload))]
    if first_commits:
        assert second_id == first
        assert rows == [(first, {"by": "a"})]
    else:
        assert second_id != first
        assert rows == [(second_id, {"by": "b"})]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_concurrent_enqueue_many_with_one_unique_key_returns_the_existing_id(
    engine: Engine, database_url: str, table: Table, raw: psycopg.Connection[Any], mode: str
) -> None:
    enqueue_many = client.enqueue_many if mode == "sync" else client.enqueue_many_async
    batch = [NewJob("t", {"n": 1}), NewJob("t", {"by": "b"}, unique_key="k")]
    pids: queue.Queue[int] = queue.Queue()
    run_b = second_session(
        engine, database_url, mode, lambda conn: enqueue_many(conn, table, batch)
    )
    with session(engine) as a, ThreadPoolExecutor(1) as pool:
        try:
            (first,) = client.enqueue_many(a, table, [NewJob("t", {"by": "a"}, unique_key="k")])
            second = in_background(pool, lambda: run_b(pids))
            assert wait_until_blocked(raw, pids.get(timeout=10)) == "transactionid"
        finally:
            a.commit()
        plain, keyed = second.result(timeout=10)
    assert keyed == first  # found on the retry, in input order
    with session(engine) as conn:
        rows = conn.execute(select(table.c.id, table.c.payload).order_by(table.c.id)).all()
    assert [tuple(r) for r in rows] == [(first, {"by": "a"}), (plain, {"n": 1})]
