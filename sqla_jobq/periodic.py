"""When periodic tasks fire: pure computation, no clock and no database (internal).

A schedule is a standard 5-field cron string, evaluated by `cronsim` in UTC or
in the schedule's `timezone` (so a DST gap or overlap is handled as cronsim
handles it, like Debian cron: a daily 02:30 in a skipped hour fires at the end
of the gap, in a repeated hour once, at its first occurrence), or a fixed
interval anchored on the schedule's last fire time. Every function here takes
`now` and the last fire time as arguments, so the scheduler, `jobq cron` and
the tests all compute the same fire times from the same inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from itertools import islice
from typing import Any, Protocol
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

from .job import InvalidJob, encode_payload


class Declared(Protocol):
    """What a schedule needs of its task (a `registry.Task`): its name, for
    messages, and its payload check."""

    name: str

    def check_payload(self, payload: Any) -> dict[str, Any]: ...


# A fire time at most this late is on time, not missed: the worker that
# enqueues it was busy, or its clock a little behind. `catch_up=0` skips only
# fire times older than this.
ON_TIME = timedelta(minutes=1)
# At most this many fire times of one schedule are enqueued by one tick; a
# longer catch-up continues on the next tick, which is due at once.
MAX_FIRES = 100
# How far back the latest fire time is looked for, one span after another:
# a frequent schedule is settled by the first, a yearly one by the fourth.
_LOOKBACK = (
    timedelta(hours=1),
    timedelta(days=1),
    timedelta(days=32),
    timedelta(days=367),
    timedelta(days=8 * 366),
)


class InvalidSchedule(ValueError):
    """A periodic task's declaration refused: names the task and the problem."""


@dataclass(frozen=True)
class Schedule:
    """When one periodic task fires, and with which keyword arguments."""

    name: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    cron: str | None = None
    every: timedelta | None = None
    timezone: str | None = None
    catch_up: timedelta | None = None

    @property
    def zone(self) -> tzinfo:
        return UTC if self.timezone is None else ZoneInfo(self.timezone)

    @property
    def spec(self) -> str:
        """The schedule as a user wrote it: the cron string, or `every 30s`."""
        return self.cron if self.cron is not None else f"every {_duration(self.every)}"


@dataclass(frozen=True)
class Plan:
    """What one tick does for one schedule: the fire times to enqueue now, in
    order, and when the schedule next needs a look (in the past when a long
    catch-up was cut at MAX_FIRES)."""

    due: tuple[datetime, ...]
    next: datetime


def declare(
    task: Declared,
    *,
    cron: str | None,
    every: timedelta | None,
    timezone: str | None,
    payload: Mapping[str, Any] | None,
    catch_up: timedelta | float | None,
) -> Schedule | None:
    """The task's schedule, or None without `cron` or `every`.

    Everything is checked here, at import time, so a typo in a schedule stops
    the app from starting instead of silently never firing.
    """
    if cron is None and every is None:
        if timezone is not None or payload is not None or catch_up is not None:
            raise _refused(task, "timezone=, payload= and catch_up= need cron= or every=")
        return None
    if cron is not None and every is not None:
        raise _refused(task, "give cron= or every=, not both")
    if cron is not None:
        _check_cron(task, cron, timezone)
    else:
        _check_every(task, every, timezone)
    return Schedule(
        name=task.name,
        payload=_checked_payload(task, payload),
        cron=cron,
        every=every,
        timezone=timezone,
        catch_up=_checked_catch_up(task, catch_up),
    )


def plan(schedule: Schedule, last_fire: datetime, now: datetime) -> Plan:
    """The fire times due at `now` for a schedule last fired at `last_fire`.

    Due means after `last_fire` and at or before `now`. With `catch_up=None`
    only the latest of them is enqueued; with a window, those no older than
    the window (or than ON_TIME, whichever is longer), oldest first.
    """
    if schedule.catch_up is None:
        latest = _latest(schedule, last_fire, now)
        return Plan(() if latest is None else (latest,), first_after(schedule, last_fire, now))
    # A fire time exactly as old as the window is still within it.
    oldest = now - max(schedule.catch_up, ON_TIME)
    start = max(last_fire, oldest - timedelta(microseconds=1))
    due = tuple(islice(_until(schedule, last_fire, start, now), MAX_FIRES + 1))
    if len(due) > MAX_FIRES:
        return Plan(due[:MAX_FIRES], due[MAX_FIRES])
    return Plan(due, first_after(schedule, last_fire, now))


