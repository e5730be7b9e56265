"""The worker registry's statements and `Presence`, on a real queue table.

The worker's own use of them (register at start, beat after claims, leave at
shutdown) is the worker's to test; here: what each statement does to the
rows, when a worker counts as stale, and that a beat too soon sends nothing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import presence
from sqla_jobq.db import compiled, conninfo
from sqla_jobq.presence import BEAT_EVERY, FORGET_AFTER, STALE_MARGIN, Presence, WorkerInfo

Raw = psycopg.Connection[Any]
Conn = psycopg.AsyncConnection[Any]


def info(name: str = "w1", beat_interval: float = 20.0) -> WorkerInfo:
    return WorkerInfo(
        id=f"host-a:1:{name}",
        host="host-a",
        pid=1,
        queues=("default", "mail"),
        concurrency=4,
        beat_interval=timedelta(seconds=beat_interval),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(database_url: str, step: Callable[[Conn], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(
            conninfo(database_url), autocommit=True
        ) as conn:
            return await step(conn)

    return asyncio.run(main())


def workers(engine: Engine, table: Table) -> dict[str, Any]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(presence.listing(table))}


def silence(raw: Raw, table: Table, worker_id: str, seconds: float) -> None:
    """Pretend the worker's last beat was `seconds` ago."""
    raw.execute(
        f"UPDATE \"{table.name}_workers\" SET heartbeat_at = now() - make_interval(secs => %s) "
        "WHERE id = %s",
        (seconds, worker_id),
    )


def test_register_writes_the_row_and_the_worker_is_live(
    database_url: str, engine: Engine, table: Table
) -> None:
    me = info()
    assert run(database_url, Presence(table, me).register)
    row = workers(engine, table)[me.id]
    assert (row.host, row.pid, row.queues, row.concurrency) == ("host-a", 1, ["default", "mail"], 4)
    assert row.jobs_done == 0
    assert row.beat_interval == timedelta(seconds=20)
    assert row.stale is False
    assert row.started_at == row.heartbeat_at


def test_here_promises_its_poll_interval_or_a_third_of_its_longest_lease_plus_throttle() -> None:
    idle = WorkerInfo.here(["default"], 8, poll_interval=60, longest_lease=timedelta(minutes=1))
    busy = WorkerInfo.here(["default"], 8, poll_interval=5, longest_lease=timedelta(minutes=30))
    assert idle.beat_interval == timedelta(seconds=60) + BEAT_EVERY
    assert busy.beat_interval == timedelta(minutes=10) + BEAT_EVERY
    assert idle.id != busy.id


def test_beat_refreshes_the_heartbeat_and_jobs_done_once_the_throttle_allows(
    database_url: str, raw: Raw, engine: Engine, table: Table
) -> None:
    me, clock = info(), Clock()
    worker = Presence(table, me, clock=clock)

    async def steps(conn: Conn) -> tuple[bool, bool]:
        await worker.register(conn)
        silence(raw, table, me.id, 5)
        clock.now += BEAT_EVERY.total_seconds() - 1
        too_soon = await worker.beat(conn, 7)
        after_soon = workers(engine, table)[me.id]
        clock.now += 1
        sent = await worker.beat(conn, 9)
        assert after_soon.jobs_done == 0 and after_soon.heartbeat_age >= 5
        return too_soon, sent

    assert run(database_url, steps) == (False, True)
    row = workers(engine, table)[me.id]
    assert row.jobs_done == 9
    assert row.heartbeat_age < 5


def test_a_beat_too_soon_sends_no_query_at_all(database_url: str, raw: Raw, table: Table) -> None:
    worker = Presence(table, info(), clock=Clock())

    async def steps(conn: Conn) -> tuple[Any, Any]:
        await worker.register(conn)
        pid = conn.info.backend_pid
        state = "SELECT state_change FROM pg_stat_activity WHERE pid = %s"
        before = raw.execute(state, (pid,)).fetchone()
        await worker.beat(conn, 1)
        return before, raw.execute(state, (pid,)).fetchone()

    before, after = run(database_url, steps)
    assert before is not None and after == before


def test_beat_brings_back_a_row_that_was_deleted(
    database_url: str, engine: Engine, table: Table
) -> None:
    me = info()

    async def steps(conn: Conn) -> None:
        await Presence(table, me).register(conn)
        await conn.execute(*compiled(presence.leave(table, me.id)))
        await Presence(table, me).beat(conn, 3)

    run(database_url, steps)
    assert workers(engine, table)[me.id].jobs_done == 3


