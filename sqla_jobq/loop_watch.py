"""Noticing a blocked event loop (internal).

An `async def` handler that calls blocking code (`time.sleep`, a sync
database driver, heavy CPU work) stops the worker's event loop: no claim,
no completion, no cancel, no timeout happens until it returns. Leases are
kept meanwhile (their keeper has a thread of its own), so nothing is run
twice, but a worker that silently stops moving is hard to diagnose. The
lease keeper's thread calls `check` on each tick; the watch names the async
jobs running when the loop has not turned for `STUCK_SECONDS`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("sqla_jobq.worker")

STUCK_SECONDS = 1.0


class LoopWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, suspects: Callable[[], list[str]]) -> None:
        self.loop = loop
        self.suspects = suspects  # the async jobs running (called off the loop)
        # When the loop was asked to check in and has not yet: the loop has
        # not turned since then.
        self.asked_at: float | None = None
        self.warned = False

    def check(self) -> None:
        """From another thread: warn once per stall, and ask the loop to check in."""
        now = time.monotonic()
        if self.asked_at is None:
            self.asked_at = now
            self.loop.call_soon_threadsafe(self._turned)
        elif not self.warned and now - self.asked_at >= STUCK_SECONDS:
            self.warned = True
            jobs = ", ".join(self.suspects()) or "none"
            log.warning(
                "the event loop has not run for %.1fs: an async handler is blocking it "
                "(running async jobs: %s); leases are kept, nothing else moves",
                now - self.asked_at,
                jobs,
            )

    def _turned(self) -> None:
        if self.warned and self.asked_at is not None:
            log.warning("the event loop runs again after %.1fs", time.monotonic() - self.asked_at)
        self.warned = False
        self.asked_at = None
