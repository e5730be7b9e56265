"""Judge whether autovacuum can keep the queue table clean, and with what settings.

Why a check of its own: every job leaves two dead row versions in the queue
table, and only VACUUM makes their space reusable. With autovacuum off (for
the server, or for this table alone) or `track_counts` off (then nothing
counts dead tuples, so autovacuum never sees any, and `pg_stat_user_tables`
reads zero) nothing does that on its own, whatever the dead-tuple check says
today. When all is on, the finding shows the settings autovacuum applies to
this table and where each comes from: the table's own (schema version 6 sets
them) or the server's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..schema import QUEUE_TABLE_SETTINGS, Names, quote_ident
from .model import Facts, Finding, Row, ok, warn

# The schema version whose migration sets QUEUE_TABLE_SETTINGS on the table.
SETTINGS_VERSION = 6
NAPTIME = "autovacuum_naptime"
# What `collect` reads from pg_settings, as the doctor's own session sees it.
SERVER_SETTINGS = ("autovacuum", "track_counts", NAPTIME, *QUEUE_TABLE_SETTINGS)

_TRUE = {"on", "true", "yes", "1"}


def table_option_off(row: Row) -> bool:
    """The table's reloption autovacuum_enabled is set, and not to true."""
    option = row["autovacuum_table"]
    return option is not None and str(option).lower() not in _TRUE


def off_where(facts: Facts) -> str | None:
    """What keeps autovacuum off this table, in a few words; None when nothing does."""
    server = _by_name(facts)
    if server["autovacuum"]["value"] != "on":
        return "server setting"
    if table_option_off(facts.table):
        return "table option"
    if server["track_counts"]["value"] != "on":
        return "track_counts is off"
    return None


def _by_name(facts: Facts) -> dict[str, Row]:
    return {r["name"]: r for r in facts.autovacuum}


def autovacuum_finding(facts: Facts, names: Names) -> Finding:
    """WARN when autovacuum cannot clean the table; else its effective settings."""
    server = _by_name(facts)
    settings = _effective(server)
    # Before version 6 the table has no settings of its own to have changed.
    changed = _changed(settings) if facts.schema_version >= SETTINGS_VERSION else {}
    data: dict[str, Any] = {
        "autovacuum": server["autovacuum"]["value"] == "on",
        "track_counts": server["track_counts"]["value"] == "on",
        "table_autovacuum_enabled": facts.table["autovacuum_table"],
        "settings": settings,
        NAPTIME: server[NAPTIME]["value"],
        "changed": changed,
    }
    blockers = _blockers(server, facts.table, facts.database, names)
    if blockers:
        summary = "autovacuum cannot clean this table: " + "; ".join(b for b, _ in blockers)
        advice = _consequence(server) + "; fix: " + "; ".join(f for _, f in blockers)
        return warn("autovacuum", "table", summary, advice, data)
    return ok("autovacuum", "table", _summary(settings, server[NAPTIME], changed), data)


def _effective(server: Mapping[str, Row]) -> dict[str, dict[str, str]]:
    """Each step-6 setting's value for this table: its own, else the server's."""
    effective: dict[str, dict[str, str]] = {}
    for name in QUEUE_TABLE_SETTINGS:
        row = server[name]
        own = row["table_value"]
        effective[name] = (
            {"value": str(own), "source": "table"}
            if own is not None
            else {"value": str(row["value"]), "source": "server"}
        )
    return effective


def _blockers(
    server: Mapping[str, Row], table: Row, database: str, names: Names
) -> list[tuple[str, str]]:
    """(what is off, the statement that turns it back on), in the order they apply."""
    found: list[tuple[str, str]] = []
    if server["autovacuum"]["value"] != "on":
        found.append(_server_off(server["autovacuum"], database))
    if table_option_off(table):
        found.append(
            (
                f"table option autovacuum_enabled = {table['autovacuum_table']}",
                f"ALTER TABLE {names.qualified} RESET (autovacuum_enabled)",
            )
        )
    if server["track_counts"]["value"] != "on":
        found.append(_server_off(server["track_counts"], database))
    return found


def _server_off(row: Row, database: str) -> tuple[str, str]:
    """A setting that is off, named with where it was set, and how to undo it there.

    `autovacuum` can only be set for the whole server; `track_counts` also per
    database or role (it is a superuser setting), where ALTER SYSTEM would not
    reach it.
    """
    name, source = row["name"], row["source"]
    what = f"{name} = off (source: {source})"
    if source == "database":
        return what, f"ALTER DATABASE {quote_ident(database)} RESET {name}"
    if source == "user":
        return what, f"ALTER ROLE CURRENT_USER RESET {name}"
    if source == "database user":
        return what, f"ALTER ROLE CURRENT_USER IN DATABASE {quote_ident(database)} RESET {name}"
    if source == "command line":
        return what, f"restart the server without -c {name}=off"
    return what, f"ALTER SYSTEM SET {name} = on; SELECT pg_reload_conf();"


def _consequence(server: Mapping[str, Row]) -> str:
    consequence = (
        "dead row versions are never removed on their own: the queue table grows "
        "without bound unless pruned and vacuumed by hand"
    )
    if server["track_counts"]["value"] != "on":
        consequence += " (a worker's own VACUUM, where it has one, needs pg_stat counts too)"
    return consequence


def _changed(settings: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """The step-6 settings this table no longer has as schema version 6 set them."""
    return {
        name: {"value": settings[name]["value"], "schema": wanted}
        for name, wanted in QUEUE_TABLE_SETTINGS.items()
        if not _same(settings[name]["value"], wanted)
    }


def _same(value: str, wanted: str) -> bool:
    """Equal as PostgreSQL reads them: `0.0` is `0`."""
    try:
        return float(value) == float(wanted)
    except ValueError:
        return value == wanted


def _summary(
    settings: Mapping[str, Mapping[str, str]],
    naptime: Row,
    changed: Mapping[str, Mapping[str, str]],
) -> str:
    shown = [f"{name} = {s['value']} ({s['source']})" for name, s in settings.items()]
    shown.append(f"{NAPTIME} = {naptime['value']} (server)")
    summary = "on; " + ", ".join(shown)
    if changed:
        edits = [f"{name} (was {c['schema']})" for name, c in changed.items()]
        summary += f"; changed since schema version {SETTINGS_VERSION}: " + ", ".join(edits)
    return summary
