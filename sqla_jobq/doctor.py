"""`jobq doctor`: a read-only health report on one queue table and on what
keeps VACUUM from cleaning it.

Why it exists: a queue table is all updates and deletes (claim, complete,
retry, prune), so it is the first table to bloat when VACUUM is held back, and
what holds VACUUM back is invisible from the queue itself: one session left
`idle in transaction` after a claim, a forgotten prepared transaction or an
abandoned replication slot keeps every row version newer than its xmin
("dead but not yet removable") in every table of the database. This report
names the culprit (its pid), then looks at the table (dead tuples, vacuum
history, sizes, indexes) and at the queue (backlog, leases, failures), and
says for each finding what to do, in one line.

It must never become the problem it reports: everything runs in ONE short
READ ONLY transaction (no xid, no row lock), under a statement and a lock
timeout, and the connection is handed back at once. The work is split in
three steps so each stays small: `collect` (SQL to plain rows), `judge` (rows
to findings, no I/O) and `render_text` / `Report.as_dict` (output).

JSON shape (``jobq doctor --json``), stable, ``format`` 1::

    {"format": 1, "table": "jobs", "database": "app",
     "server_version": "15.4", "checked_at": "2025-01-01T12:00:00+00:00",
     "healthy": false, "exit_status": 1,
     "findings": [{"check": "idle_in_transaction", "level": "warn",
                   "subject": "pid 4242 (billing)", "summary": "...",
                   "advice": "...", "data": {...}}, ...]}

``table`` is NAME or SCHEMA.NAME, unquoted; ``level`` is ``"ok"`` or
``"warn"``; ``advice`` is empty for ``ok``; ``check`` is one of `CHECKS`;
``data`` holds the measured numbers of that check.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Engine, MetaData, Table, text
from sqlalchemy.dialects.postgresql.base import PGDialect
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateIndex, Index

from .migrations import LATEST, SchemaError, schema_version
from .schema import Names, jobs_table, names_of

# --- thresholds --------------------------------------------------------------
# A session idle in transaction this long is doing something slow (an HTTP
# call, a whole job) with a transaction open: it pins a server connection (and
# a pooler slot) and keeps its locks, and VACUUM can remove nothing newer than
# its snapshot or xid. Matches a sensible idle_in_transaction_session_timeout.
IDLE_IN_TRANSACTION_SECONDS = 60.0
# Idle in transaction for any time while this many transactions went by: at
# least that many row versions VACUUM must keep. A healthy pause between two
# statements of a transaction lasts milliseconds and lets few go by.
HORIZON_XID_AGE = 1_000
# No queue statement needs a transaction anywhere near the default 5-minute
# lease; reports and migrations that do belong off-peak or on a replica.
LONG_TRANSACTION_SECONDS = 300.0
# A two-phase commit is resolved by its transaction manager within moments;
# one prepared a minute ago is probably orphaned, and it holds its xid forever.
PREPARED_XACT_SECONDS = 60.0
# An active slot's consumer (a standby with hot_standby_feedback, a logical
# subscriber) lags a little; this far behind it is stuck. An inactive slot is
# flagged from HORIZON_XID_AGE: nothing will ever advance it.
SLOT_XID_AGE = 1_000_000
# Autovacuum's own trigger is 50 rows + 20% of the table: past both a ratio of
# 20% dead and an absolute 10,000 (so a tiny table's noise is ignored), dead
# rows are winning the race and every claim scans more of them.
DEAD_RATIO = 0.20
DEAD_TUPLES = 10_000
# A ready job waiting five minutes means no worker serves its queue, or too few.
OLDEST_READY_SECONDS = 300.0
# Reapers run every few seconds; a job still `running` a minute past its lease
# means no reaper is running at all (and no worker, since workers reap).
EXPIRED_LEASE_GRACE_SECONDS = 60.0
# A running job that has used 80% of its lease is about to be reaped and run
# twice unless its handler extends the lease.
LEASE_USED_RATIO = 0.80
# How far back "recently failed" and "recently outlived its lease" look.
RECENT = timedelta(days=1)
# The doctor must never be the long transaction it warns about, nor queue
# behind a migration's ACCESS EXCLUSIVE lock and block everyone behind it.
STATEMENT_TIMEOUT_MS = 10_000
LOCK_TIMEOUT_MS = 1_000
APPLICATION_NAME = "jobq doctor"
_PG = PGDialect()  # type: ignore[no-untyped-call]
EXAMPLE_IDS = 5

CHECKS = (
    "schema_version",
    "visibility",
    "xmin_horizon",
    "idle_in_transaction",
    "long_transaction",
    "prepared_transaction",
    "replication_slot",
    "dead_tuples",
    "table_size",
    "index",
    "ready_backlog",
    "expired_leases",
    "lease_nearly_used",
    "lease_expired_recently",
    "failed_recently",
)

Level = Literal["ok", "warn"]
Row = dict[str, Any]


@dataclass(frozen=True)
class Thresholds:
    """The limits above, overridable (e.g. by a test that cannot wait a minute)."""

    idle_in_transaction_seconds: float = IDLE_IN_TRANSACTION_SECONDS
    horizon_xid_age: int = HORIZON_XID_AGE
    long_transaction_seconds: float = LONG_TRANSACTION_SECONDS
    prepared_xact_seconds: float = PREPARED_XACT_SECONDS
    slot_xid_age: int = SLOT_XID_AGE
    dead_ratio: float = DEAD_RATIO
    dead_tuples: int = DEAD_TUPLES
    oldest_ready_seconds: float = OLDEST_READY_SECONDS
    expired_lease_grace_seconds: float = EXPIRED_LEASE_GRACE_SECONDS
    lease_used_ratio: float = LEASE_USED_RATIO
    recent: timedelta = RECENT


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was measured and, if it is bad, what to do."""

    check: str
    level: Level
    subject: str
    summary: str
    advice: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Facts:
    """Everything `collect` read, as plain values, for `judge` to weigh."""

    database: str
    server_version: str
    checked_at: datetime
    schema_version: int
    hidden_sessions: int
    sessions: list[Row]
    prepared: list[Row]
    slots: list[Row]
    table: Row
    archive: Row | None
    indexes: list[Row]
    queues: list[Row]


