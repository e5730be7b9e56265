"""A claimed job as values: what a handler sees through `current_job()`.

Rows are decoded here, by column name, and nowhere else, so adding a column to
the claim cannot shift what another module reads.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["Job", "JobCancelled", "LeaseLost", "current_job", "set_current_job"]


class JobCancelled(Exception):
    """Raised by `Job.raise_if_cancelled()` in a handler whose job was cancelled."""


class LeaseLost(Exception):
    """The job's fenced completion matched no row: it is someone else's now."""


@dataclass(frozen=True)
class Job:
    """A claimed job: what the worker runs, and what `current_job()` returns."""

    id: int
    task: str | None
    queue: str
    payload: Any
    attempts: int
    max_attempts: int
    # The fire time of a periodic task's job, else None.
    scheduled_for: datetime | None = None
    # Set by the worker when the job is cancelled while it runs (shared with
    # the handler's thread, so a plain function can look at it between steps).
    cancel_event: threading.Event = field(
        default_factory=threading.Event, repr=False, compare=False
    )

    @property
    def cancel_requested(self) -> bool:
        """True once the job was cancelled: stop, nothing you record will count."""
        return self.cancel_event.is_set()

    def raise_if_cancelled(self) -> None:
        """Raise JobCancelled if the job was cancelled (for sync handlers between steps)."""
        if self.cancel_requested:
            raise JobCancelled(f"job {self.id} was cancelled")

    @property
    def key(self) -> tuple[int, int]:
        """`(id, attempts)`: one attempt of one job, the fencing token included.

        A job re-claimed by the same worker after its lease was lost is a new
        key, so nothing kept for the old attempt can be mistaken for the new.
        """
        return (self.id, self.attempts)

    @classmethod
    def from_row(
        cls,
        row: Mapping[str, Any],
        payload: Any = None,
        cancel_event: threading.Event | None = None,
    ) -> Job:
        """A job from a claimed row; `payload` replaces the row's when given
        (the worker decodes it itself, inside the attempt's error boundary)."""
        return cls(
            id=row["id"],
            task=row["task"],
            queue=row["queue"],
            payload=row["payload"] if payload is None else payload,
            attempts=row["attempts"],
            max_attempts=row["max_attempts"],
            scheduled_for=row.get("scheduled_for"),
            cancel_event=cancel_event or threading.Event(),
        )


_current_job: ContextVar[Job] = ContextVar("sqla_jobq_current_job")


def current_job() -> Job:
    """The job being run by the calling handler (LookupError outside one)."""
    try:
        return _current_job.get()
    except LookupError:
        raise LookupError("current_job() is only available inside a running job") from None


def set_current_job(job: Job) -> None:
    """Bind `job` to the current context; the worker runs each job in a fresh one."""
    _current_job.set(job)
