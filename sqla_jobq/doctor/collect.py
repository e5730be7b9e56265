"""The doctor's only I/O: the read-only SQL whose rows become `Facts`, and
`read_only`, the one short, bounded transaction it all runs in, so the doctor
never becomes the long transaction (or the lock queue) it reports.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, MetaData, text
from sqlalchemy.engine import Connection

from .. import queue_statements
from ..migrations.check import SchemaError, schema_version
from ..schema import QUEUES_VERSION, Names, jobs_table
from .autovacuum import SERVER_SETTINGS
from .model import Facts, Row, Thresholds

# The doctor must never be the long transaction it warns about, nor queue
# behind a migration's ACCESS EXCLUSIVE lock and block everyone behind it.
STATEMENT_TIMEOUT_MS = 10_000
LOCK_TIMEOUT_MS = 1_000
APPLICATION_NAME = "jobq doctor"
EXAMPLE_IDS = 5

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
       pg_size_bytes(current_setting('shared_buffers')) AS shared_buffers_bytes,
       current_setting('block_size')::int AS block_size,
       (SELECT option_value FROM pg_options_to_table(c.reloptions)
        WHERE option_name = 'autovacuum_enabled') AS autovacuum_table
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = to_regclass(:qualified)
"""

# As the doctor's session sees them: a database's or a role's own setting
# (track_counts may have one) shows, with where it came from.
_AUTOVACUUM = """
SELECT s.name, current_setting(s.name) AS value, s.source,
       (SELECT option_value FROM pg_options_to_table(c.reloptions)
        WHERE option_name = s.name) AS table_value
FROM pg_settings s LEFT JOIN pg_class c ON c.oid = to_regclass(:qualified)
WHERE s.name = ANY(CAST(:names AS text[]))
"""

# The current checkpoint interval: its start, the WAL since its redo point, the
# settings that decide when the next one comes (see `checkpoints`), and the
# cumulative counts, from the view that holds them in this server version.
_CHECKPOINT = """
SELECT extract(epoch FROM now() - c.checkpoint_time)::float8 AS seconds,
       pg_wal_lsn_diff(pg_current_wal_lsn(), c.redo_lsn)::bigint AS wal_bytes,
       pg_size_bytes(current_setting('max_wal_size')) AS max_wal_size_bytes,
       current_setting('checkpoint_completion_target')::float8 AS completion_target,
       (SELECT setting::float8 FROM pg_settings WHERE name = 'checkpoint_timeout')
         AS checkpoint_timeout_seconds,
       k.{requested} AS requested, k.{timed} AS timed
FROM pg_control_checkpoint() c, {view} k
"""

# (view, requested, timed): PostgreSQL 17 moved the counts to a view of their own.
_CHECKPOINT_COUNTS = {
    16: ("pg_stat_bgwriter", "checkpoints_req", "checkpoints_timed"),
    17: ("pg_stat_checkpointer", "num_requested", "num_timed"),
}

_WRITEBACK = """
SELECT pg_size_bytes(current_setting(name)) AS bytes, source
FROM pg_settings WHERE name = 'backend_flush_after'
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
        autovacuum=_rows(conn, _AUTOVACUUM, {**qualified, "names": list(SERVER_SETTINGS)}),
        archive=archive[0] if archive else None,
        indexes=_rows(conn, _INDEXES, qualified),
        queues=_rows(conn, _queues_sql(names), _queue_params(thresholds)),
        settings=_settings(conn, names, version),
        checkpoints=_checkpoints(conn),
        writeback=_rows(conn, _WRITEBACK)[0],
    )


def _checkpoints(conn: Connection) -> Row:
    """The current checkpoint interval, or why it cannot be read here: a standby
    writes no WAL of its own, and a managed server may keep pg_control_checkpoint
    from this role (its privilege is checked first: a failed call would end the
    doctor's one transaction)."""
    standby, allowed, version = conn.execute(
        text(
            "SELECT pg_is_in_recovery(), "
            "has_function_privilege('pg_control_checkpoint()', 'EXECUTE'), "
            "current_setting('server_version_num')::int"
        )
    ).one()
    if standby:
        return {"unreadable": "a standby (its checkpoints follow its primary's WAL)"}
    if not allowed:
        return {"unreadable": "this role may not call pg_control_checkpoint()"}
    view, requested, timed = _CHECKPOINT_COUNTS[17 if version >= 170000 else 16]
    return _rows(conn, _CHECKPOINT.format(view=view, requested=requested, timed=timed))[0]


def _settings(conn: Connection, names: Names, version: int) -> list[Row]:
    """Paused and limited queues; a table older than their settings has none."""
    if version < QUEUES_VERSION:
        return []
    table = jobs_table(MetaData(), names.table, names.schema)
    return [dict(r._mapping) for r in conn.execute(queue_statements.settings(table))]


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
