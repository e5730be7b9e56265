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

from typing import Any

from alembic import op
from sqlalchemy import Table, text
from sqlalchemy.engine import Connection

from ..schema import Names, parse_version_comment, quote_ident
from .steps import LATEST, down_statements, up_statements

__all__ = [
    "LATEST",
    "SchemaError",
    "check_schema",
    "downgrade",
    "include_object",
    "schema_version",
    "upgrade",
]


class SchemaError(RuntimeError):
    """The queue table is missing or older than this code needs."""


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


def check_schema(conn: Connection, table: Table) -> None:
    """Refuse to work on a missing or outdated queue table, naming the fix."""
    names = Names(table.name, table.schema)
    version = schema_version(conn, names)
    # Version 0 is also what a table without our comment reads as: say
    # "does not exist" only when it truly does not.
    exists = conn.execute(
        text("SELECT to_regclass(:qualified) IS NOT NULL"), {"qualified": names.qualified}
    ).scalar()
    if not exists:
        raise SchemaError(
            f"the queue table {names.qualified} does not exist in this database: "
            "run `jobq migrate` (or `alembic upgrade head`) first"
        )
    if version < LATEST:
        raise SchemaError(
            f"the queue table {names.qualified} is at schema version {version}, this "
            f"sqla_jobq needs {LATEST}: run `jobq migrate` (or `alembic upgrade heads`)"
        )


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
