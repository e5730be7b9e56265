"""Periodic tasks, the pure part: which fire times are due, which is next, and
what a declaration refuses. Every `now` is injected; nothing sleeps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy import MetaData

from sqla_jobq import Registry, jobs_table
from sqla_jobq.periodic import MAX_FIRES, ON_TIME, Schedule, first_after, plan

T0 = datetime(2025, 1, 6, 10, 0, tzinfo=UTC)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def hourly(catch_up: timedelta | None = None) -> Schedule:
    return Schedule("hourly", cron="0 * * * *", catch_up=catch_up)


def registry() -> Registry:
    return Registry(jobs_table(MetaData()))


def test_a_cron_schedule_fires_once_its_time_has_come_and_names_the_next() -> None:
    every_5 = Schedule("five", cron="*/5 * * * *")
    early = plan(every_5, last_fire=T0, now=T0 + timedelta(minutes=4, seconds=59))
    assert early.due == ()
    assert early.next == T0 + timedelta(minutes=5)

    on_time = plan(every_5, last_fire=T0, now=T0 + timedelta(minutes=5, seconds=20))
    assert on_time.due == (T0 + timedelta(minutes=5),)
    assert on_time.next == T0 + timedelta(minutes=10)


def test_by_default_only_the_last_missed_fire_time_is_caught_up() -> None:
    down = plan(hourly(), last_fire=T0, now=T0 + timedelta(hours=5, minutes=20))
    assert down.due == (T0 + timedelta(hours=5),)
    assert down.next == T0 + timedelta(hours=6)


def test_the_default_finds_the_last_fire_time_of_a_minutely_schedule_a_year_late() -> None:
    minutely = Schedule("minutely", cron="* * * * *")
    now = T0 + timedelta(days=365, seconds=30)
    assert plan(minutely, last_fire=T0, now=now).due == (now - timedelta(seconds=30),)


def test_catch_up_zero_skips_missed_fire_times_but_not_one_that_is_merely_late() -> None:
    skip = hourly(catch_up=timedelta(0))
    down = plan(skip, last_fire=T0, now=T0 + timedelta(hours=5, minutes=20))
    assert down.due == ()
    assert down.next == T0 + timedelta(hours=6)

    late = plan(skip, last_fire=T0, now=T0 + timedelta(hours=1) + ON_TIME - timedelta(seconds=1))
    assert late.due == (T0 + timedelta(hours=1),)


def test_a_catch_up_window_enqueues_every_missed_fire_time_within_it_oldest_first() -> None:
    window = hourly(catch_up=timedelta(hours=2, minutes=30))
    down = plan(window, last_fire=T0, now=T0 + timedelta(hours=5, minutes=20))
    assert down.due == tuple(T0 + timedelta(hours=h) for h in (3, 4, 5))
    assert down.next == T0 + timedelta(hours=6)


def test_a_long_catch_up_is_cut_into_batches_and_the_rest_is_due_at_once() -> None:
    minutely = Schedule("minutely", cron="* * * * *", catch_up=timedelta(days=1))
    now = T0 + timedelta(hours=3)
    first = plan(minutely, last_fire=T0, now=now)
    assert len(first.due) == MAX_FIRES
    assert first.due[0] == T0 + timedelta(minutes=1)
    assert first.next == T0 + timedelta(minutes=MAX_FIRES + 1)
    assert first.next < now

    rest = plan(minutely, last_fire=first.due[-1], now=now)
    assert rest.due[0] == first.next


def test_an_every_schedule_is_anchored_on_its_last_fire() -> None:
    every = Schedule("every", every=timedelta(seconds=30))
    anchor = T0 + timedelta(seconds=7)
    on_time = plan(every, last_fire=anchor, now=anchor + timedelta(seconds=33))
    assert on_time.due == (anchor + timedelta(seconds=30),)
    assert on_time.next == anchor + timedelta(seconds=60)

    down = plan(every, last_fire=anchor, now=anchor + timedelta(minutes=5, seconds=10))
    assert down.due == (anchor + timedelta(minutes=5),)
    assert down.next == anchor + timedelta(minutes=5, seconds=30)


def test_an_every_schedule_catches_up_on_its_own_grid() -> None:
    every = Schedule("every", every=timedelta(minutes=10), catch_up=timedelta(minutes=25))
    anchor = T0 + timedelta(seconds=7)
    down = plan(every, last_fire=anchor, now=anchor + timedelta(hours=1, minutes=5))
    assert down.due == tuple(anchor + timedelta(minutes=m) for m in (40, 50, 60))


def test_a_timezone_schedule_follows_local_time_across_daylight_saving() -> None:
    nine = Schedule("nine", cron="0 9 * * *", timezone="Europe/Paris")
    assert first_after(nine, T0, utc(2025, 1, 6, 0, 0)) == utc(2025, 1, 6, 8, 0)
    assert first_after(nine, T0, utc(2025, 7, 7, 0, 0)) == utc(2025, 7, 7, 7, 0)
    utc_nine = Schedule("utc-nine", cron="0 9 * * *")
    assert first_after(utc_nine, T0, utc(2025, 7, 7, 0, 0)) == utc(2025, 7, 7, 9, 0)


def test_a_time_in_the_skipped_dst_hour_fires_at_the_end_of_the_gap() -> None:
    # Europe/Paris, 2024-03-31: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
    night = Schedule("night", cron="30 2 * * *", timezone="Europe/Paris")
    day_before = utc(2024, 3, 30, 1, 30)
    got = plan(night, last_fire=day_before, now=utc(2024, 3, 31, 1, 5))
    assert got.due == (utc(2024, 3, 31, 1, 0),)
    assert got.next == utc(2024, 4, 1, 0, 30)


def test_a_time_in_the_repeated_dst_hour_fires_once() -> None:
    # Europe/Paris, 2024-10-27: 03:00 CEST falls back to 02:00 CET (01:00 UTC),
    # so 02:30 local happens at 00:30 and again at 01:30 UTC.
    night = Schedule(
        "night", cron="30 2 * * *", timezone="Europe/Paris", catch_up=timedelta(days=2)
    )
    day = plan(night, last_fire=utc(2024, 10, 26, 12, 0), now=utc(2024, 10, 27, 12, 0))
    assert day.due == (utc(2024, 10, 27, 0, 30),)
    # Asked from inside the repeated hour, the next is tomorrow, not the first pass.
    assert first_after(night, T0, utc(2024, 10, 27, 1, 15)) == utc(2024, 10, 28, 1, 30)


def test_an_interval_schedule_in_a_timezone_keeps_real_time_across_dst() -> None:
    half_hours = Schedule("half", cron="*/30 * * * *", timezone="Europe/Paris")
    fires = [utc(2024, 10, 26, 23, 30)]
    for _ in range(8):
        fires.append(first_after(half_hours, T0, fires[-1]))
    gaps = {b - a for a, b in pairwise(fires)}
    assert gaps == {timedelta(minutes=30)}


def test_a_declared_schedule_is_kept_on_the_registry_with_its_checked_payload() -> None:
    reg = registry()

    @reg.task(name="report", cron="*/5 * * * *", timezone="Europe/Paris", payload={"kind": "daily"})
    def report(kind: str) -> None: ...

    @reg.task(name="ping", every=timedelta(seconds=90), catch_up=0)
    def ping() -> None: ...

    assert reg.schedules["report"] == Schedule(
        "report", {"kind": "daily"}, cron="*/5 * * * *", timezone="Europe/Paris"
    )
    assert reg.schedules["ping"].catch_up == timedelta(0)
    assert reg.schedules["ping"].spec == "every 1m30s"
    assert set(reg.tasks) == {"report", "ping"}


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"cron": "61 * * * *"}, "malformed cron string '61 * * * *': Bad minute"),
        ({"cron": "* * * *"}, "malformed cron string '* * * *': expected 5 fields"),
        ({"cron": "0 0 * * * *"}, "expected 5 fields"),
        ({"cron": "every day"}, "malformed cron string 'every day'"),
        ({"cron": "* * * * *", "every": timedelta(seconds=1)}, "give cron= or every=, not both"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "unknown timezone 'Mars/Olympus'"),
        ({"cron": "* * * * *", "timezone": "../etc"}, "unknown timezone '../etc'"),
        ({"every": timedelta(0)}, "every= must be a positive timedelta, got datetime.timedelta(0)"),
        ({"every": 30}, "every= must be a positive timedelta, got 30"),
        ({"every": timedelta(1), "timezone": "UTC"}, "timezone= applies to cron= schedules only"),
        ({"every": timedelta(1), "catch_up": -1}, "catch_up= must be None, 0 or a non-negative"),
        ({"every": timedelta(1), "payload": {"nope": 1}}, "payload does not match"),
        ({"every": timedelta(1), "payload": {"n": float("nan")}}, "not JSON-serialisable"),
        ({"every": timedelta(1), "payload": [1]}, "must be a JSON object"),
        ({"payload": {"n": 1}}, "need cron= or every="),
    ],
)
def test_a_bad_schedule_is_refused_at_declaration_naming_the_task(
    options: dict[str, Any], problem: str
) -> None:
    reg = registry()
    with pytest.raises(ValueError, match="periodic task 'bad': ") as refused:

        @reg.task(name="bad", **options)
        def bad(n: int = 0) -> None: ...

    assert problem in str(refused.value)
    assert reg.tasks == {}
    assert reg.schedules == {}


def test_a_task_with_required_arguments_needs_them_in_its_payload() -> None:
    reg = registry()
    with pytest.raises(ValueError, match="periodic task 'needs': payload does not match"):

        @reg.task(name="needs", cron="0 * * * *")
        def needs(user_id: int) -> None: ...
