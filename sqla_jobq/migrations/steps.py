"""Versioned schema steps: the single source of the queue's DDL.

Each step is frozen once released (append a new one, never edit an old one),
takes the table's name and schema, and is plain SQL run through Alembic's
`op.execute`, so the Alembic revisions of this package and a host app's own
revisions (custom name, two queues) run exactly the same DDL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..schema import UNIQUE_WHERE, Names, qualify, quote_ident, quote_literal, version_comment

Execute = Callable[[str], object]


@dataclass(frozen=True)
class Step:
    version: int
    why: str
    up: Callable[[Names], list[str]]
    down: Callable[[Names], list[str]]


def _v1_up(n: Names) -> list[str]:
    # The trigger announces scheduled jobs too: an idle worker sleeps until the
    # earliest run_at it knows of, and a new, earlier one must shorten that.
    table = n.qualified
    function = qualify(n.schema, n.notify_function)
    body = f"""
BEGIN
  PERFORM pg_notify({quote_literal(n.channel)}, inserted.queue)
  FROM (SELECT DISTINCT queue FROM new_jobs) AS inserted;
  RETURN NULL;
END;
"""
    return [
        f"""CREATE TABLE {table} (
  id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  queue        text        NOT NULL DEFAULT 'default',
  payload      jsonb       NOT NULL,
  status       text        NOT NULL DEFAULT 'queued'
               CONSTRAINT {quote_ident(n.status_check)}
               CHECK (status IN ('queued', 'running', 'done', 'failed')),
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 5,
  locked_until timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL DEFAULT now(),
  task         text,
  priority     int         NOT NULL DEFAULT 0,
  unique_key   text,
  started_at   timestamptz,
  finished_at  timestamptz
)""",
        f"CREATE INDEX {quote_ident(n.ready_index)} ON {table} (queue, run_at) "
        "WHERE status = 'queued'",
        f"CREATE INDEX {quote_ident(n.claim_index)} ON {table} "
        "(queue, priority DESC, run_at, id) WHERE status = 'queued'",
        f"CREATE INDEX {quote_ident(n.running_index)} ON {table} (locked_until) "
        "WHERE status = 'running'",
        f"CREATE UNIQUE INDEX {quote_ident(n.unique_index)} ON {table} (unique_key) "
        f"WHERE {UNIQUE_WHERE}",
        f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $jobq${body}$jobq$",
        f"CREATE TRIGGER {quote_ident(n.notify_trigger)} AFTER INSERT ON {table} "
        f"REFERENCING NEW TABLE AS new_jobs FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
    ]


def _v1_down(n: Names) -> list[str]:
    return [
        f"DROP TABLE {n.qualified}",
        f"DROP FUNCTION {qualify(n.schema, n.notify_function)}()",
    ]


def _v2_up(n: Names) -> list[str]:
    archive = n.archive_qualified
    return [
        f"""CREATE TABLE {archive} (
  id           bigint      NOT NULL CONSTRAINT {quote_ident(n.archive_pkey)} PRIMARY KEY,
  queue        text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       text        NOT NULL,
  run_at       timestamptz NOT NULL,
  attempts     int         NOT NULL,
  max_attempts int         NOT NULL,
  locked_until timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL,
  task         text,
  priority     int         NOT NULL,
  unique_key   text,
  started_at   timestamptz,
  finished_at  timestamptz,
  archived_at  timestamptz NOT NULL DEFAULT now()
)""",
        f"CREATE INDEX {quote_ident(n.archive_index)} ON {archive} (archived_at)",
        f"COMMENT ON TABLE {archive} IS {quote_literal(version_comment(2))}",
    ]


def _v2_down(n: Names) -> list[str]:
    return [f"DROP TABLE {n.archive_qualified}"]


STEPS: tuple[Step, ...] = (
    Step(
        1,
        "the jobs table, its partial indexes (ready, claim order, running leases, "
        "unique keys) and the per-statement NOTIFY trigger",
        _v1_up,
        _v1_down,
    ),
    Step(
        2,
        "the archive table `<name>_archive`: the jobs table's columns (ids copied, no "
        "identity, no trigger) plus `archived_at`, where `prune --archive` moves finished "
        "jobs so the hot table stays small without losing history",
        _v2_up,
        _v2_down,
    ),
)

LATEST = STEPS[-1].version


def _comment(n: Names, version: int | None) -> str:
    value = "NULL" if version is None else quote_literal(version_comment(version))
    return f"COMMENT ON TABLE {n.qualified} IS {value}"


def up_statements(n: Names, current: int, target: int) -> list[str]:
    """DDL taking the table from version `current` (0: absent) to `target`."""
    _check_target(target)
    sql: list[str] = []
    for step in STEPS:
        if current < step.version <= target:
            sql += step.up(n)
            sql.append(_comment(n, step.version))
    return sql


def down_statements(n: Names, current: int, target: int) -> list[str]:
    """DDL taking the table from version `current` down to `target` (0: drop it all)."""
    _check_target(target)
    sql: list[str] = []
    for step in reversed(STEPS):
        if target < step.version <= current:
            sql += step.down(n)
            if step.version - 1 > 0:
                sql.append(_comment(n, step.version - 1))
    return sql


def _check_target(target: int) -> None:
    if not 0 <= target <= LATEST:
        raise ValueError(f"sqla_jobq schema versions run from 0 to {LATEST}, not {target}")
