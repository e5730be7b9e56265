"""The worker against real PostgreSQL, as real `jobq worker` processes.

Every test starts `jobq worker workerapp:registry` subprocesses on a queue
table of its own; the handlers (tests/support/workerapp.py) write each execution to a
side table from connections of their own. Nothing here asserts on speed:
waits poll the database against a generous deadline, and where a latency is
the point (NOTIFY versus a 60 s poll) the bound is far from what it must beat.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Engine, Table

from sqla_jobq import client, statements
from sqla_jobq.db import connect_kwargs, conninfo
from sqla_jobq.statements import NewJob
from tests.support import APP_DIR
from tests.support.processes import JOBQ
from tests.support.rows import every_job
from tests.support.rows import job_now as job
from tests.support.waiting import wait_until
from tests.support.workerapp import SIDE_DDL

Raw = psycopg.Connection[Any]


# --------------------------------------------------------------------------- helpers


class WorkerProcess:
    """A `jobq worker` subprocess whose stdout and stderr go to a log file."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def app_name(self) -> str:
        """The LIKE pattern of this process's `application_name`."""
        return f"jobq worker %:{self.pid}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        def seen() -> bool:
            if text in self.log():
                return True
            if self.proc.poll() is not None and text not in self.log():
                raise AssertionError(
                    f"worker exited ({self.proc.returncode}) before logging {text!r}:\n{self.log()}"
                )
            return False

        wait_until(seen, timeout, f"{text!r} in the worker's log")

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker still running after {timeout}s:\n{self.log()}") from None


StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def side(raw: Raw, table: Table) -> Iterator[str]:
    """The side table the handlers record their executions in."""
    name = f"{table.name}_side"
    raw.execute(SIDE_DDL.format(side=f'"{name}"'))
    yield name
    raw.execute(f'DROP TABLE IF EXISTS "{name}"')


@pytest.fixture
def start_worker(
    database_url: str, table: Table, side: str, tmp_path: Path
) -> Iterator[StartWorker]:
    """Start `jobq worker workerapp:registry ARGS...`; all are killed at teardown."""
    started: list[WorkerProcess] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBQ_")}
    env.update(
        JOBQ_DATABASE_URL=database_url,
        JOBQ_TABLE=table.name,
        JOBQ_TEST_TABLE=table.name,
        JOBQ_TEST_SIDE=side,
        PYTHONUNBUFFERED="1",
    )

    def start(*args: str) -> WorkerProcess:
        log_path = tmp_path / f"worker{len(started)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [JOBQ, "worker", "workerapp:registry", *args],
                cwd=APP_DIR,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        worker = WorkerProcess(proc, log_path)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait(timeout=30)


def enqueue(engine: Engine, table: Table, task: str, payload: Any = None, **options: Any) -> int:
    with engine.begin() as conn:
        return client.enqueue(conn, table, task, payload or {}, **options)


def wait_status(
    raw: Raw, table: Table, job_id: int, status: str, timeout: float = 30
) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        row = job(raw, table, job_id)
        return row if row["status"] == status else None

    return wait_until(reached, timeout, f"job {job_id} to be {status}")  # type: ignore[no-any-return]


def events(raw: Raw, side: str, job_id: int | None = None) -> list[dict[str, Any]]:
    """The side table's rows (for one job), in the order they were written."""
    where, params = ("WHERE job_id = %s", (job_id,)) if job_id is not None else ("", ())
    with raw.cursor(row_factory=dict_row) as cur:
        return cur.execute(f'SELECT * FROM "{side}" {where} ORDER BY n', params).fetchall()


def wait_event(raw: Raw, side: str, job_id: int, event: str, attempt: int = 1) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for row in events(raw, side, job_id):
            if row["event"] == event and row["attempt"] == attempt:
                return row
        return None

    return wait_until(found, 30, f"{event!r} of job {job_id} attempt {attempt}")  # type: ignore[no-any-return]