@dataclass(frozen=True)
class Report:
    database: str
    server_version: str
    table: str
    checked_at: datetime
    findings: tuple[Finding, ...]

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level == "warn")

    @property
    def healthy(self) -> bool:
        return not self.warnings

    @property
    def exit_status(self) -> int:
        """0 healthy, 1 something needs attention (2, user errors, is the CLI's)."""
        return 0 if self.healthy else 1

    def as_dict(self) -> dict[str, Any]:
        """The documented JSON shape (see the module docstring)."""
        return {
            "format": 1,
            "table": self.table,
            "database": self.database,
            "server_version": self.server_version,
            "checked_at": self.checked_at.isoformat(),
            "healthy": self.healthy,
            "exit_status": self.exit_status,
            "findings": [
                {
                    "check": f.check,
                    "level": f.level,
                    "subject": f.subject,
                    "summary": f.summary,
                    "advice": f.advice,
                    "data": dict(f.data),
                }
                for f in self.findings
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)


# --- collect -------------------------------------------------------------------

_HEAD = """
SELECT current_database(), split_part(current_setting('server_version'), ' ', 1), now()
"""

_SESSIONS = """
SELECT pid, usename, application_name, client_addr::text AS client_addr,
       backend_type, state, left(query, 200) AS query,
       extract(epoch FROM now() - xact_start)::float8 AS xact_seconds,
       extract(epoch FROM now() - state_change)::float8 AS state_seconds,
       backend_xid IS NOT NULL AS has_xid,
       backend_xmin IS NOT NULL AS has_snapshot,
       age(backend_xid) AS xid_age,
       age(backend_xmin) AS xmin_age
FROM pg_stat_activity
WHERE pid <> pg_backend_pid()
  AND backend_type IN ('client backend', 'walsender')
  -- other databases' sessions do not hold this database's horizon back;
  -- a physical walsender's (hot_standby_feedback) holds every database's
  AND (datname = current_database() OR (backend_type = 'walsender' AND datname IS NULL))
  AND (xact_start IS NOT NULL OR backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
ORDER BY xact_start NULLS LAST, pid
"""

_HIDDEN_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND query = '<insufficient privilege>'
"""

_PREPARED = """
SELECT gid, owner, extract(epoch FROM now() - prepared)::float8 AS seconds,
       age(transaction) AS xid_age
FROM pg_prepared_xacts
WHERE database = current_database()
ORDER BY prepared
"""

_SLOTS = """
SELECT slot_name, slot_type, active, active_pid, database,
       age(xmin) AS xmin_age, age(catalog_xmin) AS catalog_xmin_age
FROM pg_replication_slots
WHERE (xmin IS NOT NULL OR catalog_xmin IS NOT NULL)
  AND (database IS NULL OR database = current_database())
ORDER BY slot_name
"""

_TABLE = """
SELECT coalesce(s.n_live_tup, 0) AS n_live_tup, coalesce(s.n_dead_tup, 0) AS n_dead_tup,
       s.last_vacuum, s.last_autovacuum, s.last_analyze, s.last_autoanalyze,
       pg_relation_size(c.oid) AS table_bytes, pg_indexes_size(c.oid) AS index_bytes,
       pg_total_relation_size(c.oid) AS total_bytes,
       current_setting('autovacuum') = 'on' AS autovacuum_server,
       (SELECT option_value FROM pg_options_to_table(c.reloptions)
        WHERE option_name = 'autovacuum_enabled') AS autovacuum_table
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = to_regclass(:qualified)
"""

_ARCHIVE = """
SELECT pg_total_relation_size(c.oid) AS total_bytes, c.reltuples::bigint AS rows_estimate
FROM pg_class c WHERE c.oid = to_regclass(:qualified)
"""

_INDEXES = """
SELECT c.relname AS name, i.indisvalid AS valid, i.indisready AS ready,
       EXISTS (SELECT 1 FROM pg_stat_progress_create_index p
               WHERE p.index_relid = i.indexrelid) AS building
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass(:qualified)
"""

# One pass over the table, grouped by queue. Status literals are inline so the
# partial indexes' predicates stay recognisable (see statements.py).
_QUEUES = """
WITH j AS (
  SELECT id, queue, status, run_at, locked_until, last_error, finished_at,
         status = 'queued' AND run_at <= now() AS ready,
         status = 'running' AND locked_until < now() - :grace AS expired,
         status = 'running' AND locked_until >= now() - :grace
           AND now() - started_at > (locked_until - started_at) * :used_ratio AS nearly_used,
         status = 'failed' AND finished_at > now() - :recent
           AND last_error IS DISTINCT FROM 'cancelled' AS failed_recently,
         last_error = 'lease expired'
           AND greatest(started_at, finished_at) > now() - :recent AS outlived_recently
  FROM {table}
)
SELECT queue,
       count(*) FILTER (WHERE ready) AS ready,
       extract(epoch FROM now() - min(run_at) FILTER (WHERE ready))::float8
         AS oldest_ready_seconds,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE expired) AS expired_leases,
       (array_agg(id ORDER BY locked_until, id) FILTER (WHERE expired))[1:{n}]
         AS expired_leases_ids,
       count(*) FILTER (WHERE nearly_used) AS lease_nearly_used,
       (array_agg(id ORDER BY locked_until, id) FILTER (WHERE nearly_used))[1:{n}]
         AS lease_nearly_used_ids,
       count(*) FILTER (WHERE outlived_recently) AS lease_expired_recently,
       (array_agg(id ORDER BY id DESC) FILTER (WHERE outlived_recently))[1:{n}]
         AS lease_expired_recently_ids,
       count(*) FILTER (WHERE failed_recently) AS failed_recently,
       (array_agg(id ORDER BY finished_at DESC, id) FILTER (WHERE failed_recently))[1:{n}]
         AS failed_recently_ids
