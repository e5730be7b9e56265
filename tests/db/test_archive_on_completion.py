"""With `archive_after` 0 a worker's completions move their jobs to
`<table>_archive` in the same statement (`statements.complete_to_archive`):
each job ends in exactly one of the two tables, only if its attempt is still
the row's, a job someone waits on is completed in place so its end is
announced, and a lock or a held row sends completions back to the in-place
path instead of stalling them (a role that may not move them:
test_archiving's role test)."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, Table

from sqla_jobq import Registry, archiving, statements
from sqla_jobq.db import conninfo
from tests.db import test_archiving as archiving_tests
from tests.db.test_archiving import archive_of, enqueue
from tests.db.test_statements import SHORT_LEASE, autocommit
from tests.support.inprocess import running
from tests.support.rows import Raw
from tests.support.waiting import wait_until


def claim(conn: Connection, table: Table, limit: int, **options: Any) -> list[tuple[int, int]]:
    rows = conn.execute(statements.claim(table, limit=limit, **options)).all()
    return sorted((r.id, r.attempts) for r in rows)


def rows_of(raw: Raw, name: str) -> dict[int, tuple[Any, ...]]:
    """id -> (status, attempts, locked_until, finished_at is set, result)."""
    columns = "id, status, attempts, locked_until, finished_at IS NOT NULL, result"
    found = raw.execute(f'SELECT {columns} FROM "{name}"'.encode()).fetchall()
    return {int(str(r[0])): tuple(r[1:]) for r in found}


def test_completing_into_the_archive_moves_each_job_with_its_result(
    engine: Engine, table: Table, raw: Raw
) -> None:
    enqueue(engine, table, "noop", 3)
    with autocommit(engine) as conn:
        pairs = claim(conn, table, 3)
        stmt = statements.complete_to_archive(table, pairs, ['{"r": 1}', None, '"x"'])
        done = sorted(tuple(r) for r in conn.execute(stmt))
    assert done == pairs
    assert rows_of(raw, table.name) == {}
    archived = rows_of(raw, archive_of(table))
    assert archived == {
        pairs[0][0]: ("done", 1, None, True, {"r": 1}),
        pairs[1][0]: ("done", 1, None, True, None),
        pairs[2][0]: ("done", 1, None, True, "x"),
    }


def test_stale_attempt_cannot_archive_its_reclaimed_job(
    engine: Engine, table: Table, raw: Raw
) -> None:
    [job_id] = enqueue(engine, table, "noop", 1)
    with autocommit(engine) as conn:
        [stale] = claim(conn, table, 1, lease=SHORT_LEASE)
        time.sleep(0.1)
        conn.execute(statements.reap(table))
        [live] = claim(conn, table, 1)
        for skip_locked in (False, True):
            stmt = statements.complete_to_archive(table, [stale], skip_locked=skip_locked)
            assert conn.execute(stmt).all() == []
    assert live == (job_id, 2)
    assert rows_of(raw, table.name)[job_id][:2] == ("running", 2)
    assert rows_of(raw, archive_of(table)) == {}


def test_an_awaited_job_is_completed_in_place_and_its_end_announced(
    engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    """`wait_for` hears of a job's end from the row trigger on UPDATE of
    status; a job moved by DELETE would end unannounced, so awaited jobs are
    completed in place, in the same statement as the rest of the batch."""
    awaited, plain = enqueue(engine, table, "noop", 2)
    with autocommit(engine) as conn:
        assert conn.execute(statements.mark_awaited(table, awaited)).all() == [(awaited,)]
        pairs = claim(conn, table, 2)
        with psycopg.connect(conninfo(database_url), autocommit=True) as listener:
            channel = raw.execute(
                "SELECT n.nspname || '.' || c.relname FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s::regclass",
                (table.name,),
            ).fetchone()
            assert channel is not None
            listener.execute(
                psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel[0]))
            )
            done = sorted(
                tuple(r) for r in conn.execute(statements.complete_to_archive(table, pairs))
            )
            heard = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert done == pairs
    assert heard == [f"#finished {awaited}"]
    assert rows_of(raw, table.name)[awaited][:2] == ("done", 1)
    assert list(rows_of(raw, archive_of(table))) == [plain]


def test_a_row_another_session_holds_is_skipped_and_stays_ours(
    engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    held, free = enqueue(engine, table, "noop", 2)
    with autocommit(engine) as conn:
        pairs = claim(conn, table, 2)
        with psycopg.connect(conninfo(database_url)) as holder:
            holder.execute(
                f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE'.encode(), [held]
            )
            stmt = statements.complete_to_archive(table, pairs, skip_locked=True)
            done = conn.execute(stmt).all()
            fates = conn.execute(statements.fates(table, pairs)).all()
    assert [tuple(r) for r in done] == [(free, 1)]
    assert [tuple(r) for r in fates] == [(held, 1, "running")]
    assert list(rows_of(raw, archive_of(table))) == [free]


def test_concurrent_waiters_never_leave_a_job_in_both_tables_or_neither(
    engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    """Waiters mark jobs awaited on their own connections while batches
    complete into the archive: every job ends done exactly once, in the
    archive or (awaited) in place, and each batch reports exactly the jobs it
    ended; the rest are still running and ours, and complete on a retry."""
    enqueue(engine, table, "noop", 600)
    with autocommit(engine) as conn:
        pairs = claim(conn, table, 600)
    ids = [p[0] for p in pairs]
    stop = threading.Event()

    def waiter(seed: int) -> None:
        rng = random.Random(seed)
        with autocommit(engine) as conn:
            while not stop.is_set():
                conn.execute(statements.mark_awaited(table, rng.choice(ids)))

    threads = [threading.Thread(target=waiter, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    reported: list[tuple[int, int]] = []
    try:
        with autocommit(engine) as conn:
            left = list(pairs)
            for _ in range(200):
                if not left:
                    break
                batch, left = left[:40], left[40:]
                stmt = statements.complete_to_archive(table, batch)
                matched = [(r.id, r.attempts) for r in conn.execute(stmt)]
                reported += matched
                left += [p for p in batch if p not in matched]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert sorted(reported) == pairs, "each job reported completed exactly once"
    in_place = rows_of(raw, table.name)
    archived = rows_of(raw, archive_of(table))
    assert not set(in_place) & set(archived)
    assert sorted([*in_place, *archived]) == ids
    assert {r[0] for r in [*in_place.values(), *archived.values()]} == {"done"}
    awaited = raw.execute(f'SELECT count(*) FROM "{table.name}" WHERE awaited'.encode()).fetchone()
    assert awaited is not None and awaited[0] == len(in_place) > 0, "some waiters got in"


def registry_of(table: Table) -> Registry:
    """test_archiving's tasks, and one that returns a value."""
    registry = archiving_tests.registry_of(table)

    @registry.task(name="answer")
    def answer() -> int:
        return 42

    return registry


