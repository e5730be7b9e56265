"""wait_for and wait_for_async: a job's stored result, or its failure,
cancellation, absence or a timeout; woken by the NOTIFY its end sends, which
only awaited jobs send."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine, Table, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from sqla_jobq import (
    JobCancelled,
    JobFailed,
    Registry,
    client,
    statements,
    wait_for,
    wait_for_async,
)
from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.migrations import check_schema
from tests.support.faultqueue import drop_role
from tests.support.inprocess import running
from tests.support.waiting import wait_until

Raw = psycopg.Connection[Any]


def enqueue(engine: Engine, table: Table, task: str = "t", **options: Any) -> int:
    with engine.begin() as conn:
        return client.enqueue(conn, table, task, {}, **options)


def finish(engine: Engine, table: Table, how: Callable[[int, int], Any]) -> None:
    """Claim the one queued job and end it with `how(id, attempts)`, by statements."""
    with engine.begin() as conn:
        row = conn.execute(statements.claim(table, limit=1)).one()
    with engine.begin() as conn:
        conn.execute(how(row.id, row.attempts))


def in_thread(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn)
    thread.start()
    return thread


def test_wait_for_returns_the_result_a_real_worker_stored(
    engine: Engine, table: Table, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="receipt")
    def receipt(order: int) -> dict[str, Any]:
        return {"order": order, "lines": ["tea", "cake"]}

    with engine.begin() as conn:
        job_id = receipt.enqueue(conn, order=7)
    with running(registry, database_url, poll_interval=60):
        result = wait_for(engine, job_id, timeout=60, table=table)
    assert result == {"order": 7, "lines": ["tea", "cake"]}


def test_wait_for_wakes_when_statements_complete_the_job_while_it_waits(
    engine: Engine, table: Table, raw: Raw
) -> None:
    job_id = enqueue(engine, table)
    got: list[Any] = []
    waiter = in_thread(lambda: got.append(wait_for(engine, job_id, timeout=60, table=table)))
    awaited = f'SELECT awaited FROM "{table.name}" WHERE id = %s'
    wait_until(lambda: raw.execute(awaited, (job_id,)).fetchone() == (True,), 30, "the mark")
    finish(engine, table, lambda i, a: statements.complete(table, i, a, result=[1, 2]))
    waiter.join(60)
    assert got == [[1, 2]]


def test_a_job_finished_before_the_wait_returns_its_result_at_once(
    engine: Engine, table: Table
) -> None:
    job_id = enqueue(engine, table)
    finish(engine, table, lambda i, a: statements.complete(table, i, a, result="early"))
    assert wait_for(engine, job_id, timeout=0, table=table) == "early"


def test_a_job_that_returned_nothing_gives_none(engine: Engine, table: Table) -> None:
    job_id = enqueue(engine, table)
    finish(engine, table, lambda i, a: statements.complete(table, i, a))
    assert wait_for(engine, job_id, timeout=0, table=table) is None


def test_a_failed_job_raises_job_failed_with_its_last_error(engine: Engine, table: Table) -> None:
    job_id = enqueue(engine, table, max_attempts=1)
    finish(engine, table, lambda i, a: statements.fail(table, i, a, "SMTP 451"))
    with pytest.raises(JobFailed, match="SMTP 451") as failed:
        wait_for(engine, job_id, timeout=0, table=table)
    assert (failed.value.job_id, failed.value.last_error) == (job_id, "SMTP 451")


def test_a_cancelled_job_raises_job_cancelled(engine: Engine, table: Table) -> None:
    job_id = enqueue(engine, table)
    with engine.begin() as conn:
        conn.execute(statements.cancel(table, job_id))
    with pytest.raises(JobCancelled, match=f"job {job_id} was cancelled"):
        wait_for(engine, job_id, timeout=0, table=table)


def archive_all(engine: Engine, table: Table) -> int:
    """Move every finished job to the archive now, as a worker does after `archive_after`."""
    with engine.begin() as conn:
        return conn.execute(statements.archive(table, older_than=timedelta(0))).rowcount


def test_result_of_an_archived_job_is_still_returned(engine: Engine, table: Table) -> None:
    job_id = enqueue(engine, table)
    finish(engine, table, lambda i, a: statements.complete(table, i, a, result={"n": 1}))
    assert archive_all(engine, table) == 1
    assert wait_for(engine, job_id, timeout=0, table=table) == {"n": 1}


def test_an_archived_failed_or_cancelled_job_raises_as_it_did_in_the_table(
    engine: Engine, table: Table
) -> None:
    failed = enqueue(engine, table, max_attempts=1)
    finish(engine, table, lambda i, a: statements.fail(table, i, a, "SMTP 451"))
    cancelled = enqueue(engine, table)
    with engine.begin() as conn:
        conn.execute(statements.cancel(table, cancelled))
    assert archive_all(engine, table) == 2
    with pytest.raises(JobFailed, match="SMTP 451") as raised:
        wait_for(engine, failed, timeout=0, table=table)
    assert (raised.value.job_id, raised.value.last_error) == (failed, "SMTP 451")
    with pytest.raises(JobCancelled, match=f"job {cancelled} was cancelled"):
        wait_for(engine, cancelled, timeout=0, table=table)


def test_a_job_archived_while_its_waiter_listens_is_found_in_the_archive(
    engine: Engine, table: Table, raw: Raw
) -> None:
    """The job ends and is moved before the waiter reads it again: the
    waiter must find it in the archive, not call it unknown."""
    job_id = enqueue(engine, table)
    got: list[Any] = []
    waiter = in_thread(lambda: got.append(wait_for(engine, job_id, timeout=60, table=table)))
    awaited = f'SELECT awaited FROM "{table.name}" WHERE id = %s'
    wait_until(lambda: raw.execute(awaited, (job_id,)).fetchone() == (True,), 30, "the mark")
    with engine.begin() as conn:
        row = conn.execute(statements.claim(table, limit=1)).one()
        conn.execute(statements.complete(table, row.id, row.attempts, result="moved"))
        # finished_at is now(), this transaction's start: age it, so the move
        # commits with the completion and the waiter never sees the job done
        # in the jobs table.
        conn.execute(
            table.update().values(finished_at=table.c.finished_at - timedelta(seconds=1))
        )
        assert conn.execute(statements.archive(table, older_than=timedelta(0))).rowcount == 1
    waiter.join(60)
    assert got == ["moved"]


def test_a_role_that_may_not_read_the_archive_still_waits_on_the_jobs_table(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    """Before archiving by default, an app's role needed no SELECT on the
    archive. Such a role still gets results from the jobs table; for a job
    it cannot find, the LookupError says what to grant."""
    role = f"jobq_noarch_{uuid.uuid4().hex[:8]}"
    raw.execute(f"CREATE ROLE {role} LOGIN".encode())
    raw.execute(f'GRANT SELECT, UPDATE ON "{table.name}" TO {role}'.encode())
    url = make_url(database_url).set(username=role).render_as_string(hide_password=False)
    limited = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        job_id = enqueue(engine, table)
        finish(engine, table, lambda i, a: statements.complete(table, i, a, result="here"))
        assert wait_for(limited, job_id, timeout=0, table=table) == "here"
        archive_all(engine, table)
        with pytest.raises(LookupError, match=f"GRANT SELECT ON {table.name}_archive"):
            wait_for(limited, job_id, timeout=0, table=table)
    finally:
        limited.dispose()
        drop_role(raw, role, owned=True)


def test_an_unknown_job_raises_lookup_error(engine: Engine, table: Table) -> None:
    with pytest.raises(LookupError, match="job 424242 is not in"):
        wait_for(engine, 424242, timeout=1, table=table)


def test_a_job_still_queued_at_the_deadline_raises_timeout_error(
    engine: Engine, table: Table
) -> None:
    job_id = enqueue(engine, table)
    with pytest.raises(TimeoutError, match=f"job {job_id} is still queued after 0.3s"):
        wait_for(engine, job_id, timeout=0.3, table=table)


def test_only_awaited_jobs_send_a_notification_when_they_end(
    engine: Engine, table: Table, raw: Raw
) -> None:
    with engine.connect() as conn:
        channel = check_schema(conn, table)
    raw.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    enqueue(engine, table)  # nobody waits for this one
    awaited = enqueue(engine, table)
    with engine.begin() as conn:
        assert conn.execute(statements.mark_awaited(table, awaited)).scalar() == awaited
    for _ in range(2):
        finish(engine, table, lambda i, a: statements.complete(table, i, a, result=i))
    raw.execute("SELECT 1")  # a round trip after the commits: their NOTIFYs are in
    finished = [n.payload for n in raw.notifies(timeout=0) if n.payload.startswith("#finished")]
    assert finished == [f"#finished {awaited}"]


def test_mark_awaited_skips_finished_jobs_and_rows_another_session_locked(
    engine: Engine, table: Table, database_url: str
) -> None:
    done, locked = enqueue(engine, table), enqueue(engine, table)
    finish(engine, table, lambda i, a: statements.complete(table, i, a))
    with psycopg.connect(conninfo(database_url)) as other, engine.begin() as conn:
        other.execute(f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE', (locked,))
        assert conn.execute(statements.mark_awaited(table, done)).first() is None
        assert conn.execute(statements.mark_awaited(table, locked)).first() is None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    yield eng
    await eng.dispose()


@pytest.mark.anyio
async def test_wait_for_async_returns_the_result_a_real_worker_stored(
    engine: Engine, async_engine: AsyncEngine, table: Table, database_url: str
) -> None:
    registry = Registry(table)

    @registry.task(name="square")
    async def square(n: int) -> int:
        return n * n

    async with async_engine.begin() as conn:
        job_id = await square.enqueue(conn, n=12)
    with running(registry, database_url, poll_interval=60):
        assert await wait_for_async(async_engine, job_id, timeout=60, table=table) == 144


@pytest.mark.anyio
async def test_wait_for_async_raises_for_failed_cancelled_and_unknown_jobs_archived_or_not(
    engine: Engine, async_engine: AsyncEngine, table: Table
) -> None:
    failed = enqueue(engine, table, max_attempts=1)
    finish(engine, table, lambda i, a: statements.fail(table, i, a, "boom"))
    cancelled = enqueue(engine, table)
    with engine.begin() as conn:
        conn.execute(statements.cancel(table, cancelled))
    with pytest.raises(JobFailed, match="boom"):
        await wait_for_async(async_engine, failed, timeout=0, table=table)
    with pytest.raises(JobCancelled):
        await wait_for_async(async_engine, cancelled, timeout=0, table=table)
    with pytest.raises(LookupError):
        await wait_for_async(async_engine, 424242, timeout=0, table=table)
    done = enqueue(engine, table)
    finish(engine, table, lambda i, a: statements.complete(table, i, a, result=[3]))
    assert archive_all(engine, table) == 3
    assert await wait_for_async(async_engine, done, timeout=0, table=table) == [3]
    with pytest.raises(JobFailed, match="boom"):
        await wait_for_async(async_engine, failed, timeout=0, table=table)
    with pytest.raises(JobCancelled):
        await wait_for_async(async_engine, cancelled, timeout=0, table=table)
    queued = enqueue(engine, table)
    with pytest.raises(TimeoutError):
        await wait_for_async(async_engine, queued, timeout=0.2, table=table)
