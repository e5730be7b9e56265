"""One claimed attempt of one job, and the only object that tracks it (internal).

The worker used to keep a job's bookkeeping in several places keyed by job id,
which let two attempts of one job (the first still running after its lease
was lost, the second claimed again by the same worker) overwrite each other.
An `Attempt` is keyed by `(id, attempts)` and owns its lifecycle:

    claimed --> started --> finished --> recorded
       |           |            |
       +-----------+------------+-----> handed back | lost

Every change of state goes through a method here that checks the state it
leaves, so an attempt cannot be both recorded and handed back, or started
twice; the worker, the lease keeper and the finisher only call these methods.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .job import CancelSignal

Key = tuple[int, int]


class State(enum.Enum):
    CLAIMED = "claimed"  # leased to us, waiting for a slot
    STARTED = "started"  # its handler is running
    FINISHED = "finished"  # its handler is done; the outcome is not recorded yet
    RECORDED = "recorded"  # the outcome is in the database
    HANDED_BACK = "handed back"  # returned to the queue unfinished
    LOST = "lost"  # the lease went to someone else: touch nothing

    @property
    def settled(self) -> bool:
        return self in _SETTLED


_SETTLED = {State.RECORDED, State.HANDED_BACK, State.LOST}


@dataclass(frozen=True)
class Outcome:
    """What to record for a finished handler: success (`error is None`) or a failure."""

    error: str | None = None
    exc: BaseException | None = field(default=None, repr=False)
    # What the handler returned (stored with the job when not None).
    result: object = field(default=None, repr=False)
    # A transactional task completed its job in its own transaction (done),
    # or found it was no longer its own there (lost): nothing left to record.
    settled: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Cancel(enum.Enum):
    """Why the worker itself cancelled a running attempt."""

    LOST = "lease lost"
    SHUTDOWN = "worker shutting down"
    CANCELLED = "cancelled"
    TIMEOUT = "timed out"


@dataclass(eq=False)
class Attempt:
    row: dict[str, Any] = field(repr=False)
    # `(id, attempts)`, read from the row once: it is looked up many times per job.
    key: Key
    lease: timedelta
    claimed_at: float
    # The local clock's view of the lease: when it was last extended (or
    # claimed), and when it runs out unless extended again.
    extended_at: float
    expires_at: float
    state: State = State.CLAIMED
    started_at: float | None = None
    outcome: Outcome | None = None
    cancelled: Cancel | None = None
    handler: asyncio.Task[Any] | None = field(default=None, repr=False)
    # Shared with the handler's `current_job()`, so a sync handler sees a cancel.
    cancel_event: CancelSignal = field(default_factory=CancelSignal, repr=False)

    @classmethod
    def claimed(
        cls,
        row: dict[str, Any],
        lease: timedelta,
        claim_lease: timedelta,
        *,
        at: float | None = None,
        cancel_event: CancelSignal | None = None,
    ) -> Attempt:
        """Claimed now, or `at` (monotonic) when built after the claim; with
        the `cancel_event` its handler was already given, if it has one."""
        now = time.monotonic() if at is None else at
        # The claim leased it for `claim_lease` (the shortest of all tasks),
        # not its own: date the last extension back so the first heartbeat is
        # due a third of the way into the claim lease, not into the task's.
        head_start = (lease - claim_lease).total_seconds() / 3
        key = (row["id"], row["attempts"])
        expires = now + claim_lease.total_seconds()
        signal = cancel_event or CancelSignal()
        return cls(row, key, lease, now, now - head_start, expires, cancel_event=signal)

    @property
    def task_name(self) -> str | None:
        task: str | None = self.row["task"]
        return task

    def describe(self) -> str:
        return f"job {self.key[0]} task={self.task_name} attempt={self.key[1]}"

    def _leave(self, *allowed: State) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"{self.describe()}: cannot leave state {self.state.value}")

    def start(self, at: float | None = None) -> None:
        self._leave(State.CLAIMED)
        self.state = State.STARTED
        self.started_at = time.monotonic() if at is None else at

    def finish(self, outcome: Outcome) -> bool:
        """Keep the handler's outcome to record; False if the attempt was
        settled meanwhile (lost, handed back, cancelled) or already finished
        (a sync handler that outlived its timeout): then the outcome is dropped."""
        if self.state.settled or self.state is State.FINISHED:
            return False
        self._leave(State.STARTED)
        self.state = State.FINISHED
        self.outcome = outcome
        return True

    def recorded(self) -> None:
        self._leave(State.FINISHED)
        self.state = State.RECORDED

    def handed_back(self) -> None:
        self._leave(State.CLAIMED, State.STARTED)
        self.state = State.HANDED_BACK

    def lose(self) -> None:
        self._leave(State.CLAIMED, State.STARTED, State.FINISHED)
        self.state = State.LOST

    def cancel(self, why: Cancel) -> None:
        """Ask a running async handler to stop; the reason decides what its
        `CancelledError` means (anything else raising it is a failure)."""
        if self.cancelled is None:
            self.cancelled = why
        self.cancel_event.set()
        if self.handler is not None:
            self.handler.cancel()

    def extended(self, at: float) -> None:
        self.extended_at = at
        self.expires_at = at + self.lease.total_seconds()

    def lease_due(self, now: float) -> bool:
        return now - self.extended_at >= self.lease.total_seconds() / 3

    def lease_valid(self, now: float) -> bool:
        return now < self.expires_at
