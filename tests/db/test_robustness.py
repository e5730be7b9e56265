"""Hostile handlers, other sessions' locks, and shutdown: nothing may strand a
job in `running` or run one attempt twice.

Each test is the regression test of one finding of a hostile review (issue 14,
numbered as there). Workers run in-process (tests/support/inprocess.py) so handlers can
misbehave in any way Python allows; the outcome is always read back from the
database.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import Registry, client, current_job, execute, statements
from sqla_jobq import worker as worker_module
from sqla_jobq.attempt import Attempt
from sqla_jobq.db import conninfo
from tests.support.inprocess import Side, burst, running
from tests.support.rows import enqueue, every_job
from tests.support.rows import job_row as row
from tests.support.waiting import wait_until

Raw = psycopg.Connection[Any]


class Oops(BaseException):
    """A custom BaseException: neither Exception nor SystemExit."""


def statuses(raw: Raw, table: Table) -> dict[str, int]:
    rows = raw.execute(
        f"SELECT status, count(*) FROM {every_job(table, 'status')} GROUP BY status"
    ).fetchall()
    return {str(s): int(n) for s, n in rows}


# ------------------------------------------------------------ 1-4: handlers may do anything


def hostile(table: Table, side: Side) -> Registry:
    registry = Registry(table)

    @registry.task(name="ok")
    def ok() -> None:
        side.record("ran")

    @registry.task(name="stop_iteration")
    def stop_iteration() -> None:
        next(iter([]))

    @registry.task(name="subtask_cancelled")
    async def subtask_cancelled() -> None:
        inner = asyncio.create_task(asyncio.sleep(10))
        await asyncio.sleep(0)
        inner.cancel()
        await inner

    @registry.task(name="system_exit")
    async def system_exit() -> None:
        raise SystemExit(3)

    @registry.task(name="custom_base")
    def custom_base() -> None:
        raise Oops("not an Exception")

    def plain_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            return fn(**kwargs)

        return call

    @registry.task(name="wrapped_async")
    @plain_wrapper
    async def wrapped_async() -> None:
        await asyncio.sleep(0.01)
        side.record("ran")

    return registry


def test_stop_iteration_fails_its_job_alone_and_batch_mates_finish(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 1: `StopIteration` used to break `Future.set_exception` and strand the batch."""
    oks = [enqueue(engine, table, "ok") for _ in range(3)]
    bad = enqueue(engine, table, "stop_iteration", max_attempts=1)
    oks += [enqueue(engine, table, "ok") for _ in range(3)]
    assert burst(hostile(table, side), database_url, concurrency=4) == 0
    failed = row(raw, table, bad)
    assert (failed["status"], failed["last_error"]) == ("failed", "StopIteration: ")
    assert all(row(raw, table, j)["status"] == "done" for j in oks)


