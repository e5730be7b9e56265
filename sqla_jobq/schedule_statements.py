"""Pure builders for periodic tasks' statements: fire, load, report.

Like `statements`, each function returns a SQLAlchemy construct and executes
nothing. The schedules table (`<table>_schedules`, schema version 4) holds one
row per schedule, its `last_fire`; that row, not a worker's memory, decides
which fire times have been enqueued.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    MetaData,
    Select,
    Table,
    Text,
    TextualSelect,
    any_,
    bindparam,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, TIMESTAMP

from .job import InvalidJob, encode_payload
from .schema import UNIQUE_WHERE, archive_table, names_of, schedules_table
from .units import setting_ms


def fire_key(name: str, at: datetime) -> str:
    """The unique key of the job of schedule `name` at fire time `at`."""
    return f"schedule:{name}@{at.astimezone(UTC).isoformat()}"


def fire(
    table: Table,
    name: str,
    at: datetime,
    *,
    task: str,
    payload: Any,
    queue: str = "default",
    priority: int = 0,
    max_attempts: int = 5,
    lock_timeout: timedelta | None = None,
) -> TextualSelect:
    """Enqueue fire time `at` of schedule `name`, once; selects the new job's id.

    One statement: the upsert moves the schedule's `last_fire` forward to `at`,
    and only a row it moved feeds the INSERT of the job. A racing worker's
    upsert waits for the row lock, then finds `last_fire` no longer older and
    changes nothing, so it inserts nothing: one job per fire time however many
    workers fire it, and never a second one after the first has finished and
    left the table (a unique key on active jobs could not promise that).

    The job's id is drawn first and recorded as `last_job_id` by the upsert
    itself (the same statement cannot update that row twice). If a job with the
    fire's unique key is still active (the schedule row was deleted and the
    fire time came round again), that job's id is recorded and nothing is
    inserted. Selects no row when this fire time was already enqueued.

    `lock_timeout` bounds the wait for the schedule's row, in the statement
    (see `statements.waiting_at_most`): the row is inserted through a SELECT
    whose one-time condition sets it before the row is touched.
    """
    if at.tzinfo is None:
        raise InvalidJob("a fire time must be timezone-aware")
    names = names_of(table)
    waiting, bounded = "", []
    if lock_timeout is not None:
        waiting = "\n  WHERE (SELECT set_config('lock_timeout', :lock_timeout, true)) IS NOT NULL"
        bounded.append(bindparam("lock_timeout", setting_ms(lock_timeout), type_=Text))
    sql = f"""
WITH fired AS (
  INSERT INTO {names.schedules_qualified} AS s (name, last_fire, last_job_id, updated_at)
  SELECT :name, :at, coalesce(
    (SELECT j.id FROM {names.qualified} j
     WHERE j.unique_key = :unique_key AND j.status IN ('queued', 'running')),
    nextval(CAST(pg_get_serial_sequence(:table, 'id') AS regclass))
  ), now(){waiting}
  ON CONFLICT (name) DO UPDATE
    SET last_fire = excluded.last_fire, last_job_id = excluded.last_job_id,
        updated_at = excluded.updated_at
    WHERE s.last_fire < excluded.last_fire
  RETURNING s.last_job_id AS id
)
INSERT INTO {names.qualified}
  (id, task, payload, queue, priority, max_attempts, unique_key, run_at, scheduled_for)
OVERRIDING SYSTEM VALUE
SELECT fired.id, :task, CAST(:payload AS jsonb), :queue, :priority, :max_attempts,
       :unique_key, :at, :at
FROM fired
ON CONFLICT (unique_key) WHERE {UNIQUE_WHERE} DO NOTHING
RETURNING id
"""
    return (
        text(sql)
        .bindparams(
            bindparam("name", name, type_=Text),
            bindparam("at", at, type_=TIMESTAMP(timezone=True)),
            bindparam("unique_key", fire_key(name, at), type_=Text),
            bindparam("table", names.qualified, type_=Text),
            bindparam("task", task, type_=Text),
            bindparam("payload", encode_payload(payload), type_=Text),
            bindparam("queue", queue, type_=Text),
            bindparam("priority", priority, type_=Integer),
            bindparam("max_attempts", max_attempts, type_=Integer),
            *bounded,
        )
        .columns(id=BigInteger)
    )


def load(table: Table, names: Sequence[str], now: datetime) -> TextualSelect:
    """Each schedule's `last_fire`, a new schedule's row created as last fired `now`.

    A schedule seen for the first time starts from now (nothing is back-filled),
    and its start is stored, so every worker counts an `every=` schedule's
    fire times from the same anchor. A row created by another worker after
    this statement's snapshot is missing from its result: load again.
    """
    schedules = names_of(table).schedules_qualified
    sql = f"""
WITH seeded AS (
  INSERT INTO {schedules} (name, last_fire)
  SELECT n, :now FROM unnest(CAST(:names AS text[])) AS n
  ON CONFLICT (name) DO NOTHING
  RETURNING name, last_fire
)
SELECT name, last_fire FROM seeded
UNION ALL
SELECT name, last_fire FROM {schedules} WHERE name = ANY(CAST(:names AS text[]))
"""
    return (
        text(sql)
        .bindparams(
            bindparam("names", list(names), type_=ARRAY(Text)),
            bindparam("now", now, type_=TIMESTAMP(timezone=True)),
        )
        .columns(name=Text, last_fire=TIMESTAMP(timezone=True))
    )


def report(table: Table, names: Sequence[str]) -> Select[Any]:
    """Per schedule: last fire time, last job's id and status, and whether that
    job has been moved to the archive (a pruned job has no status)."""
    metadata = MetaData()
    schedules = schedules_table(metadata, table.name, table.schema)
    archive = archive_table(metadata, table.name, table.schema)
    s = schedules.c
    return (
        select(
            s.name,
            s.last_fire,
            s.last_job_id,
            func.coalesce(table.c.status, archive.c.status).label("status"),
            archive.c.id.is_not(None).label("archived"),
        )
        .select_from(
            schedules.outerjoin(table, table.c.id == s.last_job_id).outerjoin(
                archive, archive.c.id == s.last_job_id
            )
        )
        .where(s.name == any_(bindparam("names", list(names), type_=ARRAY(Text))))
        .order_by(s.name)
    )