FROM j
GROUP BY queue
ORDER BY queue
"""


def diagnose(engine: Engine, table: Table, thresholds: Thresholds | None = None) -> Report:
    """Collect in one short read-only transaction, then judge outside it."""
    names = names_of(table)
    limits = thresholds or Thresholds()
    with read_only(engine) as conn:
        facts = collect(conn, names, limits)
    return Report(
        database=facts.database,
        server_version=facts.server_version,
        table=names.table if names.schema is None else f"{names.schema}.{names.table}",
        checked_at=facts.checked_at,
        findings=tuple(judge(facts, names, limits)),
    )


@contextmanager
def read_only(engine: Engine) -> Iterator[Connection]:
    """One READ ONLY transaction (so no xid is ever taken and nothing is locked
    but for reading), bounded by a statement and a lock timeout, and named
    `jobq doctor` in pg_stat_activity. The SETs must come first in it."""
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SET TRANSACTION READ ONLY"))
        conn.execute(text(f"SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}"))
        conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
        conn.execute(text(f"SET LOCAL application_name = '{APPLICATION_NAME}'"))
        yield conn


def collect(conn: Connection, names: Names, thresholds: Thresholds) -> Facts:
    """Read everything the checks need; raises SchemaError if there is no queue table."""
    version = schema_version(conn, names)
    if version == 0:
        raise SchemaError(
            f"the queue table {names.qualified} does not exist in this database: "
            "check --table, or run `jobq migrate` first"
        )
    head = conn.execute(text(_HEAD)).one()
    qualified = {"qualified": names.qualified}
    archive = _rows(conn, _ARCHIVE, {"qualified": names.archive_qualified})
    return Facts(
        database=head[0],
        server_version=head[1],
        checked_at=head[2],
        schema_version=version,
        hidden_sessions=int(conn.execute(text(_HIDDEN_SESSIONS)).scalar_one()),
        sessions=_rows(conn, _SESSIONS),
        prepared=_rows(conn, _PREPARED),
        slots=_rows(conn, _SLOTS),
        table=_rows(conn, _TABLE, qualified)[0],
        archive=archive[0] if archive else None,
        indexes=_rows(conn, _INDEXES, qualified),
        queues=_rows(conn, _queues_sql(names), _queue_params(thresholds)),
    )


def _rows(conn: Connection, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
    return [dict(r._mapping) for r in conn.execute(text(sql), dict(params or {}))]


def _queues_sql(names: Names) -> str:
    return _QUEUES.format(table=names.qualified, n=EXAMPLE_IDS)


def _queue_params(t: Thresholds) -> dict[str, Any]:
    return {
        "grace": timedelta(seconds=t.expired_lease_grace_seconds),
        "used_ratio": t.lease_used_ratio,
        "recent": t.recent,
    }


# --- judge ---------------------------------------------------------------------


def judge(facts: Facts, names: Names, t: Thresholds) -> list[Finding]:
    """Turn the facts into findings: the database first, then the table, then its queues.

    Every check says something: one OK line when all is well, else one WARN
    line per culprit, so the report doubles as a dashboard.
    """
    horizon = _horizon_age(facts)
    sessions = _session_findings(facts.sessions, horizon, t)
    prepared = _prepared_findings(facts.prepared, t)
    slots = _slot_findings(facts.slots, t)
    held_back = bool(sessions or prepared or slots)
    return [
        _schema_finding(facts.schema_version),
        *_visibility_findings(facts.hidden_sessions),
        _horizon_finding(facts, horizon),
        *_or_ok(
            sessions,
            "idle_in_transaction",
            f"no session idle in transaction over {_secs(t.idle_in_transaction_seconds)} "
            f"or {t.horizon_xid_age:,} transactions behind",
        ),
        *_or_ok(
            sessions,
            "long_transaction",
            f"no transaction open over {_secs(t.long_transaction_seconds)}",
        ),
        *_or_ok(prepared, "prepared_transaction", "no orphaned prepared transaction"),
        *_or_ok(slots, "replication_slot", "no replication slot holds the horizon back"),
        _dead_tuple_finding(facts, names, t, held_back),
        _size_finding(facts),
        *_index_findings(facts.indexes, names),
        *_queue_findings(facts.queues, names, t),
    ]


def _ok(check: str, subject: str, summary: str, data: Mapping[str, Any] | None = None) -> Finding:
    return Finding(check, "ok", subject, summary, "", dict(data or {}))


def _warn(
    check: str, subject: str, summary: str, advice: str, data: Mapping[str, Any] | None = None
) -> Finding:
    return Finding(check, "warn", subject, summary, advice, dict(data or {}))


def _or_ok(findings: Iterable[Finding], check: str, ok_summary: str) -> list[Finding]:
    """The warnings of `check`, or one OK line saying what was checked."""
    mine = [f for f in findings if f.check == check]
    return mine or [_ok(check, "database", ok_summary)]


def _schema_finding(version: int) -> Finding:
    data = {"version": version, "expected": LATEST}
    if version < LATEST:
        return _warn(
            "schema_version",
            "table",
            f"schema version {version}, this sqla_jobq needs {LATEST}",
            "run `jobq migrate` (or `alembic upgrade heads`)",
            data,
        )
    return _ok("schema_version", "table", f"schema version {version}", data)


def _visibility_findings(hidden: int) -> list[Finding]:
    """Without pg_read_all_stats, other roles' sessions are blank rows: say so."""
    if not hidden:
        return []
    return [
        _warn(
            "visibility",
            "database",
            f"{hidden} session(s) of other roles are hidden from this role, "
            "so the session checks below cannot see them",
            "run doctor as a role with pg_read_all_stats (GRANT pg_read_all_stats TO ...)",
            {"hidden_sessions": hidden},
        )
    ]


