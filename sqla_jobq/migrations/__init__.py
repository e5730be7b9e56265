"""Schema migrations: Alembic revisions on the `sqla_jobq` branch, and helpers
for host apps that run the queue's DDL from revisions of their own.

Four ways in:

* standalone: `alembic upgrade head` from this repository (or `jobq migrate`);
* a host that already uses Alembic gets one revision of its own calling
  `upgrade(version=N)` per queue upgrade (`jobq alembic-revision`, `host.py`);
* or it adds ``sqla_jobq:migrations/versions`` to its `version_locations`
  (with ``path_separator = space``), starts a branch of its own, and runs
  `alembic upgrade heads`;
* a host that wants another table name, a schema, or two queues calls
  `upgrade(version=..., name=..., schema=...)` from its own revision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alembic import op
from sqlalchemy import Table, text
from sqlalchemy.engine import Connection

from ..schema import (
    MAX_IDENTIFIER_BYTES,
    Names,
    canonical_channel,
    parse_version_comment,
    quote_ident,
)
from .steps import LATEST, down_statements, up_statements

__all__ = [
    "LATEST",
    "SchemaError",
    "check_schema",
    "downgrade",
    "include_object",
    "missing_triggers",
    "schema_version",
    "upgrade",
]


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


_FIND = text(
    "SELECT n.nspname, c.relname, obj_description(c.oid, 'pg_class'), "
    "ARRAY(SELECT t.tgname::text FROM pg_trigger t WHERE t.tgrelid = c.oid "
    "AND NOT t.tgisinternal AND t.tgenabled <> 'D') "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = to_regclass(:qualified)"
)


def _find(conn: Connection, names: Names) -> _Found | None:
    row = conn.execute(_FIND, {"qualified": names.qualified}).first()
    if row is None:
        return None
    return _Found(row[0], row[1], parse_version_comment(row[2]) or 0, frozenset(row[3]))


def _missing(names: Names, found: _Found | None) -> list[str]:
    wanted = [names.notify_trigger, names.notify_requeue_trigger]
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
    names = Names(table.name, table.schema)
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


def upgrade(version: int = LATEST, *, name: str = "jobs", schema: str | None = None) -> None:
    """From a host's Alembic revision: bring one queue table up to `version`.

    Pin `version` in the revision (as Oban does) so the revision means the
    same thing after sqla_jobq is upgraded; a later revision raises it.
    """
    names = Names(name, schema)
    if schema is not None:
        op.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
    for sql in up_statements(names, _current(names), version):
        op.execute(sql)


def downgrade(version: int = 0, *, name: str = "jobs", schema: str | None = None) -> None:
    """From a host's Alembic revision: take one queue table down to `version`."""
    names = Names(name, schema)
    for sql in down_statements(names, _current(names), version):
        op.execute(sql)


def _current(names: Names) -> int:
    return schema_version(op.get_bind(), names)


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """An `include_object` hook keeping a host's autogenerate off the queue's objects.

    Without it, autogenerate in an app that does not declare the jobs table
    proposes dropping it. Queue tables are recognised by the version comment
    the migrations put on them, whatever their name.
    """
    table = obj if type_ == "table" else getattr(obj, "table", None)
    comment = getattr(table, "comment", None)
    return parse_version_comment(comment) is None
