"""Where a worker's next claim starts looking: the head of the queue, or just
past the last job it took (internal).

A claim walks the claim index from the head of its queue. The entries of jobs
claimed earlier are still there (each claim leaves the old `queued` version
behind); normally the first scan that meets one marks it dead and later scans
skip it for free. While any session holds a snapshot older than those jobs (a
REPEATABLE READ report, a session idle in transaction, a replication slot)
they cannot be marked, and every claim re-reads all of them and their heap
tuples: measured here, a claim grew from 0.3 ms to 20 ms after 60,000 jobs,
and a worker fell to a third of its offered load within a minute.

So when a claim from the head is slow (see SLOW_CLAIM), the worker claims past the
last job it took instead, within that job's priority (`statements.claim`
with `after`): an index range that starts beyond the old entries. A claim from
the head, a sweep, still runs every HEAD_EVERY seconds (or, when a sweep takes
longer than HEAD_SHARE of that, as much less often as keeps it to that share),
on a connection of its own so the positional claims go on meanwhile; what the
positional claim cannot see waits at most that long: a job of another
priority, a job whose transaction committed after later ones were claimed, a
job put back with its old `run_at`, a due job another session had locked. A
sweep never moves the position back within its priority (that would make the
next positional claim step over the old entries after all); a sweep that
finds another priority's jobs moves the position there, as traffic moved. The
first fast sweep ends it; so does a sweep that finds nothing when the
positional claims found nothing either (an idle worker then sleeps as usual
instead of waking for sweeps).

None of this touches correctness: every claim locks with SKIP LOCKED and every
outcome is fenced. The position only decides where to start looking. Workers
of several queues always claim from the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from .statements import Position

# A claim from the head slower than SLOW_FACTOR times the fastest one seen
# (its round trip and the server's own pace), and than SLOW_CLAIM seconds, is
# taken as the sign of entries it cannot skip. Engaging early matters: a
# claim that steps over the entries costs more with every job, and until the
# worker engages it falls behind (measured: 10 s and a backlog of 1,400 jobs
# at 20 ms alone, at 4,260 jobs/s).
SLOW_CLAIM = 0.005
SLOW_FACTOR = 5.0
# While claiming past a position, a claim from the head at least this often,
# and no more than HEAD_SHARE of the time: a head claim that took 0.5 s (two
# million entries to step over, measured) is due again in 10 s, not in 1.
HEAD_EVERY = 1.0
HEAD_SHARE = 0.05


def _position(row: dict[str, Any]) -> Position:
    return (row["priority"], row["run_at"], row["id"])


def _order(position: Position) -> tuple[int, datetime, int]:
    """Claim order, ascending: higher priority first, then run_at, then id."""
    priority, run_at, job_id = position
    return (-priority, run_at, job_id)


class ClaimCursor:
    """Decides, claim by claim, between the head of the queue and a position."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.engaged = False
        self.position: Position | None = None
        self.head_due = 0.0  # monotonic time of the next sweep
        self.took_since_head = False
        self.fastest: float | None = None  # the fastest claim from the head seen

    def after(self) -> Position | None:
        """Where the next claim starts: past this position, or None for the head."""
        return self.position if self.engaged else None

    def sweep_due(self, now: float) -> bool:
        """Whether a claim from the head should run beside the positional ones now."""
        return self.engaged and now >= self.head_due

    def claimed(
        self, rows: Sequence[dict[str, Any]], seconds: float, *, from_head: bool, now: float
    ) -> None:
        """Learn from a claim: how long it took (from the head) and what it took."""
        if not self.enabled:
            return
        if from_head:
            idle = not rows and not self.took_since_head
            fastest = seconds if self.fastest is None else min(self.fastest, seconds)
            slow = max(SLOW_CLAIM, SLOW_FACTOR * (self.fastest or 0.0))
            self.fastest = fastest
            self.engaged = seconds >= slow and not idle
            self.head_due = now + max(HEAD_EVERY, seconds / HEAD_SHARE)
            self.took_since_head = False
        elif rows:
            self.took_since_head = True
        if rows:
            self._advance(max((_position(r) for r in rows), key=_order))

    def _advance(self, last: Position) -> None:
        """Forward only within a priority; to another priority wherever it is."""
        at = self.position
        if at is None or at[0] != last[0] or _order(last) > _order(at):
            self.position = last

    def wake_by(self, now: float) -> float | None:
        """Seconds until the next sweep is due, while engaged."""
        return max(0.0, self.head_due - now) if self.engaged else None