# --- judge: the xmin horizon ------------------------------------------------------


def _session_age(s: Row) -> int | None:
    """How many transactions behind this session's xid or snapshot is (None: neither)."""
    ages = [a for a in (s["xid_age"], s["xmin_age"]) if a is not None]
    return max(ages) if ages else None


def _slot_age(s: Row) -> int | None:
    """A slot's `xmin` holds every table back; `catalog_xmin` only the catalogs."""
    return None if s["xmin_age"] is None else int(s["xmin_age"])


def _horizon_age(facts: Facts) -> int | None:
    ages = [
        *(_session_age(s) for s in facts.sessions),
        *(p["xid_age"] for p in facts.prepared),
        *(_slot_age(s) for s in facts.slots),
    ]
    known = [int(a) for a in ages if a is not None]
    return max(known) if known else None


def _horizon_holder(facts: Facts, horizon: int) -> str:
    for s in facts.sessions:
        if _session_age(s) == horizon:
            return _session_subject(s)
    for p in facts.prepared:
        if p["xid_age"] == horizon:
            return f"prepared transaction {p['gid']!r}"
    for s in facts.slots:
        if _slot_age(s) == horizon:
            return f"replication slot {s['slot_name']!r}"
    return "unknown"


def _horizon_finding(facts: Facts, horizon: int | None) -> Finding:
    if horizon is None:
        return _ok(
            "xmin_horizon",
            "database",
            "no other session, prepared transaction or slot holds an xid or snapshot",
            {"horizon_age": None, "holder": None},
        )
    holder = _horizon_holder(facts, horizon)
    return _ok(
        "xmin_horizon",
        "database",
        f"oldest xid/snapshot is {horizon:,} transactions behind, held by {holder}",
        {"horizon_age": horizon, "holder": holder},
    )


