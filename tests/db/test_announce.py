"""Schema version 3's announcements, on real PostgreSQL: one channel however the
table's name is spelled (the one `check_schema` returns), jobs put back to
`queued` announced, the hot path silent and free of plpgsql, trigger bodies
that no name can break, and a table that lost its triggers refused and
repaired."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, MetaData, Table, create_engine, text
from sqlalchemy.pool import NullPool

from sqla_jobq import client, queue_statements, statements
from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.migrations import SchemaError, check_schema
from sqla_jobq.migrations.runner import migrate_to_latest
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names, canonical_channel, jobs_table, names_of, quote_ident
from tests.db.test_notify import listening, received
from tests.support.queues import create_queue_table, drop_queue_table

Raw = psycopg.Connection[Any]


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def channel_of(engine: Engine, table: Table) -> str:
    with engine.connect() as conn:
        return check_schema(conn, table)


def heard(listener: Raw, count: int = 1) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=count)]


@pytest.fixture
def made(database_url: str, raw: Raw) -> Iterator[Callable[[Names], None]]:
    """Migrates queue tables of the test's choosing; drops them, and their schemas, after."""
    tables: list[Names] = []

    def make(names: Names) -> None:
        create_queue_table(database_url, names)
        tables.append(names)

    yield make
    for names in tables:
        drop_queue_table(database_url, names)
        if names.schema not in (None, "public"):
            raw.execute(f"DROP SCHEMA {quote_ident(names.schema)}".encode())


@contextmanager
def engine_on(database_url: str, search_path: str | None) -> Iterator[Engine]:
    """An engine whose sessions resolve unqualified names through `search_path`."""
    options = {} if search_path is None else {"options": f"-c search_path={search_path}"}
    engine = create_engine(sqlalchemy_url(database_url), poolclass=NullPool, connect_args=options)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("custom_schema", "spelled_with_schema"),
    [(False, False), (True, True), (True, False)],
    ids=["public.t used as t", "s.t used as s.t", "s.t used as t through search_path"],
)
def test_a_job_enqueued_under_any_spelling_of_the_name_is_heard_on_check_schemas_channel(
    database_url: str, made: Callable[[Names], None], custom_schema: bool, spelled_with_schema: bool
) -> None:
    name = unique("r16_")
    schema = unique("jobq_s_") if custom_schema else "public"
    made(Names(name, schema))  # as `jobq migrate --table <schema>.<name>` does
    used = jobs_table(MetaData(), name, schema if spelled_with_schema else None)
    with engine_on(database_url, schema if custom_schema else None) as engine:
        channel = channel_of(engine, used)
        assert channel == canonical_channel(schema, name) == f"{schema}.{name}"
        with listening(database_url, channel) as listener:
            with engine.begin() as conn:
                client.enqueue(conn, used, "t", {}, queue="mail")
            assert heard(listener) == [(channel, "mail")]


def test_release_reap_retry_and_a_failure_to_retry_announce_the_job_put_back(
    engine: Engine, table: Table, database_url: str, raw: Raw
) -> None:
    queues = ["released", "reaped", "retried", "failed"]
    channel = channel_of(engine, table)
    with listening(database_url, channel) as listener:
        with engine.begin() as conn:
            for queue in queues:
                tries = 1 if queue == "retried" else 2
                client.enqueue(conn, table, "t", {}, queue=queue, max_attempts=tries)
            running = {r.queue: r for r in conn.execute(statements.claim(table, queue=queues))}
        assert sorted(p for _, p in heard(listener, 4)) == sorted(queues)  # the inserts

        with engine.begin() as conn:
            conn.execute(statements.release(table, running["released"].id, 1))
        assert heard(listener) == [(channel, "released")]

        raw.execute(
            f"UPDATE {table.name} SET locked_until = now() - interval '1 second' WHERE id = %s",
            (running["reaped"].id,),
        )
        with engine.begin() as conn:
            assert [r.id for r in conn.execute(statements.reap(table))] == [running["reaped"].id]
        assert heard(listener) == [(channel, "reaped")]

        with engine.begin() as conn:  # final: failed, which is no put-back...
            failed = conn.execute(statements.fail(table, running["retried"].id, 1, "x")).one()
            assert failed.status == "failed"
        with engine.begin() as conn:  # ...until `retry`
            assert conn.execute(statements.retry(table, running["retried"].id)).one()
        assert heard(listener) == [(channel, "retried")]

        with engine.begin() as conn:
            again = conn.execute(statements.fail(table, running["failed"].id, 1, "x")).one()
            assert again.status == "queued"
        assert heard(listener) == [(channel, "failed")]
        assert received(listener) == []  # the lease change and the final failure: nothing


def requeue_calls(conn: Any, table: Table) -> int:
    """Calls of the put-back trigger's function in this transaction so far."""
    function = Names(table.name, None).notify_requeue_function
    calls = conn.execute(
        text("SELECT pg_stat_get_xact_function_calls(to_regproc(:f))"),
        {"f": quote_ident(function)},
    ).scalar()
    return calls or 0


def test_claims_completions_and_lease_extensions_announce_nothing_and_run_no_plpgsql(
    engine: Engine, table: Table, database_url: str
) -> None:
    channel = channel_of(engine, table)
    with listening(database_url, channel) as listener:
        with engine.begin() as conn:
            client.enqueue(conn, table, "t", {})
            client.enqueue(conn, table, "t", {})
        assert heard(listener) == [(channel, "default")]
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL track_functions = 'pl'"))
            first, second = conn.execute(statements.claim(table)).all()
            conn.execute(statements.extend_lease(table, first.id, first.attempts))
            conn.execute(statements.complete(table, first.id, first.attempts))
            assert requeue_calls(conn, table) == 0
            conn.execute(statements.release(table, second.id, second.attempts))
            assert requeue_calls(conn, table) == 1  # the count is live
        assert heard(listener) == [(channel, "default")]  # the release alone
        assert received(listener) == []


