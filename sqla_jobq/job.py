"""A job as values: a new one (`NewJob`, checked and encoded before any SQL
is built) and a claimed one (`Job`, what a handler sees through
`current_job()`).

Claimed rows are decoded here, by column name, and nowhere else, so adding a
column to the claim cannot shift what another module reads. Payloads and
results are encoded here, once, by the same strict JSON encoder, and a
claimed payload's JSON text is decoded here (`decode_json`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, TypeGuard

__all__ = [
    "InvalidJob",
    "Job",
    "JobCancelled",
    "LeaseLost",
    "NewJob",
    "current_job",
    "encode_payload",
    "encode_result",
    "set_current_job",
]


class JobCancelled(Exception):
    """Raised by `Job.raise_if_cancelled()` in a handler whose job was cancelled."""


class LeaseLost(Exception):
    """The job's fenced completion matched no row: it is someone else's now."""


class CancelSignal:
    """`threading.Event`'s set, is_set and wait, for one job's cancellation.

    Every claimed job gets one, and almost none is ever waited on: a real
    Event builds a Condition and a lock per job, several microseconds of the
    worker's hot path, so this one makes its Event only when someone waits.
    A flag set before the Event exists is seen by the waiter, which checks it
    again after making the Event.
    """

    __slots__ = ("_event", "_flag")
    _making = threading.Lock()

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def set(self) -> None:
        self._flag = True
        if self._event is not None:
            self._event.set()

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        with self._making:
            if self._event is None:
                self._event = threading.Event()
        if self._flag:
            self._event.set()
        return self._event.wait(timeout)


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
    cancel_event: CancelSignal = field(default_factory=CancelSignal, repr=False, compare=False)

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
        cancel_event: CancelSignal | None = None,
    ) -> Job:
        """A job from a claimed row; `payload` replaces the row's when given
        (the worker decodes it itself, inside the attempt's error boundary).

        Built by filling the instance's dict: a frozen dataclass's `__init__`
        sets each field through `object.__setattr__`, 4.3 us a job against
        1.8 us, paid for every job the worker runs. The fields and their
        values are exactly those `__init__` would set."""
        job = object.__new__(cls)
        job.__dict__.update(
            id=row["id"],
            task=row["task"],
            queue=row["queue"],
            payload=row["payload"] if payload is None else payload,
            attempts=row["attempts"],
            max_attempts=row["max_attempts"],
            scheduled_for=row.get("scheduled_for"),
            cancel_event=cancel_event or CancelSignal(),
        )
        return job


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


class InvalidJob(ValueError):
    """A job refused before anything reached the database."""


@dataclass(frozen=True)
class NewJob:
    """One row for `enqueue_many`."""

    task: str | None
    payload: Any = field(default_factory=dict)
    queue: str = "default"
    run_at: datetime | None = None
    delay: timedelta | None = None
    priority: int = 0
    max_attempts: int = 5
    unique_key: str | None = None


def is_mapping(value: object) -> TypeGuard[Mapping[Any, Any]]:
    """`isinstance(value, Mapping)`, a dict tried first: the ABC check is a
    Python-level call, paid per job by the worker and per row by bulk enqueue."""
    return type(value) is dict or isinstance(value, Mapping)


def check_text(what: str, value: str) -> str:
    if not isinstance(value, str):
        raise InvalidJob(f"{what} must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise InvalidJob(f"{what} contains a NUL character, which PostgreSQL text cannot store")
    return value


# Queue names travel as NOTIFY payloads (under 8000 bytes) and sit in btree
# indexes with unique keys (entries of at most about 2.7 kB): refuse longer
# ones here rather than fail inside the database, the transaction lost.
MAX_KEY_BYTES = 1024


def check_short_text(what: str, value: str) -> str:
    check_text(what, value)
    size = len(value.encode())
    if size > MAX_KEY_BYTES:
        raise InvalidJob(f"{what} is {size} bytes long; the limit is {MAX_KEY_BYTES} bytes")
    return value


def error_text(error: str) -> str:
    """An error message PostgreSQL text can store (NUL removed)."""
    if not isinstance(error, str):
        raise InvalidJob(f"error must be a string, not {type(error).__name__}")
    return error.replace("\x00", "")


_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _unencodable(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# `JSONEncoder.encode` builds a new C encoder on every call, half the cost of
# encoding a small payload; this one is built once. It keeps no record of the
# containers it is inside (that record would be shared by every thread
# encoding at once), so a circular payload ends in RecursionError instead.
_ENCODE: Callable[[Any], str]
if c_make_encoder is not None:
    _C_ENCODER = c_make_encoder(
        None, _unencodable, encode_basestring_ascii, None, ":", ",", False, False, False
    )

    def _ENCODE(payload: Any) -> str:
        return "".join(_C_ENCODER(payload, 0))

else:  # no C speedups: the pure-Python encoder, built once all the same
    _ENCODE = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


# What `json.loads` itself calls (typeshed does not declare the attribute).
_SCANNER: Callable[[str, int], tuple[Any, int]]
_SCANNER = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def decode_json(raw: str | bytes) -> Any:
    """`json.loads`, straight to its C scanner for the text PostgreSQL writes
    for jsonb (one value, no surrounding space): 0.75 us a payload against
    2.8 us. Anything else goes through `json.loads`, for its checks and its
    error messages."""
    if isinstance(raw, str):
        try:
            value, end = _SCANNER(raw, 0)
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(raw):
                return value
    return json.loads(raw)


def encode_payload(payload: Any) -> str:
    """Serialise a payload as strict JSON, refusing what jsonb would refuse."""
    try:
        encoded = _ENCODE(payload)
    except (TypeError, ValueError) as exc:
        raise InvalidJob(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidJob(
            "payload is not JSON-serialisable: nested too deeply, or circular"
        ) from None
    # A real NUL is a `\u0000` escape whose backslash is not itself escaped;
    # the text "\\u0000" (a backslash, then "u0000") encodes as `\\u0000` and is fine.
    if "\\u0000" in encoded and _JSON_NUL.search(encoded):
        raise InvalidJob("payload contains a NUL character (\\u0000), which jsonb cannot store")
    return encoded


def _check_schedule(run_at: datetime | None, delay: timedelta | None) -> None:
    if run_at is not None and delay is not None:
        raise InvalidJob("give run_at or delay, not both")
    if run_at is not None and run_at.tzinfo is None:
        raise InvalidJob("run_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
    if delay is not None and delay < timedelta(0):
        raise InvalidJob(f"delay must not be negative, got {delay}")


def _check_counts(priority: int, max_attempts: int) -> None:
    for what, value in (("priority", priority), ("max_attempts", max_attempts)):
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**31:
            raise InvalidJob(f"{what} must be a 32-bit integer, got {value!r}")
    if max_attempts < 1:
        raise InvalidJob(f"max_attempts must be at least 1, got {max_attempts}")


def check_job(job: NewJob) -> str:
    """Check every field of a job; its payload, encoded."""
    check_job_fields(job)
    return encode_payload(job.payload)


def check_job_fields(job: NewJob) -> None:
    """Every check of `check_job` but the payload's."""
    if job.task is not None:
        check_text("task name", job.task)
    check_short_text("queue", job.queue)
    if job.unique_key is not None:
        check_short_text("unique_key", job.unique_key)
    _check_schedule(job.run_at, job.delay)
    _check_counts(job.priority, job.max_attempts)


def encode_result(result: Any) -> str:
    """A return value as strict JSON, or InvalidJob saying why it cannot be stored."""
    try:
        return encode_payload(result)
    except InvalidJob as exc:
        raise InvalidJob(str(exc).replace("payload", "result")) from None
