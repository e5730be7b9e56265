"""Finished jobs leave the hot table by default: a worker moves `done` jobs
that finished more than `archive_after` ago (60 s unless told otherwise) into
`<table>_archive`, in short batches, on a connection of its own, in the
background. Failed and cancelled jobs stay where people act on them; an idle
worker sends nothing for it; errors, a role that may not delete and shutdown
are each survived.

Real workers in-process (tests/support/inprocess.py), on a queue table of
each test's own.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table
from sqlalchemy.engine import make_url

from sqla_jobq import Registry, archiving, client
from sqla_jobq.db import conninfo
from sqla_jobq.job import NewJob
from sqla_jobq.schema import names_of
from sqla_jobq.worker import DEFAULT_ARCHIVE_AFTER, WorkerOptions
from tests.support.faultqueue import drop_role
from tests.support.inprocess import running
from tests.support.waiting import wait_until

Raw = psycopg.Connection[Any]


def registry_of(table: Table) -> Registry:
    registry = Registry(table)

    @registry.task(name="noop")
    def noop() -> None:
        return None

    @registry.task(name="boom")
    def boom() -> None:
        raise RuntimeError("boom")

    return registry


def enqueue(
    engine: Engine, table: Table, task: str, count: int = 1, max_attempts: int = 5
) -> list[int]:
    jobs = [NewJob(task, max_attempts=max_attempts) for _ in range(count)]
    with engine.begin() as conn:
        return client.enqueue_many(conn, table, jobs)


def ids_in(raw: Raw, name: str, where: str = "true") -> list[int]:
    rows = raw.execute(f'SELECT id FROM "{name}" WHERE {where} ORDER BY id'.encode()).fetchall()
    return [int(str(r[0])) for r in rows]


def archive_of(table: Table) -> str:
    return names_of(table).archive


def old_history(raw: Raw, table: Table, count: int) -> list[int]:
    """`count` jobs done a day ago, as a table that never archived holds them."""
    rows = raw.execute(
        f"INSERT INTO \"{table.name}\" (payload, task, status, attempts, started_at, finished_at) "
        "SELECT '{}', 'noop', 'done', 1, now() - interval '1 day', now() - interval '1 day' "
        "FROM generate_series(1, %s) RETURNING id".encode(),
        (count,),
    ).fetchall()
    return sorted(int(str(r[0])) for r in rows)


def sessions(raw: Raw) -> dict[int, datetime]:
    """This process's worker sessions (in-process workers share its pid) and
    when each last changed state: a query moves it."""
    rows = raw.execute(
        "SELECT pid, state_change FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"jobq worker %:{os.getpid()}",),
    ).fetchall()
    return {int(str(p)): s for p, s in rows if isinstance(s, datetime)}


def test_the_default_archives_at_completion_and_none_keeps_done_jobs() -> None:
    options = WorkerOptions(database_url="postgresql://unused/db")
    assert options.archive_after == DEFAULT_ARCHIVE_AFTER == timedelta(0)
    assert archiving.at_completion(options.archive_after)
    assert WorkerOptions(database_url="x", archive_after=None).archive_after is None
    with pytest.raises(ValueError, match="archive-after must not be negative"):
        WorkerOptions(database_url="x", archive_after=timedelta(seconds=-1))


def test_done_jobs_move_to_the_archive_failed_and_cancelled_ones_stay(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    done = enqueue(engine, table, "noop", 20)
    [failed] = enqueue(engine, table, "boom", max_attempts=1)
    [cancelled] = enqueue(engine, table, "noop")
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'cancelled', finished_at = now() "
        "WHERE id = %s".encode(),
        (cancelled,),
    )
    [later] = enqueue(engine, table, "noop")
    raw.execute(
        f"UPDATE \"{table.name}\" SET run_at = now() + interval '1 hour' WHERE id = %s".encode(),
        (later,),
    )
    options = {"archive_after": timedelta(seconds=1), "poll_interval": 0.2}
    with running(registry_of(table), database_url, **options):
        wait_until(lambda: ids_in(raw, archive_of(table)) == done, 30, "the done jobs archived")
    assert ids_in(raw, table.name) == [failed, cancelled, later]
    statuses = raw.execute(f'SELECT status FROM "{table.name}" ORDER BY id'.encode()).fetchall()
    assert [s[0] for s in statuses] == ["failed", "cancelled", "queued"]
    archived = raw.execute(
        f'SELECT count(*) FROM "{archive_of(table)}" WHERE status = \'done\' '
        "AND archived_at >= finished_at + interval '1 second'".encode()
    ).fetchone()
    assert archived == (20,), "each moved once it was archive_after old, not before"


def test_with_archive_after_none_done_jobs_stay(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    history = old_history(raw, table, 50)
    fresh = enqueue(engine, table, "noop", 10)
    with running(registry_of(table), database_url, archive_after=None, poll_interval=0.2) as run:
        wait_until(
            lambda: len(ids_in(raw, table.name, "status = 'done'")) == 60, 30, "all jobs done"
        )
        time.sleep(1.5)  # a pass would have come at once
        assert run.worker.archiver.passes == 0
    assert ids_in(raw, table.name) == sorted(history + fresh)
    assert ids_in(raw, archive_of(table)) == []


def test_a_worker_started_on_a_long_history_moves_it_in_batches_in_the_background(
    database_url: str,
    engine: Engine,
    table: Table,
    raw: Raw,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The upgrade: a table that kept every job gets a worker at the new
    default. Its first pass moves the history in short batches on its own
    connection, while claims go on."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.archive")
    monkeypatch.setattr(archiving, "BATCH", 500)
    history = old_history(raw, table, 5_250)
    with running(registry_of(table), database_url, poll_interval=0.2) as run:
        [job] = enqueue(engine, table, "noop")
        wait_until(
            lambda: ids_in(raw, archive_of(table), f"id = {job}") == [job],
            30,
            "a new job done (and moved as it completed) meanwhile",
        )
        wait_until(lambda: ids_in(raw, table.name) == [], 60, "the history moved")
        archiver = run.worker.archiver
        assert archiver.batches >= 11  # 10 full batches, then a short one
    assert ids_in(raw, archive_of(table)) == sorted([*history, job])
    assert any(f"archived {len(history):,} done jobs" in r.getMessage() for r in caplog.records)


def test_an_idle_worker_sends_nothing_but_one_pass_after_its_last_jobs(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    """A serverless compute must be able to sleep: once its last jobs are
    archive_after old, the worker makes one pass for them, then sends
    nothing at all (its poll is 660 s away). On a slow machine a pass made
    because jobs finished may find them old enough already; the pass for
    the last jobs still follows it, and then nothing does."""
    after = timedelta(seconds=2)
    with running(
        registry_of(table), database_url, archive_after=after, poll_interval=660
    ) as run:
        archiver = run.worker.archiver
        wait_until(lambda: archiver.passes == 1, 30, "the pass at start")
        jobs = enqueue(engine, table, "noop", 3)
        wait_until(
            lambda: ids_in(raw, archive_of(table)) == jobs and archiver.tail_at is None,
            30,
            "the last jobs archived, and the pass for them made",
        )
        run.settle()
        passes = archiver.passes
        before = sessions(raw)
        time.sleep(2 * after.total_seconds() + 2)
        assert sessions(raw) == before, "an idle worker touched the database"
        assert archiver.passes == passes


def test_archiving_survives_database_errors_and_goes_on(
    database_url: str,
    engine: Engine,
    table: Table,
    raw: Raw,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The archive table locked by someone else (the pass's lock wait times
    out), then the archiver's connection killed: one line each, a wait, and
    the jobs are moved once the way is clear. Claims go on meanwhile."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.archive")
    monkeypatch.setattr(archiving, "BACKOFF_START", 0.5)
    options = {"archive_after": timedelta(0), "poll_interval": 0.2}
    with psycopg.connect(conninfo(database_url)) as holder:
        holder.execute(f'LOCK TABLE "{archive_of(table)}" IN ACCESS EXCLUSIVE MODE'.encode())
        with running(registry_of(table), database_url, **options) as run:
            first = enqueue(engine, table, "noop", 5)
            wait_until(
                lambda: len(ids_in(raw, table.name, "status = 'done'")) == 5, 30, "jobs done"
            )
            wait_until(
                lambda: any("could not archive" in r.getMessage() for r in caplog.records),
                30,
                "the failed pass logged",
            )
            holder.rollback()
            wait_until(lambda: ids_in(raw, archive_of(table)) == first, 30, "moved after all")
            raw.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name LIKE %s AND query LIKE %s",
                (f"jobq worker %:{os.getpid()}", f"%INSERT INTO {archive_of(table)}%"),
            )
            more = enqueue(engine, table, "noop", 5)
            wait_until(
                lambda: ids_in(raw, archive_of(table)) == sorted(first + more), 30, "and again"
            )
            assert run.worker.archiver.enabled
    failures = [r for r in caplog.records if "could not archive" in r.getMessage()]
    assert failures and all(len(r.getMessage().splitlines()) == 1 for r in failures)


@pytest.fixture
def role_url(database_url: str, raw: Raw, table: Table) -> Iterator[str]:
    """A login role that may work the queue but not delete from it."""
    role = f"jobq_nodel_{uuid.uuid4().hex[:8]}"
    raw.execute(f"CREATE ROLE {role} LOGIN".encode())
    names = names_of(table)
    for granted in (table.name, f"{table.name}_queues", f"{table.name}_workers"):
        raw.execute(f'GRANT SELECT, INSERT, UPDATE ON "{granted}" TO {role}'.encode())
    raw.execute(f'GRANT SELECT, INSERT ON "{names.archive}" TO {role}'.encode())
    raw.execute(f"GRANT DELETE ON \"{table.name}_workers\" TO {role}".encode())
    yield make_url(database_url).set(username=role).render_as_string(hide_password=False)
    drop_role(raw, role, owned=True)


def test_a_role_that_may_not_delete_is_told_once_and_archiving_turns_off(
    role_url: str, engine: Engine, table: Table, raw: Raw, caplog: pytest.LogCaptureFixture
) -> None:
    """With `archive_after` 0 the completions would move the jobs: they are
    recorded in place instead, and that is said once too."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.archive")
    caplog.set_level(logging.INFO, logger="sqla_jobq.finisher")
    jobs = enqueue(engine, table, "noop", 3)
    options = {"archive_after": timedelta(0), "poll_interval": 0.2}
    with running(registry_of(table), role_url, **options) as run:
        wait_until(lambda: not run.worker.archiver.enabled, 30, "archiving turned off")
        wait_until(
            lambda: len(ids_in(raw, table.name, "status = 'done'")) == 3, 30, "jobs still done"
        )
        more = enqueue(engine, table, "noop", 2)
        wait_until(
            lambda: len(ids_in(raw, table.name, "status = 'done'")) == 5, 30, "and more"
        )
    told = [r.getMessage() for r in caplog.records if r.name == "sqla_jobq.archive"]
    assert len(told) == 1, told
    assert "not archiving" in told[0] and "permission denied" in told[0]
    in_place = [r.getMessage() for r in caplog.records if r.name == "sqla_jobq.finisher"]
    assert len(in_place) == 1 and "completing jobs in place" in in_place[0], in_place
    assert ids_in(raw, table.name) == sorted(jobs + more)