def migrate(raw: Raw, names: Names, current: int, target: int) -> None:
    steps = up_statements if target > current else down_statements
    for sql in steps(names, current, target):
        raw.execute(sql.encode())


def heard_of_an_insert_and_a_put_back(database_url: str, table: Table, channel: str) -> None:
    with listening(database_url, channel) as listener, engine_on(database_url, None) as engine:
        with engine.begin() as conn:
            client.enqueue(conn, table, "t", {}, queue="q")
        assert heard(listener) == [(channel, "q")]
        with engine.begin() as conn:
            (job,) = conn.execute(statements.claim(table, queue="q")).all()
            conn.execute(statements.release(table, job.id, job.attempts))
        assert heard(listener) == [(channel, "q")]


@pytest.mark.parametrize(
    ("name", "schema"),
    [("a$jobq$b ", None), ("o'q\\ $jobq$ ", "s'$jobq$")],
    ids=["dollar tag", "quotes, backslash and dollar tag in table and schema"],
)
def test_names_with_dollar_tags_or_quotes_migrate_up_and_down_to_0_with_working_triggers(
    database_url: str, raw: Raw, name: str, schema: str | None
) -> None:
    names = Names(unique(name), schema)
    if schema is not None:
        raw.execute(f"CREATE SCHEMA {quote_ident(schema)}".encode())
    table = jobs_table(MetaData(), names.table, schema)
    try:
        migrate(raw, names, 0, LATEST)
        heard_of_an_insert_and_a_put_back(
            database_url, table, canonical_channel(schema or "public", names.table)
        )
        migrate(raw, names, LATEST, 2)  # the literal channel of version 2 is back
        with listening(database_url, names.literal_channel) as listener:
            with engine_on(database_url, None) as engine, engine.begin() as conn:
                client.enqueue(conn, table, "t", {}, queue="v2")
            assert heard(listener) == [(names.literal_channel, "v2")]
        migrate(raw, names, 2, 0)
    finally:
        if schema is not None:
            raw.execute(f"DROP SCHEMA {quote_ident(schema)} CASCADE".encode())
    assert raw.execute("SELECT to_regclass(%s)", [names.qualified]).fetchone() == (None,)
    functions = raw.execute(
        "SELECT count(*) FROM pg_proc WHERE proname = ANY(%s)",
        [[names.notify_function, names.notify_requeue_function, names.notify_finished,
          names.notify_cancel]],
    )
    assert functions.fetchone() == (0,)


@pytest.mark.parametrize(
    ("damage", "trigger"),
    [
        ("DROP TRIGGER {trigger} ON {table}", "notify_trigger"),
        ("ALTER TABLE {table} DISABLE TRIGGER {trigger}", "notify_requeue_trigger"),
    ],
    ids=["insert trigger dropped", "put-back trigger disabled"],
)
def test_check_schema_refuses_a_table_that_lost_a_trigger_and_jobq_migrate_restores_it(
    database_url: str, engine: Engine, table: Table, raw: Raw, damage: str, trigger: str
) -> None:
    names = names_of(table)
    lost = getattr(names, trigger)
    raw.execute(damage.format(trigger=quote_ident(lost), table=names.qualified).encode())
    with pytest.raises(SchemaError) as refused:
        channel_of(engine, table)
    message = str(refused.value)
    assert "\n" not in message
    assert lost in message and "jobq migrate" in message

    migrate_to_latest(sqlalchemy_url(database_url), table)
    heard_of_an_insert_and_a_put_back(database_url, table, channel_of(engine, table))


def test_check_schema_refuses_a_lost_queue_settings_trigger_and_jobq_migrate_restores_it(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    """The queue settings' trigger is what wakes workers when a queue is
    resumed: without it a resumed queue waits for their fallback poll."""
    names = names_of(table)
    raw.execute(
        f"DROP TRIGGER {quote_ident(names.queues_notify)} ON {names.queues_qualified}".encode()
    )
    with pytest.raises(SchemaError) as refused:
        channel_of(engine, table)
    assert names.queues_notify in str(refused.value)

    migrate_to_latest(sqlalchemy_url(database_url), table)
    channel = channel_of(engine, table)
    with listening(database_url, channel) as listener:
        with engine.begin() as conn:
            conn.execute(queue_statements.pause(table, "q"))
            conn.execute(queue_statements.resume(table, "q"))
        assert heard(listener) == [(channel, "q")]


def test_check_schema_refuses_a_resolved_channel_longer_than_pg_notify_takes(
    database_url: str, raw: Raw
) -> None:
    schema, name = unique("jobq_long_schema_"), unique("t" * 39)
    raw.execute(f"CREATE SCHEMA {schema}".encode())
    try:
        with psycopg.connect(
            conninfo(database_url), autocommit=True, options=f"-c search_path={schema}"
        ) as conn:
            migrate(conn, Names(name, None), 0, LATEST)
        with engine_on(database_url, schema) as engine, pytest.raises(SchemaError) as refused:
            channel_of(engine, jobs_table(MetaData(), name))
        assert "over 63 bytes" in str(refused.value)
    finally:
        raw.execute(f"DROP SCHEMA {schema} CASCADE".encode())
