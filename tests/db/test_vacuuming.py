"""A busy worker vacuums its queue table once dead tuples pile up, never waits
on another vacuum, and leaves the table alone when its role may not vacuum it.

The shared test server runs with autovacuum off, so every vacuum these tests
see is the worker's own."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Engine, Table

from sqla_jobq import client
from sqla_jobq.db import compiled, conninfo
from sqla_jobq.job import NewJob
from sqla_jobq.reindexing import OLD_TRANSACTION_SECONDS
from sqla_jobq.vacuum_statements import dead_tuples, vacuum
from sqla_jobq.vacuuming import BACKOFF_START, Vacuumer
from tests.support.inprocess import running
from tests.support.upkeep import dml_role, done, noop_registry
from tests.support.waiting import wait_until

Raw = psycopg.Connection[Any]


def enqueue(engine: Engine, table: Table, count: int) -> None:
    with engine.begin() as conn:
        client.enqueue_many(conn, table, [NewJob("noop") for _ in range(count)])


def vacuums(raw: Raw, table: Table) -> int:
    row = raw.execute(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass", (table.name,)
    ).fetchone()
    return int(row[0]) if row else 0


def vacuum_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for r in list(caplog.records) if (m := r.getMessage()).startswith("vacuumed ")]


def test_busy_worker_vacuums_the_queue_table_past_the_threshold(
    database_url: str, engine: Engine, raw: Raw, table: Table, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobq.vacuum")
    registry = noop_registry(table)
    enqueue(engine, table, 3000)  # two dead versions per job: 6,000
    with running(registry, database_url, vacuum_dead_tuples=2000, poll_interval=0.2):
        wait_until(lambda: done(raw, table) == 3000, 60, "all jobs done")
        # The log line, not vacuum_count: the server counts the vacuum before
        # the worker has read the count after it and logged.
        wait_until(lambda: bool(vacuum_lines(caplog)), 30, "a vacuum logged")
    assert vacuums(raw, table) >= 1
    dead = raw.execute(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = %s::regclass", (table.name,)
    ).fetchone()
    assert dead is not None and dead[0] < 6000  # 6,000 had nothing vacuumed
    counts = [[int(n) for n in re.findall(r"(\d+) -> (\d+)", m)[0]] for m in vacuum_lines(caplog)]
    assert counts and all(after < before for before, after in counts), counts


def test_worker_below_the_threshold_or_with_vacuuming_off_never_vacuums(
    database_url: str, engine: Engine, raw: Raw, table: Table
) -> None:
    registry = noop_registry(table)
    enqueue(engine, table, 1500)
    with running(registry, database_url, vacuum_dead_tuples=0, poll_interval=0.2):
        wait_until(lambda: done(raw, table) == 1500, 60, "1500 jobs done")
        time.sleep(2.5)  # past a look at the count, had vacuuming been on
    enqueue(engine, table, 500)
    with running(registry, database_url, vacuum_dead_tuples=100_000, poll_interval=0.2):
        wait_until(lambda: done(raw, table) == 2000, 60, "2000 jobs done")
        time.sleep(2.5)
    assert vacuums(raw, table) == 0


def test_vacuum_never_waits_behind_another_session_holding_the_table(
    database_url: str,
    engine: Engine,
    raw: Raw,
    table: Table,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another session holds the lock VACUUM needs (as a manual VACUUM or
    autovacuum would): the worker's SKIP_LOCKED vacuum gives up at once, the
    worker keeps claiming and completing, and vacuums once the lock is gone."""
    caplog.set_level(logging.DEBUG, logger="sqla_jobq.vacuum")
    registry = noop_registry(table)
    enqueue(engine, table, 2000)
    with psycopg.connect(conninfo(database_url)) as holder:
        holder.execute(f'LOCK TABLE "{table.name}" IN SHARE UPDATE EXCLUSIVE MODE')
        with running(registry, database_url, vacuum_dead_tuples=1000, poll_interval=0.2):
            wait_until(lambda: done(raw, table) == 2000, 60, "2000 jobs done")
            wait_until(
                lambda: any("skipped" in r.getMessage() for r in caplog.records),
                30,
                "a skipped vacuum",
            )
            enqueue(engine, table, 1000)  # still claimed and completed meanwhile
            wait_until(lambda: done(raw, table) == 3000, 60, "3000 jobs done")
            assert vacuums(raw, table) == 0
            holder.rollback()
            enqueue(engine, table, 10)
            wait_until(lambda: vacuums(raw, table) >= 1, 30, "a vacuum")


async def vacuum_when_due(vacuumer: Vacuumer, url: str, seconds: float) -> bool:
    """Look at the count (the statistics may lag by a second) until a VACUUM
    starts, then wait for it; False if none started within `seconds`."""
    async with await psycopg.AsyncConnection.connect(
        conninfo(url), autocommit=True, row_factory=dict_row
    ) as conn:
        deadline = time.monotonic() + seconds
        before = vacuumer.running
        while vacuumer.running is before and time.monotonic() < deadline:
            vacuumer.last_check = float("-inf")
            await vacuumer.check(conn)
            await asyncio.sleep(0.2)
        if vacuumer.running is before or vacuumer.running is None:
            return False
        await vacuumer.running
        return True


@pytest.fixture
def role_url(database_url: str, raw: Raw, table: Table) -> Iterator[str]:
    """A login role with DML on the queue table: it may work the queue, not vacuum it."""
    with dml_role(raw, database_url, table, "jobq_novac") as url:
        yield url