def test_a_worker_archiving_at_once_leaves_no_done_job_in_the_jobs_table(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    jobs = enqueue(engine, table, "noop", 300) + enqueue(engine, table, "answer", 5)
    options = {"archive_after": timedelta(0), "poll_interval": 0.2, "concurrency": 4}
    with running(registry_of(table), database_url, **options):
        wait_until(lambda: len(rows_of(raw, archive_of(table))) == 305, 30, "all archived")
        assert rows_of(raw, table.name) == {}
    archived = rows_of(raw, archive_of(table))
    assert sorted(archived) == jobs
    assert {r[:2] for r in archived.values()} == {("done", 1)}
    assert sorted(r[4] for r in archived.values() if r[4] is not None) == [42] * 5


def test_a_locked_archive_sends_completions_in_place_and_the_sweep_moves_them_later(
    database_url: str,
    engine: Engine,
    table: Table,
    raw: Raw,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DDL or a LOCK on the archive must not stall completions: they are
    recorded in place after the lock wait, and the archiver's sweep moves
    them once the archive is free."""
    monkeypatch.setattr(archiving, "SWEEP_INTERVAL", 0.5)
    monkeypatch.setattr(archiving, "BACKOFF_START", 0.5)
    options = {"archive_after": timedelta(0), "poll_interval": 0.2}
    with running(registry_of(table), database_url, **options):
        with psycopg.connect(conninfo(database_url)) as holder:
            holder.execute(f'LOCK TABLE "{archive_of(table)}" IN ACCESS EXCLUSIVE MODE'.encode())
            jobs = enqueue(engine, table, "noop", 20)
            wait_until(
                lambda: [r[0] for r in rows_of(raw, table.name).values()] == ["done"] * 20,
                30,
                "done in place while the archive is locked",
            )
        wait_until(lambda: sorted(rows_of(raw, archive_of(table))) == jobs, 30, "swept")
    assert rows_of(raw, table.name) == {}


def test_an_idle_worker_archiving_at_once_sweeps_once_after_its_last_jobs_then_sends_nothing(
    database_url: str, engine: Engine, table: Table, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A serverless compute must be able to sleep: the completions moved the
    jobs already, so one sweep notices the worker finished some and nothing
    waits for them to age; after it, the worker sends nothing (its poll is
    660 s away)."""
    monkeypatch.setattr(archiving, "SWEEP_INTERVAL", 0.5)
    options = {"archive_after": timedelta(0), "poll_interval": 660}
    with running(registry_of(table), database_url, **options) as run:
        archiver = run.worker.archiver
        wait_until(lambda: archiver.passes == 1, 30, "the pass at start")
        jobs = enqueue(engine, table, "noop", 3)
        wait_until(lambda: sorted(rows_of(raw, archive_of(table))) == jobs, 30, "moved")
        wait_until(lambda: archiver.passes == 2, 30, "the sweep after the jobs")
        run.settle()
        before = archiving_tests.sessions(raw)
        time.sleep(8 * archiving.SWEEP_INTERVAL)
        assert archiving_tests.sessions(raw) == before, "an idle worker touched the database"
        assert archiver.passes == 2
