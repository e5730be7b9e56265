"""Registry and Task: naming, registration, enqueueing in the caller's
transaction on every kind of SQLAlchemy connection, and refusing bad calls
before any SQL is sent."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, Table, event, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sqla_jobq import Registry, Task
from sqla_jobq.db import sqlalchemy_url
from sqla_jobq.statements import DEFAULT_LEASE, InvalidJob


def plain(x: int, y: int = 1) -> int:
    """Adds."""
    return x + y


async def coro(x: int) -> int:
    return x * 2


@pytest.fixture
def registry(table: Table) -> Registry:
    return Registry(table)


def rows(engine: Engine, table: Table) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def count(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


@pytest.fixture
def statements_sent(engine: Engine) -> Iterator[list[str]]:
    """Every SQL statement the test engine sends while the test runs."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    yield sent
    event.remove(engine, "before_cursor_execute", record)


# --------------------------------------------------------------------------- registration


def test_task_name_defaults_to_module_and_qualname(registry: Registry) -> None:
    task = registry.task(plain)
    assert task.name == f"{__name__}.plain"
    assert registry.tasks == {task.name: task}

    class Holder:
        @staticmethod
        def method() -> None: ...

    nested = registry.task(Holder.method)
    assert nested.name.endswith(
        ".test_task_name_defaults_to_module_and_qualname.<locals>.Holder.method"
    )


def test_decorated_function_is_still_callable_as_itself(registry: Registry) -> None:
    task = registry.task(plain)
    assert isinstance(task, Task)
    assert task(2, y=3) == 5
    assert (task.__name__, task.__doc__) == ("plain", "Adds.")
    atask = registry.task(coro)
    assert atask.is_async and not task.is_async
    assert asyncio.run(atask(4)) == 8


def test_task_options_are_kept_and_defaults_apply(registry: Registry) -> None:
    default = registry.task(plain)
    assert (default.queue, default.max_attempts, default.lease, default.priority) == (
        "default",
        5,
        DEFAULT_LEASE,
        0,
    )

    @registry.task(name="mail", queue="io", max_attempts=2, lease=timedelta(seconds=30), priority=3)
    def mail(to: str) -> None: ...

    assert (mail.name, mail.queue, mail.max_attempts, mail.lease, mail.priority) == (
        "mail",
        "io",
        2,
        timedelta(seconds=30),
        3,
    )
    assert registry.queues == ["default", "io"]
    assert (
        registry.get("mail") is mail and registry.get("nope") is None and registry.get(None) is None
    )


def test_duplicate_task_name_is_refused(registry: Registry) -> None:
    registry.task(name="same")(plain)
    with pytest.raises(ValueError, match="'same' is registered twice"):
        registry.task(name="same")(coro)
    registry.task(plain)
    with pytest.raises(ValueError, match="registered twice"):
        registry.task(plain)
    assert registry.tasks["same"].fn is plain


def test_non_positive_lease_is_refused(registry: Registry) -> None:
    with pytest.raises(ValueError, match="lease must be positive"):
        registry.task(lease=timedelta(0))(plain)
    assert registry.tasks == {}


def test_require_names_the_known_tasks(registry: Registry) -> None:
    registry.task(name="b")(plain)
    registry.task(name="a")(coro)
    with pytest.raises(InvalidJob, match=r"unknown task 'c' \(registered: a, b\)"):
        registry.require("c")


# --------------------------------------------------------------------------- enqueue


def test_enqueue_on_a_connection_returns_the_id_with_the_tasks_options(
    registry: Registry, engine: Engine, table: Table
) -> None:
    task = registry.task(name="mail", queue="io", max_attempts=2, priority=3)(plain)
    with engine.begin() as conn:
        job_id = task.enqueue(conn, x=1, y=2)
    assert isinstance(job_id, int)
    [row] = rows(engine, table)
    assert (row.id, row.task, row.payload, row.queue, row.max_attempts, row.priority) == (
        job_id,
        "mail",
        {"x": 1, "y": 2},
        "io",
        2,
        3,
    )
    assert (row.status, row.attempts) == ("queued", 0)


def test_enqueue_on_a_session(registry: Registry, engine: Engine, table: Table) -> None:
    task = registry.task(plain)
    with Session(engine) as session:
        job_id = task.enqueue(session, x=1)
        session.commit()
    assert [(r.id, r.payload) for r in rows(engine, table)] == [(job_id, {"x": 1})]


def test_enqueue_on_async_connection_and_session_is_awaitable(
    registry: Registry, database_url: str, engine: Engine, table: Table
) -> None:
    task = registry.task(plain)

    async def main() -> tuple[int, int]:
        async_engine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
        try:
            async with async_engine.begin() as conn:
                pending = task.enqueue(conn, x=1)
                assert inspect.isawaitable(pending)
                first = await pending
            async with AsyncSession(async_engine) as session:
                pending = task.enqueue(session, x=2)
                assert inspect.isawaitable(pending)
                second = await pending
                await session.commit()
        finally:
            await async_engine.dispose()
        return first, second

    first, second = asyncio.run(main())
    assert [(r.id, r.payload) for r in rows(engine, table)] == [
        (first, {"x": 1}),
        (second, {"x": 2}),
    ]


