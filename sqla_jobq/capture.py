"""A handler's outcome as a value, never as a raised exception (internal).

Whatever a user's handler does (return, raise `StopIteration`, `SystemExit`,
`CancelledError`, any `BaseException`) becomes a `Captured`, so no exception
of theirs ever crosses into the worker's own machinery: not into
`Future.set_exception` (which refuses `StopIteration`), not into the event
loop (which `SystemExit` would end), not into a batch of other jobs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Captured:
    """What a call returned, or what it raised."""

    value: object = None
    error: BaseException | None = None


# Most handlers return None: one immutable value for all of them, rather than
# a frozen dataclass built per job.
RETURNED_NONE = Captured()


def capture(call: Callable[[], object]) -> Captured:
    try:
        value = call()
    except BaseException as exc:  # the point of this module: every outcome is a value
        return Captured(error=exc)
    return RETURNED_NONE if value is None else Captured(value=value)


async def capture_async(awaitable: Awaitable[object]) -> Captured:
    try:
        return Captured(value=await awaitable)
    except BaseException as exc:  # CancelledError too: the caller decides what it meant
        return Captured(error=exc)
