"""Periodic tasks on real PostgreSQL: one job per fire time however many
workers race for it, catch-up after downtime, the next fire time, no query
while nothing is due, and `jobq cron`. Every `now` is injected."""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import subprocess
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from threading import Barrier
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Engine, Table

from sqla_jobq import Registry
from sqla_jobq.db import conninfo
from sqla_jobq.schedule_statements import fire
from sqla_jobq.scheduler import Scheduler, compiled
from tests.support.processes import JOBQ

T0 = datetime(2025, 1, 6, 10, 0, tzinfo=UTC)
Raw = psycopg.Connection[Any]


def jobs_of(raw: Raw, table: Table) -> list[dict[str, Any]]:
    with raw.cursor(row_factory=dict_row) as cur:
        return cur.execute(f'SELECT * FROM "{table.name}" ORDER BY scheduled_for, id').fetchall()


def schedule_row(raw: Raw, table: Table, name: str) -> dict[str, Any] | None:
    with raw.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            f'SELECT * FROM "{table.name}_schedules" WHERE name = %s', [name]
        ).fetchone()


def connect(database_url: str) -> Raw:
    return psycopg.connect(conninfo(database_url), autocommit=True)


def compile_fire(table: Table, at: datetime) -> tuple[str, dict[str, Any]]:
    """Fire time `at` of schedule `s`, as the scheduler sends it."""
    return compiled(fire(table, "s", at, task="s", payload={}))


def test_racing_workers_enqueue_each_fire_time_exactly_once(
    database_url: str, table: Table, raw: Raw
) -> None:
    registry = Registry(table)

    @registry.task(name="minutely", cron="* * * * *")
    def minutely() -> None: ...

    @registry.task(name="sixty", every=timedelta(seconds=60), payload={"n": 1})
    def sixty(n: int) -> None: ...

    workers, rounds = 4, 20
    barrier = Barrier(workers)
    start = T0 + timedelta(seconds=1)

    def worker() -> None:
        scheduler = Scheduler(registry)  # one per worker process, as in production
        with connect(database_url) as conn:
            for r in range(rounds + 1):  # round 0: every worker creates the rows
                barrier.wait()
                scheduler.tick_sync(conn, now=start + timedelta(minutes=r))

    with ThreadPoolExecutor(workers) as pool:
        for done in [pool.submit(worker) for _ in range(workers)]:
            done.result()

    jobs = jobs_of(raw, table)
    fired = [(j["task"], j["scheduled_for"]) for j in jobs]
    assert len(fired) == len(set(fired)) == 2 * rounds
    assert {f for t, f in fired if t == "minutely"} == {
        T0 + timedelta(minutes=r) for r in range(1, rounds + 1)
    }
    assert {f for t, f in fired if t == "sixty"} == {
        start + timedelta(minutes=r) for r in range(1, rounds + 1)
    }
    assert all(j["run_at"] == j["scheduled_for"] for j in jobs)
    assert {json.dumps(j["payload"]) for j in jobs if j["task"] == "sixty"} == {'{"n": 1}'}
    last = schedule_row(raw, table, "sixty")
    assert last is not None
    assert last["last_fire"] == start + timedelta(minutes=rounds)
    assert last["last_job_id"] == max(j["id"] for j in jobs if j["task"] == "sixty")


def test_workers_firing_late_after_the_job_finished_enqueue_nothing_more(
    database_url: str, table: Table, raw: Raw
) -> None:
    """The unique key on active jobs no longer covers a finished job: only
    the schedules row stops a worker whose memory lags behind."""
    workers, rounds = 4, 20
    barrier = Barrier(workers)

    def worker(index: int) -> None:
        with connect(database_url) as conn:
            for r in range(1, rounds + 1):
                fresh, older = (
                    compile_fire(table, T0 + timedelta(minutes=r)),
                    compile_fire(table, T0 + timedelta(minutes=r - 1)),
                )
                barrier.wait()
                conn.execute(*fresh)  # all at once
                barrier.wait()
                if index == 0:
                    conn.execute(f"UPDATE \"{table.name}\" SET status = 'done'".encode())
                barrier.wait()
                conn.execute(*fresh)  # late, the job done
                conn.execute(*older)

    with ThreadPoolExecutor(workers) as pool:
        for done in [pool.submit(worker, i) for i in range(workers)]:
            done.result()

    fired = [j["scheduled_for"] for j in jobs_of(raw, table)]
    assert fired == [T0 + timedelta(minutes=r) for r in range(1, rounds + 1)]


