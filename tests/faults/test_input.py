"""Hostile and malformed input, through the API, the CLI and a real worker.

Hostile strings are stored and handed to the handler verbatim, or refused with a
clear error before anything is written; the schema is never touched. Malformed
command lines fail with one line on stderr and exit status 2, writing nothing.
A least-privilege role (DML only, no DDL, not the owner) runs the whole queue.
The tests that start `jobq` processes are marked `faults`; the API checks are not.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.schema import Names, quote_ident
from sqla_jobq.statements import InvalidJob, NewJob
from tests.support import APP_DIR
from tests.support.faultqueue import FaultQueue, drop_role
from tests.support.processes import Workers, jobq_command
from tests.support.waiting import wait_until

SQLI = "'; DROP TABLE jobs; --"
HOSTILE = [
    'it\'s a "quoted" name',
    "semi;colon;",
    SQLI,
    'x"); DELETE FROM pg_class; --',
    "emoji 🎉🐘 ünïcödé",
    "back\\slash and \\u0000 as text",
    "$$ dollar $jobq$ quoting",
]
BIG = secrets.token_hex(5000)  # 10 KB, incompressible


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def jobq(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
    proc = subprocess.run(
        [*jobq_command(), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=APP_DIR,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def clear_refusal(run: Run) -> str:
    """Exit status 2 and exactly one line on stderr, `jobq: error: ...`."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.code == 2, (run.code, run.stdout, run.stderr)
    assert len(lines) == 1 and lines[0].startswith("jobq: error: "), run.stderr
    return lines[0]