def sessions(raw: Raw, worker: WorkerProcess) -> list[dict[str, Any]]:
    """The worker's sessions as pg_stat_activity shows them."""
    with raw.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "SELECT pid, state, query, query_start, state_change, xact_start, backend_start "
            "FROM pg_stat_activity WHERE application_name LIKE %s AND datname = current_database()",
            (worker.app_name,),
        ).fetchall()


def listen_session(raw: Raw, worker: WorkerProcess) -> dict[str, Any] | None:
    found = [s for s in sessions(raw, worker) if s["query"].startswith("LISTEN ")]
    return found[0] if found else None


def wait_idle(raw: Raw, worker: WorkerProcess, after: datetime | None = None) -> None:
    """Until the claimer's last statement is the next-run_at lookup the worker
    runs just before it goes to sleep (and, with `after`, ran after that)."""

    def idle() -> bool:
        return any(
            s["state"] == "idle"
            and s["query"].startswith("SELECT min(")
            and (after is None or s["query_start"] > after)
            for s in sessions(raw, worker)
        )

    wait_until(idle, 30, "the worker to go idle")


def start_idle_worker(
    start_worker: StartWorker, raw: Raw, *args: str
) -> tuple[WorkerProcess, dict[str, Any]]:
    """A worker on a poll of 60 s, with its LISTEN connection up and asleep after
    its first claim; returns it and its LISTEN session."""
    worker = start_worker("--poll-interval", "60", *args)
    listen = wait_until(lambda: listen_session(raw, worker), 30, "the LISTEN connection")
    wait_idle(raw, worker)
    return worker, listen


# --------------------------------------------------------------------------- throughput


