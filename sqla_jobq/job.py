"""A claimed job as values: what a handler sees through `current_job()`.

Rows are decoded here, by column name, and nowhere else, so adding a column to
the claim cannot shift what another module reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = ["Job", "current_job", "set_current_job"]


@dataclass(frozen=True)
class Job:
    """A claimed job: what the worker runs, and what `current_job()` returns."""

    id: int
    task: str | None
    queue: str
    payload: Any
    attempts: int
    max_attempts: int

    @property
    def key(self) -> tuple[int, int]:
        """`(id, attempts)`: one attempt of one job, the fencing token included.

        A job re-claimed by the same worker after its lease was lost is a new
        key, so nothing kept for the old attempt can be mistaken for the new.
        """
        return (self.id, self.attempts)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], payload: Any = None) -> Job:
        """A job from a claimed row; `payload` replaces the row's when given
        (the worker decodes it itself, inside the attempt's error boundary)."""
        return cls(
            id=row["id"],
            task=row["task"],
            queue=row["queue"],
            payload=row["payload"] if payload is None else payload,
            attempts=row["attempts"],
            max_attempts=row["max_attempts"],
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