def test_shutdown_stops_a_pass_between_batches_and_leaves_no_job_half_moved(
    database_url: str, engine: Engine, table: Table, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archiving, "BATCH", 100)
    history = old_history(raw, table, 20_000)
    with running(registry_of(table), database_url, poll_interval=0.2) as run:
        wait_until(lambda: run.worker.archiver.batches >= 3, 30, "a pass under way")
    assert run.join(5) == 0
    moved = ids_in(raw, archive_of(table))
    left = ids_in(raw, table.name)
    assert moved and left, "stopped part-way, as it should at shutdown"
    assert sorted(moved + left) == history and not set(moved) & set(left)
    wait_until(lambda: not sessions(raw), 10, "every worker session closed")


def test_the_workers_prune_passes_a_held_row_by_and_takes_it_later(
    database_url: str,
    engine: Engine,
    table: Table,
    raw: Raw,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--prune-older-than` runs on the claimer's connection, whose statements
    may wait 200 ms for a row lock: a done row someone holds must be skipped
    (SKIP LOCKED), not turn the prune into a failed claim."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.worker")
    history = old_history(raw, table, 5)
    options = {
        "prune_older_than": timedelta(hours=1),
        "prune_interval": 0.5,
        "archive_after": None,
        "poll_interval": 0.2,
    }
    with psycopg.connect(conninfo(database_url)) as holder:
        held = history[2]
        holder.execute(f'SELECT id FROM "{table.name}" WHERE id = %s FOR UPDATE'.encode(), (held,))
        with running(registry_of(table), database_url, **options):
            wait_until(lambda: ids_in(raw, table.name) == [held], 30, "the others pruned")
            jobs = enqueue(engine, table, "noop", 3)
            wait_until(
                lambda: ids_in(raw, table.name, "status = 'done'") == [held, *jobs], 30, "claims"
            )
            holder.rollback()
            wait_until(lambda: ids_in(raw, table.name) == jobs, 30, "the held row pruned later")
    assert not [r for r in caplog.records if "claim failed" in r.getMessage()]