def test_leave_deletes_only_the_leaving_workers_row(
    database_url: str, engine: Engine, table: Table
) -> None:
    staying, leaving = Presence(table, info("a")), Presence(table, info("b"))

    async def steps(conn: Conn) -> bool:
        await staying.register(conn)
        await leaving.register(conn)
        return await leaving.leave(conn)

    assert run(database_url, steps)
    assert list(workers(engine, table)) == [staying.info.id]


@pytest.mark.parametrize(("silent_for", "stale"), [(-1, False), (+1, True)])
def test_a_worker_is_stale_once_silent_for_twice_its_beat_interval_plus_the_margin(
    database_url: str, raw: Raw, engine: Engine, table: Table, silent_for: float, stale: bool
) -> None:
    me = info(beat_interval=20)
    run(database_url, Presence(table, me).register)
    limit = 2 * 20 + STALE_MARGIN.total_seconds()
    silence(raw, table, me.id, limit + silent_for)
    assert workers(engine, table)[me.id].stale is stale


def test_listing_puts_live_workers_before_stale_ones(
    database_url: str, raw: Raw, engine: Engine, table: Table
) -> None:
    dead, live = info("a"), info("b")

    async def steps(conn: Conn) -> None:
        await Presence(table, dead).register(conn)
        await Presence(table, live).register(conn)

    run(database_url, steps)
    silence(raw, table, dead.id, 3600)
    assert [(r.id, r.stale) for r in workers(engine, table).values()] == [
        (live.id, False),
        (dead.id, True),
    ]


def test_register_forgets_workers_dead_for_a_day_and_keeps_merely_stale_ones(
    database_url: str, raw: Raw, engine: Engine, table: Table
) -> None:
    long_dead, stale, newcomer = info("a"), info("b"), info("c")
    limit = 2 * 20 + STALE_MARGIN.total_seconds()
    run(database_url, Presence(table, long_dead).register)
    run(database_url, Presence(table, stale).register)
    silence(raw, table, long_dead.id, limit + FORGET_AFTER.total_seconds() + 1)
    silence(raw, table, stale.id, limit + FORGET_AFTER.total_seconds() - 60)
    run(database_url, Presence(table, newcomer).register)
    assert sorted(workers(engine, table)) == [stale.id, newcomer.id]


def test_a_failing_registry_write_is_logged_and_never_raised(
    database_url: str, raw: Raw, table: Table, caplog: pytest.LogCaptureFixture
) -> None:
    raw.execute(f'DROP TABLE "{table.name}_workers"')
    try:
        assert run(database_url, Presence(table, info()).register) is False
    finally:
        raw.execute(f'CREATE TABLE "{table.name}_workers" (id text PRIMARY KEY)')
    assert "worker registry register failed" in caplog.text


def test_presence_refuses_a_connection_outside_autocommit(database_url: str, table: Table) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(conninfo(database_url)) as conn:
            await Presence(table, info()).register(conn)

    with pytest.raises(ValueError, match="autocommit"):
        asyncio.run(main())


@pytest.mark.parametrize("flag", ["--workers", None])
def test_jobq_stats_lists_live_workers_first_and_flags_the_stale(
    database_url: str, raw: Raw, table: Table, flag: str | None
) -> None:
    live, dead = info("live"), info("dead")

    async def steps(conn: Conn) -> None:
        await Presence(table, live).register(conn)
        await Presence(table, dead).register(conn)

    run(database_url, steps)
    silence(raw, table, dead.id, 3600)
    jobq = str(Path(sys.executable).with_name("jobq"))
    base = [jobq, "stats", "--database-url", database_url, "--table", table.name]
    shown = subprocess.run([*base, *filter(None, [flag])], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    [live_line] = [line for line in lines if line.startswith(live.id)]
    [dead_line] = [line for line in lines if line.startswith(dead.id)]
    assert live_line.endswith("  live") and "STALE" in dead_line
    assert lines.index(live_line) < lines.index(dead_line)
    if flag:
        as_json = subprocess.run([*base, flag, "--json"], capture_output=True, text=True)
        found = {w["id"]: w for w in json.loads(as_json.stdout)}
        assert (found[live.id]["stale"], found[dead.id]["stale"]) == (False, True)
        assert found[dead.id]["queues"] == ["default", "mail"]
        assert found[dead.id]["heartbeat_age"] >= 3600
