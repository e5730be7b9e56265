"""Workers that die: SIGKILL mid-job, and a poison job that takes its worker down."""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest

from tests.support.faultqueue import FaultQueue
from tests.support.processes import Fleet, Workers
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults

FAST = ("--concurrency", "4", "--reap-interval", "0.5", "--poll-interval", "1")


def test_sigkill_mid_job_loses_nothing(fq: FaultQueue, workers: Workers) -> None:
    """5,000 jobs, 3 workers, 2 s leases; a worker holding running jobs is SIGKILLed
    six times and restarted. Every job ends done, every handler ran at least once,
    and every transition is legal and fenced: the killed workers' jobs come back
    only through the reaper, on expired leases."""
    rng = random.Random(5)
    ids = fq.enqueue_work(5000, sleep=0.002, max_attempts=25)
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
    never_started = fq.sql(
        f"""SELECT count(*) FROM {fq.audit} a WHERE a.old_status = 'running'
            AND a.new_status = 'queued' AND a.lease_expired AND NOT EXISTS (
              SELECT 1 FROM {fq.side} s WHERE s.job_id = a.id AND s.attempt = a.old_attempts)"""
    )[0][0]
    # Claimed ahead (prefetch) but never started: charged an attempt all the same.
    print(f"reaped {summary.reaped} attempts, {never_started} of them never started")


@pytest.mark.parametrize("archive_after", ["1s", "0"], ids=["passes", "at_completion"])
def test_sigkill_while_workers_archive_loses_nothing_and_moves_each_job_once(
    fq: FaultQueue, workers: Workers, archive_after: str
) -> None:
    """3,000 jobs, 3 workers archiving done jobs, a worker SIGKILLed four
    times, mid-batch or mid-job, and restarted: with passes every second
    (all three workers' at once, SKIP LOCKED), or with each completion moving
    its jobs (`0`; a move is audited as `running -> done`, and must be its
    owner's). A killed statement rolls back whole: every job ends done, in
    exactly one of the two tables, every transition legal; and in the end
    every one of them is in the archive, once."""
    rng = random.Random(11)
    ids = fq.enqueue_work(3000, sleep=0.002, max_attempts=25)
    env = workers.env(fq, 2.0, JOBQ_ARCHIVE_AFTER=archive_after)
    fleet = Fleet(workers, fq, 3, *FAST, lease=2.0, env=env)
    for _ in range(4):
        threshold = fq.done_count() + rng.randint(200, 500)
        fleet.run_until(lambda t=threshold: fq.done_count() >= t, 60, "progress between kills")
        target = rng.choice([w for w in fleet.slots if w.alive()])
        target.kill(signal.SIGKILL)
        target.proc.wait(10)
    fleet.run_until(lambda: fq.done_count() >= len(ids), 120, "all 3,000 jobs done")
    fq.check_all_done(ids)

    def archived() -> int:
        return int(fq.sql(f"SELECT count(*) FROM {fq.names.archive_qualified}")[0][0])

    fleet.run_until(lambda: archived() == len(ids), 60, "every done job archived")
    assert fq.sql(f"SELECT count(*) FROM {fq.qualified}")[0][0] == 0
    fq.check_all_done(ids)
    summary = fq.check_audit()
    assert summary.count[("running", "done")] == len(ids)


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
        # A replacement may still be starting (the other worker made the
        # progress alone): SIGTERM before its handler is in kills it outright.
        wait_until(lambda w=leaving: "worker started" in w.output(), 30, "the worker up")
        leaving.kill(signal.SIGTERM)
        assert leaving.proc.wait(30) == 0, leaving.output()[-2000:]
    fleet.run_until(lambda: fq.done_count() >= len(ids), 120, "all jobs done")
    fq.check_all_done(ids)
    summary = fq.check_audit()
    assert summary.reaped == 0, "a gracefully stopped worker abandoned a job"
    print("released by their owners at shutdown:", summary.by_owner["queued"])
    assert fleet.deaths == 3


def test_a_worker_death_costs_unstarted_jobs_one_attempt(fq: FaultQueue, workers: Workers) -> None:
    """Attempts are charged at claim time. A worker SIGKILLed while it holds jobs it
    claimed but had not started (claimed ahead of its free slots by `--prefetch`,
    or between claim and handler) costs those jobs one attempt they never ran: the
    reaper puts them back with attempts = 1. So with max_attempts=2, one death
    fails nothing: every job is done, each having run at least once."""
    ids = fq.enqueue_work(3000, sleep=0.001, max_attempts=2)
    args = ("--concurrency", "4", "--reap-interval", "0.5")

    def unstarted() -> list[Any]:
        return fq.sql(
            f"""SELECT j.id FROM {fq.qualified} j WHERE j.status = 'running' AND NOT EXISTS (
                  SELECT 1 FROM {fq.side} s WHERE s.job_id = j.id AND s.attempt = j.attempts)"""
        )

    # Exactly one death: a worker killed without catching any (it started
    # them between the look and the kill) would have charged attempts too,
    # and a job caught by two deaths has used both. So the worker is frozen
    # to look, and let go on if it holds none.
    worker = workers.start(fq, *args, lease=1.0)
    victims: list[Any] = []
    for _ in range(20):
        wait_until(unstarted, 30, "claimed jobs not started yet")
        worker.kill(signal.SIGSTOP)
        victims = unstarted()  # frozen: these stay unstarted
        if victims:
            break
        worker.kill(signal.SIGCONT)
    assert victims, "never caught the worker holding jobs it had not started"
    worker.kill(signal.SIGKILL)
    worker.proc.wait(10)
    workers.start(fq, *args, lease=1.0)
    wait_until(lambda: fq.done_count() >= len(ids), 120, "all jobs done")
    fq.check_all_done(ids)
    fq.check_audit()
    charged = fq.sql(
        f"SELECT attempts FROM {fq.qualified} WHERE id = ANY(%s)", ([v[0] for v in victims],)
    )
    assert {a for (a,) in charged} == {2}, "each unstarted job was charged exactly one attempt"
    print(f"{len(victims)} jobs claimed but not started when their worker died")
