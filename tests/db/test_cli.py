"""`jobq` as a user runs it: a subprocess per command, on a queue table of its own.

Happy paths check what the command printed and what it did to the table;
error paths check the contract: one line on stderr, exit status 2, no
traceback, and the table exactly as it was.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Engine, MetaData, Table, text

from sqla_jobq import client, statements
from sqla_jobq.db import conninfo
from sqla_jobq.job import NewJob
from sqla_jobq.migrations import check_schema
from sqla_jobq.process import SWITCH_INTERVAL
from sqla_jobq.schema import Names, jobs_table
from tests.support import APP_DIR
from tests.support.processes import JOBQ
from tests.support.queues import drop_queue_table
from tests.support.rows import job_now as job
from tests.support.workerapp import SIDE_DDL

Raw = psycopg.Connection[Any]
Jobq = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def jobq(database_url: str, table: Table) -> Jobq:
    """Run `jobq ARGS...` from tests/support/ with the test database and table in the env."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("JOBQ_")}
    base.update(JOBQ_DATABASE_URL=database_url, JOBQ_TABLE=table.name, JOBQ_TEST_TABLE=table.name)

    def run(
        *args: str, env: dict[str, str | None] | None = None
    ) -> subprocess.CompletedProcess[str]:
        full = dict(base)
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        return subprocess.run(
            [JOBQ, *args], cwd=APP_DIR, env=full, capture_output=True, text=True, timeout=120
        )

    return run


