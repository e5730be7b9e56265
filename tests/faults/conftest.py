"""Helpers for the fault suite: worker processes, an audit trail, a throwaway
PostgreSQL cluster and a PgBouncer, each torn down even when a test fails.

Every scenario checks its outcome from the database:

* the side table ``<table>_fx`` gets one row per handler execution (tests/faultapp.py);
* the audit table ``<table>_audit`` gets one row per status or attempts change of
  a job, written by a row trigger in the same transaction as the change, with the
  writer's `application_name` (``jobq worker <host>:<pid>``: one per process) and
  whether the job's lease had expired at that moment.

`check_audit` then proves that every transition is legal and fenced: a transition
out of ``running`` is made either by the session that claimed that very attempt
or, for a return to the queue or a failure, by a reaper on an expired lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import psycopg.rows
import pytest
from sqlalchemy import Engine, MetaData, Table, create_engine
from sqlalchemy.pool import NullPool

from sqla_jobq import client
from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names, jobs_table, quote_ident
from sqla_jobq.statements import NewJob

TESTS_DIR = Path(__file__).resolve().parent.parent
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
LEGAL = {
    (None, "queued"),
    ("queued", "running"),
    ("running", "done"),
    ("running", "queued"),
    ("running", "failed"),
    ("failed", "queued"),  # retry only
    ("cancelled", "queued"),  # retry only
    ("queued", "failed"),  # cancel only, before schema version 5
    ("queued", "cancelled"),
    ("running", "cancelled"),
}


def jobq_command() -> list[str]:
    """The `jobq` script installed beside this interpreter (a venv's, in CI)."""
    beside = Path(sys.executable).parent / "jobq"
    found = str(beside) if beside.exists() else shutil.which("jobq")
    assert found, "the jobq script is not installed"
    return [found]


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll until `predicate()` is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# ---------------------------------------------------------------------------
# The queue under test: jobs table, side table, audit trail.


@dataclass
class FaultQueue:
    """A migrated queue table with its side-effect table and audit trigger."""

    url: str
    names: Names

    @property
    def table(self) -> Table:
        return jobs_table(MetaData(), self.names.table, self.names.schema)

    @property
    def side(self) -> str:
        return quote_ident(f"{self.names.table}_fx")

    @property
    def audit(self) -> str:
        return quote_ident(f"{self.names.table}_audit")

    @property
    def qualified(self) -> str:
        return self.names.qualified

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(conninfo(self.url), autocommit=True)

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        with self.connect() as conn:
            cur = conn.execute(query.encode(), params)
            return cur.fetchall() if cur.description else []

    def create(self) -> None:
        with self.connect() as conn:
            for ddl in up_statements(self.names, 0, LATEST):
                conn.execute(ddl.encode())
        function = quote_ident(f"{self.names.table}_audit_fn")
        with self.connect() as conn:
            for ddl in (
                f"""CREATE TABLE {self.side} (
                      seq bigserial PRIMARY KEY, job_id bigint NOT NULL, attempt int NOT NULL,
                      pid int NOT NULL, task text, queue text, payload text,
                      at timestamptz NOT NULL DEFAULT clock_timestamp())""",
                f"""CREATE TABLE {self.audit} (
                      seq bigserial PRIMARY KEY, id bigint NOT NULL,
                      old_status text, new_status text NOT NULL,
                      old_attempts int, new_attempts int NOT NULL,
                      old_max int, new_max int NOT NULL,
                      lease_expired boolean, last_error text, app text, txid bigint,
                      at timestamptz NOT NULL DEFAULT clock_timestamp())""",
                f"""CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql
                    SECURITY DEFINER AS $fx$
                    BEGIN
                      IF TG_OP = 'INSERT' THEN
                        INSERT INTO {self.audit} (id, new_status, new_attempts, new_max, app,
                                                  txid)
                        VALUES (NEW.id, NEW.status, NEW.attempts, NEW.max_attempts,
                                current_setting('application_name'), txid_current());
                      ELSE
                        INSERT INTO {self.audit} (id, old_status, new_status, old_attempts,
                               new_attempts, old_max, new_max, lease_expired, last_error,
                               app, txid)
                        VALUES (NEW.id, OLD.status, NEW.status, OLD.attempts, NEW.attempts,
                                OLD.max_attempts, NEW.max_attempts, OLD.locked_until < now(),
                                NEW.last_error, current_setting('application_name'),
                                txid_current());
                      END IF;
                      RETURN NULL;
                    END $fx$""",
                f"""CREATE TRIGGER fx_audit_insert AFTER INSERT ON {self.qualified}
                    FOR EACH ROW EXECUTE FUNCTION {function}()""",
                f"""CREATE TRIGGER fx_audit_update AFTER UPDATE ON {self.qualified}
                    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status
                                       OR OLD.attempts IS DISTINCT FROM NEW.attempts
                                       OR OLD.max_attempts IS DISTINCT FROM NEW.max_attempts)
                    EXECUTE FUNCTION {function}()""",
            ):
                conn.execute(ddl.encode())

    def drop(self) -> None:
        with self.connect() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {self.side}, {self.audit}".encode())
        with self.connect() as conn:
            for ddl in down_statements(self.names, LATEST, 0):
                with contextlib.suppress(psycopg.Error):
                    conn.execute(ddl.encode())
            conn.execute(
                f"DROP FUNCTION IF EXISTS {quote_ident(self.names.table + '_audit_fn')}()".encode()
            )

    # -- enqueueing and progress --------------------------------------------

    @contextlib.contextmanager
    def engine(self) -> Iterator[Engine]:
        engine = create_engine(parse_url(self.url), poolclass=NullPool)
        try:
            yield engine
        finally:
            engine.dispose()

    def enqueue_work(self, count: int, sleep: float = 0.0, **options: Any) -> list[int]:
        """`count` fx.work jobs through the public API (enqueue_many), one transaction."""
        rows = [NewJob("fx.work", {"n": n, "sleep": sleep}, **options) for n in range(count)]
        with self.engine() as engine, engine.begin() as conn:
            return client.enqueue_many(conn, self.table, rows)

    def enqueue(self, task: str = "fx.work", payload: Any = None, **options: Any) -> int:
        """One job through the public API, committed."""
        with self.engine() as engine, engine.begin() as conn:
            body = {"n": 0} if payload is None else payload
            return client.enqueue(conn, self.table, task, body, **options)

    def job(self, job_id: int) -> dict[str, Any]:
        with self.connect() as conn:
            conn.row_factory = psycopg.rows.dict_row  # type: ignore[assignment]
            row = conn.execute(
                f"SELECT * FROM {self.qualified} WHERE id = %s".encode(), (job_id,)
            ).fetchone()
        assert row is not None, f"job {job_id} does not exist"
        return dict(row)

    def statuses(self) -> dict[str, int]:
        rows = self.sql(f"SELECT status, count(*) FROM {self.qualified} GROUP BY status")
        return {status: count for status, count in rows}

    def done_count(self) -> int:
        return self.statuses().get("done", 0)

    def executions(self) -> dict[int, int]:
        """Handler executions per job id, from the side table."""
        return dict(self.sql(f"SELECT job_id, count(*) FROM {self.side} GROUP BY job_id"))

    # -- the proof ----------------------------------------------------------

    def check_all_done(self, ids: Sequence[int] | None = None) -> None:
        rows = self.sql(f"SELECT id, status FROM {self.qualified}")
        wanted = set(ids) if ids is not None else {r[0] for r in rows}
        status = dict(rows)
        missing = wanted - status.keys()
        assert not missing, f"jobs lost (rows gone): {sorted(missing)[:10]}"
        not_done = {i: status[i] for i in wanted if status[i] != "done"}
        assert not not_done, f"{len(not_done)} jobs not done: {list(not_done.items())[:10]}"
        executed = self.executions()
        never = [i for i in wanted if executed.get(i, 0) < 1]
        assert not never, f"{len(never)} done jobs whose handler never ran: {never[:10]}"

    def check_audit(self) -> AuditSummary:
        """Every transition legal, continuous and fenced (see the module docstring)."""
        rows = self.sql(
            f"""SELECT seq, id, old_status, new_status, old_attempts, new_attempts, old_max,
                       new_max, lease_expired, last_error, app
                FROM {self.audit} ORDER BY seq"""
        )
        final = {
            r[0]: (r[1], r[2])
            for r in self.sql(f"SELECT id, status, attempts FROM {self.qualified}")
        }
        summary = AuditSummary()
        last: dict[int, tuple[str, int]] = {}
        claimer: dict[tuple[int, int], str] = {}
        problems: list[str] = []
        for seq, job, old, new, old_att, new_att, old_max, new_max, expired, error, app in rows:
            where = f"audit #{seq} job {job} {old}->{new} attempts {old_att}->{new_att} by {app!r}"
            summary.count[(old, new)] += 1
            if (old, new) not in LEGAL:
                problems.append(f"illegal transition: {where}")
            if old is not None and last.get(job, (old, old_att)) != (old, old_att):
                problems.append(f"not continuous with previous state {last.get(job)}: {where}")
            if old_att is not None and new_att < old_att:
                problems.append(f"attempts went down: {where}")
            last[job] = (new, new_att)
            if (old, new) == ("queued", "running"):
                if new_att != old_att + 1:
                    problems.append(f"claim did not bump attempts by one: {where}")
                claimer[(job, new_att)] = app
            elif old == "running":
                if new_att != old_att:
                    problems.append(f"attempts changed leaving running: {where}")
                owner = claimer.get((job, old_att))
                if app == owner:
                    summary.by_owner[new] += 1
                elif new == "done":
                    problems.append(
                        f"completed by a session that does not own it ({owner}): {where}"
                    )
                elif not expired:
                    problems.append(f"taken from its owner ({owner}) on a live lease: {where}")
                else:
                    summary.reaped += 1
                    summary.reaped_jobs.add(job)
            elif (old, new) == ("failed", "queued"):
                if new_att != old_att or new_max <= new_att:
                    problems.append(f"retry did not keep attempts and grant one more: {where}")
            elif (old, new) == ("queued", "failed") and error != "cancelled":
                problems.append(f"queued->failed other than by cancel: {where}")
            if old_max is not None and new_max < old_max:
                problems.append(f"max_attempts went down: {where}")
        for job, state in last.items():
            if job in final and final[job] != state:
                problems.append(f"job {job} is {final[job]} but its audit ends at {state}")
        assert not problems, f"{len(problems)} audit violations:\n" + "\n".join(problems[:20])
        return summary


@dataclass
class AuditSummary:
    count: defaultdict[tuple[str | None, str], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    by_owner: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    reaped: int = 0
    reaped_jobs: set[int] = field(default_factory=set)


@pytest.fixture
def fq(database_url: str) -> Iterator[FaultQueue]:
    """A fresh queue table, side table and audit trail in the session database."""
    queue = FaultQueue(database_url, Names(f"fx_{uuid.uuid4().hex[:10]}", None))
    queue.create()
    yield queue
    queue.drop()


# ---------------------------------------------------------------------------
# Worker processes.


class WorkerProcess:
    """One `jobq worker faultapp:registry` process, logging to a file."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*jobq_command(), "worker", "faultapp:registry", *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=TESTS_DIR,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def app_name(self) -> str:
        """The `application_name` of this process's sessions."""
        return f"jobq worker {socket.gethostname()}:{self.pid}"[:63]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        kill_group(self.proc, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not leave within `timeout`."""
        if self.alive():
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        if self.alive():
            self.kill(signal.SIGKILL)
        code = self.proc.wait(10)
        kill_group(self.proc)  # anything it left in its group
        self._log.close()
        return code

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


class Workers:
    """Starts worker processes for one test and guarantees they all die after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[WorkerProcess] = []

    def env(self, queue: FaultQueue, lease: float = 2.0, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
            PYTHONUNBUFFERED="1",
            JOBQ_FAULT_TABLE=queue.names.table,
            JOBQ_FAULT_DSN=queue.url,
            JOBQ_FAULT_LEASE=str(lease),
        )
        env.update(extra)
        return env

    def start(
        self,
        queue: FaultQueue,
        *args: str,
        database_url: str | None = None,
        lease: float = 2.0,
        env: dict[str, str] | None = None,
    ) -> WorkerProcess:
        log = self.tmp / f"worker-{len(self.started)}.log"
        argv = ["--database-url", database_url or queue.url, *args]
        proc = WorkerProcess(argv, env or self.env(queue, lease), log)
        self.started.append(proc)
        return proc

    def logs(self) -> str:
        parts = []
        for w in self.started:
            text = w.output() if w.log_path.exists() else ""
            parts.append(f"--- worker pid {w.pid} ---\n{text[-3000:]}")
        return "\n".join(parts)

    def stop_all(self) -> None:
        for w in self.started:
            if w.alive() or not w._log.closed:
                w.stop()


@pytest.fixture
def workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Workers]:
    fleet = Workers(tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(fleet.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


class Fleet:
    """N worker slots; a slot whose process died is restarted (the harness's job)."""

    def __init__(self, workers: Workers, queue: FaultQueue, size: int, *args: str, **kw: Any):
        self.workers = workers
        self.queue = queue
        self.args = args
        self.kw = kw
        self.slots = [workers.start(queue, *args, **kw) for _ in range(size)]
        self.deaths = 0

    def restart_dead(self) -> None:
        for i, w in enumerate(self.slots):
            if not w.alive():
                self.deaths += 1
                w.stop()
                self.slots[i] = self.workers.start(self.queue, *self.args, **self.kw)

    def run_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        def check() -> Any:
            self.restart_dead()
            return predicate()

        return wait_until(check, timeout, what, interval=0.1)


def backends(url: str, app_name: str) -> list[tuple[int, str, str]]:
    """(pid, state, query) of the sessions a worker process holds."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, state, query FROM pg_stat_activity WHERE application_name = %s",
            (app_name,),
        ).fetchall()


def terminate(url: str, pid: int) -> bool:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        return bool(conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0])


def drop_role(conn: psycopg.Connection[Any], role: str, *, owned: bool = False) -> None:
    """End the login role's sessions and drop it; with `owned`, first reassign what
    it owns and drop its grants. DROP ROLE is retried while the terminated
    backends are still on their way out."""
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
    )
    name = quote_ident(role)
    if owned:
        conn.execute(f"REASSIGN OWNED BY {name} TO CURRENT_USER".encode())
        conn.execute(f"DROP OWNED BY {name}".encode())
    for _ in range(50):
        try:
            conn.execute(f"DROP ROLE IF EXISTS {name}".encode())
            return
        except psycopg.errors.DependentObjectsStillInUse:
            time.sleep(0.1)


# ---------------------------------------------------------------------------
# A throwaway PostgreSQL cluster (initdb/pg_ctl refuse root: run as postgres).


def _as_postgres(*argv: str) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return list(argv)


def _postgres_owned_tempdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")
    path.chmod(0o700)
    return path


@dataclass
class Cluster:
    datadir: Path
    port: int
    logfile: Path

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def pg_ctl(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), *args),
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        options = (
            f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c max_connections=60"
        )
        self.pg_ctl("-o", options, "-l", str(self.logfile), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-m", mode, "-w", "stop")

    def running(self) -> bool:
        return (self.datadir / "postmaster.pid").exists()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A PostgreSQL 15 cluster of this test's own, on a free port; removed afterwards."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip("PostgreSQL 15 server binaries are not installed")
    base = _postgres_owned_tempdir("jobq-cluster-")
    datadir = base / "data"
    subprocess.run(
        _as_postgres(
            str(PG_BIN / "initdb"), "-D", str(datadir), "-U", "postgres", "--auth=trust", "-N"
        ),
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    node = Cluster(datadir, free_port(), base / "server.log")
    try:
        node.start()
        yield node
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            if node.running():
                node.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------
# PgBouncer in transaction mode, in the foreground, as the postgres user.


@dataclass
class Bouncer:
    port: int
    dbname: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.dbname}"


PGBOUNCER_INI = """\
[databases]
{dbname} = host=127.0.0.1 port={pg_port} dbname={dbname}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
pool_mode = transaction
ignore_startup_parameters = extra_float_digits, options
max_client_conn = 200
default_pool_size = 10
"""


@pytest.fixture
def pgbouncer(database_url: str) -> Iterator[Bouncer]:
    """PgBouncer (transaction pooling) in front of the session database."""
    if not Path(PGBOUNCER).exists():
        pytest.skip("pgbouncer is not installed")
    url = parse_url(database_url)
    base = _postgres_owned_tempdir("jobq-pgbouncer-")
    port = free_port()
    ini = base / "pgbouncer.ini"
    ini.write_text(
        PGBOUNCER_INI.format(dbname=url.database, pg_port=url.port or 5432, port=port, dir=base)
    )
    (base / "userlist.txt").write_text('"postgres" ""\n')
    for path in (ini, base / "userlist.txt"):
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")
    log = base / "pgbouncer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _as_postgres(PGBOUNCER, str(ini)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    bouncer = Bouncer(port, str(url.database), proc, log)
    try:

        def answers() -> bool:
            try:
                psycopg.connect(conninfo(bouncer.url), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                assert proc.poll() is None, f"pgbouncer exited: {log.read_text()}"
                return False

        wait_until(answers, 15, "pgbouncer to accept connections")
        yield bouncer
    finally:
        kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def dump_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
