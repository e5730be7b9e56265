"""When a worker claims from the head of its queue and when past a position."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqla_jobq.claim_cursor import HEAD_EVERY, HEAD_SHARE, SLOW_CLAIM, ClaimCursor

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def row(job_id: int, priority: int = 0, seconds: int = 0) -> dict[str, Any]:
    return {"id": job_id, "priority": priority, "run_at": T0 + timedelta(seconds=seconds)}


SLOW = SLOW_CLAIM * 2
FAST = SLOW_CLAIM / 2


def test_a_fast_claim_from_the_head_keeps_claiming_from_the_head() -> None:
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1), row(2)], FAST, from_head=True, now=0.0)
    assert cursor.after(0.1) is None and cursor.wake_by(0.1) is None


def test_a_slow_claim_from_the_head_moves_claims_past_the_last_job_in_claim_order() -> None:
    cursor = ClaimCursor(enabled=True)
    rows = [row(9, priority=5, seconds=3), row(4, priority=0, seconds=1), row(3, priority=0)]
    cursor.claimed(rows, SLOW, from_head=True, now=0.0)
    # Higher priorities come first, so the last job taken is priority 0's latest.
    assert cursor.after(0.1) == (0, T0 + timedelta(seconds=1), 4)
    cursor.claimed([row(7, seconds=2), row(8, seconds=2)], FAST, from_head=False, now=0.2)
    assert cursor.after(0.3) == (0, T0 + timedelta(seconds=2), 8)


def test_the_head_is_claimed_again_every_head_every_seconds() -> None:
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1)], SLOW, from_head=True, now=10.0)
    assert cursor.after(10.0 + HEAD_EVERY / 2) is not None
    assert cursor.wake_by(10.0 + HEAD_EVERY / 2) == HEAD_EVERY / 2
    assert cursor.after(10.0 + HEAD_EVERY) is None


def test_a_positional_claim_that_finds_nothing_keeps_the_position() -> None:
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(5, seconds=5)], SLOW, from_head=True, now=0.0)
    cursor.claimed([], FAST, from_head=False, now=0.1)
    assert cursor.after(0.2) == (0, T0 + timedelta(seconds=5), 5)


def test_a_fast_head_claim_ends_it() -> None:
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1)], SLOW, from_head=True, now=0.0)
    cursor.claimed([row(2)], FAST, from_head=True, now=HEAD_EVERY)
    assert cursor.after(HEAD_EVERY + 0.1) is None and not cursor.engaged


def test_an_idle_worker_stops_waking_for_head_claims() -> None:
    """A slow head claim that finds nothing, after positional claims that
    found nothing either: nothing is waiting, so sleep as usual."""
    cursor = ClaimCursor(enabled=True)
    cursor.claimed([row(1)], SLOW, from_head=True, now=0.0)
    cursor.claimed([], FAST, from_head=False, now=0.5)
    cursor.claimed([], SLOW, from_head=True, now=HEAD_EVERY)
    assert not cursor.engaged and cursor.wake_by(HEAD_EVERY + 0.1) is None
    busy = ClaimCursor(enabled=True)
    busy.claimed([row(1)], SLOW, from_head=True, now=0.0)
    busy.claimed([row(2)], FAST, from_head=False, now=0.5)
    busy.claimed([], SLOW, from_head=True, now=HEAD_EVERY)
    assert busy.engaged  # jobs are still coming: the next claims start at the position


def test_a_worker_of_several_queues_always_claims_from_the_head() -> None:
    cursor = ClaimCursor(enabled=False)
    cursor.claimed([row(1)], SLOW, from_head=True, now=0.0)
    assert cursor.after(0.1) is None and cursor.wake_by(0.1) is None


def test_a_very_slow_claim_from_the_head_comes_round_less_often() -> None:
    """A head claim that steps over millions of entries costs half a second:
    repeating it every second would spend half the claims on it."""
    cursor = ClaimCursor(enabled=True)
    slow = HEAD_EVERY * HEAD_SHARE * 10
    cursor.claimed([row(1)], slow, from_head=True, now=0.0)
    assert cursor.after(HEAD_EVERY * 5) is not None
    assert cursor.after(slow / HEAD_SHARE) is None
