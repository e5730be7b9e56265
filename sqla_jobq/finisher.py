"""Recording outcomes: batched fenced completions, and retries across lost connections.

A completion is one fenced statement whatever the batch size, so while one
flush is in flight the next completions wait and go together: the busier the
worker, the fewer round trips per job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg

from .driver import Driver

log = logging.getLogger("sqla_jobq.worker")

T = TypeVar("T")

RETRY_START = 0.1
RETRY_MAX = 5.0
FINISH_RETRIES = 12


class Finisher:
    """Batches completions into one fenced `complete_many` per flush.

    While one flush is in flight, later completions queue up and go together
    in the next: the busier the worker, the bigger the batches.
    """

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.pending: list[tuple[int, int, asyncio.Future[bool]]] = []
        self.kick = asyncio.Event()

    def complete(self, job_id: int, attempts: int) -> asyncio.Future[bool]:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.pending.append((job_id, attempts, future))
        self.kick.set()
        return future

    async def run(self) -> None:
        while True:
            await self.kick.wait()
            self.kick.clear()
            await self.flush()

    async def flush(self) -> None:
        batch, self.pending = self.pending, []
        if not batch:
            return
        pairs = [(job_id, attempts) for job_id, attempts, _ in batch]
        try:
            owned = await retrying("record completions", lambda: self.driver.complete_many(pairs))
        except psycopg.Error as exc:
            for *_, future in batch:
                future.set_exception(exc)
            return
        for job_id, _, future in batch:
            future.set_result(job_id in owned)


async def retrying(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """Retry a statement across lost connections, with backoff, a bounded number of times.

    Fenced statements are safe to repeat: one that already took effect
    matches no row the second time.
    """
    delay = RETRY_START
    for attempt in range(FINISH_RETRIES):
        try:
            return await call()
        except psycopg.OperationalError as exc:
            if attempt == FINISH_RETRIES - 1:
                raise
            log.warning("could not %s (%s); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)
    raise AssertionError("unreachable")