def test_cancelled_error_the_worker_did_not_ask_for_is_a_failure_of_that_attempt(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 2: a sub-task's cancellation escaping a handler fails the attempt."""
    job_id = enqueue(engine, table, "subtask_cancelled")
    after = enqueue(engine, table, "ok")
    assert burst(hostile(table, side), database_url, concurrency=2) == 0
    found = row(raw, table, job_id)
    assert (found["status"], found["attempts"]) == ("queued", 1)
    assert found["last_error"].startswith("CancelledError")
    assert found["locked_until"] is None
    assert row(raw, table, after)["status"] == "done"


@pytest.mark.parametrize("task", ["system_exit", "custom_base"])
def test_base_exceptions_fail_their_job_and_the_worker_goes_on(
    task: str, engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 3: `SystemExit` in an async handler used to end `asyncio.run`."""
    job_id = enqueue(engine, table, task, max_attempts=1)
    later = [enqueue(engine, table, "ok") for _ in range(5)]
    assert burst(hostile(table, side), database_url, concurrency=2) == 0
    found = row(raw, table, job_id)
    expected = "SystemExit: 3" if task == "system_exit" else "Oops: not an Exception"
    assert (found["status"], found["last_error"]) == ("failed", expected)
    assert all(row(raw, table, j)["status"] == "done" for j in later)


def test_payload_python_cannot_decode_fails_alone_in_its_claimed_batch(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 3: jsonb keeps a 5,000-digit integer that json.loads refuses; it
    used to raise in the claim and strand every job claimed with it."""
    oks = [enqueue(engine, table, "ok") for _ in range(4)]
    bad = raw.execute(
        f'INSERT INTO "{table.name}" (task, payload, max_attempts) '
        "VALUES ('ok', ('{\"n\": 1' || repeat('0', 5000) || '}')::jsonb, 1) RETURNING id"
    ).fetchone()
    assert bad is not None
    oks += [enqueue(engine, table, "ok") for _ in range(4)]
    assert burst(hostile(table, side), database_url, concurrency=4) == 0
    found = row(raw, table, bad[0])
    assert found["status"] == "failed"
    assert found["last_error"].startswith("InvalidPayload: cannot decode the payload")
    assert all(row(raw, table, j)["status"] == "done" for j in oks)


@pytest.mark.parametrize("where", ["prepare", "outcome_of"])
def test_a_bug_of_ours_around_one_plain_job_fails_that_attempt_alone(
    where: str,
    engine: Engine,
    table: Table,
    raw: Raw,
    side: Side,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain handlers start inside the worker's dispatch and end in a callback
    of their thread's future, in no task of their own: an exception of ours at
    either end must stay with its attempt, as one in a task does, and break
    neither the loop that dispatches the others nor the slot's bookkeeping."""
    bug = enqueue(engine, table, "ok", max_attempts=1)
    oks = [enqueue(engine, table, "ok") for _ in range(5)]
    real = getattr(execute, where)

    def buggy(*args: Any) -> Any:
        if any(isinstance(a, Attempt) and a.key[0] == bug for a in args):
            raise RuntimeError("a bug of ours")
        return real(*args)

    monkeypatch.setattr(execute, where, buggy)
    assert burst(hostile(table, side), database_url, concurrency=2) == 0
    found = row(raw, table, bug)
    assert (found["status"], found["last_error"]) == ("failed", "RuntimeError: a bug of ours")
    assert all(row(raw, table, j)["status"] == "done" for j in oks)
    ran = sorted(e["job_id"] for e in side.events())
    assert ran == (oks if where == "prepare" else sorted([bug, *oks]))


def test_sync_wrapper_returning_a_coroutine_runs_its_body_before_done(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 4: the coroutine used to be dropped unawaited and the job marked done."""
    job_id = enqueue(engine, table, "wrapped_async")
    assert burst(hostile(table, side), database_url) == 0
    assert row(raw, table, job_id)["status"] == "done"
    assert [e["event"] for e in side.events(job_id)] == ["ran"]


# --------------------------------------------------------- 5-8: other sessions' locks


def test_reclaimed_job_keeps_its_lease_while_its_lost_first_attempt_ends(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 5: attempt 1 loses its lease and this same worker claims attempt 2;
    attempt 1's clean-up used to stop attempt 2's heartbeats, so the job ran a
    third time. Keyed by (id, attempts), it runs exactly twice."""
    registry = Registry(table)

    @registry.task(name="slow", lease=timedelta(seconds=1))
    def slow() -> None:
        side.record("started")
        time.sleep(2.0 if current_job().attempts == 1 else 3.0)
        side.record("finished")

    job_id = enqueue(engine, table, "slow")
    with running(registry, database_url, concurrency=2, reap_interval=0.2, poll_interval=0.2):
        wait_until(lambda: side.events(job_id), 10, "attempt 1 to start")
        raw.execute(  # the lease is taken away while attempt 1 still runs
            f"UPDATE \"{table.name}\" SET locked_until = now() - interval '1 s' WHERE id = %s",
            (job_id,),
        )
        wait_until(lambda: row(raw, table, job_id)["status"] == "done", 30, "the job done")
        time.sleep(1.5)  # time for a wrong third claim to show
    runs = [(e["attempt"], e["event"]) for e in side.events(job_id)]
    assert sorted(runs) == [(1, "finished"), (1, "started"), (2, "finished"), (2, "started")]
    found = row(raw, table, job_id)
    assert (found["status"], found["attempts"]) == ("done", 2)


def test_heartbeats_go_on_while_a_completion_waits_on_another_sessions_row_lock(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 6: one completion blocked by a row lock used to stop every heartbeat
    of its worker (one shared connection), so long jobs lost their leases."""
    registry = Registry(table)

    @registry.task(name="long", lease=timedelta(seconds=1))
    def long() -> None:
        time.sleep(3.0)

    locked = threading.Event()

    @registry.task(name="quick")
    def quick() -> None:
        side.record("ran")
        locked.wait(10)  # finish only once its row is locked: the completion must wait

    long_id = enqueue(engine, table, "long")
    quick_id = enqueue(engine, table, "quick")
    with (
        running(registry, database_url, concurrency=2),
        psycopg.connect(conninfo(database_url)) as holder,
    ):
        wait_until(lambda: side.events(quick_id), 10, "the quick job to run")
        holder.execute(f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE', (quick_id,))
        locked.set()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # another worker's reaper, all along
            with psycopg.connect(conninfo(database_url), autocommit=True) as reaper:
                reaper.execute(*_compiled(statements.reap(table)))
            time.sleep(0.2)
        holder.rollback()
        wait_until(lambda: row(raw, table, quick_id)["status"] == "done", 10, "quick done")
        wait_until(lambda: row(raw, table, long_id)["status"] == "done", 10, "long done")
    assert row(raw, table, long_id)["attempts"] == 1, "the long job lost its lease"


def test_claims_go_on_while_another_session_holds_a_due_schedules_row(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """The scheduler fires on the claim connection, between claims. A fire
    waiting on a schedule row another session holds (an admin's open
    transaction on the schedules table) used to fail the claim after it,
    again at every turn, so the worker claimed nothing while the row was
    held. A fire that meets a held row is tried again later; claims go on."""
    registry = Registry(table)

    @registry.task(name="tick", every=timedelta(seconds=1))
    def tick() -> None:
        side.record("tick")

    @registry.task(name="quick")
    def quick() -> None:
        side.record("ran")

    schedules = f'"{table.name}_schedules"'
    with running(registry, database_url), psycopg.connect(conninfo(database_url)) as holder:
        wait_until(lambda: _count(raw, table, "tick") >= 1, 10, "the first fire")
        holder.execute(f"SELECT 1 FROM {schedules} WHERE name = 'tick' FOR UPDATE")
        held = _count(raw, table, "tick")
        time.sleep(2.5)  # two fire times come while the row is held
        job_id = enqueue(engine, table, "quick")
        wait_until(lambda: row(raw, table, job_id)["status"] == "done", 10, "quick done")
        assert _count(raw, table, "tick") == held  # no fire while its row is held
        holder.rollback()
        wait_until(lambda: _count(raw, table, "tick") > held, 10, "the fires again")


def _count(raw: Raw, table: Table, task: str) -> int:
    found = raw.execute(
        f"SELECT count(*) FROM {every_job(table, 'task')} WHERE task = %s", (task,)
    ).fetchone()
    assert found is not None
    return int(found[0])


def _compiled(stmt: Any) -> tuple[str, dict[str, Any]]:
    from sqlalchemy.dialects import postgresql

    compiled = stmt.compile(dialect=postgresql.psycopg.dialect())
    return compiled.string, dict(compiled.params)


def _expired_running(raw: Raw, table: Table) -> int:
    found = raw.execute(
        f'INSERT INTO "{table.name}" (task, payload, status, attempts, locked_until) '
        "VALUES ('quick', '{}', 'running', 1, now() - interval '1 min') RETURNING id"
    ).fetchone()
    assert found is not None
    return int(found[0])


def test_reaper_skips_a_locked_expired_row_and_claiming_goes_on(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 7: the reaper's UPDATE used to wait on a locked expired row, on the
    claim connection, so nothing was claimed until the lock went."""
    registry = Registry(table)

    @registry.task(name="quick")
    def quick() -> None:
        side.record("ran")

    stuck = _expired_running(raw, table)
    with psycopg.connect(conninfo(database_url)) as holder:
        holder.execute(f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE', (stuck,))
        job_id = enqueue(engine, table, "quick")
        assert burst(registry, database_url, timeout=30, reap_interval=0) == 0
        assert row(raw, table, job_id)["status"] == "done"
        assert row(raw, table, stuck)["status"] == "running"  # skipped, not waited on
        holder.rollback()
    assert burst(registry, database_url, reap_interval=0) == 0
    assert row(raw, table, stuck)["status"] == "done"  # reaped, then run


def test_idle_worker_backs_off_when_the_due_job_is_locked_by_another_session(
    engine: Engine, table: Table, database_url: str
) -> None:
    """Item 8: an empty claim with a due (but locked) job used to retry at once,
    thousands of claims a second."""
    registry = Registry(table)

    @registry.task(name="quick")
    def quick() -> None:
        pass

    job_id = enqueue(engine, table, "quick")
    with psycopg.connect(conninfo(database_url)) as holder:
        holder.execute(f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE', (job_id,))
        with running(registry, database_url, poll_interval=5) as run:
            claims = _count_claims(run)
            time.sleep(2.0)
            assert 1 <= claims() <= 20, claims()
        holder.rollback()


def _count_claims(run: Any) -> Callable[[], int]:
    count = [0]
    claimer = run.worker.claimer
    original = claimer.claim

    async def counted(limit: int, after: Any = None) -> Any:
        count[0] += 1
        return await original(limit, after)

    done = threading.Event()

    def patch() -> None:
        claimer.claim = counted
        done.set()

    run.call(patch)
    done.wait(5)
    return lambda: count[0]


# ---------------------------------------------------------- 9-11: shutdown and hand-back


def warmed(table: Table, side: Side, lease: timedelta | None = None) -> Registry:
    """A registry whose worker prefetches: short jobs first, then a slow one."""
    registry = Registry(table)
    leased = {} if lease is None else {"lease": lease}

    @registry.task(name="quick", **leased)
    def quick() -> None:
        side.record("ran")

    @registry.task(name="slow", **leased)
    def slow(seconds: float) -> None:
        side.record("started")
        time.sleep(seconds)

    return registry


def _hold_prefetched(
    engine: Engine,
    table: Table,
    raw: Raw,
    side: Side,
    run: Any,
    seconds: float,
    slow_task: str = "slow",
) -> tuple[int, list[int]]:
    """Warm the worker up on quick jobs, then give it a slow job first and ten
    quick ones in the same transaction: it claims them together."""
    warm = [enqueue(engine, table, "quick") for _ in range(20)]
    wait_until(lambda: all(row(raw, table, j)["status"] == "done" for j in warm), 20, "warm-up")
    with engine.begin() as conn:
        slow = client.enqueue(conn, table, slow_task, {"seconds": seconds})
        quick = [client.enqueue(conn, table, "quick", {}, max_attempts=2) for _ in range(10)]
    wait_until(lambda: side.events(slow), 10, "the slow job to start")
    return slow, quick


@contextlib.contextmanager
def _lock_prefetched(url: str, table: Table, quick: list[int]) -> Iterator[tuple[Raw, list[int]]]:
    """Another session holding, until the block ends, the locks of the quick
    jobs the worker claimed with the slow one (how many depends on its
    measure of handler time; while the slow one runs it claims nothing more,
    so this set holds still): that session, and the ids."""
    with psycopg.connect(conninfo(url)) as conn:
        held = conn.execute(
            f'SELECT id FROM "{table.name}" WHERE id = ANY(%s) AND status = %s FOR UPDATE',
            (quick, "running"),
        ).fetchall()
        assert held, "no quick job was prefetched behind the slow one"
        yield conn, [r[0] for r in held]


def test_prefetched_jobs_handed_back_at_shutdown_get_their_attempt_back(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 9: a job handed back without ever starting used to keep the attempt
    its claim consumed; now `max_attempts` goes up by one (attempts never down)."""
    with running(warmed(table, side), database_url, concurrency=1, shutdown_timeout=5) as run:
        _slow, quick = _hold_prefetched(engine, table, raw, side, run, seconds=0.5)
        run.stop()
        assert run.join() == 0
    handed = [f for f in (row(raw, table, j) for j in quick) if f["status"] == "queued"]
    assert handed, "the quick jobs were prefetched behind the slow one, not run"
    for found in handed:
        assert found["max_attempts"] - found["attempts"] == 2, found  # refunded: two tries remain
        assert found["locked_until"] is None
    assert statuses(raw, table).get("running", 0) == 0


def test_shutdown_records_finished_jobs_and_hands_back_despite_dropped_connections(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 10: a dropped connection during shutdown used to make `Worker.run`
    raise before handing jobs back (both stayed `running` with minutes of lease)."""
    registry = Registry(table)

    @registry.task(name="sleeps")
    def sleeps(seconds: float) -> None:
        side.record("started")
        time.sleep(seconds)

    short = enqueue(engine, table, "sleeps", {"seconds": 1.0})
    long = enqueue(engine, table, "sleeps", {"seconds": 8.0})
    with running(registry, database_url, concurrency=2, shutdown_timeout=3) as run:
        wait_until(lambda: len(side.events()) == 2, 10, "both jobs to start")
        run.stop()
        wait_until(lambda: row(raw, table, short)["status"] == "done", 10, "the short job")
        raw.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE 'jobq worker %' AND datname = current_database()"
        )
        assert run.join() == 0
    assert row(raw, table, short)["status"] == "done"
    handed = row(raw, table, long)
    assert (handed["status"], handed["attempts"], handed["locked_until"]) == ("queued", 1, None)


def test_stop_while_handler_threads_turn_slots_over_runs_nothing_twice_nor_strands_it(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Handler threads start the next prefetched job in the slot they free
    (sqla_jobq/ready.py), beside the loop that stops the worker and hands
    back what never started: stopped mid-drain, every job that ran is done
    once, every other is queued with its attempt refunded, none `running`."""
    registry = Registry(table)

    @registry.task(name="brief")
    def brief() -> None:
        side.record("ran")
        time.sleep(0.002)

    with engine.begin() as conn:
        ids = [client.enqueue(conn, table, "brief", {}, max_attempts=1) for _ in range(3_000)]
    with running(registry, database_url, concurrency=4, shutdown_timeout=5) as run:
        wait_until(lambda: len(side.events()) >= 600, 30, "the drain under way")
        run.stop()
        assert run.join() == 0
    ran = [(e["job_id"], e["attempt"]) for e in side.events()]
    assert len(ran) == len(set(ran)), "an attempt ran twice"
    found = {
        r[0]: r[1:]
        for r in raw.execute(
            "SELECT id, status, attempts, max_attempts FROM "
            f"{every_job(table, 'id, status, attempts, max_attempts')} WHERE id = ANY(%s)",
            (ids,),
        )
    }
    ran_ids = {job_id for job_id, _ in ran}
    for job_id in ids:
        status, attempts, max_attempts = found[job_id]
        if job_id in ran_ids:
            assert (status, attempts) == ("done", 1), (job_id, found[job_id])
        else:
            assert (status, max_attempts - attempts) == ("queued", 1), (job_id, found[job_id])
    assert len(ran_ids) < len(ids), "stopped after the drain, not in it"


def test_a_prefetched_sync_job_started_by_a_handler_thread_still_times_out(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """At -c 1 the prefetched job starts on the thread of the job before it;
    its timeout counts from that start and records it failed at once, while
    the handler is still blocked."""
    registry = warmed(table, side)
    release = threading.Event()

    @registry.task(name="stuck", timeout=timedelta(seconds=0.3), max_attempts=1)
    def stuck() -> None:
        side.record("started")
        release.wait(30)

    with running(registry, database_url, concurrency=1, poll_interval=30):
        warm = [enqueue(engine, table, "quick") for _ in range(20)]  # prefetching from here
        wait_until(lambda: all(row(raw, table, j)["status"] == "done" for j in warm), 20, "warm")
        with engine.begin() as conn:  # claimed together
            first = client.enqueue(conn, table, "slow", {"seconds": 0.2})
            stuck_id = client.enqueue(conn, table, "stuck", {}, max_attempts=1)
        wait_until(lambda: side.events(stuck_id), 10, "the stuck job to start")
        wait_until(lambda: row(raw, table, stuck_id)["status"] == "failed", 5, "its timeout")
        assert [e["event"] for e in side.events(stuck_id)] == ["started"]  # still blocked
        release.set()
    assert row(raw, table, first)["status"] == "done"
    assert row(raw, table, stuck_id)["last_error"].startswith("TimeoutError")


def test_prefetched_jobs_behind_a_slow_one_go_to_an_idle_worker(
    engine: Engine, table: Table, raw: Raw, side: Side, database_url: str
) -> None:
    """Item 11: two workers at -c 1, one busy with a slow job, used to leave its
    prefetched jobs waiting while the other sat idle."""
    registry = warmed(table, side)
    with running(registry, database_url, concurrency=1) as first:
        slow, quick = _hold_prefetched(engine, table, raw, side, first, seconds=4.0)
        with running(registry, database_url, concurrency=1):
            wait_until(
                lambda: all(row(raw, table, j)["status"] == "done" for j in quick),
                15,
                "the quick jobs done",
            )
            assert row(raw, table, slow)["status"] == "running", "they waited for the slow one"
        wait_until(lambda: row(raw, table, slow)["status"] == "done", 15, "the slow job")
    for job_id in quick:
        found = row(raw, table, job_id)
        assert found["max_attempts"] - found["attempts"] >= 1, found  # handed back refunded


def test_a_prefetched_job_locked_through_its_hand_back_and_past_its_lease_still_runs(
    engine: Engine,
    table: Table,
    raw: Raw,
    side: Side,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the hostile property test: a prefetched job stuck behind a slow
    one, whose row another session held locked through the hand-back and past
    the local lease, was dropped from the hand-back but kept (and its lease
    renewed) by the worker: `running` for as long as the worker lived, never run."""
    monkeypatch.setattr(worker_module, "STALL_SECONDS", 1.0)  # lock before it is handed back
    lease = timedelta(seconds=0.6)
    registry = warmed(table, side, lease)
    with running(registry, database_url, concurrency=1) as run:
        slow_id, quick = _hold_prefetched(engine, table, raw, side, run, seconds=5.0)
        with _lock_prefetched(database_url, table, quick):
            time.sleep(4 * lease.total_seconds())  # the hand-back waits; the lease runs out
        wait_until(
            lambda: all(row(raw, table, j)["status"] == "done" for j in [slow_id, *quick]),
            20,
            "every job done",
        )
    assert statuses(raw, table) == {"done": 31}


def test_shutdown_leaves_rows_locked_throughout_to_the_reaper_and_still_exits(
    engine: Engine,
    table: Table,
    raw: Raw,
    side: Side,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hand-back at shutdown waits for another session's row lock only so
    long; then the worker stops renewing those leases and exits, and a reaper
    returns the jobs once the leases run out."""
    monkeypatch.setattr(worker_module, "STALL_SECONDS", 60.0)  # handed back at shutdown only
    monkeypatch.setattr(worker_module, "HAND_BACK_PATIENCE", 1.0)
    lease = timedelta(seconds=0.6)
    registry = warmed(table, side, lease)
    with running(registry, database_url, concurrency=1) as run:
        slow_id, quick = _hold_prefetched(engine, table, raw, side, run, seconds=1.0)
        with _lock_prefetched(database_url, table, quick) as (_, held):
            run.stop()
            assert run.join(20) == 0
            assert row(raw, table, slow_id)["status"] == "done"
            assert {row(raw, table, j)["status"] for j in held} == {"running"}
    time.sleep(lease.total_seconds())  # no longer renewed: the leases run out
    assert burst(registry, database_url, reap_interval=0.1) == 0
    assert statuses(raw, table) == {"done": 31}
    assert all(row(raw, table, j)["attempts"] == 2 for j in held)  # the reaper counts one


def test_a_prefetched_job_whose_lease_ran_out_while_it_waited_is_never_started(
    engine: Engine,
    table: Table,
    raw: Raw,
    side: Side,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefetched job waits for a slot while another session holds its row
    locked (no heartbeat gets through) past its lease, and another worker's
    reaper and claim take it over the moment the lock goes. The slot frees in
    that same moment: starting the job then would run it twice."""
    monkeypatch.setattr(worker_module, "STALL_SECONDS", 60.0)
    lease = timedelta(seconds=0.6)
    registry = warmed(table, side, lease)
    go = threading.Event()

    @registry.task(name="gate", lease=lease)
    def gate(seconds: float) -> None:
        side.record("started")
        go.wait(seconds)

    with running(registry, database_url, concurrency=1) as run:
        gate_id, quick = _hold_prefetched(engine, table, raw, side, run, 20.0, slow_task="gate")
        with _lock_prefetched(database_url, table, quick) as (other, held):
            time.sleep(2 * lease.total_seconds())
            other.execute(  # reaped and claimed again, as by another worker
                f'UPDATE "{table.name}" SET attempts = attempts + 1, '
                "locked_until = now() + interval '1 hour' WHERE id = ANY(%s)",
                (held,),
            )
        go.set()
        wait_until(lambda: row(raw, table, gate_id)["status"] == "done", 10, "the gate job")
        time.sleep(1.0)  # time to start what it would start
    assert [e for e in side.events() if e["job_id"] in held] == []
    assert {(f["status"], f["attempts"]) for f in (row(raw, table, j) for j in held)} == {
        ("running", 2)
    }


def test_an_async_handler_blocking_the_loop_costs_no_job_its_lease(
    engine: Engine,
    table: Table,
    raw: Raw,
    side: Side,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An `async def` handler calling blocking code (time.sleep, a sync
    driver) stops the worker's event loop. Heartbeats used to stop with it:
    after a lease, another worker's reaper took every job the worker held and
    ran it again, the blocker included. Leases are kept on a thread of their
    own, so a job runs once however long the loop is stuck."""
    lease = timedelta(seconds=1)
    registry = Registry(table)

    @registry.task(name="blocks", lease=lease)
    async def blocks() -> None:
        side.record("ran")
        time.sleep(3 * lease.total_seconds())

    @registry.task(name="works", lease=lease)
    def works() -> None:
        side.record("ran")
        time.sleep(3 * lease.total_seconds())

    worker = enqueue(engine, table, "works")
    with running(registry, database_url, concurrency=2, reap_interval=0.1):
        wait_until(lambda: side.events(worker), 10, "the plain job to start")
        blocker = enqueue(engine, table, "blocks")
        wait_until(lambda: side.events(blocker), 10, "the blocking job to start")
        with running(registry, database_url, concurrency=2, reap_interval=0.1):
            wait_until(
                lambda: {row(raw, table, j)["status"] for j in (worker, blocker)} == {"done"},
                20,
                "both jobs done",
            )
    assert [(e["job_id"], e["attempt"]) for e in side.events()] == [(worker, 1), (blocker, 1)]
    stuck = [r.getMessage() for r in caplog.records if "has not run for" in r.getMessage()]
    assert len(stuck) == 1 and f"job {blocker} task=blocks" in stuck[0], stuck