def first_after(schedule: Schedule, last_fire: datetime, moment: datetime) -> datetime:
    """The first fire time strictly after `moment` (an `every` schedule's fire
    times are `last_fire + k * every`)."""
    return next(_after(schedule, last_fire, moment))


def _after(schedule: Schedule, anchor: datetime, start: datetime) -> Iterator[datetime]:
    """Fire times strictly after `start`, in UTC, ascending."""
    if schedule.every is not None:
        k = max((start - anchor) // schedule.every + 1, 1)
        while True:
            yield anchor + k * schedule.every
            k += 1
    assert schedule.cron is not None
    for fire in CronSim(schedule.cron, start.astimezone(schedule.zone)):
        # In a repeated DST hour cronsim may step back to the first occurrence.
        if fire > start:
            yield fire.astimezone(UTC)


def _until(
    schedule: Schedule, anchor: datetime, start: datetime, end: datetime
) -> Iterator[datetime]:
    """Fire times in (start, end]."""
    for fire in _after(schedule, anchor, start):
        if fire > end:
            return
        yield fire


def _latest(schedule: Schedule, last_fire: datetime, now: datetime) -> datetime | None:
    """The latest fire time in (last_fire, now], found without walking every
    fire time since `last_fire` (which may be a year of minutes ago)."""
    if schedule.every is not None:
        k = (now - last_fire) // schedule.every
        return last_fire + k * schedule.every if k >= 1 else None
    for span in _LOOKBACK:
        start = max(last_fire, now - span)
        found = None
        for fire in _until(schedule, last_fire, start, now):
            found = fire
        if found is not None or start == last_fire:
            return found
    return None


def _check_cron(task: Declared, cron: str, timezone: str | None) -> None:
    if not isinstance(cron, str) or len(cron.split()) != 5:
        raise _refused(
            task,
            f"malformed cron string {cron!r}: expected 5 fields "
            "(minute hour day-of-month month day-of-week)",
        )
    zone = _zone(task, timezone)
    try:
        next(CronSim(cron, datetime.now(zone)))
    except CronSimError as exc:
        raise _refused(task, f"malformed cron string {cron!r}: {exc}") from None
    except StopIteration:
        raise _refused(task, f"cron string {cron!r} never fires") from None


def _zone(task: Declared, timezone: str | None) -> tzinfo:
    if timezone is None:
        return UTC
    try:
        return ZoneInfo(timezone)
    except (ValueError, KeyError, OSError, TypeError):  # not found is a KeyError
        raise _refused(task, f"unknown timezone {timezone!r} (use an IANA name)") from None


def _check_every(task: Declared, every: Any, timezone: str | None) -> None:
    if not isinstance(every, timedelta) or every <= timedelta(0):
        raise _refused(task, f"every= must be a positive timedelta, got {every!r}")
    if timezone is not None:
        raise _refused(task, "timezone= applies to cron= schedules only")


def _checked_payload(task: Declared, payload: Mapping[str, Any] | None) -> dict[str, Any]:
    try:
        kwargs = task.check_payload({} if payload is None else payload)
        encode_payload(kwargs)
    except InvalidJob as exc:
        raise _refused(task, str(exc)) from None
    return kwargs


def _checked_catch_up(task: Declared, catch_up: Any) -> timedelta | None:
    if catch_up is None:
        return None
    if isinstance(catch_up, int | float) and not isinstance(catch_up, bool):
        catch_up = timedelta(seconds=catch_up)
    if not isinstance(catch_up, timedelta) or catch_up < timedelta(0):
        raise _refused(
            task, f"catch_up= must be None, 0 or a non-negative timedelta, got {catch_up!r}"
        )
    return catch_up


def _refused(task: Declared, problem: str) -> InvalidSchedule:
    return InvalidSchedule(f"periodic task {task.name!r}: {problem}")


def _duration(every: timedelta | None) -> str:
    """`90s` as `1m30s`; `1d2h`."""
    assert every is not None
    seconds = every.total_seconds()
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{int(count)}{unit}")
    if seconds or not parts:
        parts.append(f"{seconds:g}s")
    return "".join(parts)
