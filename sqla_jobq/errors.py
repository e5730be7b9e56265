"""Errors a user can cause, each reported as one line naming the fix (exit 2) (internal)."""

from __future__ import annotations

import psycopg
from sqlalchemy.exc import OperationalError

from .db import BadDatabaseURL
from .job import InvalidJob
from .migrations.check import SchemaError
from .migrations.refused import RevisionRefused


class UsageError(ValueError):
    """Bad command-line input: a module path, a JSON payload, an option value."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    UsageError,
    BadDatabaseURL,
    SchemaError,
    InvalidJob,
    RevisionRefused,
)


def describe_connection_error(exc: BaseException) -> str:
    """One line for a database that cannot be reached, or that refused a statement."""
    cause = getattr(exc, "orig", None) or exc
    detail = str(cause).strip().splitlines()
    first = detail[0] if detail else type(cause).__name__
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(cause, psycopg.errors.QueryCanceled):
        return f"the database cancelled a query: {first} (a statement or lock timeout; retry)"
    if sqlstate is not None and not sqlstate.startswith("08"):
        return f"the database refused the statement: {first}"
    return f"cannot connect to the database: {first} (check --database-url / JOBQ_DATABASE_URL)"


CONNECTION_ERRORS: tuple[type[BaseException], ...] = (psycopg.OperationalError, OperationalError)
