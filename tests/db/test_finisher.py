"""While outcomes keep coming, the finisher waits for a batch's worth of them
before the next completion, and never longer than its gap."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, Table

from sqla_jobq import finisher
from sqla_jobq.attempt import Attempt, Outcome
from sqla_jobq.driver import Driver, lifecycle_statements
from tests.support.rows import enqueue
from tests.support.waiting import wait_until_async

LEASE = timedelta(minutes=5)


class Gated:
    """The driver's batch completion, recording each batch's size; the first
    round trip waits until the test opens the gate, so outcomes pile up
    behind it as they would behind a slow one."""

    def __init__(self, driver: Driver) -> None:
        self.complete_many = driver.complete_many
        self.sizes: list[int] = []
        self.gate = asyncio.Event()
        driver.complete_many = self._complete_many  # type: ignore[method-assign]

    async def _complete_many(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        self.sizes.append(len(keys))
        if len(self.sizes) == 1:
            await self.gate.wait()
        return await self.complete_many(keys, *args, **kwargs)


def test_next_completion_waits_for_a_batch_not_for_the_gap(
    database_url: str, engine: Engine, table: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finisher, "FLUSH_GAP", 60.0)  # only a full batch ends the wait
    batch = finisher.FLUSH_BATCH
    for n in range(batch + 1):
        enqueue(engine, table, "t", {"n": n})

    async def scenario() -> tuple[list[int], int, int]:
        driver = Driver(database_url, lifecycle_statements(table, ["default"], LEASE), True)
        settled: list[str] = []
        gated = Gated(driver)
        done = finisher.Finisher(driver, lambda attempt, what, kind: settled.append(kind))
        attempts = []
        for row in await driver.claim(batch + 1):
            attempt = Attempt.claimed(row, LEASE, LEASE)
            attempt.start()
            attempt.finish(Outcome())
            attempts.append(attempt)
        runner = asyncio.create_task(done.run())
        try:
            done.add(attempts[0])  # a lone outcome goes at once, and waits at the gate
            await wait_until_async(lambda: gated.sizes == [1], 10, "the first flush")
            for attempt in attempts[1:batch]:
                done.add(attempt)  # one short of a batch behind it
            gated.gate.set()
            await wait_until_async(lambda: len(settled) == 1, 10, "the lone outcome recorded")
            await asyncio.sleep(0.5)
            short = len(settled)
            done.add(attempts[batch])  # the batch is full: flushed without the gap
            await wait_until_async(lambda: len(settled) == batch + 1, 10, "the full batch recorded")
            return gated.sizes, short, len(settled)
        finally:
            runner.cancel()
            await driver.close()

    sizes, short, total = asyncio.run(scenario())
    assert short == 1
    assert sizes == [1, batch]
    assert total == batch + 1
