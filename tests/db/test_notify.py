"""NOTIFY: one hint per queue per enqueue statement, scheduled jobs included,
only on commit; the channel is `schema.table` as the server resolves the
table, whatever that name is."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, MetaData, Table, func, select

from sqla_jobq import client, statements
from sqla_jobq.db import conninfo
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names, canonical_channel, jobs_table
from sqla_jobq.statements import NewJob

QUIET = 0.3  # how long "no notification" is waited for


@contextmanager
def listening(database_url: str, channel: str) -> Iterator[psycopg.Connection[Any]]:
    """A dedicated autocommit connection LISTENing on `channel`."""
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        yield conn


def public(table: Table) -> str:
    """The channel of a test table, created without a schema, so in `public`."""
    return canonical_channel("public", table.name)


def received(conn: psycopg.Connection[Any], timeout: float = QUIET) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in conn.notifies(timeout=timeout)]


def count(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def test_rolled_back_enqueue_leaves_no_job_and_sends_no_notification(
    engine: Engine, table: Table, database_url: str
) -> None:
    with listening(database_url, public(table)) as listener:
        with engine.connect() as conn:
            client.enqueue(conn, table, "t", {})
            client.enqueue_many(conn, table, [NewJob("t", {}, queue="other")])
            conn.rollback()
        assert received(listener) == []
    assert count(engine, table) == 0


def test_committed_enqueue_notifies_the_table_channel_once_on_commit(
    engine: Engine, table: Table, database_url: str
) -> None:
    with listening(database_url, public(table)) as listener:
        with engine.connect() as conn:
            job_id = client.enqueue(conn, table, "t", {})
            client.enqueue(conn, table, "t", {})
            assert received(listener) == []  # nothing before the commit
            conn.commit()
        notes = list(listener.notifies(timeout=5, stop_after=1))
        assert [(n.channel, n.payload) for n in notes] == [(public(table), "default")]
        # two inserts of one queue in one transaction: identical hints coalesce
        assert received(listener) == []
    assert count(engine, table) == 2
    with engine.connect() as conn:
        assert conn.execute(statements.claim(table, limit=1)).one().id == job_id


def test_notification_carries_the_channel_and_the_queue_name(
    engine: Engine, table: Table, database_url: str
) -> None:
    with listening(database_url, public(table)) as listener:
        with engine.begin() as conn:
            client.enqueue(conn, table, "t", {}, queue="mail")
        assert [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=1)] == [
            (public(table), "mail")
        ]


def test_enqueue_many_of_10000_jobs_over_two_queues_notifies_once_per_queue(
    engine: Engine, table: Table, database_url: str, raw: psycopg.Connection[Any]
) -> None:
    rows = [NewJob("t", {"i": i}, queue="even" if i % 2 == 0 else "odd") for i in range(10_000)]
    with listening(database_url, public(table)) as listener:
        with engine.begin() as conn:
            assert len(client.enqueue_many(conn, table, rows)) == 10_000
        first = list(listener.notifies(timeout=5, stop_after=2))
        assert sorted(n.payload for n in first) == ["even", "odd"]
        assert received(listener) == []  # and nothing more
    # PostgreSQL folds identical notifications of one transaction, so the count
    # alone cannot tell a per-row trigger from ours: check that it really runs
    # once per statement, over a transition table, calling pg_notify per queue.
    (definition,) = raw.execute(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger "
        "WHERE tgrelid = to_regclass(%s) AND tgname = %s",
        [table.name, Names(table.name, None).notify_trigger],
    ).fetchone()
    assert "FOR EACH STATEMENT" in definition
    assert "REFERENCING NEW TABLE AS new_jobs" in definition


def test_scheduled_jobs_notify_so_idle_workers_can_reschedule(
    engine: Engine, table: Table, database_url: str
) -> None:
    """A worker sleeping until the earliest run_at it knows must hear of an earlier one."""
    later = datetime.now(UTC) + timedelta(hours=1)
    with listening(database_url, public(table)) as listener:
        with engine.begin() as conn:
            client.enqueue(conn, table, "t", {}, delay=timedelta(minutes=5))
            client.enqueue(conn, table, "t", {}, queue="scheduled", run_at=later)
        got = sorted(n.payload for n in listener.notifies(timeout=5, stop_after=2))
        assert got == ["default", "scheduled"]
        assert count(engine, table) == 2

        with engine.begin() as conn:  # a mixed batch: one notification per queue
            client.enqueue_many(
                conn,
                table,
                [
                    NewJob("t", {}, queue="later", delay=timedelta(minutes=1)),
                    NewJob("t", {}, queue="now"),
                    NewJob("t", {}, queue="now", run_at=datetime.now(UTC) - timedelta(1)),
                ],
            )
        got = sorted(n.payload for n in listener.notifies(timeout=5, stop_after=2))
        assert got == ["later", "now"]
        assert received(listener) == []


def test_queue_table_with_hostile_name_is_created_used_notified_and_dropped(
    engine: Engine, database_url: str, raw: psycopg.Connection[Any]
) -> None:
    name = f"we\"ird; name ' -- {uuid.uuid4().hex[:6]}"
    names = Names(name, None)
    for step in up_statements(names, 0, LATEST):
        raw.execute(step.encode())
    table = jobs_table(MetaData(), name)
    try:
        with listening(database_url, public(table)) as listener:
            with engine.begin() as conn:
                job_id = client.enqueue(conn, table, "t", {"x": 1}, queue="q'; --")
            notes = list(listener.notifies(timeout=5, stop_after=1))
            assert [(n.channel, n.payload) for n in notes] == [(public(table), "q'; --")]
        with engine.begin() as conn:
            (row,) = conn.execute(statements.claim(table, queue="q'; --")).all()
            assert (row.id, row.payload) == (job_id, {"x": 1})
            assert conn.execute(statements.complete(table, row.id, row.attempts)).rowcount == 1
    finally:
        for step in down_statements(names, LATEST, 0):
            raw.execute(step.encode())
    assert raw.execute("SELECT to_regclass(%s)", [names.qualified]).fetchone() == (None,)
    functions = raw.execute(
        "SELECT count(*) FROM pg_proc WHERE proname = ANY(%s)",
        [[names.notify_function, names.notify_requeue_function]],
    )
    assert functions.fetchone() == (0,)
