"""Workers that die: SIGKILL mid-job, and a poison job that takes its worker down."""

from __future__ import annotations

import random
import signal

import pytest

from .conftest import FaultQueue, Fleet, Workers, wait_until

pytestmark = pytest.mark.faults

FAST = ("--concurrency", "4", "--reap-interval", "0.5", "--poll-interval", "1")


def test_sigkill_mid_job_loses_nothing(fq: FaultQueue, workers: Workers) -> None:
    """5,000 jobs, 3 workers, 2 s leases; a worker holding running jobs is SIGKILLed
    six times and restarted. Every job ends done, every handler ran at least once,
    and every transition is legal and fenced: the killed workers' jobs come back
    only through the reaper, on expired leases."""
    rng = random.Random(5)
    ids = fq.enqueue_work(5000, sleep=0.002)
    fleet = Fleet(workers, fq, 3, *FAST, lease=2.0)
    kills = 0
    for _ in range(6):
        threshold = fq.done_count() + rng.randint(150, 400)
        fleet.run_until(lambda t=threshold: fq.done_count() >= t, 60, "progress between kills")

        def victim() -> object:
            # A worker that is mid-job: it has a job running that its handler started.
            running = fq.sql(
                f"""SELECT DISTINCT s.pid FROM {fq.side} s JOIN {fq.qualified} j
                    ON j.id = s.job_id AND j.attempts = s.attempt
                    WHERE j.status = 'running'"""
            )
            pids = {w.pid for w in fleet.slots if w.alive()} & {r[0] for r in running}
            return sorted(pids)

        pids = fleet.run_until(victim, 30, "a worker with a job in flight")
        chosen = rng.choice(pids)
        target = next(w for w in fleet.slots if w.pid == chosen)
        target.kill(signal.SIGKILL)
        target.proc.wait(10)
        kills += 1
    fleet.run_until(lambda: fq.done_count() >= len(ids), 120, "all 5,000 jobs done")

    fq.check_all_done(ids)
    summary = fq.check_audit()
    assert kills == 6 and fleet.deaths == 6
    # The kills really hit jobs mid-flight: those came back through the reaper.
    assert summary.reaped >= 6, summary
    assert summary.count[("running", "done")] == len(ids)
    executions = fq.executions()
    assert sum(executions.values()) >= len(ids)


def test_poison_job_fails_at_max_attempts_others_unaffected(
    fq: FaultQueue, workers: Workers
) -> None:
    """A handler that calls os._exit(1) kills its worker on each of its 3 attempts.
    The harness restarts the dead workers; the reaper fails the job at max_attempts
    with 'lease expired'; the 300 other jobs in the run are all done."""
    ids = fq.enqueue_work(150, sleep=0.005)
    poison = fq.enqueue("fx.poison", {}, max_attempts=3)
    ids += fq.enqueue_work(150, sleep=0.005)

    fleet = Fleet(workers, fq, 2, *FAST, lease=2.0)

    def settled() -> bool:
        status = dict(fq.sql(f"SELECT id, status FROM {fq.qualified}"))
        return status[poison] == "failed" and all(status[i] == "done" for i in ids)

    fleet.run_until(settled, 90, "the poison job to fail and the others to finish")
    fleet.restart_dead()

    (row,) = fq.sql(
        f"SELECT status, attempts, max_attempts, last_error FROM {fq.qualified} WHERE id = %s",
        (poison,),
    )
    assert tuple(row) == ("failed", 3, 3, "lease expired")
    assert fq.executions()[poison] == 3
    assert fleet.deaths == 3
    fq.check_all_done(ids)
    summary = fq.check_audit()
    assert summary.count[("running", "failed")] == 1
    wait_until(lambda: all(w.alive() for w in fleet.slots), 5, "workers up")


def test_sigterm_mid_run_hands_jobs_back(fq: FaultQueue, workers: Workers) -> None:
    """Graceful stops mid-run: a worker given SIGTERM stops claiming, lets its running
    jobs finish, hands back the jobs it had claimed ahead (prefetch) or could not
    finish (fenced `release`), and exits 0; a fresh worker takes its place. Three
    such stops in a run of 2,000 short jobs: all done, nothing reaped (nothing was
    abandoned), every return to the queue made by the worker that held the job."""
    ids = fq.enqueue_work(2000, sleep=0.001)
    fleet = Fleet(workers, fq, 2, "--concurrency", "4", "--reap-interval", "0.5", lease=5.0)
    for step in range(3):
        target = fq.done_count() + 300
        fleet.run_until(lambda t=target: fq.done_count() >= t, 60, "progress between stops")
        leaving = fleet.slots[step % 2]
        leaving.kill(signal.SIGTERM)
        assert leaving.proc.wait(30) == 0, leaving.output()[-2000:]
    fleet.run_until(lambda: fq.done_count() >= len(ids), 120, "all jobs done")
    fq.check_all_done(ids)
    summary = fq.check_audit()
    assert summary.reaped == 0, "a gracefully stopped worker abandoned a job"
    print("released by their owners at shutdown:", summary.by_owner["queued"])
    assert fleet.deaths == 3
