"""After its VACUUM, a worker rebuilds the queue table's indexes that VACUUM
left mostly empty, never while a snapshot still holds their dead entries,
without blocking claims, and cleans up after a rebuild that gave up."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table
from sqlalchemy.dialects import postgresql

from sqla_jobq import client, statements
from sqla_jobq.db import compiled
from sqla_jobq.job import NewJob
from sqla_jobq.reindex_statements import sparse_indexes
from sqla_jobq.reindexing import (
    BACKOFF_START,
    MAX_ENTRIES_PER_PAGE,
    OLD_TRANSACTION_SECONDS,
    Reindexer,
)
from tests.support.inprocess import running
from tests.support.rows import every_job
from tests.support.upkeep import dml_role, done, noop_registry, snapshot_held
from tests.support.waiting import wait_until, wait_until_async

Raw = psycopg.Connection[Any]

# Small enough that a few thousand jobs make every index of a test table count.
MIN_BYTES = 64 * 1024
CHURN = 12_000


def indexes(raw: Raw, table: Table) -> dict[str, tuple[int, bool]]:
    """Each index of the table: its size in bytes and whether it is valid."""
    rows = raw.execute(
        "SELECT c.relname, pg_relation_size(c.oid), i.indisvalid FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass",
        (table.name,),
    ).fetchall()
    return {str(name): (int(size), bool(valid)) for name, size, valid in rows}


def counted_sparse(raw: Raw, table: Table) -> int:
    """Indexes whose catalog counts, as the last VACUUM or ANALYZE left
    them, say fewer than MAX_ENTRIES_PER_PAGE entries a page: the worker's
    own query, with its guard against old transactions set beyond any test."""
    query = sparse_indexes(table, MIN_BYTES, MAX_ENTRIES_PER_PAGE, old_after=3600)
    return len(raw.execute(*compiled(query)).fetchall())


def total_index_bytes(raw: Raw, table: Table) -> int:
    return sum(size for size, _ in indexes(raw, table).values())


def churn(engine: Engine, raw: Raw, table: Table, count: int = CHURN) -> None:
    """Jobs enqueued, claimed and gone, as a queue's day leaves them: every
    index took their entries, and the rows are dead."""
    with engine.begin() as conn:
        client.enqueue_many(conn, table, [NewJob("noop") for _ in range(count)])
    raw.execute(f"UPDATE \"{table.name}\" SET status = 'running', locked_until = now()")
    raw.execute(f'DELETE FROM "{table.name}"')


def vacuum(raw: Raw, table: Table) -> None:
    raw.execute(f'VACUUM "{table.name}"')


@pytest.fixture
def held(database_url: str) -> Iterator[Raw]:
    """Another session holding a REPEATABLE READ snapshot until the test ends it."""
    with snapshot_held(database_url) as conn:
        yield conn


def reindexer(url: str, table: Table, **kwargs: Any) -> Reindexer:
    return Reindexer(url, table, min_bytes=MIN_BYTES, prepared=True, **kwargs)


async def look_and_rebuild(r: Reindexer) -> None:
    """What a worker does right after its VACUUM, on that VACUUM's connection."""
    async with await psycopg.AsyncConnection.connect(r.url, autocommit=True) as look:
        await r.run(look)


def rebuild(r: Reindexer) -> None:
    asyncio.run(look_and_rebuild(r))


def rebuilt_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for r in caplog.records if (m := r.getMessage()).startswith("rebuilt ")]


def test_sparse_index_query_reads_as_sql_and_names_the_catalog_counts(table: Table) -> None:
    sql = str(
        sparse_indexes(table, MIN_BYTES, MAX_ENTRIES_PER_PAGE, 1.0).compile(
            dialect=postgresql.dialect()  # type: ignore[no-untyped-call]
        )
    )
    assert "c.reltuples < c.relpages * %(max_entries_per_page)s" in sql
    assert "a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL" in sql
    assert "i.indisvalid" in sql


