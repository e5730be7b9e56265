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

from types import ModuleType
from typing import Any

from ..schema import Names, parse_version_comment, quote_ident
from .check import LATEST, SchemaError, check_schema, missing_triggers, schema_version
from .steps import down_statements, up_statements

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


def upgrade(version: int = LATEST, *, name: str = "jobs", schema: str | None = None) -> None:
    """From a host's Alembic revision: bring one queue table up to `version`.

    Pin `version` in the revision (as Oban does) so the revision means the
    same thing after sqla_jobq is upgraded; a later revision raises it.
    """
    names, op = Names(name, schema), _op()
    if schema is not None:
        op.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
    for sql in up_statements(names, _current(names), version):
        op.execute(sql)


def downgrade(version: int = 0, *, name: str = "jobs", schema: str | None = None) -> None:
    """From a host's Alembic revision: take one queue table down to `version`."""
    names, op = Names(name, schema), _op()
    for sql in down_statements(names, _current(names), version):
        op.execute(sql)


def _current(names: Names) -> int:
    return schema_version(_op().get_bind(), names)


def _op() -> ModuleType:
    """`alembic.op`, imported by the revisions that call this module's
    helpers: the runtime check below this package must not import Alembic,
    a sixth of a worker's start-up on its own."""
    from alembic import op

    return op


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