def _session_subject(s: Row) -> str:
    app = s["application_name"]
    return f"pid {s['pid']} ({app})" if app else f"pid {s['pid']}"


def _holds(s: Row, horizon: int | None) -> str:
    held = [w for w, on in (("an xid", s["has_xid"]), ("a snapshot", s["has_snapshot"])) if on]
    age = _session_age(s)
    if not held or age is None:
        return "holds no xid or snapshot"
    where = "it IS the xmin horizon" if age == horizon else f"the horizon is {horizon:,} behind"
    return f"holds {' and '.join(held)} {age:,} transactions behind; {where}"


def _session_data(s: Row, horizon: int | None) -> dict[str, Any]:
    age = _session_age(s)
    return {
        "pid": s["pid"],
        "usename": s["usename"],
        "application_name": s["application_name"],
        "client_addr": s["client_addr"],
        "backend_type": s["backend_type"],
        "state": s["state"],
        "xact_seconds": _round(s["xact_seconds"]),
        "state_seconds": _round(s["state_seconds"]),
        "has_xid": s["has_xid"],
        "has_snapshot": s["has_snapshot"],
        "xid_age": s["xid_age"],
        "xmin_age": s["xmin_age"],
        "holds_horizon": age is not None and age == horizon,
        "horizon_age": horizon,
        "query": s["query"],
    }


def _session_findings(sessions: Sequence[Row], horizon: int | None, t: Thresholds) -> list[Finding]:
    """Idle-in-transaction culprits first; otherwise, transactions open too long."""
    found: list[Finding] = []
    for s in sessions:
        idle = str(s["state"] or "").startswith("idle in transaction")
        age = _session_age(s)
        idle_long = idle and (s["state_seconds"] or 0.0) >= t.idle_in_transaction_seconds
        idle_holding = idle and age is not None and age >= t.horizon_xid_age
        if idle_long or idle_holding:
            found.append(_idle_finding(s, horizon))
        elif (s["xact_seconds"] or 0.0) >= t.long_transaction_seconds:
            found.append(_long_finding(s, horizon))
    return found


def _idle_finding(s: Row, horizon: int | None) -> Finding:
    pid = s["pid"]
    return _warn(
        "idle_in_transaction",
        _session_subject(s),
        f"{s['state']} for {_secs(s['state_seconds'])} (transaction open "
        f"{_secs(s['xact_seconds'])}); {_holds(s, horizon)}",
        f"commit or roll back in the app that owns it, or end it: "
        f"SELECT pg_terminate_backend({pid}); set idle_in_transaction_session_timeout",
        _session_data(s, horizon),
    )