def test_no_index_is_rebuilt_while_a_snapshot_holds_its_dead_entries(
    database_url: str,
    engine: Engine,
    raw: Raw,
    table: Table,
    held: Raw,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """VACUUM must keep what the snapshot may still read, and counts those
    entries: the index is not sparse yet, and a rebuild would only wait for
    the snapshot. Once it is released, the next VACUUM and look rebuild."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    churn(engine, raw, table)
    vacuum(raw, table)
    before = indexes(raw, table)
    rebuild(reindexer(database_url, table))
    assert indexes(raw, table) == before and not rebuilt_lines(caplog)

    held.rollback()
    vacuum(raw, table)
    rebuild(reindexer(database_url, table))
    after = indexes(raw, table)
    assert after.keys() == before.keys() and all(valid for _, valid in after.values())
    assert total_index_bytes(raw, table) < sum(size for size, _ in before.values()) / 4
    assert len(rebuilt_lines(caplog)) >= 3, rebuilt_lines(caplog)


def test_an_analyze_during_a_hold_does_not_start_a_rebuild_that_would_wait_for_it(
    database_url: str,
    engine: Engine,
    raw: Raw,
    table: Table,
    held: Raw,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ANALYZE (autovacuum runs one each minute on a busy queue) counts only
    the live rows an index covers, against its full size: during a hold the
    indexes look sparse. A rebuild then would wait for the held snapshot
    until its lock timeout, and leave a copy every write keeps updating."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    churn(engine, raw, table)
    vacuum(raw, table)
    raw.execute(f'ANALYZE "{table.name}"')
    assert counted_sparse(raw, table) >= 3, "ANALYZE made them look sparse"
    time.sleep(OLD_TRANSACTION_SECONDS)  # the hold is older than any claim now
    before = indexes(raw, table)
    rebuild(reindexer(database_url, table))
    assert indexes(raw, table) == before and not rebuilt_lines(caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_busy_worker_rebuilds_the_indexes_a_held_snapshot_left_mostly_empty(
    database_url: str,
    engine: Engine,
    raw: Raw,
    table: Table,
    held: Raw,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    registry = noop_registry(table)
    options = {"vacuum_dead_tuples": 2000, "reindex_sparse_bytes": MIN_BYTES, "poll_interval": 0.2}
    with running(registry, database_url, **options):
        with engine.begin() as conn:
            client.enqueue_many(conn, table, [NewJob("noop") for _ in range(CHURN)])
        wait_until(lambda: done(raw, table) == CHURN, 120, "the jobs done under the hold")
        grown = total_index_bytes(raw, table)
        assert not rebuilt_lines(caplog)
        held.rollback()
        enqueued = [CHURN]

        def busy_until_rebuilt() -> bool:
            """More jobs, so the worker looks at its dead tuples again (a VACUUM
            that removed little under the hold made the next one wait)."""
            with engine.begin() as conn:
                client.enqueue_many(conn, table, [NewJob("noop") for _ in range(100)])
            enqueued[0] += 100
            return bool(rebuilt_lines(caplog))

        wait_until(busy_until_rebuilt, 120, "a rebuild after the release", interval=0.5)
        wait_until(lambda: len(rebuilt_lines(caplog)) >= 3, 60, "the indexes rebuilt")
        wait_until(lambda: done(raw, table) == enqueued[0], 60, "every job done")
    assert all(valid for _, valid in indexes(raw, table).values())
    assert total_index_bytes(raw, table) < grown / 4
    total = raw.execute(f"SELECT count(*) FROM {every_job(table, 'status')}").fetchone()
    assert total is not None and int(total[0]) == enqueued[0]


def leftovers(raw: Raw, table: Table) -> list[str]:
    return [
        name for name, (_, valid) in indexes(raw, table).items() if "_ccnew" in name or not valid
    ]


def active_reindex(raw: Raw) -> str | None:
    """What a running REINDEX INDEX CONCURRENTLY waits on ("" for nothing), or
    None when none is running."""
    row = raw.execute(
        "SELECT coalesce(wait_event_type, '') FROM pg_stat_activity "
        "WHERE query LIKE 'REINDEX INDEX CONCURRENTLY%' AND state = 'active' LIMIT 1"
    ).fetchone()
    return None if row is None else str(row[0])


def reindex_waiting(raw: Raw) -> bool:
    return active_reindex(raw) == "Lock"


def claim_and_complete_one(engine: Engine, table: Table) -> None:
    with engine.begin() as conn:
        client.enqueue(conn, table, "noop", {})
    with engine.begin() as conn:
        job = conn.execute(statements.claim(table, limit=1)).one()
    with engine.begin() as conn:
        assert conn.execute(statements.complete(table, job.id, job.attempts)).rowcount == 1


def test_a_rebuild_behind_an_older_snapshot_blocks_no_claim_gives_up_and_its_leftover_is_dropped(
    database_url: str,
    engine: Engine,
    raw: Raw,
    table: Table,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """REINDEX CONCURRENTLY waits for snapshots older than its build. Taken
    after the dead entries went, this one does not keep the index dense, so
    the rebuild starts, waits for it, and gives up at its lock timeout with
    an invalid `_ccnew` index left behind; claims and completions go on
    meanwhile. The next attempt drops that index first, then rebuilds."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    churn(engine, raw, table)
    vacuum(raw, table)
    names = set(indexes(raw, table))
    slow = reindexer(database_url, table, lock_timeout_ms=3000, old_transaction_seconds=60)
    with snapshot_held(database_url):
        attempt = threading.Thread(target=lambda: rebuild(slow))
        attempt.start()
        wait_until(lambda: reindex_waiting(raw), 10, "the rebuild waiting for the snapshot")
        claim_and_complete_one(engine, table)
        assert reindex_waiting(raw), "the claim should not have waited for the rebuild"
        attempt.join(30)
    assert slow.backoff == BACKOFF_START and not slow.refused
    left = leftovers(raw, table)
    assert left and all(name.endswith("_ccnew") for name in left), left

    slow.not_before = float("-inf")
    rebuild(slow)
    assert set(indexes(raw, table)) == names and not leftovers(raw, table)
    assert slow.backoff == 0.0 and rebuilt_lines(caplog)
    assert any(r.getMessage().startswith("dropped ") for r in caplog.records)


def test_a_worker_stopped_mid_rebuild_cancels_it_on_the_server_and_the_next_attempt_cleans_up(
    database_url: str, engine: Engine, raw: Raw, table: Table
) -> None:
    """Stopping a worker cancels its VACUUM task (`Vacuumer.stop`): the
    rebuild is cancelled on the server too, not left running for nobody,
    and what it had built is dropped by the next attempt."""
    churn(engine, raw, table)
    vacuum(raw, table)
    names = set(indexes(raw, table))
    patient = reindexer(
        database_url, table, lock_timeout_ms=60_000, old_transaction_seconds=60
    )

    async def stopped_mid_rebuild() -> None:
        task = asyncio.create_task(look_and_rebuild(patient))
        await wait_until_async(lambda: reindex_waiting(raw), 10, "the rebuild waiting")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with snapshot_held(database_url):
        asyncio.run(stopped_mid_rebuild())
        wait_until(lambda: active_reindex(raw) is None, 10, "the rebuild gone from the server")
    assert leftovers(raw, table)
    rebuild(patient)
    assert set(indexes(raw, table)) == names and not leftovers(raw, table)


def test_two_workers_rebuilding_at_once_leave_valid_compact_indexes(
    database_url: str, engine: Engine, raw: Raw, table: Table
) -> None:
    """Two rebuilds of one table that start together collide on its lock:
    PostgreSQL ends one as a deadlock, which may leave an invalid `_ccnew`
    index. The loser's next attempt drops it; no index is missing, none is
    left invalid, and claims go on."""
    churn(engine, raw, table)
    vacuum(raw, table)
    before = indexes(raw, table)
    pair = [reindexer(database_url, table), reindexer(database_url, table)]

    async def both() -> None:
        await asyncio.gather(*(look_and_rebuild(r) for r in pair))

    asyncio.run(both())
    for r in pair:
        if r.backoff:
            r.not_before = float("-inf")
            rebuild(r)
    after = indexes(raw, table)
    assert after.keys() == before.keys() and not leftovers(raw, table)
    assert total_index_bytes(raw, table) < sum(size for size, _ in before.values()) / 4
    claim_and_complete_one(engine, table)


@pytest.fixture
def role_url(database_url: str, raw: Raw, table: Table) -> Iterator[str]:
    """A login role with DML on the queue table: it may work the queue, not rebuild it."""
    with dml_role(raw, database_url, table, "jobq_noreindex") as url:
        yield url


def test_a_role_that_may_not_rebuild_indexes_is_told_once_and_stops_trying(
    role_url: str, engine: Engine, raw: Raw, table: Table, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    churn(engine, raw, table)
    vacuum(raw, table)
    before = indexes(raw, table)
    refused = reindexer(role_url, table)
    rebuild(refused)
    rebuild(refused)
    assert refused.refused and not refused.enabled
    told = [r.getMessage() for r in caplog.records if "may not" in r.getMessage()]
    assert len(told) == 1 and "owner" in told[0], told
    assert indexes(raw, table) == before


def test_indexes_of_a_heap_too_large_to_read_twice_are_left_to_a_rebuild_by_hand(
    database_url: str, engine: Engine, raw: Raw, table: Table, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    churn(engine, raw, table)
    vacuum(raw, table)
    before = indexes(raw, table)
    careful = reindexer(database_url, table, max_heap_bytes=8192)
    rebuild(careful)
    rebuild(careful)
    assert indexes(raw, table) == before and not rebuilt_lines(caplog)
    told = [r.getMessage() for r in caplog.records if "at a quiet time" in r.getMessage()]
    assert len(told) == 1 and "REINDEX INDEX CONCURRENTLY" in told[0], told


def test_an_exclusion_constraint_a_host_app_added_is_left_alone_and_the_rest_rebuilt(
    database_url: str, engine: Engine, raw: Raw, table: Table, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL cannot rebuild an exclusion constraint's index concurrently:
    trying would fail at every attempt, and hold the others back."""
    caplog.set_level(logging.INFO, logger="sqla_jobq.reindex")
    raw.execute(
        f'ALTER TABLE "{table.name}" ADD CONSTRAINT "{table.name}_x" '
        "EXCLUDE USING btree (id WITH =)"
    )
    churn(engine, raw, table)
    vacuum(raw, table)
    before = indexes(raw, table)
    everyone = reindexer(database_url, table)
    rebuild(everyone)
    after = indexes(raw, table)
    assert after[f"{table.name}_x"] == before[f"{table.name}_x"]
    assert everyone.backoff == 0.0 and len(rebuilt_lines(caplog)) >= 3
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_a_size_of_zero_turns_rebuilding_off(database_url: str, table: Table) -> None:
    assert not Reindexer(database_url, table, min_bytes=0, prepared=True).enabled