def snapshot(url: str) -> list[tuple[Any, ...]]:
    """Every relation and column of the database, and how many rows the queues hold."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        return conn.execute(
            """SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod)
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
               WHERE n.nspname = 'public' ORDER BY 1, 2, 3"""
        ).fetchall()


def row_count(fq: FaultQueue) -> int:
    return int(fq.sql(f"SELECT count(*) FROM {fq.qualified}")[0][0])


@pytest.mark.faults
def test_hostile_strings_are_stored_and_run_verbatim(
    fq: FaultQueue, workers: Workers, database_url: str
) -> None:
    """Task names, queue names, payload strings and keys, and unique keys made of
    quotes, semicolons, SQL injections, dollar quotes, emoji and 10 KB strings,
    enqueued through the API and through `jobq enqueue`, are worked by a real
    worker listening on those queues: the handler receives exactly what was
    enqueued, under exactly that task name and queue. The schema is untouched."""
    before = snapshot(database_url)
    expected: dict[int, tuple[str, str, dict[str, Any]]] = {}
    with fq.engine() as engine, engine.begin() as conn:
        from sqla_jobq import client

        for i, s in enumerate(HOSTILE):
            payload = {"s": s, s: [s, {"nested": s}], "big": BIG}
            job_id = client.enqueue(conn, fq.table, s, payload, queue=s, unique_key=f"{s}{i}")
            expected[job_id] = (s, s, payload)
        big_payload = {"s": BIG}
        job_id = client.enqueue(conn, fq.table, BIG, big_payload, queue="default")
        expected[job_id] = (BIG, "default", big_payload)
    env = workers.env(fq)
    for i, s in enumerate(HOSTILE):
        payload = {"s": s, s: s}
        run = jobq(
            "enqueue", s, "--payload", json.dumps(payload), "--queue", s,
            "--unique-key", f"cli {s}{i}", "--database-url", fq.url, "--table", fq.names.table,
            env=env,
        )  # fmt: skip
        assert run.code == 0, run.stderr
        expected[int(run.stdout.strip())] = (s, s, payload)

    big_cli = {"s": BIG}
    run = jobq(
        "enqueue", BIG, "--payload", json.dumps(big_cli), "--database-url", fq.url,
        "--table", fq.names.table, env=env,
    )  # fmt: skip
    assert run.code == 0, run.stderr
    expected[int(run.stdout.strip())] = (BIG, "default", big_cli)

    queues = [arg for s in HOSTILE for arg in ("-q", s)]
    tasks = json.dumps([*HOSTILE, BIG])
    worker = workers.start(
        fq, "--burst", "-q", "default", *queues, env=workers.env(fq, JOBQ_FAULT_TASKS=tasks)
    )
    assert worker.proc.wait(60) == 0, worker.output()[-3000:]

    fq.check_all_done(list(expected))
    seen = fq.sql(f"SELECT job_id, task, queue, payload FROM {fq.side}")
    assert len(seen) == len(expected)
    for job_id, task, queue, payload in seen:
        assert (task, queue, json.loads(payload)) == expected[job_id]
    stored = dict(fq.sql(f"SELECT id, unique_key FROM {fq.qualified}"))
    assert {stored[i] for i in expected} >= {f"{s}{i}" for i, s in enumerate(HOSTILE)}
    assert snapshot(database_url) == before
    fq.check_audit()


def test_refused_strings_write_nothing(fq: FaultQueue, workers: Workers) -> None:
    """NUL (which PostgreSQL text and jsonb cannot store) anywhere, and 10 KB queue
    names or unique keys (indexed, and a queue name is a NOTIFY payload), are
    refused before the database is reached: a clear InvalidJob through the API, one
    line and exit 2 through the CLI; no row is written, in a batch none at all."""
    from sqla_jobq import client

    bad: list[tuple[str | None, Any, dict[str, Any]]] = [
        ("nul\x00task", {}, {}),
        ("t", {"s": "nul\x00here"}, {}),
        ("t", {"nul\x00key": 1}, {}),
        ("t", {}, {"queue": "nul\x00queue"}),
        ("t", {}, {"unique_key": "nul\x00key"}),
        ("t", {}, {"queue": BIG}),
        ("t", {}, {"unique_key": BIG}),
        ("t", {"x": float("nan")}, {}),
        ("t", {"x": float("inf")}, {}),
        ("t", {"x": object()}, {}),
    ]
    with fq.engine() as engine:
        for task, payload, options in bad:
            with engine.begin() as conn, pytest.raises(InvalidJob) as caught:
                client.enqueue(conn, fq.table, task, payload, **options)
            assert str(caught.value) and "\n" not in str(caught.value)
            with engine.begin() as conn, pytest.raises(InvalidJob):
                client.enqueue_many(
                    conn,
                    fq.table,
                    [NewJob("fine", {}), NewJob(task, payload, **options)],
                )
    env = workers.env(fq)
    common = ("--database-url", fq.url, "--table", fq.names.table)
    runs = [
        ("enqueue", "t", "--payload", '{"s": "nul\\u0000here"}', *common),
        ("enqueue", "t", "--queue", BIG, *common),
        ("enqueue", "t", "--unique-key", BIG, *common),
    ]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda a: jobq(*a, env=env), runs))
    for run in results:
        clear_refusal(run)
    assert row_count(fq) == 0


@pytest.fixture
def empty_database(server_url: str) -> Iterator[str]:
    """A database with no queue schema at all."""
    name = f"jobq_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"'.encode())
    yield parse_url(server_url).set(database=name).render_as_string(False)
    with psycopg.connect(conninfo(server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


@pytest.mark.faults
def test_malformed_command_lines_exit_2_with_one_line(
    fq: FaultQueue, workers: Workers, empty_database: str, database_url: str
) -> None:
    """Bad payloads (not JSON, NaN, Infinity, not an object, not matching the task's
    signature with --app), a negative delay, --concurrency 0, unknown MODULE:ATTR,
    unusable URLs, a database without the schema and a table at an older schema
    version: each is one `jobq: error:` line on stderr, exit status 2, and nothing
    is written anywhere."""
    env = workers.env(fq)
    url = ("--database-url", fq.url)
    on_table = (*url, "--table", fq.names.table)
    older = FaultQueue(fq.url, Names(f"fx_old_{uuid.uuid4().hex[:8]}", None))
    older.create()
    older.sql(f"COMMENT ON TABLE {older.qualified} IS 'sqla_jobq schema version 0'")
    on_older = (*url, "--table", older.names.table)
    old_env = workers.env(older)
    refused = "postgresql://postgres@127.0.0.1:1/nowhere"
    cases: list[tuple[Sequence[str], dict[str, str], str]] = [
        (("enqueue", "fx.work", "--payload", "not json", *on_table), env, "not valid JSON"),
        (("enqueue", "fx.work", "--payload", "NaN", *on_table), env, "NaN"),
        (("enqueue", "fx.work", "--payload", '{"n": Infinity}', *on_table), env, "Infinity"),
        (("enqueue", "fx.work", "--payload", "[1, 2]", *on_table), env, "JSON object"),
        (
            ("enqueue", "fx.work", "--app", "faultapp:registry", "--payload", '{"m": 1}', *url),
            env,
            "does not match",
        ),
        (
            ("enqueue", "nope", "--app", "faultapp:registry", *url),
            env,
            "unknown task",
        ),
        (("enqueue", "fx.work", "--delay", "-5", *on_table), env, "negative"),
        (("enqueue", "fx.work", "--database-url", "mysql://u@h/db"), env, "unsupported"),
        (("enqueue", "fx.work", "--database-url", "not a url"), env, "URL"),
        (("enqueue", "fx.work", "--database-url", refused), env, "cannot connect"),
        (("enqueue", "fx.work", "--database-url", empty_database), env, "does not exist"),
        (("enqueue", "fx.work", *on_older), old_env, "schema version 0"),
        (("worker", "faultapp:registry", "--concurrency", "0", *url), env, "concurrency"),
        (("worker", "no_such_module:registry", *url), env, "cannot import"),
        (("worker", "faultapp:nothing", *url), env, "not a sqla_jobq Registry"),
        (("worker", "faultapp:registry", "--database-url", refused), env, "cannot connect"),
        (("worker", "faultapp:registry", "--database-url", empty_database), env, "not exist"),
        (("worker", "faultapp:registry", *url), old_env, "schema version 0"),
    ]
    before = snapshot(database_url)
    empty_before = snapshot(empty_database)
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda c: jobq(*c[0], env=c[1], timeout=30), cases))
        for (args, _, expect), run in zip(cases, results, strict=True):
            line = clear_refusal(run)
            assert expect.lower() in line.lower(), (args[:3], line)
            assert len(line) < 600, line
        assert row_count(fq) == 0 and row_count(older) == 0
        assert snapshot(database_url) == before
        assert snapshot(empty_database) == empty_before == []
    finally:
        older.drop()


@pytest.mark.faults
def test_table_name_with_quotes(database_url: str, workers: Workers) -> None:
    """A queue table whose name holds both kinds of quotes and a semicolon works via
    `jobq enqueue --table` and `jobq worker`, and its NOTIFY channel works: an idle
    worker with a 60 s poll picks a new job up within seconds."""
    name = f"q\"uo'te; {uuid.uuid4().hex[:6]}"
    fq = FaultQueue(database_url, Names(name, None))
    fq.create()
    try:
        env = workers.env(fq)
        worker = workers.start(fq, "--poll-interval", "60")
        wait_until(
            lambda: fq.sql(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND query = %s",
                (worker.app_name, f"LISTEN {quote_ident('public.' + name)}"),
            ),
            20,
            "the worker to LISTEN on the quoted channel",
        )
        t0 = time.monotonic()
        run = jobq("enqueue", "fx.work", "--payload", '{"n": 7}', "--database-url", fq.url,
                   "--table", name, env=env)  # fmt: skip
        assert run.code == 0, run.stderr
        job_id = int(run.stdout)
        wait_until(lambda: fq.job(job_id)["status"] == "done", 10, "the job, by notification")
        assert time.monotonic() - t0 < 10
        stats = jobq("stats", "--json", "--database-url", fq.url, "--table", name, env=env)
        assert stats.code == 0 and json.loads(stats.stdout)[0]["status"] == "done"
        fq.check_audit()
    finally:
        workers.stop_all()
        fq.drop()


@pytest.fixture
def app_role(fq: FaultQueue) -> Iterator[str]:
    """A login role with DML on the queue table, INSERT on its archive, nothing else."""
    role = f"jobq_app_{uuid.uuid4().hex[:8]}"
    archive = fq.sql("SELECT to_regclass(%s)::text", (fq.names.archive_qualified,))[0][0]
    settings = fq.sql("SELECT to_regclass(%s)::text", (fq.names.queues_qualified,))[0][0]
    registry = fq.sql("SELECT to_regclass(%s)::text", (fq.names.workers_qualified,))[0][0]
    with fq.connect() as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN".encode())
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}".encode())
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {fq.qualified} TO {role}".encode())
        if archive:  # `prune --archive` only inserts into it
            conn.execute(f"GRANT INSERT ON {archive} TO {role}".encode())
        if settings:  # schema version 5: every claim reads the queue settings
            conn.execute(f"GRANT SELECT ON {settings} TO {role}".encode())
        if registry:  # schema version 5: workers keep their row, `stats` lists them
            conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {registry} TO {role}".encode())
    yield role
    with fq.connect() as conn:
        drop_role(conn, role, owned=True)


def worker_burst(workers: Workers, fq: FaultQueue, url: str) -> int:
    worker = workers.start(fq, "--burst", database_url=url)
    code = worker.proc.wait(60)
    assert code == 0, worker.output()[-3000:]
    return code


@pytest.mark.faults
def test_least_privilege_role_runs_the_queue(
    app_role: str, fq: FaultQueue, workers: Workers
) -> None:
    """A role that is not the owner and may not run DDL, granted only USAGE on the
    schema, SELECT, INSERT, UPDATE, DELETE on the queue table and INSERT on its archive,
    enqueues through the API and the CLI, runs a worker to completion, and uses
    stats, reap, retry, cancel and prune. The identity column needs no grant on its
    sequence; the NOTIFY trigger needs no grant either."""
    from sqla_jobq import client

    role_url = parse_url(fq.url).set(username=app_role).render_as_string(False)
    with psycopg.connect(conninfo(role_url), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE jobq_app_may_not (x int)")
        owner = conn.execute(
            "SELECT pg_get_userbyid(relowner) = current_user FROM pg_class "
            "WHERE oid = %s::regclass",
            (fq.qualified,),
        ).fetchone()
        assert owner == (False,)
    role_queue = FaultQueue(role_url, fq.names)
    ids = role_queue.enqueue_work(200)
    with role_queue.engine() as engine, engine.begin() as conn:
        cancelled = client.enqueue(conn, fq.table, "fx.work", {"n": -1})
    env = workers.env(fq)
    role_args = ("--database-url", role_url, "--table", fq.names.table)
    run = jobq("enqueue", "fx.work", "--payload", '{"n": 1}', *role_args, env=env)
    assert run.code == 0, run.stderr
    ids.append(int(run.stdout))
    assert jobq("cancel", str(cancelled), *role_args, env=env).code == 0
    assert jobq("retry", str(cancelled), *role_args, env=env).code == 0
    ids.append(cancelled)
    assert worker_burst(workers, fq, role_url) == 0
    fq.check_all_done(ids)
    commands = [("stats",), ("reap",), ("prune", "--older-than", "0")]
    if fq.sql("SELECT to_regclass(%s)", (fq.names.archive_qualified,))[0][0] is not None:
        fq.enqueue_work(3)
        assert worker_burst(workers, fq, role_url) == 0
        commands.insert(2, ("prune", "--archive", "--older-than", "0"))
    for command in commands:
        run = jobq(*command, *role_args, env=env)
        assert run.code == 0, (command, run.stderr)
    assert row_count(fq) == 0  # archived and pruned, by the role
    fq.check_audit()
