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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

import psycopg
from psycopg import sql

from .db import RETRY_MAX, RETRY_START, close_quietly, connect_kwargs, conninfo

log = logging.getLogger("sqla_jobq.notify")


class Listener:
    """Calls `wake()` on every notification for our queues, and after reconnecting."""

    def __init__(
        self,
        url: str,
        channel: str,
        queues: Collection[str],
        wake: Callable[[], None],
        *,
        eager: bool = True,
        hint: Callable[[str], None] | None = None,
    ) -> None:
        self.url = conninfo(url)
        self.channel = channel
        self.queues = set(queues)
        self.wake = wake
        self.eager = eager
        self.hint = hint  # for notifications that name no queue (`#cancel <id>`)
        self.connected = asyncio.Event()
        self.allowed = asyncio.Event()  # lazy: the worker is using the database
        self._conn: psycopg.AsyncConnection[Any] | None = None

    def poke(self) -> None:
        """The worker is talking to the database anyway: a lazy listener may reconnect."""
        self.allowed.set()

    async def run(self) -> None:
        """Listen until cancelled, reconnecting forever."""
        delay = RETRY_START
        first = True
        while True:
            try:
                await self._listen(catch_up=not first)
            except psycopg.Error as exc:
                if self.connected.is_set():
                    delay = RETRY_START
                when = f"in {delay:.1f}s" if self.eager else "when the worker next polls"
                log.warning("LISTEN connection lost (%s); reconnecting %s", exc, when)
            self.connected.clear()
            await self._close()
            first = False
            if not self.eager:
                self.allowed.clear()
                await self.allowed.wait()
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _listen(self, *, catch_up: bool) -> None:
        self._conn = await psycopg.AsyncConnection.connect(
            self.url, **connect_kwargs(prepared=False)
        )
        await self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        self.connected.set()
        log.debug("listening on channel %r", self.channel)
        if catch_up:
            log.info("LISTEN connection restored; claiming to catch up")
            self.wake()
        async for note in self._conn.notifies():
            if note.payload in self.queues:
                self.wake()
                # Let the claim go out before this connection waits again:
                # waiting again costs a tenth of a millisecond, every one of
                # it otherwise between the notification and the claim.
                await asyncio.sleep(0)
            elif self.hint is not None and note.payload.startswith("#"):
                self.hint(note.payload)

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        await close_quietly(conn, log)

    async def stop(self) -> None:
        await self._close()
