"""What a user asks the job list for, read from the query string and checked.

Kept apart from the SQL so the same filter travels unchanged from the list
page to the bulk-retry confirmation and its action, and back into links.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from ..schema import STATUSES

# `ready` and `scheduled` split `queued` by run_at, as the overview counts them.
LIST_STATUSES = ("ready", "scheduled", *STATUSES)
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


class BadRequest(ValueError):
    """A query parameter the dashboard cannot use; shown as one line (400)."""


@dataclass(frozen=True)
class JobFilter:
    """Equality on queue, task and status; `error` is text searched in last_error."""

    queue: str | None = None
    task: str | None = None
    status: str | None = None
    error: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> JobFilter:
        values = {f.name: _text(f.name, params.get(f.name)) for f in fields(cls)}
        status = values["status"]
        if status is not None and status not in LIST_STATUSES:
            raise BadRequest(f"unknown status {status!r}: use one of {', '.join(LIST_STATUSES)}")
        return cls(**values)

    def params(self) -> dict[str, str]:
        """The filter as query parameters, empty ones left out."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def failed(self) -> JobFilter:
        """The same filter on failed jobs only: what a bulk retry acts on."""
        return replace(self, status="failed")


@dataclass(frozen=True)
class Cursor:
    """Keyset position: rows older than `before`, or newer than `after`, by id."""

    before: int | None = None
    after: int | None = None
    limit: int = PAGE_SIZE

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> Cursor:
        before = _number("before", params.get("before"))
        after = _number("after", params.get("after"))
        if before is not None and after is not None:
            raise BadRequest("give before or after, not both")
        limit = _number("limit", params.get("limit"))
        if limit is not None and not 1 <= limit <= MAX_PAGE_SIZE:
            raise BadRequest(f"limit must be between 1 and {MAX_PAGE_SIZE}, got {limit}")
        return cls(before, after, PAGE_SIZE if limit is None else limit)


def _text(name: str, value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    if "\x00" in value:
        raise BadRequest(f"{name} contains a NUL character")
    return value.strip()


def number(name: str, value: str | None) -> int:
    """A required whole number from a form or query string."""
    parsed = _number(name, value)
    if parsed is None:
        raise BadRequest(f"{name} is required")
    return parsed


def _number(name: str, value: str | None) -> int | None:
    if value is None or value == "":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) >= 2**63:
        raise BadRequest(f"{name} must be a whole number, got {value!r}")
    return int(value)
