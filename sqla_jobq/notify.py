"""The LISTEN connection: a hint that jobs are ready, never the queue itself (internal).

Notifications arrive only at commit, only to sessions listening at that moment,
and identical ones coalesce, so the worker treats each as "go and claim" and
keeps a fallback poll. LISTEN belongs to a server session, so it needs a direct
connection (a transaction-mode pooler would hand the session to someone else).
When the connection drops, reconnect with backoff, LISTEN again, and wake the
worker once to catch up on whatever was announced while nobody listened.

How soon to reconnect is a choice. *Eager* reconnects with backoff at once.
*Lazy* waits until the worker talks to the database anyway (its next poll, or
work to record): a serverless compute that suspended, closing every
connection, is not woken again by a worker that has nothing to do.

The connection is waited on by a thread blocked in `poll`, not by the
worker's event loop: an idle worker's pickup latency is a chain of wake-ups,
and each hop in it (the loop noticing the socket, then the claim's own
socket, then the hand-over to a handler thread) cost about a tenth of a
millisecond here. A notification wakes the listening thread at once, and
`pickup` (see `sqla_jobq.pickup`) may claim right there and give back the
first job's handler to run on that same thread. Two threads take turns, so
one always listens: the one that runs a handler first hands listening over to
the other, which never runs one while its partner still does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple, Protocol

import psycopg
from psycopg import sql

from .db import RETRY_MAX, RETRY_START, connect_kwargs, conninfo

log = logging.getLogger("sqla_jobq.notify")

# How long `stop()` waits for a thread that is listening (it may be inside a
# connection attempt); one running a handler is not waited for.
JOIN_SECONDS = 5.0


class Handover(NamedTuple):
    """An idle claim whose first job runs on the listening thread: `deliver`
    first (the other thread does, so that the worker's loop, woken by it,
    does not take the GIL from the handler's start), then `run` (this one)."""

    deliver: Callable[[], None]
    run: Callable[[], None]


class Pickup(Protocol):
    def heard(self, *, here: bool) -> Handover | bool:
        """On the listening thread, for a notification of one of our queues:
        False to wake the worker; True if it claimed and told the worker; or,
        only if `here`, a handler to run on this thread once the other has
        told the worker."""


class Listener:
    """Calls `wake()` on every notification for our queues, and after reconnecting.

    `wake` and `hint` run on the event loop that called `run()`; `pickup.heard`
    runs on the listening thread.
    """

    def __init__(
        self,
        url: str,
        channel: str,
        queues: Collection[str],
        wake: Callable[[], None],
        *,
        eager: bool = True,
        hint: Callable[[str], None] | None = None,
        pickup: Pickup | None = None,
    ) -> None:
        self.url = conninfo(url)
        self.channel = channel
        self.queues = set(queues)
        self.wake = wake
        self.eager = eager
        self.hint = hint  # for notifications that name no queue (`#cancel <id>`)
        self.pickup = pickup
        self.allowed = threading.Event()  # lazy: the worker is using the database
        self._stopping = False
        self._bell_r, self._bell_w = socket.socketpair()
        self._bell_r.setblocking(False)
        self._bell_w.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        # Whoever holds the turn listens; the state below is the listener's.
        self._turn = threading.Lock()
        self._running: threading.Thread | None = None  # the thread inside a handler
        self._deliver: Callable[[], None] | None = None  # for the next to take the turn
        self._waking = False  # a wake is on its way to the loop
        self._conn: psycopg.Connection[Any] | None = None
        self._delay = RETRY_START
        self._connected_once = False

    def poke(self) -> None:
        """The worker is talking to the database anyway: a lazy listener may reconnect.

        Called after every claim, so it costs a flag test while connected."""
        if not self.allowed.is_set():
            self.allowed.set()
            self._ring()

    async def run(self) -> None:
        """Listen until cancelled, reconnecting forever."""
        self._loop = asyncio.get_running_loop()
        for n in range(2 if self.pickup is not None else 1):
            thread = threading.Thread(target=self._serve, name=f"jobq_listener_{n}", daemon=True)
            self._threads.append(thread)
            thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping = True
        self._ring()
        for thread in self._threads:
            if thread.is_alive() and thread is not self._running:
                await asyncio.to_thread(thread.join, JOIN_SECONDS)
        if not any(t.is_alive() for t in self._threads):
            self._bell_w.close()
            self._bell_r.close()

    # -- the listening threads ----------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._turn:
                if self._deliver is not None:  # the handler's claim, for the worker
                    deliver, self._deliver = self._deliver, None
                    deliver()
                if self._stopping:
                    return
                handover = self._reconnecting()
                if handover is not None:
                    self._running = threading.current_thread()
                    self._deliver = handover.deliver
            if handover is not None:
                try:
                    handover.run()  # the other thread listens meanwhile
                finally:
                    self._running = None

    def _reconnecting(self) -> Handover | None:
        """Listen (connecting first if need be) until stopped, or until a
        handler is given to this thread to run."""
        while not self._stopping:
            try:
                if self._conn is None:
                    self._connect()
                assert self._conn is not None
                run = self._listen(self._conn)
                if run is not None:
                    return run
            except psycopg.Error as exc:
                when = f"in {self._delay:.1f}s" if self.eager else "when the worker next polls"
                log.warning("LISTEN connection lost (%s); reconnecting %s", exc, when)
                self._after_loss()
            except Exception:  # a bug of ours must not silence the worker for good
                log.exception("listener failed; reconnecting")
                self._after_loss()
        self._close()
        return None

    def _connect(self) -> None:
        conn = psycopg.connect(self.url, **connect_kwargs(prepared=False))
        self._conn = conn
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        self._delay = RETRY_START
        log.debug("listening on channel %r", self.channel)
        if self._connected_once:
            log.info("LISTEN connection restored; claiming to catch up")
            self._wake_loop()
        self._connected_once = True

    def _after_loss(self) -> None:
        self._close()
        if self._stopping:
            return
        if not self.eager:
            self.allowed.clear()
            while not self.allowed.is_set() and not self._stopping:
                self._doze(None)
            return
        self._sleep(self._delay)
        self._delay = min(self._delay * 2, RETRY_MAX)

    def _listen(self, conn: psycopg.Connection[Any]) -> Handover | None:
        """Wait on the connection and the bell until stopped or given a
        handler to run; psycopg.Error if the connection drops."""
        fd, bell = conn.fileno(), self._bell_r.fileno()
        pgconn, encoding = conn.pgconn, conn.info.encoding
        poller = select.poll()  # not select(): an app's process may hold fds past 1024
        poller.register(fd, select.POLLIN)
        poller.register(bell, select.POLLIN)
        while not self._stopping:
            readable = {ready for ready, _ in poller.poll()}
            if bell in readable:
                self._silence()
            if fd in readable:
                # What `conn.notifies()` does, without its generator, lock
                # and second wait: this is the pickup's hot path.
                pgconn.consume_input()
                handover = None
                while (note := pgconn.notifies()) is not None:
                    payload = note.extra.decode(encoding)
                    handover = self._heard(payload, here=handover is None) or handover
                if handover is not None:
                    return handover
        return None

    def _heard(self, payload: str, *, here: bool) -> Handover | None:
        if payload in self.queues:
            spare = here and self._running is None and len(self._threads) > 1
            try:
                took = self.pickup.heard(here=spare) if self.pickup is not None else False
            except Exception:  # a bug of ours: the worker claims as it would have
                log.exception("idle claim failed; waking the worker")
                took = False
            if took is False:
                self._wake_loop()
            elif took is not True:
                return took
        elif self.hint is not None and payload.startswith("#"):
            self._to_loop(self.hint, payload)
        return None

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _sleep(self, seconds: float) -> None:
        """The eager backoff: only a stop cuts it short."""
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._doze(left)

    def _doze(self, timeout: float | None) -> None:
        """Sleep until `timeout` runs out or the bell rings (stop, poke)."""
        poller = select.poll()
        poller.register(self._bell_r.fileno(), select.POLLIN)
        if poller.poll(None if timeout is None else timeout * 1000):
            self._silence()

    def _ring(self) -> None:
        with contextlib.suppress(OSError):  # full (already rung) or closed
            self._bell_w.send(b"x")

    def _silence(self) -> None:
        with contextlib.suppress(OSError):
            while self._bell_r.recv(4096):
                pass

    def _wake_loop(self) -> None:
        """Wake the worker, once for any number of notifications heard before
        it woke: a busy worker hearing a notification per enqueue would
        otherwise be interrupted for each. None is lost: `_waking` is cleared
        before `wake` runs, so a notification heard meanwhile wakes it again."""
        if not self._waking:
            self._waking = True
            self._to_loop(self._woken)

    def _woken(self) -> None:
        self._waking = False
        self.wake()

    def _to_loop(self, fn: Callable[..., object], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(fn, *args)
