"""Turn `Facts` into `Finding`s, no I/O: the schema and what this role can
see here, then the xmin horizon (`horizon`), the server's checkpoints
(`checkpoints`) and writeback (`writeback`), the table (`table`,
`autovacuum`) and its queues (`queues`), in the order the report reads top
down."""

from __future__ import annotations

from collections.abc import Iterable

from ..migrations.check import LATEST
from ..schema import Names
from ..units import secs
from .autovacuum import autovacuum_finding
from .checkpoints import checkpoint_finding
from .horizon import (
    horizon_age,
    horizon_finding,
    prepared_findings,
    session_findings,
    slot_findings,
)
from .model import Facts, Finding, Thresholds, ok, warn
from .queues import queue_findings
from .settings import settings_findings
from .table import dead_tuple_finding, index_findings, size_finding, statistics_finding
from .writeback import writeback_finding


def judge(facts: Facts, names: Names, t: Thresholds) -> list[Finding]:
    """Turn the facts into findings: the database first, then the table, then its queues.

    Every check says something: one OK line when all is well, else one WARN
    line per culprit, so the report doubles as a dashboard.
    """
    horizon = horizon_age(facts)
    sessions = session_findings(facts.sessions, horizon, t)
    prepared = prepared_findings(facts.prepared, t)
    slots = slot_findings(facts.slots, t)
    held_back = bool(sessions or prepared or slots)
    paused = {s["queue"] for s in facts.settings if s["paused"]}
    return [
        _schema_finding(facts.schema_version),
        *_visibility_findings(facts.hidden_sessions),
        horizon_finding(facts, horizon),
        *_or_ok(
            sessions,
            "idle_in_transaction",
            f"no session idle in transaction over {secs(t.idle_in_transaction_seconds)} "
            f"or {t.horizon_xid_age:,} transactions behind",
        ),
        *_or_ok(
            sessions,
            "long_transaction",
            f"no transaction open over {secs(t.long_transaction_seconds)}",
        ),
        *_or_ok(prepared, "prepared_transaction", "no orphaned prepared transaction"),
        *_or_ok(slots, "replication_slot", "no replication slot holds the horizon back"),
        checkpoint_finding(facts, t),
        writeback_finding(facts, held_back),
        dead_tuple_finding(facts, names, t, held_back),
        autovacuum_finding(facts, names),
        statistics_finding(facts, names),
        size_finding(facts, names, t),
        *index_findings(facts.indexes, names),
        *queue_findings(facts.queues, names, t, paused),
        *settings_findings(facts.settings, facts.checked_at),
    ]


def _or_ok(findings: Iterable[Finding], check: str, ok_summary: str) -> list[Finding]:
    """The warnings of `check`, or one OK line saying what was checked."""
    mine = [f for f in findings if f.check == check]
    return mine or [ok(check, "database", ok_summary)]


def _schema_finding(version: int) -> Finding:
    data = {"version": version, "expected": LATEST}
    if version < LATEST:
        return warn(
            "schema_version",
            "table",
            f"schema version {version}, this sqla_jobq needs {LATEST}",
            "run `jobq migrate` (or `alembic upgrade heads`)",
            data,
        )
    return ok("schema_version", "table", f"schema version {version}", data)


def _visibility_findings(hidden: int) -> list[Finding]:
    """Without pg_read_all_stats, other roles' sessions are blank rows: say so."""
    if not hidden:
        return []
    return [
        warn(
            "visibility",
            "database",
            f"{hidden} session(s) of other roles are hidden from this role, "
            "so the session checks below cannot see them",
            "run doctor as a role with pg_read_all_stats (GRANT pg_read_all_stats TO ...)",
            {"hidden_sessions": hidden},
        )
    ]
