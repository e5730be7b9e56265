"""Where plain (sync) handlers run: threads fed in batches, not one future per job (internal)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from .capture import Captured, capture

# A handler's call, and the future its outcome resolves on the loop.
HandlerCall = tuple["asyncio.Future[Captured]", Callable[[], object]]
# A job a thread starts by itself, in the slot its last job freed (see
# `HandlerThreads.follow`): what the loop calls to hear of it, and the job to
# run on that thread (None: the loop runs it).
Follow = tuple[Callable[[], None], HandlerCall | None]


class HandlerThreads:
    """Runs plain (sync) handlers on threads, waking as few threads as it can.

    What `run_in_executor` pays per job (a concurrent Future, its asyncio
    twin, a thread woken to take it and the loop woken to hear back) is paid
    here per batch. Jobs handed over in one turn of the loop wake one thread,
    which runs them one after another: cheap handlers never pay a thread
    switch each. If jobs are waiting while a handler has been running for
    `spread_after` seconds with no other handler starting or finishing, that
    handler is slow: every waiting job gets a thread of its own (at most
    `size`, and the worker never has more than `size` jobs out), so a slow job
    delays the others of its batch by about a millisecond, not by itself.
    (Jobs merely waiting for a woken thread to get the GIL wake no more
    threads: that would only add contention.) Finished jobs are collected in
    a list, and only the first of a batch wakes the loop.

    A thread that finishes a job with nothing handed over waiting asks
    `follow` for the next job to start in the slot it just freed (see
    `sqla_jobq.ready`). The loop hears of that start in the same batch as
    the finished job, right after it, so what it reports running never
    counts both; until then the start counts as in transit (see `ready`).
    """

    def __init__(self, size: int, spread_after: float = 0.001) -> None:
        self.size = size
        self.spread_after = spread_after
        self.pending: deque[HandlerCall] = deque()
        self.permits: queue.SimpleQueue[None] = queue.SimpleQueue()  # C, unlike Semaphore
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.busy = 0  # threads inside a handler (under lock)
        self.unclaimed = 0  # permits released and not yet taken (under lock)
        self.progress = time.monotonic()  # when a handler last started or finished
        self.done: list[tuple[asyncio.Future[Captured], Captured]] = []
        self.follow: Callable[[], Follow | None] | None = None
        self.notices: list[Callable[[], None]] = []  # the loop's, after `done` (under lock)
        self.closing = False
        self.kicked = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self, call: Callable[[], object]) -> asyncio.Future[Captured]:
        """Run `call` on a thread; the future resolves with its outcome as a
        value (it never resolves with an exception: see `capture`)."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        future = self.loop.create_future()
        self.pending.append((future, call))
        if not self.kicked:
            # The first job of this turn of the loop wakes a thread at once
            # (it gets the GIL when the loop next waits, by which time the
            # rest of the turn's jobs are queued behind it).
            self.kicked = True
            self._wake(1)
            self.loop.call_soon(self._kicked)
        return future

    def run_here(self, future: asyncio.Future[Captured], call: Callable[[], object]) -> None:
        """Run `call` on the calling thread, not one of ours (the listener's:
        see `sqla_jobq.pickup`), its outcome delivered to `future` on the
        loop with our own threads' outcomes."""
        if self.loop is None:
            self.loop = future.get_loop()
        self.progress = time.monotonic()
        outcome = capture(call)
        self.progress = time.monotonic()
        self._done(future, outcome, ours=False)

    def _kicked(self) -> None:
        self.kicked = False
        if self.pending:  # in case that thread had already gone back to sleep
            self._wake(1)
        assert self.loop is not None
        self.loop.call_later(self.spread_after, self._spread)

    def _spread(self) -> None:
        waiting = len(self.pending)
        if not waiting:
            return
        stalled = time.monotonic() - self.progress >= self.spread_after
        self._wake(waiting if stalled and self.busy else 1)
        assert self.loop is not None
        self.loop.call_later(self.spread_after, self._spread)

    def _wake(self, count: int) -> None:
        """Make sure `count` threads are awake or about to be, starting new ones if needed."""
        with self.lock:
            release = max(0, count - self.unclaimed)
            self.unclaimed += release
            needed = min(self.size, self.busy + self.unclaimed)
        for _ in range(needed - len(self.threads)):
            thread = threading.Thread(
                target=self._work, name=f"jobq_{len(self.threads)}", daemon=True
            )
            self.threads.append(thread)
            thread.start()
        for _ in range(release):
            self.permits.put(None)

    def _work(self) -> None:
        assert self.loop is not None
        while True:
            self.permits.get()
            if self.closing:
                return
            with self.lock:
                self.unclaimed -= 1
            job = self._handed_over()
            while job is not None:
                future, call = job
                with self.lock:
                    self.busy += 1
                self.progress = time.monotonic()
                outcome = capture(call)
                self.progress = time.monotonic()
                notice, job = self._follow() or (None, None)
                if not self._done(future, outcome, ours=True, notice=notice):
                    return
                job = job or self._handed_over()

    def _handed_over(self) -> HandlerCall | None:
        while True:
            try:
                future, call = self.pending.popleft()
            except IndexError:
                return None
            if not future.cancelled():  # else its job was given up before a thread took it
                return future, call

    def _follow(self) -> Follow | None:
        """What to start in the slot just freed, when no job handed over waits for it."""
        if self.follow is None or self.pending or self.closing:
            return None
        return self.follow()

    def _done(
        self,
        future: asyncio.Future[Captured],
        outcome: Captured,
        ours: bool,
        notice: Callable[[], None] | None = None,
    ) -> bool:
        """Queue an outcome for the loop (the first of a batch wakes it), with
        the `notice` of a job started in its slot, and count one of our
        threads out of its handler; False if the loop is closed: nobody is
        waiting any more."""
        assert self.loop is not None
        with self.lock:
            self.busy -= ours
            if notice is not None:
                self.notices.append(notice)
            self.done.append((future, outcome))
            first = len(self.done) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                return False
        return True

    def _deliver(self) -> None:
        with self.lock:
            batch, self.done = self.done, []
            notices, self.notices = self.notices, []
        for future, outcome in batch:
            if not future.done():
                future.set_result(outcome)
        assert self.loop is not None
        for notice in notices:  # after the callbacks set_result has just scheduled
            self.loop.call_soon(notice)

    def shutdown(self, timeout: float = 1.0) -> None:
        """Drop calls no thread has taken yet, and let idle threads exit; a
        handler still running keeps its thread."""
        self.closing = True
        self.pending.clear()
        for _ in self.threads:
            self.permits.put(None)
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