def test_a_fire_time_whose_job_has_finished_and_gone_is_never_enqueued_again(
    raw: Raw, table: Table
) -> None:
    def fire_at(at: datetime) -> list[tuple[Any, ...]]:
        sql, params = compile_fire(table, at)
        return raw.execute(sql, params).fetchall()

    first = fire_at(T0)
    assert len(first) == 1
    raw.execute(f'DELETE FROM "{table.name}"')  # done, then pruned

    assert fire_at(T0) == []
    assert fire_at(T0 - timedelta(minutes=1)) == []
    assert jobs_of(raw, table) == []
    assert fire_at(T0 + timedelta(minutes=1)) != []


def test_a_deleted_schedule_row_does_not_duplicate_a_job_still_queued(
    raw: Raw, table: Table
) -> None:
    sql, params = compile_fire(table, T0)
    (job_id,) = raw.execute(sql, params).fetchone() or (None,)
    raw.execute(f'DELETE FROM "{table.name}_schedules"')

    assert raw.execute(sql, params).fetchall() == []
    assert [j["id"] for j in jobs_of(raw, table)] == [job_id]
    row = schedule_row(raw, table, "s")
    assert row is not None and row["last_job_id"] == job_id


def test_catch_up_after_downtime_follows_each_schedules_window(
    database_url: str, table: Table, raw: Raw
) -> None:
    registry = Registry(table)

    @registry.task(name="default", cron="0 * * * *")
    def default() -> None: ...

    @registry.task(name="window", cron="0 * * * *", catch_up=timedelta(hours=3))
    def window() -> None: ...

    @registry.task(name="skip", cron="0 * * * *", catch_up=0)
    def skip() -> None: ...

    with connect(database_url) as conn:
        Scheduler(registry).tick_sync(conn, now=T0 + timedelta(minutes=30))
        assert jobs_of(raw, table) == []  # a new schedule starts from now: no back-fill
        # Every worker down for five hours; one comes back.
        back = T0 + timedelta(hours=5, minutes=40)
        Scheduler(registry).tick_sync(conn, now=back)

    fired: dict[str, list[datetime]] = {}
    for j in jobs_of(raw, table):
        fired.setdefault(j["task"], []).append(j["scheduled_for"])
    assert fired == {
        "default": [T0 + timedelta(hours=5)],
        "window": [T0 + timedelta(hours=h) for h in (3, 4, 5)],
    }


def test_tick_returns_the_next_fire_time_of_any_schedule(
    database_url: str, table: Table, raw: Raw
) -> None:
    registry = Registry(table)

    @registry.task(name="often", every=timedelta(seconds=45))
    async def often() -> None: ...

    @registry.task(name="five", cron="*/5 * * * *")
    def five() -> None: ...

    async def run() -> list[datetime | None]:
        scheduler = Scheduler(registry)
        conn = await psycopg.AsyncConnection.connect(conninfo(database_url), autocommit=True)
        async with conn:
            start = T0 + timedelta(seconds=10)
            return [
                await scheduler.tick(conn, now=start),
                await scheduler.tick(conn, now=start + timedelta(seconds=46)),
                await scheduler.tick(conn, now=T0 + timedelta(minutes=5)),
            ]

    assert asyncio.run(run()) == [
        T0 + timedelta(seconds=55),
        T0 + timedelta(seconds=100),
        T0 + timedelta(minutes=5, seconds=25),
    ]
    assert [(j["task"], j["scheduled_for"]) for j in jobs_of(raw, table)] == [
        ("often", T0 + timedelta(seconds=55)),
        # The fires in between were missed: only the last is caught up.
        ("often", T0 + timedelta(minutes=4, seconds=40)),
        ("five", T0 + timedelta(minutes=5)),
    ]