def rows(raw: Raw, table: Table) -> list[dict[str, Any]]:
    with raw.cursor(row_factory=dict_row) as cur:
        return cur.execute(f'SELECT * FROM "{table.name}" ORDER BY id').fetchall()


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def refused(result: subprocess.CompletedProcess[str], *fragments: str, code: int = 2) -> str:
    """The error contract: status 2, one `jobq: error:` line on stderr, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jobq: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def refused_all(jobq: Jobq, cases: dict[str, tuple[tuple[str, ...], str]], **env: Any) -> None:
    """Run every case's command at once (each is a separate, mostly CPU-bound
    process start) and check each against the error contract."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = {
            label: pool.submit(jobq, *args, env=env or None) for label, (args, _) in cases.items()
        }
    failures = []
    for label, (_, fragment) in cases.items():
        try:
            refused(results[label].result(), fragment)
        except AssertionError as exc:
            failures.append(f"{label}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def seeded(engine: Engine, table: Table, raw: Raw) -> Iterator[list[dict[str, Any]]]:
    """A table with a job in it; after the test it must be exactly as it was."""
    with engine.begin() as conn:
        client.enqueue(conn, table, "record", {"n": 1})
    before = rows(raw, table)
    yield before
    assert rows(raw, table) == before, "a refused command wrote to the table"


# --------------------------------------------------------------------------- enqueue


def test_enqueue_prints_the_id_and_stores_every_option(jobq: Jobq, raw: Raw, table: Table) -> None:
    out = ok(
        jobq(
            "enqueue",
            "send_mail",
            "--payload",
            '{"to": "a@example.com", "n": [1, 2]}',
            "--queue",
            "mail",
            "--delay",
            "60",
            "--priority",
            "7",
        )
    )
    row = job(raw, table, int(out))
    assert out == f"{row['id']}\n"
    assert (row["task"], row["payload"], row["queue"], row["priority"], row["status"]) == (
        "send_mail",
        {"to": "a@example.com", "n": [1, 2]},
        "mail",
        7,
        "queued",
    )
    delay = (row["run_at"] - row["created_at"]).total_seconds()
    assert 59 <= delay <= 61

    default = job(raw, table, int(ok(jobq("enqueue", "noop"))))
    assert (default["payload"], default["queue"], default["priority"]) == ({}, "default", 0)
    assert default["run_at"] <= default["db_now"]


def test_enqueue_with_a_duplicate_unique_key_prints_the_existing_id(
    jobq: Jobq, raw: Raw, table: Table
) -> None:
    first = ok(jobq("enqueue", "sync", "--payload", '{"user": 1}', "--unique-key", "user-1"))
    again = ok(jobq("enqueue", "sync", "--payload", '{"user": 2}', "--unique-key", "user-1"))
    assert first == again
    assert [r["payload"] for r in rows(raw, table)] == [{"user": 1}]


def test_enqueue_with_app_checks_the_payload_against_the_signature(
    jobq: Jobq, raw: Raw, table: Table
) -> None:
    app = ("--app", "workerapp:registry")
    job_id = int(ok(jobq("enqueue", "typed", "--payload", '{"a": 1, "b": "x"}', *app)))
    crash = job(raw, table, int(ok(jobq("enqueue", "crash", *app))))
    assert crash["max_attempts"] == 3  # the task's own settings
    other = job(raw, table, int(ok(jobq("enqueue", "whoami_sync", "--payload", '{"x": 1}', *app))))
    assert other["queue"] == "other"
    before = rows(raw, table)

    refused_all(
        jobq,
        {
            "missing argument": (
                ("enqueue", "typed", "--payload", '{"a": 1}', *app),
                "payload does not match typed(a: 'int', b: 'str') -> 'None': "
                "missing a required argument: 'b'",
            ),
            "extra argument": (
                ("enqueue", "typed", "--payload", '{"a": 1, "b": "x", "c": 2}', *app),
                "unexpected keyword argument 'c'",
            ),
            "unknown task": (
                ("enqueue", "nosuch", *app),
                "unknown task 'nosuch' (registered: boom, crash, heartbeat",
            ),
        },
    )
    assert rows(raw, table) == before
    assert job(raw, table, job_id)["payload"] == {"a": 1, "b": "x"}


def test_enqueue_refuses_bad_input_in_one_line_before_writing(
    jobq: Jobq, seeded: list[dict[str, Any]]
) -> None:
    cases = {
        "malformed JSON": (("--payload", "{"), "--payload is not valid JSON"),
        "NaN": (("--payload", "NaN"), "NaN is not JSON"),
        "Infinity": (("--payload", '{"a": Infinity}'), "Infinity is not JSON"),
        "overflowing number": (("--payload", '{"a": 1e999}'), "not JSON-serialisable"),
        "not an object": (("--payload", "[1, 2]"), "must be a JSON object"),
        "negative delay": (("--delay", "-1"), "--delay must not be negative"),
        "no such module": (("--app", "nosuchmodule:x"), "cannot import module 'nosuchmodule'"),
        "not a Registry": (("--app", "json:dumps"), "json:dumps is function, not a sqla_jobq"),
    }
    refused_all(jobq, {k: (("enqueue", "record", *a), f) for k, (a, f) in cases.items()})


# --------------------------------------------------------- connection and schema errors


COMMANDS = {
    "enqueue": ("enqueue", "record"),
    "stats": ("stats",),
    "reap": ("reap",),
    "prune": ("prune",),
    "retry": ("retry", "1"),
    "cancel": ("cancel", "1"),
    "worker": ("worker", "workerapp:registry"),
}


def test_every_command_refuses_an_unreachable_database_in_one_line(
    jobq: Jobq, seeded: list[dict[str, Any]]
) -> None:
    url = ("--database-url", "postgresql://postgres@127.0.0.1:1/postgres")
    cases = {
        name: ((*cmd, *url), "cannot connect to the database") for name, cmd in COMMANDS.items()
    }
    cases["migrate"] = (("migrate", "--table", "x", *url), "cannot connect to the database")
    refused_all(jobq, cases)


def test_malformed_database_urls_are_refused_in_one_line(
    jobq: Jobq, seeded: list[dict[str, Any]]
) -> None:
    mysql = ("--database-url", "mysql://root@localhost/db")
    words = ("--database-url", "not a url")
    scheme, not_url = "unsupported database URL scheme 'mysql'", "not a database URL: 'not a url'"
    cases = {
        "enqueue mysql": ((*COMMANDS["enqueue"], *mysql), scheme),
        "stats words": ((*COMMANDS["stats"], *words), not_url),
        "worker mysql": ((*COMMANDS["worker"], *mysql), scheme),
        "migrate words": (("migrate", *words), not_url),
    }
    refused_all(jobq, cases)


def test_commands_refuse_a_missing_queue_table(jobq: Jobq, seeded: list[dict[str, Any]]) -> None:
    cases = {
        name: ((*cmd, "--table", "nothere"), '"nothere" does not exist in this database')
        for name, cmd in COMMANDS.items()
        if name in ("enqueue", "prune", "cancel")
    }
    # The worker's table is its Registry's (workerapp reads JOBQ_TEST_TABLE).
    refused_all(jobq, cases)
    refused(
        jobq(*COMMANDS["worker"], env={"JOBQ_TEST_TABLE": "nothere"}),
        '"nothere" does not exist in this database',
    )


def test_commands_refuse_an_outdated_schema(
    jobq: Jobq, raw: Raw, table: Table, seeded: list[dict[str, Any]]
) -> None:
    raw.execute(f"COMMENT ON TABLE \"{table.name}\" IS 'sqla_jobq schema version 0'")
    cases = {
        name: (cmd, "is at schema version 0")
        for name, cmd in COMMANDS.items()
        if name in ("enqueue", "stats", "retry", "worker")
    }
    refused_all(jobq, cases)


def test_commands_need_a_database_url(jobq: Jobq) -> None:
    cases = {name: (COMMANDS[name], "no database") for name in ("stats", "worker")}
    cases["migrate"] = (("migrate", "--table", "x"), "no database")
    refused_all(jobq, cases, JOBQ_DATABASE_URL=None)


# --------------------------------------------------------------------------- stats, reap, prune


def test_stats_counts_per_queue_and_status_as_text_and_json(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        for queue in ("default", "default", "mail"):
            client.enqueue(conn, table, "t", {}, queue=queue)
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'running', attempts = 1, "
        "locked_until = now() - interval '1 minute' WHERE queue = 'mail'"
    )
    as_json = json.loads(ok(jobq("stats", "--json")))
    assert [(r["queue"], r["status"], r["count"], r["expired_leases"]) for r in as_json] == [
        ("default", "queued", 2, 0),
        ("mail", "running", 1, 1),
    ]
    assert as_json[0]["oldest_ready_age"] >= 0 and as_json[1]["oldest_ready_age"] is None

    lines = ok(jobq("stats")).splitlines()
    assert lines[0].split()[:3] == ["queue", "status", "count"]
    assert lines[1].split()[:3] == ["default", "queued", "2"]
    assert lines[2].split() == ["mail", "running", "1", "1"]


def test_stats_shows_the_archive_by_estimate_and_counts_only_the_jobs_table(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    """Archived jobs are history: the counts per status are the jobs table's
    (what is queued, running, failed, done lately); the archive gets one line
    from the planner's statistics, never a count(*) of a table that only grows."""
    with engine.begin() as conn:
        ids = client.enqueue_many(conn, table, [NewJob("t") for _ in range(4)])
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'done', finished_at = now() - interval '1 hour' "
        "WHERE id = ANY(%s)",
        (ids[:3],),
    )
    lines = ok(jobq("stats")).splitlines()
    assert f"archive {table.name}_archive: not analyzed yet" in "\n".join(lines)
    with engine.begin() as conn:
        conn.execute(statements.archive(table, older_than=timedelta(minutes=1)))
    raw.execute(f'ANALYZE "{table.name}_archive"')
    as_json = json.loads(ok(jobq("stats", "--json")))
    assert [(r["status"], r["count"]) for r in as_json] == [("queued", 1)]
    text_lines = ok(jobq("stats")).splitlines()
    assert any(
        line.startswith(f"archive {table.name}_archive: about 3 jobs") for line in text_lines
    ), text_lines


def test_stats_of_an_empty_table(jobq: Jobq) -> None:
    assert json.loads(ok(jobq("stats", "--json"))) == []


def test_reap_returns_expired_leases_and_fails_them_at_max_attempts(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        ids = [client.enqueue(conn, table, "t", {"n": n}) for n in range(3)]
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'running', attempts = 1, "
        "locked_until = now() - interval '1 second' WHERE id = ANY(%s)",
        (ids[:2],),
    )
    raw.execute(f'UPDATE "{table.name}" SET max_attempts = 1 WHERE id = %s', (ids[1],))
    assert ok(jobq("reap")) == "reaped 2 jobs: 1 queued again, 1 failed\n"
    statuses = [(job(raw, table, i)["status"], job(raw, table, i)["last_error"]) for i in ids]
    assert statuses == [("queued", "lease expired"), ("failed", "lease expired"), ("queued", None)]
    assert ok(jobq("reap")) == "reaped 0 jobs: 0 queued again, 0 failed\n"


def test_prune_deletes_only_finished_jobs_older_than_the_age(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        ids = [client.enqueue(conn, table, "t", {"n": n}) for n in range(5)]
    old, recent = "now() - interval '8 days'", "now() - interval '1 day'"
    for job_id, status, finished in zip(
        ids,
        ("done", "failed", "done", "queued", "done"),
        (old, old, recent, "NULL", old),
        strict=True,
    ):
        raw.execute(
            f'UPDATE "{table.name}" SET status = %s, finished_at = {finished}, '
            "created_at = now() - interval '30 days' WHERE id = %s",
            (status, job_id),
        )
    assert ok(jobq("prune", "--older-than", "7d", "--status", "done")) == "pruned 2 jobs\n"
    assert ok(jobq("prune", "--older-than", "7d")) == "pruned 1 jobs\n"
    assert [r["id"] for r in rows(raw, table)] == [ids[2], ids[3]]
    refused(jobq("prune", "--older-than", "soon"), "bad duration 'soon'")
    refused(jobq("prune", "--status", "queued"), "only finished jobs")


# --------------------------------------------------------------------------- retry, cancel


def test_retry_sends_a_failed_job_back_with_attempts_kept_and_one_more_allowed(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        job_id = client.enqueue(conn, table, "t", {}, max_attempts=3)
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'failed', attempts = 3, last_error = 'boom', "
        "finished_at = now(), run_at = now() - interval '1 hour' WHERE id = %s",
        (job_id,),
    )
    assert ok(jobq("retry", str(job_id))) == f"{job_id}\n"
    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"], row["max_attempts"], row["finished_at"]) == (
        "queued",
        3,
        4,
        None,
    )
    assert row["run_at"] <= row["db_now"]
    before = rows(raw, table)
    refused(jobq("retry", str(job_id)), f"no failed or cancelled job {job_id}", code=1)
    refused(jobq("retry", "999999"), "no failed or cancelled job 999999", code=1)
    assert rows(raw, table) == before


def test_retry_of_a_job_whose_unique_key_an_active_job_holds_names_it_and_changes_nothing(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        failed_id = client.enqueue(conn, table, "t", {}, unique_key="report-7")
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'failed', finished_at = now() WHERE id = %s",
        (failed_id,),
    )
    with engine.begin() as conn:
        holder_id = client.enqueue(conn, table, "t", {}, unique_key="report-7")
    before = rows(raw, table)
    refused(jobq("retry", str(failed_id)), f"job {failed_id} not retried", f"job {holder_id}")
    assert rows(raw, table) == before


def test_cancel_moves_a_queued_or_running_job_to_cancelled(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        job_id = client.enqueue(conn, table, "t", {})
        running_id = client.enqueue(conn, table, "t", {}, priority=-1)
    assert ok(jobq("cancel", str(job_id))) == f"{job_id} cancelled\n"
    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"]) == ("cancelled", 0)
    assert row["finished_at"] is not None and row["cancel_requested_at"] is not None
    with engine.begin() as conn:
        assert conn.execute(statements.claim(table)).one().id == running_id
    out = ok(jobq("cancel", str(running_id)))
    assert out == f"{running_id} cancelled (its worker stops it at its next heartbeat)\n"
    assert job(raw, table, running_id)["status"] == "cancelled"
    before = rows(raw, table)
    refused(jobq("cancel", str(job_id)), f"no queued or running job {job_id}", code=1)
    assert rows(raw, table) == before


def test_retry_and_cancel_refuse_a_non_numeric_id(jobq: Jobq) -> None:
    for command in ("retry", "cancel"):
        result = jobq(command, "abc")
        assert result.returncode == 2 and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- migrate


@pytest.fixture
def fresh_name(database_url: str) -> Iterator[str]:
    name = f"jobs_cli_{uuid.uuid4().hex[:8]}"
    yield name
    with psycopg.connect(conninfo(database_url)) as conn:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{name}"',)).fetchone()
    if exists and exists[0]:
        drop_queue_table(database_url, Names(name, None))


def test_migrate_creates_a_named_table_and_is_idempotent(
    jobq: Jobq, engine: Engine, fresh_name: str
) -> None:
    first = ok(jobq("migrate", "--table", fresh_name))
    assert first.startswith("schema version ")
    assert ok(jobq("migrate", "--table", fresh_name)) == first
    target = jobs_table(MetaData(), fresh_name)
    with engine.begin() as conn:
        check_schema(conn, target)
        job_id = client.enqueue(conn, target, "t", {})
        assert (
            conn.execute(
                text(f'SELECT status FROM "{fresh_name}" WHERE id = :i'), {"i": job_id}
            ).scalar()
            == "queued"
        )
    assert json.loads(ok(jobq("stats", "--json", "--table", fresh_name)))[0]["count"] == 1


def test_migrate_refuses_a_bad_table_name(jobq: Jobq) -> None:
    refused(jobq("migrate", "--table", "x" * 60), "invalid queue table name")
    refused(jobq("migrate", "--table", "schema."), "bad --table")


# --------------------------------------------------------------------------- worker options


def test_worker_refuses_bad_options_in_one_line(jobq: Jobq, seeded: list[dict[str, Any]]) -> None:
    app = "workerapp:registry"
    cases = {
        "concurrency 0": ((app, "--concurrency", "0"), "concurrency must be at least 1, got 0"),
        "negative poll": ((app, "--poll-interval", "-1"), "poll-interval must not be negative"),
        "log level": ((app, "--log-level", "LOUD"), "unknown --log-level 'LOUD'"),
        "archive-after": ((app, "--archive-after", "banana"), "bad --archive-after 'banana'"),
        "negative archive-after": ((app, "--archive-after", "-5s"), "bad --archive-after '-5s'"),
        "negative reindex": (
            (app, "--reindex-sparse-mb", "-1"),
            "--reindex-sparse-mb must not be negative, got -1",
        ),
        "no such module": (("nosuchmodule:x",), "cannot import module 'nosuchmodule'"),
        "not a Registry": (("json:dumps",), "json:dumps is function, not a sqla_jobq Registry"),
    }
    refused_all(jobq, {k: (("worker", *a), f) for k, (a, f) in cases.items()})
    refused(
        jobq("worker", app, env={"JOBQ_ARCHIVE_AFTER": "soon"}),
        "bad --archive-after 'soon'",
        "or never",
    )


def test_a_burst_worker_archives_what_earlier_runs_finished_unless_told_never(
    jobq: Jobq, raw: Raw, table: Table
) -> None:
    """A burst run from cron lasts seconds: its pass at start, run to the end
    before it exits (every batch of it), moves the done jobs earlier runs left
    (all of them at the default, those that old with a duration);
    `--archive-after never` (or JOBQ_ARCHIVE_AFTER) keeps them."""
    archive = f"{table.name}_archive"

    def history(count: int) -> None:
        raw.execute(
            f"INSERT INTO \"{table.name}\" (payload, task, status, attempts, finished_at) "
            "SELECT '{}', 't', 'done', 1, now() - interval '2 minutes' "
            "FROM generate_series(1, %s)",
            (count,),
        )

    def counts() -> tuple[int, int]:
        row = raw.execute(
            f'SELECT (SELECT count(*) FROM "{table.name}"), (SELECT count(*) FROM "{archive}")'
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def burst(*args: str, **env: str) -> str:
        result = jobq("worker", "workerapp:registry", "--burst", *args, env=env)
        assert result.returncode == 0, result.stderr
        return result.stderr

    history(12_000)  # more than a batch: the run must not stop after the first
    burst(JOBQ_ARCHIVE_AFTER="never")
    assert counts() == (12_000, 0)
    burst("--archive-after", "1h")
    assert counts() == (12_000, 0)
    assert f"archived 12,000 done jobs of {table.name} in " in burst()
    assert counts() == (0, 12_000)


def test_worker_burst_runs_the_ready_jobs_and_exits_0(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    side = f"{table.name}_side"
    raw.execute(SIDE_DDL.format(side=f'"{side}"'))
    with engine.begin() as conn:
        job_id = client.enqueue(conn, table, "typed", {"a": 1, "b": "x"})
    try:
        result = jobq("worker", "workerapp:registry", "--burst", env={"JOBQ_TEST_SIDE": side})
        ran = raw.execute(f'SELECT job_id FROM "{side}"').fetchall()
    finally:
        raw.execute(f'DROP TABLE "{side}"')
    assert result.returncode == 0, result.stderr
    assert "worker started" in result.stderr
    assert "worker stopped after 1 jobs" in result.stderr
    assert (job(raw, table, job_id)["status"], ran) == ("done", [(job_id,)])


def test_a_worker_process_hands_the_gil_over_every_millisecond(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    """`jobq worker` owns its process and shortens the switch interval, so a
    handler thread woken while the event loop is busy starts within 1 ms, not
    Python's default 5 ms (see `process.SWITCH_INTERVAL`)."""
    with engine.begin() as conn:
        job_id = client.enqueue(conn, table, "switch_interval", {})
    result = jobq("worker", "workerapp:registry", "--burst")
    assert result.returncode == 0, result.stderr
    assert job(raw, table, job_id)["result"] == SWITCH_INTERVAL == 0.001


def test_a_worker_process_spares_its_collector_what_startup_made(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    """The app's modules and the worker's own, imported once and kept for the
    process's life, are frozen out of the cyclic garbage collector: its full
    collections scan only what the worker made since (see `process`)."""
    with engine.begin() as conn:
        job_id = client.enqueue(conn, table, "startup_scanned", {})
    result = jobq("worker", "workerapp:registry", "--burst")
    assert result.returncode == 0, result.stderr
    seen = job(raw, table, job_id)["result"]
    assert seen["frozen"] > 10_000 and not seen["registry_scanned"]


def test_no_gc_freeze_leaves_the_collector_as_python_sets_it(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    with engine.begin() as conn:
        job_id = client.enqueue(conn, table, "startup_scanned", {})
    result = jobq("worker", "workerapp:registry", "--burst", "--no-gc-freeze")
    assert result.returncode == 0, result.stderr
    assert job(raw, table, job_id)["result"] == {"frozen": 0, "registry_scanned": True}


def test_worker_at_info_writes_one_prefixed_line_per_finished_job_and_warnings_at_once(
    jobq: Jobq, engine: Engine, raw: Raw, table: Table
) -> None:
    """Lines are batched per turn of the worker's loop and written together,
    but each finished job still gets its own complete line, in order, and a
    failing job's WARNING/ERROR lines are not held back behind the batch."""
    side = f"{table.name}_side"
    raw.execute(SIDE_DDL.format(side=f'"{side}"'))
    with engine.begin() as conn:
        ids = client.enqueue_many(
            conn, table, [NewJob("typed", {"a": i, "b": "x"}) for i in range(300)]
        )
        failing = client.enqueue(conn, table, "boom", {"message": "bad"}, max_attempts=1)
    try:
        result = jobq(
            *("worker", "workerapp:registry", "--burst", "-c", "8", "--log-level", "INFO"),
            env={"JOBQ_TEST_SIDE": side},
        )
    finally:
        raw.execute(f'DROP TABLE "{side}"')
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    finished = [line for line in lines if " duration=" in line]
    assert len(finished) == 301
    prefix = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO sqla_jobq\.worker: job (\d+) "
    pattern = re.compile(prefix + r"task=\w+ attempt=1 duration=[\d.]+ms outcome=")
    matched = [pattern.match(line) for line in finished]
    assert all(matched), [line for line, m in zip(finished, matched, strict=True) if not m][:3]
    assert sorted(int(m.group(1)) for m in matched if m) == sorted([*ids, failing])
    assert any(f"job {failing} " in line and "ERROR" in line for line in lines)
    assert lines[-1].endswith("worker stopped after 301 jobs")
