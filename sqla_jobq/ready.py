"""Claimed attempts waiting for a slot, started by the loop or by a handler thread (internal).

A slot used to turn over only through the event loop: a handler thread that
finished a job told the loop, which freed the slot and handed the next
waiting job to a thread. With no-op jobs that is two thread wake-ups per
batch, and a loop busy with claims and completions made every slot wait for
it: at its capacity, the worker's handlers sat idle with dozens of jobs
claimed (docs/benchmarks.md, the held snapshot's tenth round). Now a thread
that finishes a plain job starts the next waiting one itself, in the slot it
just freed, and the loop hears of the start in the same batch as the
finished job (right after it; until then the start is `in_transit`).

Every way out of the queue goes through one lock: the loop's own starts, the
threads' starts, taking every waiting attempt (to hand it back: stuck behind
a slow job, or at shutdown), and losing an attempt (its row is no longer
ours). So an attempt is started at most once, never after it was taken to be
handed back or was lost, never once its lease ran out (that one is left for
the loop to hand back, so the database decides whether it is still ours),
and never after `close`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .attempt import Attempt, State


class ReadyQueue:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: deque[Attempt] = deque()
        self.closed = False  # stopping: nothing more starts (under lock)
        # Started on a thread, not yet known to the loop (under lock).
        self.in_transit = 0

    def __len__(self) -> int:
        return len(self.waiting)

    def append(self, attempt: Attempt) -> None:
        with self.lock:
            self.waiting.append(attempt)

    def oldest_claimed_at(self) -> float | None:
        with self.lock:
            return self.waiting[0].claimed_at if self.waiting else None

    def start_next(self, now: float, lapsed: list[Attempt]) -> Attempt | None:
        """The loop's start: the oldest attempt still ours, started; those
        whose leases ran out meanwhile go to `lapsed`, for a hand-back."""
        with self.lock:
            while (attempt := self._head()) is not None:
                self.waiting.popleft()
                if attempt.lease_valid(now):
                    attempt.start(now)
                    return attempt
                lapsed.append(attempt)
        return None

    def start_here(self, now: float, runs_here: Callable[[Attempt], bool]) -> Attempt | None:
        """A handler thread's start, in the slot its last job freed: the
        oldest attempt, if `runs_here` and its lease is valid. Anything else
        at the head is left for the loop, which knows what to do with it."""
        with self.lock:
            attempt = self._head()
            if attempt is None or not (attempt.lease_valid(now) and runs_here(attempt)):
                return None
            self.waiting.popleft()
            attempt.start(now)
            self.in_transit += 1
            return attempt

    def _head(self) -> Attempt | None:
        """The oldest waiting attempt still ours, left in place (those lost
        while they waited are dropped); None once closed (under lock)."""
        while self.waiting and not self.closed:
            if self.waiting[0].state is State.CLAIMED:
                return self.waiting[0]
            self.waiting.popleft()
        return None

    def arrived(self) -> None:
        """The loop has heard of a thread's start."""
        with self.lock:
            self.in_transit -= 1

    def take(self) -> list[Attempt]:
        """Every waiting attempt still ours, out of the queue: none of them starts."""
        with self.lock:
            taken = [a for a in self.waiting if a.state is State.CLAIMED]
            self.waiting.clear()
        return taken

    def lose(self, attempt: Attempt) -> State:
        """Mark the attempt lost, so no thread starts it; the state it was in."""
        with self.lock:
            was = attempt.state
            attempt.lose()
        return was

    def close(self) -> None:
        with self.lock:
            self.closed = True