def test_a_fire_gives_up_on_a_held_schedule_row_alone_and_fires_once_it_is_free(
    database_url: str, table: Table, raw: Raw
) -> None:
    """Another session holds one schedule's row (an admin's open transaction).
    On a session whose own `lock_timeout` is 0 (behind PgBouncer, which drops
    the worker's), the fire still gives up after its own 200 ms: that
    schedule is retried a second later, the other one fires meanwhile, and
    the held one fires once its row is free."""
    registry = Registry(table)

    @registry.task(name="held", every=timedelta(seconds=60))
    def held() -> None: ...

    @registry.task(name="free", every=timedelta(seconds=60))
    def free() -> None: ...

    scheduler = Scheduler(registry)
    later = T0 + timedelta(seconds=61)
    with connect(database_url) as conn, psycopg.connect(conninfo(database_url)) as holder:
        conn.execute("SET lock_timeout = 0")
        conn.execute("SET statement_timeout = '10s'")  # a guard: the fire must not need it
        scheduler.tick_sync(conn, now=T0)  # creates both rows, fires nothing yet
        holder.execute(f"SELECT 1 FROM \"{table.name}_schedules\" WHERE name = 'held' FOR UPDATE")
        assert scheduler.tick_sync(conn, now=later) == later + timedelta(seconds=1)
        assert [j["task"] for j in jobs_of(raw, table)] == ["free"]
        holder.rollback()
        assert scheduler.tick_sync(conn, now=later + timedelta(seconds=1)) == T0 + timedelta(
            seconds=120
        )
    assert sorted(j["task"] for j in jobs_of(raw, table)) == ["free", "held"]


def test_a_tick_with_nothing_due_sends_no_query(database_url: str, table: Table, raw: Raw) -> None:
    registry = Registry(table)

    @registry.task(name="hourly", cron="0 * * * *")
    def hourly() -> None: ...

    def last_query(conn: Raw) -> str:
        row = raw.execute(
            "SELECT query FROM pg_stat_activity WHERE pid = %s", [conn.info.backend_pid]
        ).fetchone()
        assert row is not None
        return str(row[0])

    scheduler = Scheduler(registry)
    with connect(database_url) as conn:
        assert scheduler.tick_sync(conn, now=T0 + timedelta(minutes=1)) == T0 + timedelta(hours=1)
        marker = f"SELECT 'nothing since {uuid.uuid4().hex}'"
        conn.execute(marker.encode())
        for minutes in (2, 30, 59):
            assert scheduler.tick_sync(conn, now=T0 + timedelta(minutes=minutes)) == T0 + timedelta(
                hours=1
            )
        assert last_query(conn) == marker

        scheduler.tick_sync(conn, now=T0 + timedelta(hours=1))
        assert last_query(conn) != marker
    assert len(jobs_of(raw, table)) == 1


def test_a_periodic_task_can_still_be_enqueued_by_hand(
    engine: Engine, table: Table, raw: Raw
) -> None:
    registry = Registry(table)

    @registry.task(name="report", cron="0 9 * * *", payload={"kind": "daily"})
    def report(kind: str) -> None: ...

    with engine.begin() as conn:
        report.enqueue(conn, kind="adhoc")
    (job,) = jobs_of(raw, table)
    assert job["payload"] == {"kind": "adhoc"}
    assert job["scheduled_for"] is None


def test_tick_refuses_a_connection_outside_autocommit(database_url: str, table: Table) -> None:
    registry = Registry(table)

    @registry.task(name="hourly", cron="0 * * * *")
    def hourly() -> None: ...

    with (
        psycopg.connect(conninfo(database_url)) as conn,
        pytest.raises(ValueError, match="autocommit"),
    ):
        Scheduler(registry).tick_sync(conn, now=T0)


# --- jobq cron ---------------------------------------------------------------------

