"""The blocked-loop warning: a real event loop on a thread, checked from another."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from sqla_jobq import loop_watch
from sqla_jobq.loop_watch import LoopWatch


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    yield running
    running.call_soon_threadsafe(running.stop)
    thread.join(5)
    running.close()


def stuck(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has not run" in r.getMessage()]


def test_a_free_loop_checked_seldom_is_never_called_stuck(
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checks further apart than STUCK_SECONDS (a 5 s lease tick) said the loop
    was stuck for the whole gap: a false warning on every tick."""
    monkeypatch.setattr(loop_watch, "STUCK_SECONDS", 0.2)
    watch = LoopWatch(loop, lambda: ["job 1"])
    for _ in range(3):
        watch.check()
        time.sleep(0.3)
    assert stuck(caplog) == []


def test_a_blocked_loop_is_named_once_and_its_end_logged(
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop_watch, "STUCK_SECONDS", 0.2)
    caplog.set_level(logging.WARNING)
    watch = LoopWatch(loop, lambda: ["job 7 task=blocks attempt=1"])
    loop.call_soon_threadsafe(time.sleep, 0.8)  # blocks the loop, as a bad handler does
    time.sleep(0.05)
    for _ in range(6):
        watch.check()
        time.sleep(0.1)
    time.sleep(0.5)
    watch.check()  # the loop turned again in between
    messages = stuck(caplog)
    assert len(messages) == 1 and "job 7 task=blocks attempt=1" in messages[0], messages
    assert any("runs again after" in r.getMessage() for r in caplog.records)
