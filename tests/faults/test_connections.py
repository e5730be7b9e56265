"""Lost connections: the claim, completion and LISTEN sessions of a live worker
are terminated by the server, and a notification is dropped outright."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from sqla_jobq import client
from sqla_jobq.db import conninfo, parse_url
from tests.support.faultqueue import FaultQueue, backends, drop_role, terminate
from tests.support.processes import WorkerProcess, Workers
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults


def session(url: str, worker: WorkerProcess, kind: str) -> int | None:
    """The backend pid of one of a worker's sessions, told apart by its last query."""
    for pid, _state, query in backends(url, worker.app_name):
        text = query or ""
        is_listen = text.lstrip().upper().startswith("LISTEN")
        is_finisher = "status='done'" in text  # complete_many
        if kind == "listen" and is_listen:
            return pid
        if kind == "finisher" and is_finisher:
            return pid
        if kind == "claim" and ("SKIP LOCKED" in text or "min(" in text):
            return pid
    return None


def replaced(url: str, worker: WorkerProcess, kind: str, old: int) -> int | None:
    pid = session(url, worker, kind)
    return pid if pid is not None and pid != old else None


def test_claim_and_completion_connections_terminated_mid_run(
    fq: FaultQueue, workers: Workers
) -> None:
    """While 3,000 jobs flow through one worker, its claim connection is terminated
    three times and its completion connection twice (pg_terminate_backend). The same
    process reconnects by itself each time and finishes every job; nothing is run by
    a session that lost its claim."""
    ids = fq.enqueue_work(3000, sleep=0.002)
    worker = workers.start(fq, "--concurrency", "4", "--reap-interval", "0.5")
    for kind in ("claim", "finisher", "claim", "finisher", "claim"):
        target = fq.done_count() + 300
        wait_until(lambda t=target: fq.done_count() >= t, 60, "jobs to flow")
        pid = wait_until(lambda k=kind: session(fq.url, worker, k), 10, f"the {kind} session")
        assert terminate(fq.url, pid)
        wait_until(
            lambda k=kind, p=pid: replaced(fq.url, worker, k, p),
            15,
            f"the worker to open a new {kind} session",
        )
        assert worker.alive()
    wait_until(lambda: fq.done_count() >= len(ids), 120, "all jobs done")
    assert worker.alive(), "the worker must ride out lost connections, not exit"
    fq.check_all_done(ids)
    fq.check_audit()


def test_listen_connection_terminated_pickup_stays_fast(fq: FaultQueue, workers: Workers) -> None:
    """With --poll-interval 60, an idle worker learns of new jobs only by LISTEN. Its
    LISTEN session is terminated: it reconnects and LISTENs again by itself, and a
    job enqueued afterwards starts within seconds, not after the 60 s poll. A job
    enqueued while the LISTEN session is down is caught up on reconnection."""
    worker = workers.start(
        fq, "--poll-interval", "60", "--reconnect", "eager", "--concurrency", "2"
    )
    first = wait_until(lambda: session(fq.url, worker, "listen"), 20, "the LISTEN session")
    # Let the worker settle into its 60 s idle wait (its first claim found nothing).
    wait_until(lambda: session(fq.url, worker, "claim"), 20, "the first claim")

    def started_within(job_id: int, seconds: float) -> float:
        t0 = time.monotonic()
        wait_until(lambda: fq.job(job_id)["status"] == "done", seconds, f"job {job_id} done")
        return time.monotonic() - t0

    # Warm path: notification wakes the idle worker.
    assert started_within(fq.enqueue(), 5) < 5

    # 1. Kill LISTEN, wait for the new LISTEN session, then enqueue.
    assert terminate(fq.url, first)
    second = wait_until(
        lambda: replaced(fq.url, worker, "listen", first), 15, "a new LISTEN session"
    )
    assert started_within(fq.enqueue(), 5) < 5

    # 2. Kill LISTEN and enqueue at once, before it is back: the reconnection catches up.
    assert terminate(fq.url, second)
    assert started_within(fq.enqueue(), 8) < 8
    assert worker.alive()
    assert "LISTEN connection lost" in worker.output()
    fq.check_all_done()
    fq.check_audit()


@pytest.fixture
def listen_role(database_url: str) -> Iterator[str]:
    """A login role used only for a worker's LISTEN session, so a test can lock it out."""
    role = f"fx_listen_{uuid.uuid4().hex[:8]}"
    admin = conninfo(database_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN'.encode())
    yield role
    with psycopg.connect(admin, autocommit=True) as conn:
        drop_role(conn, role)


def test_dropped_notification_fallback_poll(
    listen_role: str, fq: FaultQueue, workers: Workers
) -> None:
    """The LISTEN session is killed between a job's INSERT and its COMMIT, and cannot
    come back (its role may no longer log in): the NOTIFY of that commit reaches
    nobody. The job still starts, through the fallback poll (--poll-interval 3),
    within 3-6 s. Once the role may log in again, LISTEN is restored by itself."""
    listen_url = parse_url(fq.url).set(username=listen_role).render_as_string(False)
    worker = workers.start(fq, "--poll-interval", "3", "--listen-url", listen_url)
    listen = wait_until(lambda: session(fq.url, worker, "listen"), 20, "the LISTEN session")
    wait_until(lambda: session(fq.url, worker, "claim"), 20, "the first claim")

    with fq.engine() as engine, engine.connect() as conn:
        tx = conn.begin()
        job_id = client.enqueue(conn, fq.table, "fx.work", {"n": 1})
        with fq.connect() as admin:
            admin.execute(f'ALTER ROLE "{listen_role}" NOLOGIN'.encode())
        assert terminate(fq.url, listen)
        wait_until(lambda: session(fq.url, worker, "listen") is None, 10, "LISTEN gone")
        tx.commit()
        committed = time.monotonic()

    wait_until(lambda: fq.job(job_id)["status"] != "queued", 8, "the job to start")
    waited = time.monotonic() - committed
    assert waited < 6.5, f"the fallback poll took {waited:.1f}s"
    assert session(fq.url, worker, "listen") is None, "nobody was listening: a real drop"

    with fq.connect() as admin:
        admin.execute(f'ALTER ROLE "{listen_role}" LOGIN'.encode())
    wait_until(lambda: session(fq.url, worker, "listen"), 15, "LISTEN restored")
    t0 = time.monotonic()
    later = fq.enqueue()
    wait_until(lambda: fq.job(later)["status"] == "done", 5, "the next job")
    assert time.monotonic() - t0 < 5
    fq.check_all_done()
    fq.check_audit()