APP = """
from datetime import timedelta

from sqlalchemy import MetaData

from sqla_jobq import Registry, jobs_table

registry = Registry(jobs_table(MetaData(), {table!r}))
empty = Registry(jobs_table(MetaData(), {table!r}))


@registry.task(name="digest", cron="0 9 * * *", timezone="Europe/Paris", payload={{"kind": "day"}})
def digest(kind: str) -> None: ...


@registry.task(name="ping", every=timedelta(seconds=30))
def ping() -> None: ...
"""

BROKEN = """
from sqla_jobq import Registry

registry = Registry()


@registry.task(name="typo", cron="0 25 * * *")
def typo() -> None: ...
"""


@pytest.fixture
def cron_app(tmp_path: Path, table: Table) -> Path:
    (tmp_path / "cronapp.py").write_text(APP.format(table=table.name))
    (tmp_path / "brokenapp.py").write_text(textwrap.dedent(BROKEN))
    return tmp_path


def jobq_cron(cwd: Path, *args: str, url: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBQ_")}
    if url is not None:
        env["JOBQ_DATABASE_URL"] = url
    return subprocess.run(
        [JOBQ, "cron", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def test_jobq_cron_lists_schedules_last_and_next_fires_and_the_last_job(
    cron_app: Path, database_url: str, table: Table
) -> None:
    before = jobq_cron(cron_app, "cronapp:registry", "--json", url=database_url)
    assert before.returncode == 0, before.stderr
    unseen = {s["name"]: s for s in json.loads(before.stdout)}
    assert unseen["ping"]["last_fire"] is None
    assert unseen["ping"]["enqueued"] is False

    registry = runpy.run_path(str(cron_app / "cronapp.py"))["registry"]
    started = datetime.now(UTC)
    scheduler = Scheduler(registry)
    with connect(database_url) as conn:
        scheduler.tick_sync(conn, now=started)
        scheduler.tick_sync(conn, now=started + timedelta(seconds=31))

    listed = jobq_cron(cron_app, "cronapp:registry", "--json", url=database_url)
    assert listed.returncode == 0, listed.stderr
    by_name = {s["name"]: s for s in json.loads(listed.stdout)}
    ping, digest = by_name["ping"], by_name["digest"]
    assert ping["every"] == 30.0 and ping["cron"] is None
    assert datetime.fromisoformat(ping["last_fire"]) == started + timedelta(seconds=30)
    assert datetime.fromisoformat(ping["next_fire"]) == started + timedelta(seconds=60)
    assert ping["enqueued"] is True and ping["last_job_status"] == "queued"
    assert digest["cron"] == "0 9 * * *" and digest["timezone"] == "Europe/Paris"
    assert digest["last_fire"] is None and digest["enqueued"] is False
    assert datetime.fromisoformat(digest["next_fire"]).astimezone(UTC).minute == 0

    text = jobq_cron(cron_app, "cronapp:registry", url=database_url)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split()[:2] == ["task", "schedule"]
    assert any("ping" in line and "every 30s" in line and "queued" in line for line in lines)
    assert any("digest" in line and "no fire yet" in line for line in lines)


def test_jobq_cron_says_so_when_the_registry_has_no_periodic_tasks(
    cron_app: Path, database_url: str
) -> None:
    done = jobq_cron(cron_app, "cronapp:empty", url=database_url)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == "cronapp:empty declares no periodic tasks\n"


@pytest.mark.parametrize(
    ("args", "url", "message"),
    [
        (["brokenapp:registry"], "db", "periodic task 'typo': malformed cron string '0 25 * * *'"),
        (["nosuchapp:registry"], "db", "cannot import module 'nosuchapp'"),
        (["cronapp"], "db", "expected MODULE:ATTR"),
        (["cronapp:registry"], None, "no database"),
    ],
)
def test_jobq_cron_refuses_bad_input_with_one_line(
    cron_app: Path, database_url: str, args: list[str], url: str | None, message: str
) -> None:
    done = jobq_cron(cron_app, *args, url=database_url if url else None)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("jobq: error: ") and done.stderr.count("\n") == 1
    assert message in done.stderr