def _long_finding(s: Row, horizon: int | None) -> Finding:
    pid = s["pid"]
    return _warn(
        "long_transaction",
        _session_subject(s),
        f"transaction open {_secs(s['xact_seconds'])}, {s['state'] or 'state unknown'}; "
        f"{_holds(s, horizon)}",
        f"if it should not take this long, cancel it: SELECT pg_cancel_backend({pid}); "
        "run long reports on a replica",
        _session_data(s, horizon),
    )


def _prepared_findings(prepared: Sequence[Row], t: Thresholds) -> list[Finding]:
    found: list[Finding] = []
    for p in prepared:
        if (p["seconds"] or 0.0) < t.prepared_xact_seconds:
            continue
        gid = str(p["gid"]).replace("'", "''")
        found.append(
            _warn(
                "prepared_transaction",
                f"gid {p['gid']!r}",
                f"prepared {_secs(p['seconds'])} ago by {p['owner']}; holds an xid "
                f"{p['xid_age']:,} transactions behind",
                f"ask its transaction manager, then COMMIT PREPARED '{gid}' "
                f"or ROLLBACK PREPARED '{gid}'",
                {
                    "gid": p["gid"],
                    "owner": p["owner"],
                    "seconds": _round(p["seconds"]),
                    "xid_age": p["xid_age"],
                },
            )
        )
    return found


def _slot_findings(slots: Sequence[Row], t: Thresholds) -> list[Finding]:
    found: list[Finding] = []
    for s in slots:
        ages = [a for a in (s["xmin_age"], s["catalog_xmin_age"]) if a is not None]
        worst = max(ages) if ages else 0
        stuck = worst >= t.slot_xid_age or (not s["active"] and worst >= t.horizon_xid_age)
        if not stuck:
            continue
        name = str(s["slot_name"]).replace("'", "''")
        found.append(
            _warn(
                "replication_slot",
                f"slot {s['slot_name']}",
                f"{s['slot_type']} slot, {'active' if s['active'] else 'INACTIVE'}; "
                f"xmin {_age(s['xmin_age'])}, catalog_xmin {_age(s['catalog_xmin_age'])} "
                "transactions behind",
                f"if nothing consumes it any more, drop it: "
                f"SELECT pg_drop_replication_slot('{name}'); else fix its standby or subscriber",
                {
                    "slot_name": s["slot_name"],
                    "slot_type": s["slot_type"],
                    "active": s["active"],
                    "active_pid": s["active_pid"],
                    "xmin_age": s["xmin_age"],
                    "catalog_xmin_age": s["catalog_xmin_age"],
                },
            )
        )
    return found


# --- judge: the table ---------------------------------------------------------------


_VACUUM_TIMES = ("last_vacuum", "last_autovacuum", "last_analyze", "last_autoanalyze")


def _autovacuum_on(row: Row) -> bool:
    table_option = row["autovacuum_table"]
    table_on = table_option is None or str(table_option).lower() in {"on", "true", "yes", "1"}
    return bool(row["autovacuum_server"]) and table_on


def _autovacuum_off_where(row: Row) -> str:
    return "server setting" if not row["autovacuum_server"] else "table option"


def _dead_tuple_finding(facts: Facts, names: Names, t: Thresholds, held_back: bool) -> Finding:
    row = facts.table
    live, dead = int(row["n_live_tup"]), int(row["n_dead_tup"])
    ratio = dead / (live + dead) if live + dead else 0.0
    autovacuum = _autovacuum_on(row)
    now = facts.checked_at
    summary = (
        f"live {live:,}, dead {dead:,} ({ratio:.1%}); "
        f"last autovacuum {_ago(row['last_autovacuum'], now)}, "
        f"last vacuum {_ago(row['last_vacuum'], now)}, "
        f"last autoanalyze {_ago(row['last_autoanalyze'], now)}"
        + ("" if autovacuum else f"; autovacuum is OFF ({_autovacuum_off_where(row)})")
    )
    data = {
        "n_live_tup": live,
        "n_dead_tup": dead,
        "dead_ratio": round(ratio, 4),
        "autovacuum_enabled": autovacuum,
        **{k: _iso(row[k]) for k in _VACUUM_TIMES},
    }
    if ratio > t.dead_ratio and dead > t.dead_tuples:
        advice = _vacuum_advice(names, held_back, autovacuum)
        return _warn("dead_tuples", "table", summary, advice, data)
    return _ok("dead_tuples", "table", summary, data)