def test_a_role_that_may_not_vacuum_is_told_once_and_stops_trying(
    role_url: str, table: Table, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobq.vacuum")
    enqueue(engine, table, 10)
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DELETE FROM "{table.name}"')

    vacuumer = Vacuumer(role_url, table, threshold=1, prepared=True)
    assert asyncio.run(vacuum_when_due(vacuumer, role_url, 15)), "the dead tuples never showed"
    assert vacuumer.refused and not vacuumer.enabled
    assert not vacuumer.due(time.monotonic() + 3600)
    told = [r.getMessage() for r in caplog.records if "not vacuuming" in r.getMessage()]
    assert len(told) == 1 and "autovacuum" in told[0]


def test_a_vacuum_that_removes_little_makes_the_next_wait_longer(table: Table) -> None:
    """A held snapshot keeps dead tuples VACUUM must leave: vacuuming again
    every two seconds would scan the same pages for nothing."""
    vacuumer = Vacuumer("postgresql://unused/db", table, threshold=100, prepared=True)
    started = time.monotonic()
    waits = []
    for _ in range(3):
        vacuumer._judge(before=10_000, after=9_000, notices=[], started=started, held_by=None)
        waits.append(vacuumer.backoff)
    assert waits == [BACKOFF_START, BACKOFF_START * 2, BACKOFF_START * 4]
    assert vacuumer.not_before > time.monotonic()
    vacuumer._judge(before=10_000, after=100, notices=[], started=started, held_by=None)
    assert vacuumer.backoff == 0.0


def held_by(raw: Raw, table: Table) -> str | None:
    sql, params = compiled(dead_tuples(table, OLD_TRANSACTION_SECONDS))
    row = raw.execute(sql, params).fetchone()
    assert row is not None
    return None if row[1] is None else str(row[1])


def churn(engine: Engine, table: Table, count: int) -> None:
    """`count` jobs in and out again, committed: dead tuples, and xids assigned."""
    enqueue(engine, table, count)
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DELETE FROM "{table.name}"')


@contextmanager
def held_snapshot(database_url: str, table: Table) -> Iterator[psycopg.Connection[Any]]:
    """Another session's REPEATABLE READ snapshot, open for over a second."""
    with psycopg.connect(conninfo(database_url)) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f'SELECT count(*) FROM "{table.name}"').fetchall()
        time.sleep(OLD_TRANSACTION_SECONDS + 0.1)
        yield holder


def test_the_count_names_a_snapshot_held_elsewhere_for_over_a_second_until_it_ends(
    database_url: str, engine: Engine, raw: Raw, table: Table
) -> None:
    churn(engine, table, 10)
    assert held_by(raw, table) is None
    with held_snapshot(database_url, table) as holder:
        (xmin,) = holder.execute(
            "SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ).fetchall()[0]
        assert held_by(raw, table) == xmin
        churn(engine, table, 10)
        assert held_by(raw, table) == xmin
        holder.commit()
        assert held_by(raw, table) is None


def test_while_a_snapshot_holds_the_dead_tuples_no_second_vacuum_runs_until_it_ends(
    database_url: str, engine: Engine, raw: Raw, table: Table
) -> None:
    """Each futile VACUUM reads the whole heap the hold keeps growing (800 MB
    after a 3-minute hold in the held-snapshot scene); once the snapshot
    ends, the next look vacuums, however long the wait had grown."""
    vacuumer = Vacuumer(database_url, table, threshold=500, prepared=True)
    with held_snapshot(database_url, table) as holder:
        churn(engine, table, 1000)
        assert asyncio.run(vacuum_when_due(vacuumer, database_url, 15)), "no first vacuum"
        assert vacuums(raw, table) == 1
        churn(engine, table, 1000)
        vacuumer.not_before = float("-inf")  # whatever the wait, the hold decides
        assert not asyncio.run(vacuum_when_due(vacuumer, database_url, 3))
        assert vacuums(raw, table) == 1
        holder.commit()
    vacuumer.not_before = float("inf")
    assert asyncio.run(vacuum_when_due(vacuumer, database_url, 15)), "no vacuum after the release"
    wait_until(lambda: vacuums(raw, table) == 2, 10, "the second vacuum counted")
    dead = raw.execute(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = %s::regclass", (table.name,)
    ).fetchone()
    assert dead is not None and dead[0] < 500


def test_the_workers_vacuum_starts_no_parallel_workers(
    database_url: str, engine: Engine, table: Table
) -> None:
    """A parallel VACUUM sets up shared memory for its dead-tuple list, sized
    by the heap, and zero-fills it (`IO:DSMFillZeroWrite`): after a hold left
    a 231 MB heap, the worker's VACUUMs every few seconds spent a fifth of
    the time there, and one took 97 ms where `PARALLEL 0` took 16."""
    enqueue(engine, table, 5000)
    ours = compiled(vacuum(table))[0].replace("VACUUM (", "VACUUM (VERBOSE, ", 1)
    plain = f'VACUUM (VERBOSE, SKIP_LOCKED) "{table.name}"'

    def launched(statement: str, remainder: int) -> list[str]:
        notices: list[str] = []
        with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            conn.execute("SET min_parallel_index_scan_size = 0")  # every index qualifies
            conn.execute(f'DELETE FROM "{table.name}" WHERE id % 4 = {remainder}')
            conn.execute(statement)
        return [n for n in notices if "parallel vacuum worker" in n]

    assert launched(plain, 0), "the server would have run this VACUUM in parallel"
    assert launched(ours, 1) == []
