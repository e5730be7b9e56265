"""The fault suite's queue: a migrated jobs table with a side-effect table and an
audit trail, and the proof run over them afterwards.

Every scenario checks its outcome from the database:

* the side table ``<table>_fx`` gets one row per handler execution (tests/support/faultapp.py);
* the audit table ``<table>_audit`` gets one row per status or attempts change of
  a job, written by a row trigger in the same transaction as the change, with the
  writer's `application_name` (``jobq worker <host>:<pid>``: one per process) and
  whether the job's lease had expired at that moment. A running row deleted is
  a completion that moved the job to the archive (``--archive-after 0``), and is
  audited as ``running -> done``: the final state, read from both tables, says
  whether it arrived there done.

`check_audit` then proves that every transition is legal and fenced: a transition
out of ``running`` is made either by the session that claimed that very attempt
or, for a return to the queue or a failure, by a reaper on an expired lease.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import psycopg.rows
from sqlalchemy import Engine, MetaData, Table, create_engine
from sqlalchemy.pool import NullPool

from sqla_jobq import client
from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names, jobs_table, quote_ident
from sqla_jobq.statements import NewJob

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
                      ELSIF TG_OP = 'DELETE' THEN
                        INSERT INTO {self.audit} (id, old_status, new_status, old_attempts,
                               new_attempts, old_max, new_max, lease_expired, last_error,
                               app, txid)
                        VALUES (OLD.id, OLD.status, 'done', OLD.attempts, OLD.attempts,
                                OLD.max_attempts, OLD.max_attempts, OLD.locked_until < now(),
                                OLD.last_error, current_setting('application_name'),
                                txid_current());
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
                f"""CREATE TRIGGER fx_audit_delete AFTER DELETE ON {self.qualified}
                    FOR EACH ROW WHEN (OLD.status = 'running')
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
            conn.row_factory = psycopg.rows.dict_row
            row = conn.execute(
                f"SELECT * FROM {self.qualified} WHERE id = %s".encode(), (job_id,)
            ).fetchone()
        assert row is not None, f"job {job_id} does not exist"
        return dict(row)

    def statuses(self) -> dict[str, int]:
        """Jobs per status, the archived ones (done) included."""
        rows = self.sql(
            f"SELECT status, count(*) FROM ({' UNION ALL '.join(self._both('status'))}) s "
            "GROUP BY status"
        )
        return {status: count for status, count in rows}

    def _both(self, columns: str) -> list[str]:
        return [
            f"SELECT {columns} FROM {name}"
            for name in (self.qualified, self.names.archive_qualified)
        ]

    def done_count(self) -> int:
        return self.statuses().get("done", 0)

    def executions(self) -> dict[int, int]:
        """Handler executions per job id, from the side table."""
        return dict(self.sql(f"SELECT job_id, count(*) FROM {self.side} GROUP BY job_id"))

    # -- the proof ----------------------------------------------------------

    def finished_or_not(self, columns: str = "id, status") -> list[Any]:
        """`columns` of every job, in the jobs table or moved to the archive
        (workers move done jobs there as they complete them, by default, or after
        `--archive-after`): one statement, so a job moving meanwhile is seen once."""
        return self.sql(" UNION ALL ".join(self._both(columns)))

    def check_all_done(self, ids: Sequence[int] | None = None) -> None:
        rows = self.finished_or_not()
        ids_seen = [r[0] for r in rows]
        assert len(ids_seen) == len(set(ids_seen)), "a job is in the jobs table and the archive"
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
        final = {r[0]: (r[1], r[2]) for r in self.finished_or_not("id, status, attempts")}
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


def backends(url: str, app_name: str) -> list[tuple[int, str, str]]:
    """(pid, state, query) of the sessions a worker process holds."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, state, query FROM pg_stat_activity WHERE application_name = %s",
            (app_name,),
        ).fetchall()


def terminate(url: str, pid: int) -> bool:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
    return bool(row and row[0])


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
        except psycopg.errors.DependentObjectsStillExist:
            time.sleep(0.1)