def _vacuum_advice(names: Names, held_back: bool, autovacuum: bool) -> str:
    table = names.qualified
    if held_back:
        return (
            "VACUUM cannot remove them while what is flagged above holds the horizon: "
            f"end those, then VACUUM (VERBOSE) {table}"
        )
    if not autovacuum:
        return f"autovacuum is off: turn it on, or run VACUUM (VERBOSE) {table} on a schedule"
    return (
        f"run VACUUM (VERBOSE) {table}; if it recurs, vacuum it sooner: "
        f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = 0.01)"
    )


def _size_finding(facts: Facts) -> Finding:
    row = facts.table
    summary = (
        f"table {_bytes(row['table_bytes'])}, indexes {_bytes(row['index_bytes'])}, "
        f"total with TOAST {_bytes(row['total_bytes'])}"
    )
    data: dict[str, Any] = {
        "table_bytes": row["table_bytes"],
        "index_bytes": row["index_bytes"],
        "total_bytes": row["total_bytes"],
        "archive_bytes": None,
        "archive_rows_estimate": None,
    }
    archive = facts.archive
    if archive is not None:
        rows = int(archive["rows_estimate"])
        counted = f"about {rows:,} rows" if rows >= 0 else "not analyzed yet"
        summary += f"; archive {_bytes(archive['total_bytes'])}, {counted}"
        data["archive_bytes"] = archive["total_bytes"]
        data["archive_rows_estimate"] = rows if rows >= 0 else None
    return _ok("table_size", "table", summary, data)


# What goes wrong without each index, by the name `Names` gives it.
def _index_roles(names: Names) -> dict[str, str]:
    return {
        names.ready_index: "hand-written claims on (queue, run_at) scan the whole table",
        names.claim_index: "every `claim` scans the whole table instead of the ready rows",
        names.running_index: "the reaper scans the whole table",
        names.unique_index: "enqueue with a unique_key fails (ON CONFLICT finds no index)",
    }


def _index_findings(rows: Sequence[Row], names: Names) -> list[Finding]:
    """Each index the schema declares must exist and be valid (indisvalid)."""
    present = {r["name"]: r for r in rows}
    roles = _index_roles(names)
    expected = sorted(jobs_table(MetaData(), names.table, names.schema).indexes, key=_name)
    warnings: list[Finding] = []
    fine: list[str] = []
    for index in expected:
        name = _name(index)
        row = present.get(name)
        role = roles.get(name, "queries that need it scan the whole table")
        if row is None:
            warnings.append(
                _warn(
                    "index",
                    f"index {name}",
                    f"missing: {role}",
                    f"recreate it: {_create_index_sql(index)}",
                    {"name": name, "exists": False, "valid": False},
                )
            )
        elif not row["valid"] and not row["building"]:
            warnings.append(
                _warn(
                    "index",
                    f"index {name}",
                    f"INVALID (a failed CREATE INDEX CONCURRENTLY?), so ignored: {role}",
                    f"rebuild it: REINDEX INDEX CONCURRENTLY {_qualified_index(names, name)}",
                    {"name": name, "exists": True, "valid": False},
                )
            )
        else:
            fine.append(name if row["valid"] else f"{name} (being built)")
    if fine:
        warnings.append(_ok("index", "indexes", "valid: " + ", ".join(fine), {"valid": fine}))
    return warnings


def _name(index: Index) -> str:
    return str(index.name)


def _qualified_index(names: Names, name: str) -> str:
    return Names(name, names.schema).qualified


def _create_index_sql(index: Index) -> str:
    """The index's own DDL from the schema, built CONCURRENTLY so writes go on."""
    index.dialect_options["postgresql"]["concurrently"] = True
    sql = str(CreateIndex(index).compile(dialect=_PG))
    return " ".join(sql.split())


# --- judge: the queues ------------------------------------------------------------------


@dataclass(frozen=True)
class _QueueCheck:
    """A per-queue count that is a warning when not zero. Texts are formatted
    with count, ids, grace, recent, ratio and table."""

    check: str
    summary: str
    advice: str
    ok: str


