"""Hooks for watching a worker: metrics, traces, logs of your own.

The worker calls each hook of each observer given to it; the base class does
nothing, so an observer overrides only what it needs. Hooks run on the
worker's event loop (except `handler_context`, entered where the handler runs)
and must be cheap and must not raise: a hook that raises is logged and
skipped, never allowed to change a job's outcome.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .job import Job

__all__ = ["Observer"]


class Observer:
    def started(self, queue: str, task: str | None, pickup_delay: float | None) -> None:
        """A handler starts; `pickup_delay`: seconds from the job's `run_at`."""

    def settled(self, queue: str, task: str | None, kind: str, duration: float) -> None:
        """An attempt is over: `kind` is done, retry, failed, cancelled, lost,
        or "handed back" (returned unfinished to the queue at shutdown)."""

    def running(self, counts: dict[str, int]) -> None:
        """Jobs running now, per queue (after every start and end)."""

    @contextlib.contextmanager
    def handler_context(self, job: Job, row: dict[str, Any]) -> Iterator[None]:
        """Entered around the handler call, in the handler's own context (so a
        span opened here is the current span inside the handler)."""
        yield
