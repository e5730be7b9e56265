"""Which queue schema version a host app's Alembic revision pins.

A host revision written by `jobq alembic-revision` (or by hand, as the README
shows) calls `migrations.upgrade(version=N)` in its `upgrade()`. Reading the
source rather than importing it keeps this safe on any revision file, and
lets hand-edited revisions count as long as the call is still there.
"""

from __future__ import annotations

import ast


def pinned_version(source: str) -> int | None:
    """The version the revision's `upgrade()` brings the default `jobs` table to."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "upgrade":
            return _pin_in(node)
    return None


def _pin_in(function: ast.FunctionDef) -> int | None:
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and _is_queue_upgrade(node.func):
            version = _version_argument(node)
            if version is not None:
                return version
    return None


def _is_queue_upgrade(func: ast.expr) -> bool:
    """`migrations.upgrade` or `sqla_jobq.migrations.upgrade`."""
    if not (isinstance(func, ast.Attribute) and func.attr == "upgrade"):
        return False
    owner = func.value
    if isinstance(owner, ast.Name):
        return owner.id == "migrations"
    return isinstance(owner, ast.Attribute) and owner.attr == "migrations"


def _version_argument(call: ast.Call) -> int | None:
    keywords = {k.arg: k.value for k in call.keywords if k.arg is not None}
    # A call naming another table is about another queue, not the default
    # one `jobq alembic-revision` looks after.
    if not (_is(keywords.get("name"), "jobs") and _is(keywords.get("schema"), None)):
        return None
    value = keywords.get("version", call.args[0] if call.args else None)
    if isinstance(value, ast.Constant) and type(value.value) is int:
        return value.value
    return None


def _is(node: ast.expr | None, default: str | None) -> bool:
    """An argument left out, or given as the default's literal."""
    return node is None or (isinstance(node, ast.Constant) and node.value == default)
