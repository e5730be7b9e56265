"""Polling until something holds, failing with what was awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class _Deadline:
    def __init__(self, timeout: float, what: str) -> None:
        self.at = time.monotonic() + timeout
        self.message = f"timed out after {timeout}s waiting for {what}"

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise AssertionError(self.message)


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll until `predicate()` is truthy and return it; fail naming `what` after `timeout` s."""
    deadline = _Deadline(timeout, what)
    while not (value := predicate()):
        deadline.check()
        time.sleep(interval)
    return value


async def wait_until_async(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01
) -> Any:
    """`wait_until` inside an event loop: it sleeps without blocking the loop."""
    deadline = _Deadline(timeout, what)
    while not (value := predicate()):
        deadline.check()
        await asyncio.sleep(interval)
    return value
