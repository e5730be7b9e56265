"""Expired leases: a slow owner that lost its job, and reapers racing finishers."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.pool import NullPool

from sqla_jobq import statements
from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.driver import Compiled
from tests.support.faultqueue import FaultQueue
from tests.support.processes import Workers
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

HOUR = timedelta(hours=1)


@contextmanager
def session(fq: FaultQueue, name: str) -> Iterator[Connection]:
    """An autocommit SQLAlchemy connection whose writes the audit attributes to `name`."""
    engine = create_engine(
        parse_url(fq.url),
        poolclass=NullPool,
        isolation_level="AUTOCOMMIT",
        connect_args={"application_name": name},
    )
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def test_slow_owner_changes_nothing_after_its_lease_expired(fq: FaultQueue) -> None:
    """`slow` claims two jobs; time passes beyond their leases; they are reaped and
    claimed again by `fast`. Every statement `slow` can still run with its old
    attempts (complete, fail, extend_lease, release) matches 0 rows, before `fast`
    claims, while `fast` runs, and after `fast` finishes; each job ends with its
    new owner's outcome (one done, one failed with fast's error), rows unchanged."""
    t = fq.table
    first = fq.enqueue(max_attempts=2)
    second = fq.enqueue(max_attempts=2)
    with session(fq, "slow") as slow, session(fq, "fast") as fast, session(fq, "reaper") as reaper:
        claimed = slow.execute(statements.claim(t, limit=2, lease=HOUR)).all()
        assert sorted((r.id, r.attempts) for r in claimed) == [(first, 1), (second, 1)]
        # Time passes: both leases run out (the lease is data, so move it).
        reaper.execute(text(f"UPDATE {fq.qualified} SET locked_until = now() - interval '1 s'"))
        reaped = reaper.execute(statements.reap(t)).all()
        assert sorted((r.id, r.status) for r in reaped) == [(first, "queued"), (second, "queued")]

        def stale(job_id: int) -> None:
            before = fq.job(job_id)
            for stmt in (
                statements.complete(t, job_id, 1),
                statements.fail(t, job_id, 1, "slow's error"),
                statements.extend_lease(t, job_id, 1, HOUR),
                statements.release(t, job_id, 1),
                statements.complete_many(t, [(job_id, 1)]),
                statements.extend_leases(t, [(job_id, 1)], HOUR),
            ):
                assert slow.execute(stmt).rowcount == 0, stmt
            assert fq.job(job_id) == before, "a stale statement changed the row"

        for job_id in (first, second):
            stale(job_id)  # queued again, nobody owns it
        again = fast.execute(statements.claim(t, limit=2, lease=HOUR)).all()
        assert sorted((r.id, r.attempts) for r in again) == [(first, 2), (second, 2)]
        for job_id in (first, second):
            stale(job_id)  # running, owned by fast
            assert fast.execute(statements.extend_lease(t, job_id, 2, HOUR)).rowcount == 1
        assert fast.execute(statements.complete(t, first, 2)).rowcount == 1
        assert fast.execute(statements.fail(t, second, 2, "fast's error")).rowcount == 1
        for job_id in (first, second):
            stale(job_id)  # finished by fast
    done, failed = fq.job(first), fq.job(second)
    assert (done["status"], done["attempts"], done["last_error"]) == ("done", 2, "lease expired")
    assert (failed["status"], failed["attempts"], failed["last_error"]) == (
        "failed",
        2,
        "fast's error",
    )
    summary = fq.check_audit()
    assert summary.reaped == 2


def test_slow_worker_process_is_reaped_and_loses_its_job(fq: FaultQueue, workers: Workers) -> None:
    """A real worker is frozen (SIGSTOP) mid-job until its 2 s lease expires; a second
    worker reaps the job and runs it again. Thawed, the slow worker finds its lease
    gone: none of its completion, failure or lease-extension statements changes the
    row (the audit has no transition of its, other than its claim), and the job
    ends done by its new owner at attempt 2."""
    job_id = fq.enqueue("fx.work", {"n": 1, "sleep": 4.0})
    args = ("--concurrency", "1", "--reap-interval", "0.5", "--poll-interval", "1")
    slow = workers.start(fq, *args, lease=2.0)

    def attempts_run() -> dict[int, int]:
        return {
            a: p
            for a, p in fq.sql(f"SELECT attempt, pid FROM {fq.side} WHERE job_id = %s", (job_id,))
        }

    wait_until(lambda: attempts_run().get(1) == slow.pid, 20, "the slow worker to start the job")
    slow.kill(signal.SIGSTOP)
    try:
        fast = workers.start(fq, *args, lease=2.0)
        wait_until(lambda: attempts_run().get(2) == fast.pid, 30, "the job to be taken over")
    finally:
        slow.kill(signal.SIGCONT)
    wait_until(lambda: fq.job(job_id)["status"] == "done", 30, "the new owner to finish")
    wait_until(
        lambda: "lease lost" in slow.output() or "no longer ours" in slow.output(),
        15,
        "the slow worker to notice it lost the job",
    )
    row = fq.job(job_id)
    assert (row["status"], row["attempts"]) == ("done", 2)
    fq.check_audit()
    by_slow = fq.sql(
        f"SELECT old_status, new_status, new_attempts FROM {fq.audit} WHERE app = %s",
        (slow.app_name,),
    )
    assert by_slow == [("queued", "running", 1)], by_slow
    (last,) = fq.sql(
        f"SELECT new_status, app FROM {fq.audit} WHERE id = %s ORDER BY seq DESC LIMIT 1", (job_id,)
    )
    assert tuple(last) == ("done", fast.app_name)
    assert slow.alive() and fast.alive()


def test_reaper_racing_finishers_thousands_of_times(fq: FaultQueue) -> None:
    """Two finisher threads claim one job at a time with a 1-5 ms lease, sleep 0-6 ms
    and complete; a reaper thread reaps in a loop. Over 1,500 jobs (thousands of
    claim/complete/reap races on the same rows), every job ends done exactly once,
    by the finisher holding its last attempt; every completion that matched nothing
    was of an attempt the reaper had taken back; a done job carries 'lease expired'
    only if an earlier attempt of it was reaped; and the audit shows no transition
    made from a stale attempts value."""
    jobs = 1500
    ids = fq.enqueue_work(jobs, max_attempts=1_000_000)
    t = fq.table
    claim = Compiled.of(statements.claim(t, limit=1))
    complete = Compiled.of(statements.complete(t, 0, 0))
    reap = Compiled.of(statements.reap(t))
    completes: list[tuple[int, int, int]] = []
    reaps: list[tuple[int, str, int]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def connect(name: str) -> psycopg.Connection[Any]:
        return psycopg.connect(conninfo(fq.url), autocommit=True, application_name=name)

    def finisher(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with connect(f"finisher-{seed}") as conn:
                while not stop.is_set():
                    lease = timedelta(microseconds=rng.randint(1000, 5000))
                    rows = conn.execute(claim.sql, claim.params(limit=1, lease=lease)).fetchall()
                    if not rows:
                        left = conn.execute(
                            f"SELECT count(*) FROM {fq.qualified} WHERE status <> 'done'".encode()
                        ).fetchone()
                        if left is not None and left[0] == 0:
                            return
                        time.sleep(0.0005)
                        continue
                    job_id, attempts = rows[0][0], rows[0][4]
                    time.sleep(rng.uniform(0, 0.006))
                    cur = conn.execute(complete.sql, complete.params(id=job_id, attempts=attempts))
                    completes.append((job_id, attempts, cur.rowcount))
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    def reaper() -> None:
        rng = random.Random(99)
        try:
            with connect("reaper") as conn:
                while not stop.is_set():
                    reaps.extend(conn.execute(reap.sql, reap.params()).fetchall())
                    time.sleep(rng.uniform(0, 0.001))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=finisher, args=(s,)) for s in (1, 2)]
    reaper_thread = threading.Thread(target=reaper)
    for th in [*threads, reaper_thread]:
        th.start()
    deadline = time.monotonic() + 120
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    reaper_thread.join(10)
    assert not any(th.is_alive() for th in [*threads, reaper_thread]), "race did not finish"
    assert not errors, errors

    rows = {
        r[0]: r[1:] for r in fq.sql(f"SELECT id, status, attempts, last_error FROM {fq.qualified}")
    }
    assert all(status == "done" for status, _, _ in rows.values())
    won = {}
    for job_id, attempts, count in completes:
        if count == 1:
            assert job_id not in won, f"job {job_id} completed twice"
            won[job_id] = attempts
    assert won.keys() == set(ids)
    reaped_at = {(job_id, attempts) for job_id, _, attempts in reaps}
    for job_id, attempts, count in completes:
        if count == 0:
            assert (job_id, attempts) in reaped_at, f"job {job_id} attempt {attempts} lost unreaped"
    for job_id, (_, attempts, last_error) in rows.items():
        assert attempts == won[job_id], f"job {job_id} done at {attempts}, won at {won[job_id]}"
        earlier = any((job_id, a) in reaped_at for a in range(1, attempts))
        assert (last_error == "lease expired") == earlier, (job_id, last_error, earlier)
        assert (job_id, attempts) not in reaped_at, f"job {job_id}: final attempt also reaped"
    summary = fq.check_audit()
    lost = sum(1 for c in completes if c[2] == 0)
    # Both sides won often: the race was real.
    assert summary.reaped == len(reaps) and len(reaps) > 100 and lost > 100
    assert summary.count[("running", "done")] == jobs
    print(f"race: {len(completes)} completions ({lost} too late), {len(reaps)} reaps")
