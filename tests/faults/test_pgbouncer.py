"""Workers behind PgBouncer 1.18 in transaction pooling mode."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import Registry
from sqla_jobq.db import conninfo
from tests.support.faultqueue import FaultQueue
from tests.support.inprocess import running
from tests.support.pgbouncer import Bouncer
from tests.support.processes import Workers
from tests.support.rows import enqueue
from tests.support.rows import job_row as row
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

Raw = psycopg.Connection[Any]


def test_transaction_pooling_runs_each_job_exactly_once(
    pgbouncer: Bouncer, fq: FaultQueue, workers: Workers
) -> None:
    """10,000 jobs, 2 workers whose statements go through PgBouncer (transaction
    mode, `--no-prepared`) and whose LISTEN goes straight to PostgreSQL
    (`--listen-url`). No faults, leases longer than any job: each job is claimed
    once, run once (one side-effect row) and completed once."""
    ids = fq.enqueue_work(10_000)
    args = ("--no-prepared", "--listen-url", fq.url, "--concurrency", "8")
    procs = [workers.start(fq, *args, database_url=pgbouncer.url, lease=60) for _ in range(2)]
    wait_until(lambda: fq.done_count() >= len(ids), 240, "10,000 jobs done through pgbouncer")
    assert all(p.alive() for p in procs)
    fq.check_all_done(ids)
    executions = fq.executions()
    assert set(executions.values()) == {1}, "a job ran more than once"
    summary = fq.check_audit()
    assert summary.count[("queued", "running")] == len(ids)
    assert summary.count[("running", "done")] == len(ids)
    assert sum(summary.count.values()) == 3 * len(ids)  # insert, claim, complete
    logs = "".join(p.output() for p in procs)
    assert "WARNING" not in logs and "ERROR" not in logs, logs[-3000:]


def test_prepared_statements_break_behind_pgbouncer_118(
    pgbouncer: Bouncer, fq: FaultQueue, workers: Workers
) -> None:
    """Why `--no-prepared` is required: with server-side prepared statements (the
    default), psycopg names them `_pg3_0`, `_pg3_1`, ... per client connection, and
    PgBouncer 1.18 hands each transaction to whichever server connection is free. A
    name prepared by one client is missing on the next server ("does not exist"),
    already taken by another client ("already exists"), or names another client's
    statement ("bind message supplies 2 parameters, but prepared statement ...
    requires 3"). Claims and completions fail; the jobs whose completion failed
    stay running until their lease expires and are run again. Nothing is lost or
    double-completed (the fences hold), but work is duplicated and throughput
    collapses."""
    fq.enqueue_work(1000)
    args = ("--listen-url", fq.url, "--concurrency", "8", "--reap-interval", "0.5")
    procs = [workers.start(fq, *args, database_url=pgbouncer.url, lease=1) for _ in range(2)]

    def prepared_errors() -> bool:
        return 'prepared statement "_pg3_' in "".join(p.output() for p in procs)

    wait_until(prepared_errors, 30, "prepared-statement errors behind pgbouncer")
    for p in procs:
        p.stop()
    fq.check_audit()  # still: every transition legal and fenced


def test_a_row_another_session_holds_stalls_no_completion_behind_pgbouncer(
    pgbouncer: Bouncer, engine: Engine, table: Table, raw: Raw, database_url: str
) -> None:
    """PgBouncer drops the worker's startup options, its 200 ms `lock_timeout`
    among them, so a completion waiting on a row an admin's open transaction
    holds used to wait as long as that transaction, and every outcome behind
    it with it. The fenced completion and failure carry their lock timeout
    in the statement itself: the held job is retried, the next one is
    recorded while the row is still held."""
    registry = Registry(table)
    started, locked = threading.Event(), threading.Event()

    @registry.task(name="held")
    def held() -> None:
        started.set()
        locked.wait(10)  # finish only once its row is locked: the completion must wait

    @registry.task(name="quick")
    def quick() -> None:
        pass

    @registry.task(name="broken")
    def broken() -> None:
        raise ValueError("recorded while a row is held")

    held_id = enqueue(engine, table, "held")
    options = {"prepared": False, "listen_url": database_url, "concurrency": 2}
    with (
        running(registry, pgbouncer.url, **options),
        psycopg.connect(conninfo(database_url)) as holder,
    ):
        assert started.wait(10), "the held job never ran"
        holder.execute(f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE', (held_id,))
        locked.set()
        quick_id = enqueue(engine, table, "quick")
        broken_id = enqueue(engine, table, "broken", max_attempts=1)
        wait_until(lambda: row(raw, table, quick_id)["status"] == "done", 10, "quick done")
        wait_until(lambda: row(raw, table, broken_id)["status"] == "failed", 10, "broken failed")
        assert row(raw, table, held_id)["status"] == "running"  # still held, still ours
        holder.rollback()
        wait_until(lambda: row(raw, table, held_id)["status"] == "done", 10, "held done")
    assert row(raw, table, held_id)["attempts"] == 1
