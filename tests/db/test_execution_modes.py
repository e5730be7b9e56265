"""The same statement objects run unchanged on every SQLAlchemy executor:
`Connection`, ORM `Session`, `AsyncConnection` and `AsyncSession`; and the
registry's `enqueue` works on all four and refuses bad calls before writing."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, Executable, Table, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sqla_jobq import Registry, statements
from sqla_jobq.db import sqlalchemy_url
from sqla_jobq.statements import InvalidJob, NewJob


@dataclass
class Outcome:
    rows: list[Any]
    rowcount: int

    @property
    def scalar(self) -> Any:
        return self.rows[0][0]


Run = Callable[[Executable], Awaitable[Outcome]]


def outcome(result: Any) -> Outcome:
    rows = list(result.all()) if result.returns_rows else []
    return Outcome(rows, result.rowcount)


async def lifecycle(run: Run, table: Table) -> None:
    """Every statement once, each in its own transaction, through `run`."""
    j1 = (await run(statements.enqueue(table, "t", {"n": 1}))).scalar
    j2 = (await run(statements.enqueue(table, "t", {"n": 2}, unique_key="u"))).scalar
    assert (await run(statements.enqueue(table, "t", {"n": 0}, unique_key="u"))).scalar == j2
    rows = [NewJob("t", {"n": 3}, max_attempts=1), NewJob("t", {"n": 4}), NewJob("t", {"n": 5})]
    j3, j4, j5 = [r[0] for r in (await run(statements.enqueue_many(table, rows))).rows]
    assert (await run(statements.next_run_at(table))).scalar is not None

    claimed = (await run(statements.claim(table, limit=10))).rows
    assert {r.id: (r.attempts, r.payload) for r in claimed} == {
        j1: (1, {"n": 1}),
        j2: (1, {"n": 2}),
        j3: (1, {"n": 3}),
        j4: (1, {"n": 4}),
        j5: (1, {"n": 5}),
    }
    assert (await run(statements.complete(table, j1, 1))).rowcount == 1
    assert (await run(statements.complete_many(table, [(j2, 1)]))).rows == [(j2, 1)]
    assert (await run(statements.fail(table, j3, 1, "boom"))).rows[0].status == "failed"
    assert (await run(statements.extend_lease(table, j4, 1, timedelta(minutes=1)))).rowcount == 1
    extended = await run(statements.extend_leases(table, [(j4, 1), (j5, 1)], timedelta(hours=1)))
    assert sorted(r[0] for r in extended.rows) == [j4, j5]
    assert (await run(statements.release(table, j4, 1))).rowcount == 1
    short = statements.extend_lease(table, j5, 1, timedelta(milliseconds=1))
    assert (await run(short)).rowcount == 1
    await asyncio.sleep(0.02)
    assert [tuple(r) for r in (await run(statements.reap(table))).rows] == [(j5, "queued", 1)]
    assert [tuple(r) for r in (await run(statements.retry(table, j3))).rows] == [(j3, 1, 2)]
    assert (await run(statements.cancel(table, j4))).rows == [(j4, "queued")]
    stats = {(r.queue, r.status): r.count for r in (await run(statements.stats(table))).rows}
    assert stats == {
        ("default", "cancelled"): 1,
        ("default", "done"): 2,
        ("default", "queued"): 2,
    }
    assert (await run(statements.prune(table, older_than=timedelta(0)))).rowcount == 3
    left = (await run(select(table.c.id).order_by(table.c.id))).rows
    assert [r[0] for r in left] == [j3, j5]


def async_url(database_url: str) -> str:
    return sqlalchemy_url(database_url)  # postgresql+psycopg serves async engines too


@asynccontextmanager
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(async_url(database_url), poolclass=NullPool)
    try:
        yield engine
    finally:
        await engine.dispose()


def committing(executor: Connection | Session) -> Run:
    """`run` for `lifecycle`: each statement in its own transaction on `executor`."""

    async def run(stmt: Executable) -> Outcome:
        result = outcome(executor.execute(stmt))
        executor.commit()
        return result

    return run


def committing_async(executor: AsyncConnection | AsyncSession) -> Run:
    """`committing` for an async executor."""

    async def run(stmt: Executable) -> Outcome:
        result = outcome(await executor.execute(stmt))
        await executor.commit()
        return result

    return run


def test_every_statement_runs_on_a_connection(engine: Engine, table: Table) -> None:
    with engine.connect() as conn:
        assert isinstance(conn, Connection)
        asyncio.run(lifecycle(committing(conn), table))


def test_every_statement_runs_on_an_orm_session(engine: Engine, table: Table) -> None:
    with Session(engine) as session:
        asyncio.run(lifecycle(committing(session), table))


def test_every_statement_runs_on_an_async_connection(database_url: str, table: Table) -> None:
    async def main() -> None:
        async with async_engine(database_url) as engine, engine.connect() as conn:
            assert isinstance(conn, AsyncConnection)
            await lifecycle(committing_async(conn), table)

    asyncio.run(main())


def test_every_statement_runs_on_an_async_session(database_url: str, table: Table) -> None:
    async def main() -> None:
        async with async_engine(database_url) as engine, AsyncSession(engine) as session:
            await lifecycle(committing_async(session), table)

    asyncio.run(main())


# --- the registry ------------------------------------------------------------------


def make_registry(table: Table) -> Registry:
    registry = Registry(table)

    @registry.task(name="send_email")
    def send_email(to: str, subject: str = "hello") -> None:
        """Send a mail."""

    @registry.task(name="resize", queue="images", max_attempts=3, priority=5)
    async def resize(path: str, width: int) -> None:
        """Resize an image."""

    return registry


def jobs(engine: Engine, table: Table) -> list[tuple[Any, ...]]:
    c = table.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(c.task, c.queue, c.payload, c.priority, c.max_attempts).order_by(c.id)
        ).all()
    return [tuple(r) for r in rows]


def test_task_enqueue_works_on_every_executor(
    engine: Engine, database_url: str, table: Table
) -> None:
    registry = make_registry(table)
    send, resize = registry.tasks["send_email"], registry.tasks["resize"]

    with engine.begin() as conn:
        assert isinstance(send.enqueue(conn, to="conn@example.com"), int)
    with Session(engine) as session:
        assert isinstance(send.enqueue(session, to="session@example.com"), int)
        assert len(registry.enqueue_many(session, "send_email", [{"to": "m1"}, {"to": "m2"}])) == 2
        session.commit()

    async def main() -> None:
        async with async_engine(database_url) as aengine:
            async with aengine.begin() as conn:
                pending = resize.enqueue(conn, path="a.png", width=100)
                assert inspect.isawaitable(pending)
                assert isinstance(await pending, int)
                ids = await registry.enqueue_many(conn, "resize", [{"path": "b", "width": 1}])
                assert len(ids) == 1
            async with AsyncSession(aengine) as session:
                pending = resize.enqueue(session, path="c.png", width=300, unique_key="c")
                assert inspect.isawaitable(pending)
                first = await pending
                assert (
                    await resize.enqueue(session, path="c.png", width=300, unique_key="c") == first
                )
                await session.commit()

    asyncio.run(main())
    assert jobs(engine, table) == [
        ("send_email", "default", {"to": "conn@example.com"}, 0, 5),
        ("send_email", "default", {"to": "session@example.com"}, 0, 5),
        ("send_email", "default", {"to": "m1"}, 0, 5),
        ("send_email", "default", {"to": "m2"}, 0, 5),
        ("resize", "images", {"path": "a.png", "width": 100}, 5, 3),
        ("resize", "images", {"path": "b", "width": 1}, 5, 3),
        ("resize", "images", {"path": "c.png", "width": 300}, 5, 3),
    ]
    # a registered task stays callable as itself
    assert send("x") is None and send.__doc__ == "Send a mail."


class Opaque:
    pass


BAD_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("nan", {"to": math.nan}, "JSON"),
    ("infinity", {"to": "a", "subject": math.inf}, "JSON"),
    ("object", {"to": Opaque()}, "JSON"),
    ("set", {"to": {"a", "b"}}, "JSON"),
    ("bytes", {"to": b"raw"}, "JSON"),
    ("datetime", {"to": datetime(2024, 1, 1)}, "JSON"),
    ("unknown-argument", {"to": "a", "cc": "b"}, "does not match"),
    ("missing-argument", {"subject": "hi"}, "does not match"),
    ("nul", {"to": "a\x00b"}, "NUL"),
    ("nul-in-unique-key", {"to": "a", "unique_key": "k\x00"}, "NUL"),
    ("negative-delay", {"to": "a", "delay": timedelta(seconds=-1)}, "negative"),
    ("naive-run_at", {"to": "a", "run_at": datetime(2030, 1, 1)}, "timezone"),
    (
        "run_at-and-delay",
        {"to": "a", "run_at": datetime.now().astimezone(), "delay": timedelta(1)},
        "not both",
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "match"), [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS]
)
def test_task_enqueue_refuses_bad_calls_on_every_executor_and_writes_nothing(
    engine: Engine, database_url: str, table: Table, kwargs: dict[str, Any], match: str
) -> None:
    send = make_registry(table).tasks["send_email"]

    with engine.connect() as conn, conn.begin():
        with pytest.raises(InvalidJob, match=match):
            send.enqueue(conn, **kwargs)
        # refused before the database saw it: the caller's transaction lives on
        assert conn.execute(select(func.count()).select_from(table)).scalar_one() == 0
    with Session(engine) as session, pytest.raises(InvalidJob, match=match):
        send.enqueue(session, **kwargs)

    async def main() -> None:
        async with async_engine(database_url) as aengine:
            async with aengine.connect() as conn:
                with pytest.raises(InvalidJob, match=match):
                    await send.enqueue(conn, **kwargs)
                await conn.commit()
            async with AsyncSession(aengine) as session:
                with pytest.raises(InvalidJob, match=match):
                    await send.enqueue(session, **kwargs)
                await session.commit()

    asyncio.run(main())
    assert jobs(engine, table) == []


def test_refused_call_leaves_the_callers_transaction_usable(engine: Engine, table: Table) -> None:
    registry = make_registry(table)
    send = registry.tasks["send_email"]
    with engine.begin() as conn:
        with pytest.raises(InvalidJob):
            send.enqueue(conn, to=math.nan)
        with pytest.raises(InvalidJob):
            registry.enqueue_many(conn, "send_email", [{"to": "ok"}, {"to": "bad\x00"}])
        with pytest.raises(InvalidJob, match="unknown task"):
            registry.enqueue_many(conn, "no_such_task", [{}])
        send.enqueue(conn, to="fine")
    assert jobs(engine, table) == [("send_email", "default", {"to": "fine"}, 0, 5)]
