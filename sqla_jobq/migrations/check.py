"""The runtime schema check: is this database's queue table the one this code needs?

Workers, the CLI, the dashboard and `wait_for` call `check_schema` before they
touch a queue table, so a missing, outdated or silent table (its NOTIFY
triggers dropped) is refused with one line naming the fix, instead of failing
later inside a statement. Separate from the host helpers in the package's
`__init__` so runtime code depends on the check alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Table, text
from sqlalchemy.engine import Connection

from ..schema import (
    MAX_IDENTIFIER_BYTES,
    Names,
    canonical_channel,
    names_of,
    parse_version_comment,
    quote_ident,
)
from .steps import LATEST

__all__ = ["LATEST", "SchemaError", "check_schema", "missing_triggers", "schema_version"]


class SchemaError(RuntimeError):
    """The queue table is missing, older than this code needs, or has lost its triggers."""


def schema_version(conn: Connection, names: Names) -> int:
    """The version recorded on the table (0 when the table does not exist)."""
    row = conn.execute(
        text(
            "SELECT c.oid IS NOT NULL, obj_description(c.oid, 'pg_class') "
            "FROM (SELECT to_regclass(:qualified) AS oid) r "
            "LEFT JOIN pg_class c ON c.oid = r.oid"
        ),
        {"qualified": names.qualified},
    ).one()
    exists, comment = row
    if not exists:
        return 0
    return parse_version_comment(comment) or 0


@dataclass(frozen=True)
class _Found:
    """A queue table as the server resolved its name."""

    schema: str
    table: str
    version: int
    triggers: frozenset[str]


# The triggers of the jobs table and of its queue settings' table: resuming a
# queue wakes the workers through the latter's.
_FIND = text(
    "SELECT n.nspname, c.relname, obj_description(c.oid, 'pg_class'), "
    "ARRAY(SELECT t.tgname::text FROM pg_trigger t "
    "WHERE t.tgrelid IN (c.oid, to_regclass(:queues)) "
    "AND NOT t.tgisinternal AND t.tgenabled <> 'D') "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = to_regclass(:qualified)"
)


def _find(conn: Connection, names: Names) -> _Found | None:
    params = {"qualified": names.qualified, "queues": names.queues_qualified}
    row = conn.execute(_FIND, params).first()
    if row is None:
        return None
    return _Found(row[0], row[1], parse_version_comment(row[2]) or 0, frozenset(row[3]))


def _missing(names: Names, found: _Found | None) -> list[str]:
    wanted = [
        names.notify_trigger,
        names.notify_requeue_trigger,
        names.notify_finished,
        names.notify_cancel,
        names.queues_notify,
    ]
    return wanted if found is None else [t for t in wanted if t not in found.triggers]


def missing_triggers(conn: Connection, names: Names) -> list[str]:
    """The latest schema's NOTIFY triggers that the table lacks or has disabled."""
    return _missing(names, _find(conn, names))


def check_schema(conn: Connection, table: Table) -> str:
    """Refuse a missing, outdated or silent queue table, naming the fix; else
    return the NOTIFY channel its triggers send on.

    The channel comes from the server's own resolution of the name (through
    `search_path` when the table has no schema), so a worker that LISTENs on
    it hears the triggers however the table's name was spelled.
    """
    names = names_of(table)
    found = _find(conn, names)
    if found is None:
        raise SchemaError(
            f"the queue table {names.qualified} does not exist in this database: "
            "run `jobq migrate` (or `alembic upgrade head`) first"
        )
    if found.version < LATEST:
        raise SchemaError(
            f"the queue table {names.qualified} is at schema version {found.version}, this "
            f"sqla_jobq needs {LATEST}: run `jobq migrate` (or `alembic upgrade heads`)"
        )
    missing = _missing(names, found)
    if missing:
        raise SchemaError(
            f"the queue table {names.qualified} has lost its NOTIFY trigger(s) "
            f"{', '.join(map(quote_ident, missing))} (dropped or disabled), so workers would "
            "see new jobs only at their fallback poll: run `jobq migrate` to re-create them"
        )
    return _channel(found)


def _channel(found: _Found) -> str:
    channel = canonical_channel(found.schema, found.table)
    if len(channel.encode()) > MAX_IDENTIFIER_BYTES:
        raise SchemaError(
            f"the queue table's NOTIFY channel {channel!r} is over {MAX_IDENTIFIER_BYTES} "
            "bytes, which pg_notify refuses: use a shorter schema or table name"
        )
    return channel
