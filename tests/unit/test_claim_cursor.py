"""When a worker claims from the head of its queue, when past a position, and
when it sweeps from the head beside the positional claims."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqla_jobq.claim_cursor import HEAD_EVERY, HEAD_SHARE, SLOW_CLAIM, SLOW_FACTOR, ClaimCursor

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FAST = SLOW_CLAIM / 2
SLOW = SLOW_CLAIM * SLOW_FACTOR * 2  # slow against FAST and against SLOW_CLAIM


def row(job_id: int, priority: int = 0, seconds: int = 0) -> dict[str, Any]:
    return {"id": job_id, "priority": priority, "run_at": T0 + timedelta(seconds=seconds)}


def engaged_at(position_row: dict[str, Any], now: float = 0.0) -> ClaimCursor:
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([], FAST, from_head=True, now=now - HEAD_EVERY)  # the baseline
    cursor.claimed([position_row], SLOW, from_head=True, now=now)
    assert cursor.engaged
    return cursor


def test_a_fast_claim_from_the_head_keeps_claiming_from_the_head() -> None:
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1), row(2)], FAST, from_head=True, now=0.0)
    assert cursor.after() is None and not cursor.sweep_due(10.0)
    assert cursor.wake_by(0.1) is None


def test_a_slow_claim_from_the_head_moves_claims_past_the_last_job_in_claim_order() -> None:
    cursor = ClaimCursor(enabled=True)
    rows = [row(9, priority=5, seconds=3), row(4, priority=0, seconds=1), row(3, priority=0)]
    cursor.claimed(rows, SLOW, from_head=True, now=0.0)
    # Higher priorities come first, so the last job taken is priority 0's latest.
    assert cursor.after() == (0, T0 + timedelta(seconds=1), 4)
    cursor.claimed([row(7, seconds=2), row(8, seconds=2)], FAST, from_head=False, now=0.2)
    assert cursor.after() == (0, T0 + timedelta(seconds=2), 8)


def test_a_sweep_is_due_every_head_every_seconds_and_wakes_an_idle_worker_for_it() -> None:
    cursor = engaged_at(row(1), now=10.0)
    assert not cursor.sweep_due(10.0 + HEAD_EVERY / 2)
    assert cursor.wake_by(10.0 + HEAD_EVERY / 2) == HEAD_EVERY / 2
    assert cursor.sweep_due(10.0 + HEAD_EVERY)


def test_a_very_slow_sweep_comes_round_less_often() -> None:
    """A sweep that steps over millions of entries costs half a second:
    repeating it every second would spend half the time on it."""
    slow = HEAD_EVERY * HEAD_SHARE * 10
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1)], slow, from_head=True, now=0.0)
    assert not cursor.sweep_due(HEAD_EVERY * 5)
    assert cursor.sweep_due(slow / HEAD_SHARE)


def test_a_positional_claim_that_finds_nothing_keeps_the_position() -> None:
    cursor = engaged_at(row(5, seconds=5))
    cursor.claimed([], FAST, from_head=False, now=0.1)
    assert cursor.after() == (0, T0 + timedelta(seconds=5), 5)


def test_a_sweep_never_moves_the_position_back_within_its_priority() -> None:
    """A late job found at the head must not send the next positional claim
    back over every entry between it and the position."""
    cursor = engaged_at(row(50, seconds=50))
    cursor.claimed([row(1, seconds=1)], SLOW, from_head=True, now=HEAD_EVERY)
    assert cursor.after() == (0, T0 + timedelta(seconds=50), 50)


def test_a_sweep_that_finds_another_priority_moves_the_position_there() -> None:
    cursor = engaged_at(row(50, seconds=50))
    cursor.claimed([row(60, priority=7, seconds=55)], SLOW, from_head=True, now=HEAD_EVERY)
    assert cursor.after() == (7, T0 + timedelta(seconds=55), 60)


def test_a_fast_sweep_ends_it() -> None:
    cursor = engaged_at(row(1))
    cursor.claimed([row(2)], FAST, from_head=True, now=HEAD_EVERY)
    assert cursor.after() is None and not cursor.engaged


def test_an_idle_worker_stops_waking_for_sweeps() -> None:
    """A slow sweep that finds nothing, after positional claims that found
    nothing either: nothing is waiting, so sleep as usual."""
    cursor = engaged_at(row(1))
    cursor.claimed([], FAST, from_head=False, now=0.5)
    cursor.claimed([], SLOW, from_head=True, now=HEAD_EVERY)
    assert not cursor.engaged and cursor.wake_by(HEAD_EVERY + 0.1) is None
    busy = engaged_at(row(1))
    busy.claimed([row(2)], FAST, from_head=False, now=0.5)
    busy.claimed([], SLOW, from_head=True, now=HEAD_EVERY)
    assert busy.engaged  # jobs are still coming: claims stay positional


def test_a_worker_of_several_queues_always_claims_from_the_head() -> None:
    cursor = ClaimCursor(enabled=False)
    cursor.claimed([row(1)], SLOW, from_head=True, now=0.0)
    assert cursor.after() is None and cursor.wake_by(0.1) is None


def test_slow_is_judged_against_the_fastest_claim_from_the_head_seen() -> None:
    """Over a network a claim's round trip alone may pass SLOW_CLAIM: what
    counts is a claim much slower than this worker's fastest. (The very
    first claim has nothing to be judged against but SLOW_CLAIM; a worker
    that starts beside a held snapshot must still engage at once.)"""
    far = SLOW_CLAIM * 2
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1)], far, from_head=True, now=0.0)
    assert cursor.engaged
    cursor.claimed([row(2)], far * 1.5, from_head=True, now=1.0)
    assert not cursor.engaged
    cursor.claimed([row(3)], far * SLOW_FACTOR, from_head=True, now=2.0)
    assert cursor.engaged