def test_enqueue_never_commits_so_a_rollback_leaves_nothing(
    registry: Registry, database_url: str, engine: Engine, table: Table
) -> None:
    task = registry.task(plain)
    with engine.connect() as conn:
        task.enqueue(conn, x=1)
        registry.enqueue_many(conn, task.name, [{"x": 2}, {"x": 3}])
        conn.rollback()
    with Session(engine) as session:
        task.enqueue(session, x=4)
        session.rollback()

    async def main() -> None:
        async_engine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
        try:
            async with async_engine.connect() as conn:
                await task.enqueue(conn, x=5)
                await registry.enqueue_many(conn, task.name, [{"x": 6}])
                await conn.rollback()
            async with AsyncSession(async_engine) as session:
                await task.enqueue(session, x=7)
                # leaving without commit rolls back
        finally:
            await async_engine.dispose()

    asyncio.run(main())
    assert count(engine, table) == 0


def test_enqueue_with_schedule_and_unique_key(
    registry: Registry, engine: Engine, table: Table
) -> None:
    task = registry.task(plain)
    at = datetime(2100, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        later = task.enqueue(conn, run_at=at, x=1)
        delayed = task.enqueue(conn, delay=timedelta(hours=1), x=2)
        keyed = task.enqueue(conn, unique_key="k", x=3)
        again = task.enqueue(conn, unique_key="k", x=4)
    assert keyed == again
    by_id = {r.id: r for r in rows(engine, table)}
    assert by_id[later].run_at == at
    assert by_id[delayed].run_at - by_id[delayed].created_at == timedelta(hours=1)
    assert by_id[keyed].payload == {"x": 3} and len(by_id) == 3


@pytest.mark.parametrize("size", [5, 1500], ids=["array insert", "copy"])
def test_enqueue_many_returns_ids_in_input_order(
    registry: Registry, database_url: str, engine: Engine, table: Table, size: int
) -> None:
    task = registry.task(plain, queue="bulk", priority=3, max_attempts=2)
    calls = [{"x": (n * 7919) % size} for n in range(size)]
    with engine.begin() as conn:
        ids = registry.enqueue_many(conn, task.name, calls)
    stored = {r.id: r for r in rows(engine, table)}
    assert [stored[i].payload for i in ids] == calls
    assert {(r.task, r.queue, r.priority, r.max_attempts) for r in stored.values()} == {
        (task.name, "bulk", 3, 2)
    }

    async def main() -> list[int]:
        async_engine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
        try:
            async with async_engine.begin() as conn:
                pending = registry.enqueue_many(conn, task.name, calls[::-1])
                assert inspect.isawaitable(pending)
                return await pending
        finally:
            await async_engine.dispose()

    more = asyncio.run(main())
    payloads = {r.id: r.payload for r in rows(engine, table)}
    assert [payloads[i] for i in more] == calls[::-1]
    with engine.begin() as conn:
        assert registry.enqueue_many(conn, task.name, []) == []


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"x": {1, 2}}, "not JSON-serialisable"),
        ({"x": datetime.now(UTC)}, "not JSON-serialisable"),
        ({"x": math.nan}, "not JSON-serialisable"),
        ({"x": math.inf}, "not JSON-serialisable"),
        ({"x": "nul\x00"}, "NUL character"),
        ({"x": object()}, "not JSON-serialisable"),
        ({}, "missing a required argument: 'x'"),
        ({"x": 1, "z": 2}, "unexpected keyword argument 'z'"),
        ({"x": 1, "delay": timedelta(-1)}, "delay must not be negative"),
        ({"x": 1, "run_at": datetime(2100, 1, 1)}, "timezone-aware"),
        (
            {"x": 1, "run_at": datetime.now(UTC), "delay": timedelta(1)},
            "run_at or delay, not both",
        ),
        ({"x": 1, "unique_key": "a\x00b"}, "NUL"),
    ],
    ids=[
        "set",
        "datetime",
        "nan",
        "inf",
        "nul",
        "object",
        "missing",
        "unexpected",
        "negative-delay",
        "naive-run_at",
        "both-schedules",
        "nul-unique-key",
    ],
)
def test_bad_calls_raise_invalid_job_before_any_sql(
    registry: Registry,
    engine: Engine,
    table: Table,
    statements_sent: list[str],
    kwargs: dict[str, Any],
    message: str,
) -> None:
    task = registry.task(plain)
    with engine.connect() as conn:
        sent_before = len(statements_sent)
        with pytest.raises(InvalidJob, match=message):
            task.enqueue(conn, **kwargs)
        assert statements_sent[sent_before:] == []
    assert count(engine, table) == 0


def test_enqueue_many_refuses_the_whole_batch_before_any_sql(
    registry: Registry, engine: Engine, table: Table, statements_sent: list[str]
) -> None:
    task = registry.task(plain)
    with engine.connect() as conn:
        sent_before = len(statements_sent)
        with pytest.raises(InvalidJob, match="unexpected keyword argument 'q'"):
            registry.enqueue_many(conn, task.name, [{"x": 1}, {"x": 2, "q": 2}])
        with pytest.raises(InvalidJob, match="unknown task 'nope'"):
            registry.enqueue_many(conn, "nope", [{"x": 1}])
        with pytest.raises(InvalidJob, match="must be a JSON object"):
            registry.enqueue_many(conn, task.name, [[1]])  # type: ignore[list-item]
        many: list[dict[str, Any]] = [{"x": n} for n in range(1500)]
        many[1200] = {"x": math.nan}  # encoded only on the COPY path, still before any SQL
        with pytest.raises(InvalidJob, match="not JSON-serialisable"):
            registry.enqueue_many(conn, task.name, many)
        assert statements_sent[sent_before:] == []
    assert count(engine, table) == 0


def test_check_payload_refuses_what_is_not_a_mapping(registry: Registry) -> None:
    task = registry.task(plain)
    assert task.check_payload({"x": 1}) == {"x": 1}
    for payload in ([1], "x", None, 3):
        with pytest.raises(InvalidJob, match="must be a JSON object of keyword arguments"):
            task.check_payload(payload)
