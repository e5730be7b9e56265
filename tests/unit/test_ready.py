"""The ready queue: handler threads start attempts beside the loop, and every
way out of the queue is decided once (sqla_jobq/ready.py).

The races are run, not argued: real threads start attempts in a loop while
the test thread takes, loses and closes, and every attempt must end in
exactly one of those hands.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from sqla_jobq.attempt import Attempt, State
from sqla_jobq.ready import ReadyQueue

LEASE = timedelta(seconds=30)


def attempt(job_id: int, task: str = "plain", lease: timedelta = LEASE) -> Attempt:
    return Attempt.claimed({"id": job_id, "attempts": 1, "task": task}, lease, lease)


def plain(a: Attempt) -> bool:
    return a.task_name == "plain"


def filled(count: int) -> tuple[ReadyQueue, list[Attempt]]:
    ready = ReadyQueue()
    attempts = [attempt(i) for i in range(count)]
    for a in attempts:
        ready.append(a)
    return ready, attempts


@pytest.fixture
def switching_often() -> Iterator[None]:
    """Threads switch every microsecond, not every 5 ms: at the default, one
    thread would empty the queue before another ran at all."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("switching_often")
def test_threads_and_the_loop_never_start_one_attempt_twice_nor_one_taken_or_lost() -> None:
    for _ in range(20):
        _race_once()


def _race_once() -> None:
    """Four threads start as fast as they can, as after each finished job,
    while the loop loses some, starts some and takes the rest."""
    ready, attempts = filled(2_000)
    started: list[list[Attempt]] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    go = threading.Barrier(5)

    def thread_starts(mine: list[Attempt]) -> None:
        go.wait()
        try:
            while (a := ready.start_here(time.monotonic(), plain)) is not None:
                mine.append(a)
                ready.arrived()
        except BaseException as exc:  # reported below: a thread's own would be lost
            errors.append(exc)

    threads = [threading.Thread(target=thread_starts, args=(s,)) for s in started]
    for t in threads:
        t.start()
    go.wait()
    was = {a.key: ready.lose(a) for a in attempts[1_000::7]}  # started, or not yet
    lost = [a for a in attempts if was.get(a.key) is State.CLAIMED]
    loop_started: list[Attempt] = []
    for _ in range(50):
        if (a := ready.start_next(time.monotonic(), [])) is not None:
            loop_started.append(a)
    taken = ready.take()
    for t in threads:
        t.join()
    assert errors == []
    by_threads = [a for s in started for a in s]
    ends = [*by_threads, *loop_started, *taken, *lost]
    assert sorted(a.key for a in ends) == sorted(a.key for a in attempts), "not once each"
    for a in [*by_threads, *loop_started]:  # lost once started: the worker stops it
        assert a.state is (State.LOST if was.get(a.key) is State.STARTED else State.STARTED)
    assert all(a.state is State.CLAIMED for a in taken)
    assert all(a.state is State.LOST for a in lost)
    assert ready.in_transit == 0 and len(ready) == 0


def test_a_thread_leaves_an_attempt_whose_lease_ran_out_to_the_loop() -> None:
    ready = ReadyQueue()
    lapsed = attempt(1, lease=timedelta(seconds=0.01))
    fresh = attempt(2)
    ready.append(lapsed)
    ready.append(fresh)
    later = time.monotonic() + 1.0
    assert ready.start_here(later, plain) is None
    assert lapsed.state is State.CLAIMED and len(ready) == 2
    handed_back: list[Attempt] = []
    assert ready.start_next(later, handed_back) is fresh
    assert handed_back == [lapsed] and lapsed.state is State.CLAIMED


def test_a_thread_leaves_what_it_cannot_run_to_the_loop_and_keeps_the_order() -> None:
    ready = ReadyQueue()
    first, second = attempt(1, task="async"), attempt(2)
    ready.append(first)
    ready.append(second)
    assert ready.start_here(time.monotonic(), plain) is None
    assert ready.start_next(time.monotonic(), []) is first
    assert ready.start_here(time.monotonic(), plain) is second
    assert ready.in_transit == 1


def test_nothing_starts_once_closed_and_take_still_returns_every_waiting_attempt() -> None:
    ready, attempts = filled(3)
    ready.lose(attempts[1])
    ready.close()
    assert ready.start_here(time.monotonic(), plain) is None
    assert ready.start_next(time.monotonic(), []) is None
    assert ready.take() == [attempts[0], attempts[2]]


def test_a_lost_attempt_at_the_head_is_dropped_and_the_next_one_starts() -> None:
    ready, attempts = filled(2)
    assert ready.lose(attempts[0]) is State.CLAIMED
    assert ready.start_here(time.monotonic(), plain) is attempts[1]
    assert len(ready) == 0
