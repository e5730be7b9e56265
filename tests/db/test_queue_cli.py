"""`jobq pause`, `jobq resume`, `jobq queue limit` as a user runs them, and
what `jobq stats` and `jobq doctor` say about paused and limited queues."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import client
from sqla_jobq import queue_statements as qs
from sqla_jobq.doctor import diagnose
from tests.db.test_cli import Jobq, ok, refused_all
from tests.support import APP_DIR
from tests.support.processes import JOBQ


@pytest.fixture
def run(database_url: str, table: Table) -> Jobq:
    """`jobq ARGS...` on the test database and table (as test_cli's `jobq`)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("JOBQ_")}
    base.update(JOBQ_DATABASE_URL=database_url, JOBQ_TABLE=table.name)

    def jobq(*args: str, env: None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [JOBQ, *args], cwd=APP_DIR, env=base, capture_output=True, text=True, timeout=120
        )

    return jobq


def settings(engine: Engine, table: Table) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [(r.queue, r.paused, r.concurrency_limit) for r in conn.execute(qs.settings(table))]


def test_pause_resume_and_limit_change_the_queue_settings(
    run: Jobq, engine: Engine, table: Table
) -> None:
    assert ok(run("pause", "mail")) == "queue mail paused\n"
    assert ok(run("queue", "limit", "mail", "3")) == "queue mail: at most 3 running at once\n"
    assert settings(engine, table) == [("mail", True, 3)]
    assert ok(run("resume", "mail")) == "queue mail resumed\n"
    assert settings(engine, table) == [("mail", False, 3)]
    assert ok(run("queue", "limit", "mail", "none")) == "queue mail: no limit\n"
    assert settings(engine, table) == []
    ok(run("queue", "limit", "mail", "2"))
    assert ok(run("queue", "limit", "mail", "0")) == "queue mail: no limit\n"
    assert settings(engine, table) == []


def test_queue_commands_refuse_bad_input_in_one_line_and_change_nothing(
    run: Jobq, engine: Engine, table: Table
) -> None:
    cases = {
        "negative": (("queue", "limit", "mail", "-1"), "bad limit '-1'"),
        "not a number": (("queue", "limit", "mail", "two"), "bad limit 'two'"),
        "fraction": (("queue", "limit", "mail", "1.5"), "bad limit '1.5'"),
        "too big": (("queue", "limit", "mail", str(2**31)), "between 1 and 2,147,483,647"),
        "empty limit queue": (("queue", "limit", "", "2"), "queue name must not be empty"),
        "empty pause": (("pause", ""), "queue name must not be empty"),
        "empty resume": (("resume", ""), "queue name must not be empty"),
        "no table": (("pause", "mail", "--table", "nothere"), '"nothere" does not exist'),
    }
    refused_all(run, cases)
    assert settings(engine, table) == []


def test_stats_shows_paused_and_limited_queues(run: Jobq, engine: Engine, table: Table) -> None:
    with engine.begin() as conn:
        client.enqueue(conn, table, "t", {}, queue="mail")
        conn.execute(qs.pause(table, "mail"))
        conn.execute(qs.set_concurrency_limit(table, "mail", 2))
        conn.execute(qs.set_concurrency_limit(table, "sms", 5))
    lines = ok(run("stats")).splitlines()
    assert lines[1].split()[:3] == ["mail", "queued", "1"]
    assert lines[2:4] == [
        "queue mail: paused, at most 2 running (0 now)",
        "queue sms: at most 5 running (0 now)",
    ]
    (row,) = json.loads(ok(run("stats", "--json")))
    assert (row["queue"], row["paused"], row["concurrency_limit"]) == ("mail", True, 2)


def test_doctor_warns_of_a_paused_queue_only_once_jobs_arrive_after_the_pause(
    engine: Engine, table: Table
) -> None:
    with engine.begin() as conn:
        client.enqueue(conn, table, "t", {}, queue="mail")
    with engine.begin() as conn:
        conn.execute(qs.pause(table, "mail"))
        conn.execute(qs.set_concurrency_limit(table, "sms", 4))

    def found() -> dict[str, Any]:
        report = diagnose(engine, table)
        checks = ("paused_queue", "concurrency_limit")
        return {f.check: f for f in report.findings if f.check in checks}

    quiet = found()
    assert (quiet["paused_queue"].level, quiet["paused_queue"].subject) == ("ok", "queue mail")
    assert quiet["concurrency_limit"].data == {
        "queue": "sms",
        "concurrency_limit": 4,
        "running": 0,
    }
    with engine.begin() as conn:
        client.enqueue(conn, table, "t", {}, queue="mail")
    growing = found()["paused_queue"]
    assert growing.level == "warn" and growing.data["queued_since"] == 1
    assert "jobq resume mail" in growing.advice