def test_two_burst_workers_execute_10000_jobs_each_exactly_once(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    with engine.begin() as conn:
        ids = client.enqueue_many(conn, table, [NewJob("record", {"n": i}) for i in range(10_000)])
    assert len(set(ids)) == 10_000

    workers = [start_worker("--burst", "-c", "4", "--log-level", "WARNING") for _ in range(2)]
    for worker in workers:
        assert worker.wait(timeout=180) == 0, worker.log()

    done, max_attempts = raw.execute(
        "SELECT count(*) FILTER (WHERE status = 'done'), max(attempts) "
        f"FROM {every_job(table, 'status, attempts')}"
    ).fetchone()  # type: ignore[misc]
    assert (done, max_attempts) == (10_000, 1)
    executed, distinct, most, attempts = raw.execute(
        f"SELECT count(*), count(DISTINCT job_id), max(c), max(a) FROM "
        f'(SELECT job_id, count(*) AS c, max(attempt) AS a FROM "{side}" GROUP BY job_id) s'
    ).fetchone()  # type: ignore[misc]
    assert (executed, distinct, most, attempts) == (10_000, 10_000, 1, 1)
    recorded = {r[0] for r in raw.execute(f'SELECT DISTINCT job_id FROM "{side}"')}
    assert recorded == set(ids)


# --------------------------------------------------------------------------- crashes


def test_sigkilled_workers_job_returns_after_its_lease_and_completes_elsewhere_fenced(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    first = start_worker("-c", "1")
    job_id = enqueue(engine, table, "short_lease", {"seconds": 120, "only_attempt": 1})
    started = wait_event(raw, side, job_id, "started", attempt=1)
    assert started["pid"] == first.pid

    first.send(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    assert job(raw, table, job_id)["status"] == "running"

    second = start_worker("-c", "1", "--reap-interval", "0.5", "--poll-interval", "0.5")
    row = wait_status(raw, table, job_id, "done")
    assert row["attempts"] == 2
    assert row["last_error"] == "lease expired"
    assert [(e["event"], e["attempt"], e["pid"]) for e in events(raw, side, job_id)] == [
        ("started", 1, first.pid),
        ("started", 2, second.pid),
        ("finished", 2, second.pid),
    ]
    assert f"reaped job {job_id} (attempt 1, lease expired): now queued" in second.log()

    # The killed worker's completion, had it come late, is fenced out.
    with engine.begin() as conn:
        assert conn.execute(statements.complete(table, job_id, 1)).rowcount == 0
        assert conn.execute(statements.extend_lease(table, job_id, 1)).rowcount == 0
        assert conn.execute(statements.fail(table, job_id, 1, "late")).first() is None
    after = job(raw, table, job_id)
    assert {k: after[k] for k in ("status", "attempts", "finished_at", "last_error")} == {
        k: row[k] for k in ("status", "attempts", "finished_at", "last_error")
    }


def test_job_that_kills_its_worker_every_time_ends_failed_at_max_attempts(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    job_id = enqueue(engine, table, "crash", max_attempts=3)
    deaths = 0
    survivor = None
    for _ in range(6):
        worker = start_worker("-c", "1", "--reap-interval", "0.5", "--poll-interval", "0.5")

        def settled(worker: WorkerProcess = worker) -> str | None:
            if worker.proc.poll() is not None:
                return "died"
            return "failed" if job(raw, table, job_id)["status"] == "failed" else None

        if wait_until(settled, 60, "the worker to die or the job to fail") == "failed":
            survivor = worker
            break
        assert worker.proc.returncode == -signal.SIGKILL, worker.log()
        deaths += 1
    assert survivor is not None, "the job was still not failed after 6 workers"

    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"], row["last_error"]) == ("failed", 3, "lease expired")
    assert deaths == 3
    assert [e["attempt"] for e in events(raw, side, job_id)] == [1, 2, 3]
    assert f"reaped job {job_id} (attempt 3, lease expired): now failed" in survivor.log()
    survivor.send(signal.SIGTERM)
    assert survivor.wait() == 0


# --------------------------------------------------------------------------- shutdown


def test_sigterm_lets_the_running_job_finish_then_exits_0(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    worker = start_worker("-c", "2")
    job_id = enqueue(engine, table, "sleep", {"seconds": 3})
    wait_event(raw, side, job_id, "started")

    worker.send(signal.SIGTERM)
    worker.wait_for_log("stopping: no new claims")
    assert worker.wait() == 0, worker.log()

    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"]) == ("done", 1)
    assert [e["event"] for e in events(raw, side, job_id)] == ["started", "finished"]
    assert "waiting for 1 running jobs" in worker.log()
    assert f"job {job_id} task=sleep attempt=1" in worker.log()


def test_sigterm_past_the_shutdown_timeout_hands_the_job_back_with_attempts_kept(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    worker = start_worker("-c", "1", "--shutdown-timeout", "1")
    job_id = enqueue(engine, table, "sleep", {"seconds": 30})
    wait_event(raw, side, job_id, "started")

    worker.send(signal.SIGTERM)
    # Well before the 30 s handler could have ended.
    assert worker.wait(timeout=20) == 0, worker.log()

    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"], row["locked_until"]) == ("queued", 1, None)
    assert row["run_at"] <= row["db_now"]
    assert [e["event"] for e in events(raw, side, job_id)] == ["started"]
    assert "unfinished at shutdown, returned to the queue" in worker.log()


def test_second_sigterm_exits_at_once_and_leaves_the_job_to_its_lease(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    worker = start_worker("-c", "1")
    job_id = enqueue(engine, table, "short_lease", {"seconds": 30})
    wait_event(raw, side, job_id, "started")

    worker.send(signal.SIGTERM)
    worker.wait_for_log("stopping: no new claims")
    worker.send(signal.SIGTERM)
    assert worker.wait(timeout=10) == 1, worker.log()
    assert "second signal: exiting now" in worker.log()
    assert (job(raw, table, job_id)["status"], job(raw, table, job_id)["attempts"]) == (
        "running",
        1,
    )

    def reaped() -> bool:
        with engine.begin() as conn:
            return any(r.id == job_id for r in conn.execute(statements.reap(table)))

    wait_until(reaped, 30, "the abandoned lease to expire and be reaped")
    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"], row["last_error"]) == ("queued", 1, "lease expired")


# --------------------------------------------------------------------------- sessions


def test_no_worker_session_is_idle_in_transaction_while_a_job_runs(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    worker = start_worker("-c", "2")
    job_id = enqueue(engine, table, "sleep", {"seconds": 2})
    wait_event(raw, side, job_id, "started")

    samples = 0
    seen: set[int] = set()
    while not any(e["event"] == "finished" for e in events(raw, side, job_id)):
        for s in sessions(raw, worker):
            seen.add(s["pid"])
            assert s["state"] != "idle in transaction", s
            assert s["state"] == "active" or s["xact_start"] is None, s
        samples += 1
        time.sleep(0.02)
    assert samples >= 10
    assert len(seen) >= 2  # the claimer and the LISTEN connection at least
    wait_status(raw, table, job_id, "done")


def test_worker_sessions_set_an_idle_in_transaction_timeout_and_write_back_early(
    database_url: str,
) -> None:
    with psycopg.connect(conninfo(database_url), **connect_kwargs(True)) as conn:
        setting = conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
        flush = conn.execute("SHOW backend_flush_after").fetchone()
        name = conn.execute("SHOW application_name").fetchone()
    assert setting == ("1min",)
    assert flush == ("256kB",)
    assert name is not None and str(name[0]).startswith("jobq worker ")
    assert str(name[0]).endswith(f":{os.getpid()}")


# --------------------------------------------------------------------------- handlers


def test_sync_and_async_handlers_run_and_see_their_current_job(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    sync_id = enqueue(engine, table, "whoami_sync", {"x": 1}, queue="other")
    async_id = enqueue(engine, table, "whoami_async", {"x": 2})
    worker = start_worker("--burst", "-c", "2")
    assert worker.wait() == 0, worker.log()

    for job_id, task, queue, x in (
        (sync_id, "whoami_sync", "other", 1),
        (async_id, "whoami_async", "default", 2),
    ):
        assert job(raw, table, job_id)["status"] == "done"
        [seen] = events(raw, side, job_id)
        assert seen["info"] == {
            "id": job_id,
            "attempts": 1,
            "queue": queue,
            "task": task,
            "payload": {"x": x},
            "max_attempts": 5,
        }


def test_unknown_task_fails_its_attempt_and_the_worker_runs_the_next_jobs(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    unknown = enqueue(engine, table, "nosuch", {"a": 1}, priority=10)
    later = [enqueue(engine, table, "record", {"n": n}) for n in range(3)]
    worker = start_worker("--burst", "-c", "1")
    assert worker.wait() == 0, worker.log()

    row = job(raw, table, unknown)
    assert row["last_error"] == "UnknownTask: task 'nosuch' is not registered on this worker"
    assert (row["status"], row["attempts"]) == ("queued", 1)  # a newer worker may know it
    assert row["run_at"] > row["db_now"]
    assert [job(raw, table, j)["status"] for j in later] == ["done"] * 3
    # Priority 10 ran first: the later jobs ran after the failure, in the same worker.
    assert row["started_at"] < min(job(raw, table, j)["started_at"] for j in later)


def test_handler_exception_records_type_and_message_and_retries_with_backoff(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    job_id = enqueue(engine, table, "boom", {"message": "kaboom 42"})
    worker = start_worker("--burst", "-c", "1")
    assert worker.wait() == 0, worker.log()

    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"], row["last_error"]) == (
        "queued",
        1,
        "ValueError: kaboom 42",
    )
    assert row["locked_until"] is None and row["finished_at"] is None
    # 10 s * 2^attempts after the failure was recorded, which is after the claim.
    backoff = (row["run_at"] - row["started_at"]).total_seconds()
    assert 20 <= backoff < 30, backoff
    assert row["run_at"] > row["db_now"]
    log = worker.log()
    assert f"job {job_id} task=boom attempt=1 raised" in log
    assert "Traceback (most recent call last)" in log
    assert "ValueError: kaboom 42" in log
    assert "outcome=retry in 20s (ValueError: kaboom 42)" in log


def test_burst_exits_0_when_only_future_jobs_remain(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    future = enqueue(engine, table, "record", {"n": 1}, delay=timedelta(hours=1))
    now = enqueue(engine, table, "record", {"n": 2})
    worker = start_worker("--burst")
    assert worker.wait() == 0, worker.log()
    assert job(raw, table, now)["status"] == "done"
    assert (job(raw, table, future)["status"], job(raw, table, future)["attempts"]) == (
        "queued",
        0,
    )
    assert "worker stopped after 1 jobs" in worker.log()


def test_payload_not_matching_the_signature_fails_with_a_clear_error(
    table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    def insert(payload: str) -> int:
        row = raw.execute(
            f'INSERT INTO "{table.name}" (task, payload, max_attempts) '
            "VALUES ('typed', %s::jsonb, 1) RETURNING id",
            (payload,),
        ).fetchone()
        assert row is not None
        return int(row[0])

    missing = insert('{"a": 1}')
    extra = insert('{"a": 1, "b": "x", "c": 3}')
    not_object = insert("[1, 2]")
    good = insert('{"a": 1, "b": "x"}')
    worker = start_worker("--burst", "-c", "1")
    assert worker.wait() == 0, worker.log()

    def failed(job_id: int) -> str:
        row = job(raw, table, job_id)
        assert (row["status"], row["attempts"]) == ("failed", 1)
        return str(row["last_error"])

    prefix = "InvalidPayload: payload does not match typed(a: "
    assert failed(missing).startswith(prefix)
    assert failed(missing).endswith(": missing a required argument: 'b'")
    assert failed(extra).startswith(prefix)
    assert failed(extra).endswith(": got an unexpected keyword argument 'c'")
    assert failed(not_object) == "InvalidPayload: expected a JSON object, got list"
    assert job(raw, table, good)["status"] == "done"
    assert [e["job_id"] for e in events(raw, side)] == [good]


# --------------------------------------------------------------------------- LISTEN / NOTIFY


def test_idle_worker_is_woken_by_notify_not_by_its_poll(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    start_idle_worker(start_worker, raw)

    job_id = enqueue(engine, table, "record")
    # The poll would take 60 s; only the notification explains this.
    row = wait_status(raw, table, job_id, "done", timeout=15)
    assert (row["started_at"] - row["created_at"]).total_seconds() < 15


def test_idle_worker_sleeps_until_the_next_run_at_not_the_poll_interval(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    start_idle_worker(start_worker, raw)

    # One transaction: the ready job's NOTIFY wakes the worker; the delayed
    # job is announced by nobody, ever.
    with engine.begin() as conn:
        ready = client.enqueue(conn, table, "record", {"n": 1})
        delayed = client.enqueue(conn, table, "record", {"n": 2}, delay=timedelta(seconds=2))
    wait_status(raw, table, ready, "done", timeout=15)
    row = wait_status(raw, table, delayed, "done", timeout=20)
    late = (row["started_at"] - row["run_at"]).total_seconds()
    assert 0 <= late < 10, late


def test_killed_listen_connection_is_reestablished_and_notifications_still_wake(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    worker, old = start_idle_worker(start_worker, raw, "--reconnect", "eager")

    raw.execute("SELECT pg_terminate_backend(%s)", (old["pid"],))

    def replaced() -> dict[str, Any] | None:
        new = listen_session(raw, worker)
        return new if new is not None and new["pid"] != old["pid"] else None

    new = wait_until(replaced, 30, "a new LISTEN connection")
    worker.wait_for_log("LISTEN connection restored")
    # Past the catch-up claim that follows a reconnect: asleep again, on the poll of 60 s.
    wait_idle(raw, worker, after=new["query_start"])

    job_id = enqueue(engine, table, "record")
    wait_status(raw, table, job_id, "done", timeout=15)
    assert "LISTEN connection lost" in worker.log()


# --------------------------------------------------------------------------- leases


def test_heartbeats_keep_a_short_lease_alive_while_another_workers_reaper_runs(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    runner = start_worker("-c", "2")
    job_id = enqueue(engine, table, "heartbeat", {"seconds": 4})
    wait_event(raw, side, job_id, "started")
    reaper = start_worker("--reap-interval", "0.5", "--poll-interval", "0.5")

    # An orphan whose lease is long gone: proof that the reaper is running.
    orphan = raw.execute(
        f'INSERT INTO "{table.name}" (task, payload, status, attempts, max_attempts, '
        "locked_until, run_at) VALUES ('record', '{}', 'running', 1, 1, now() - interval '1s', "
        "now() - interval '1s') RETURNING id"
    ).fetchone()[0]  # type: ignore[index]
    reaped = wait_status(raw, table, orphan, "failed")
    assert reaped["last_error"] == "lease expired"

    row = wait_status(raw, table, job_id, "done")
    assert row["attempts"] == 1 and row["last_error"] is None
    assert reaped["finished_at"] < row["finished_at"]  # reaped while the job ran
    assert [(e["event"], e["pid"]) for e in events(raw, side, job_id)] == [
        ("started", runner.pid),
        ("finished", runner.pid),
    ]
    assert f"reaped job {orphan} " in reaper.log()
    assert "lease lost" not in runner.log()


def test_long_lease_task_is_extended_before_the_shorter_claim_lease_runs_out(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    # workerapp's shortest lease is 1 s, so every claim leases 1 s; `sleep`
    # has the default 5 min and must get it before that first second is over.
    worker = start_worker("-c", "2", "--reap-interval", "0.5", "--poll-interval", "0.5")
    job_id = enqueue(engine, table, "sleep", {"seconds": 3})
    wait_event(raw, side, job_id, "started")

    longest = timedelta(0)

    def finished() -> bool:
        nonlocal longest
        row = job(raw, table, job_id)
        if row["locked_until"] is not None:
            longest = max(longest, row["locked_until"] - row["db_now"])
        return any(e["event"] == "finished" for e in events(raw, side, job_id))

    wait_until(finished, 30, "the handler to finish")
    assert [(e["event"], e["attempt"]) for e in events(raw, side, job_id)] == [
        ("started", 1),
        ("finished", 1),
    ], worker.log()
    row = wait_status(raw, table, job_id, "done")
    assert row["attempts"] == 1 and row["last_error"] is None
    assert longest > timedelta(minutes=4), "the lease was never extended to the task's own"
    assert "reaped" not in worker.log()


def test_lease_taken_away_is_logged_as_lost_and_never_completed(
    engine: Engine, table: Table, raw: Raw, side: str, start_worker: StartWorker
) -> None:
    worker = start_worker("-c", "1")
    job_id = enqueue(engine, table, "heartbeat", {"seconds": 3})
    wait_event(raw, side, job_id, "started")

    # What a reaper and a new claim would leave behind, done by hand.
    raw.execute(
        f"UPDATE \"{table.name}\" SET status = 'queued', attempts = attempts + 1, "
        "locked_until = NULL, run_at = now() + interval '1 hour' WHERE id = %s",
        (job_id,),
    )
    worker.wait_for_log(f"job {job_id} task=heartbeat attempt=1: lease lost")
    wait_event(raw, side, job_id, "finished")
    worker.wait_for_log(f"job {job_id} task=heartbeat attempt=1 ")
    wait_until(lambda: "outcome=lost" in worker.log(), 30, "the lost outcome")

    row = job(raw, table, job_id)
    assert (row["status"], row["attempts"], row["finished_at"], row["last_error"]) == (
        "queued",
        2,
        None,
        None,
    )