_QUEUE_CHECKS = (
    _QueueCheck(
        "expired_leases",
        "{count:,} running job(s) whose lease expired over {grace} ago (ids {ids})",
        "nothing reaps them: run `jobq reap`, and check that workers (they reap) are running",
        "no lease expired over {grace} ago",
    ),
    _QueueCheck(
        "lease_nearly_used",
        "{count:,} running job(s) past {ratio:.0%} of their lease (ids {ids})",
        "give these tasks a longer lease or extend it while they run (extend_lease), "
        "or they are reaped and run twice",
        "no running job past {ratio:.0%} of its lease",
    ),
    _QueueCheck(
        "lease_expired_recently",
        "{count:,} job(s) outlived their lease in the last {recent} "
        "(last_error 'lease expired', ids {ids})",
        "a lease shorter than the task, or a worker crashing mid-job: compare the task's "
        "run time with its lease, and read the worker logs",
        "no job outlived its lease in the last {recent}",
    ),
    _QueueCheck(
        "failed_recently",
        "{count:,} job(s) failed for good in the last {recent} (ids {ids})",
        "read why: SELECT id, task, last_error FROM {table} WHERE id IN ({ids}); "
        "once fixed, `jobq retry ID`",
        "no job failed for good in the last {recent}",
    ),
)


def _queue_findings(queues: Sequence[Row], names: Names, t: Thresholds) -> list[Finding]:
    backlog = [_backlog_finding(q, t) for q in queues] or [
        _ok("ready_backlog", "queues", "the table holds no jobs")
    ]
    words = {
        "grace": _secs(t.expired_lease_grace_seconds),
        "recent": _span(t.recent),
        "ratio": t.lease_used_ratio,
        "table": names.qualified,
    }
    counted: list[Finding] = []
    for spec in _QUEUE_CHECKS:
        found = [_counted_finding(spec, q, words) for q in queues if q[spec.check]]
        counted += found or [_ok(spec.check, "queues", spec.ok.format(**words))]
    return [*backlog, *counted]


def _counted_finding(spec: _QueueCheck, q: Row, words: Mapping[str, Any]) -> Finding:
    ids = [int(i) for i in q[f"{spec.check}_ids"] or []]
    filled = {**words, "count": q[spec.check], "ids": ", ".join(map(str, ids))}
    return _warn(
        spec.check,
        f"queue {q['queue']}",
        spec.summary.format(**filled),
        spec.advice.format(**filled),
        {"queue": q["queue"], "count": q[spec.check], "ids": ids},
    )


def _backlog_finding(q: Row, t: Thresholds) -> Finding:
    oldest = q["oldest_ready_seconds"]
    waiting = "none waiting" if oldest is None else f"oldest waiting {_secs(oldest)}"
    summary = f"ready {q['ready']:,}, {waiting}; running {q['running']:,}"
    data = {
        "queue": q["queue"],
        "ready": q["ready"],
        "oldest_ready_seconds": _round(oldest),
        "running": q["running"],
    }
    subject = f"queue {q['queue']}"
    if oldest is not None and oldest >= t.oldest_ready_seconds:
        advice = f"no worker takes queue {q['queue']!r}, or too few: start (more) workers for it"
        return _warn("ready_backlog", subject, summary, advice, data)
    return _ok("ready_backlog", subject, summary, data)


# --- formatting -----------------------------------------------------------------------


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _age(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _secs(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _ago(value: datetime | None, now: datetime) -> str:
    return "never" if value is None else f"{_secs((now - value).total_seconds())} ago"


def _bytes(size: int | None) -> str:
    units = ("B", "kB", "MB", "GB", "TB")
    value, step = float(size or 0), 0
    while value >= 1024 and step < len(units) - 1:
        value, step = value / 1024, step + 1
    digits = 1 if step and value < 10 else 0
    return f"{value:.{digits}f} {units[step]}"


def _span(span: timedelta) -> str:
    return "day" if span == timedelta(days=1) else _secs(span.total_seconds())


def render_text(report: Report) -> str:
    """The human report: one line per finding, the advice under each WARN."""
    lines = [
        f"jobq doctor: table {report.table} in database {report.database} "
        f"(PostgreSQL {report.server_version}) at {report.checked_at:%Y-%m-%d %H:%M:%S %Z}",
        "",
        f"{'STATUS':<6}  {'CHECK':<22}  {'SUBJECT':<26}  DETAIL",
    ]
    for f in report.findings:
        lines.append(f"{f.level.upper():<6}  {f.check:<22}  {f.subject:<26}  {f.summary}")
        if f.advice:
            lines.append(f"{'':<8}-> {f.advice}")
    count = len(report.warnings)
    lines += [
        "",
        "healthy: nothing needs attention"
        if report.healthy
        else f"{count} finding(s) need attention (exit status 1)",
    ]
    return "\n".join(lines)
