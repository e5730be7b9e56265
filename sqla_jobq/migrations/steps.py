"""Versioned schema steps: the single source of the queue's DDL.

Each step is frozen once released (append a new one, never edit an old one),
takes the table's name and schema, and is plain SQL run through Alembic's
`op.execute`, so the Alembic revisions of this package and a host app's own
revisions (custom name, two queues) run exactly the same DDL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..schema import (
    DONE_WHERE,
    NO_TRUNCATE_SETTINGS,
    QUEUE_TABLE_SETTINGS,
    RUNNING_WHERE,
    UNIQUE_WHERE,
    Names,
    qualify,
    quote_ident,
    quote_literal,
    version_comment,
)


@dataclass(frozen=True)
class Step:
    version: int
    why: str
    up: Callable[[Names], list[str]]
    down: Callable[[Names], list[str]]


_TRIGGER = "() RETURNS trigger LANGUAGE plpgsql"


def _function(function: str, body: str, *, replace: bool = False, signature: str = _TRIGGER) -> str:
    """A plpgsql function (by default a trigger function) whose body is a
    plain string literal.

    A dollar-quoted body with a fixed tag (`$jobq$`, as steps 1 and 2 were
    first released) broke on a table name containing that tag. Quoting the
    body as a literal cannot be broken by any name, and PostgreSQL stores the
    same source either way: the function is byte-identical to the one the
    dollar-quoted statement made, for every name that statement accepted.
    """
    create = "CREATE OR REPLACE FUNCTION" if replace else "CREATE FUNCTION"
    return f"{create} {function}{signature} AS {quote_literal(body)}"


def _v1_notify_body(n: Names) -> str:
    return f"""
BEGIN
  PERFORM pg_notify({quote_literal(n.literal_channel)}, inserted.queue)
  FROM (SELECT DISTINCT queue FROM new_jobs) AS inserted;
  RETURN NULL;
END;
"""


def _v1_up(n: Names) -> list[str]:
    # The trigger announces scheduled jobs too: an idle worker sleeps until the
    # earliest run_at it knows of, and a new, earlier one must shorten that.
    table = n.qualified
    function = qualify(n.schema, n.notify_function)
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
        _function(function, _v1_notify_body(n)),
        _insert_trigger(n),
    ]


def _insert_trigger(n: Names) -> str:
    return (
        f"CREATE TRIGGER {quote_ident(n.notify_trigger)} AFTER INSERT ON {n.qualified} "
        "REFERENCING NEW TABLE AS new_jobs FOR EACH STATEMENT "
        f"EXECUTE FUNCTION {qualify(n.schema, n.notify_function)}()"
    )


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


# The server names the channel after the table that fired, so it cannot depend
# on how a caller spelled the name; `schema.canonical_channel` formats the same.
_CHANNEL = "TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME"

_V3_NOTIFY_BODY = f"""
BEGIN
  PERFORM pg_notify({_CHANNEL}, inserted.queue)
  FROM (SELECT DISTINCT queue FROM new_jobs) AS inserted;
  RETURN NULL;
END;
"""

_V3_REQUEUE_BODY = f"""
BEGIN
  PERFORM pg_notify({_CHANNEL}, NEW.queue);
  RETURN NULL;
END;
"""


def _requeue_trigger(n: Names) -> str:
    # Claims, completions and lease extensions fail the WHEN (extensions do not
    # even SET status), so the hot path never calls plpgsql. PostgreSQL folds
    # identical notifications of a transaction: a reap of many rows sends one
    # per queue.
    return (
        f"CREATE TRIGGER {quote_ident(n.notify_requeue_trigger)} "
        f"AFTER UPDATE OF status ON {n.qualified} FOR EACH ROW "
        "WHEN (NEW.status = 'queued' AND OLD.status IS DISTINCT FROM 'queued') "
        f"EXECUTE FUNCTION {qualify(n.schema, n.notify_requeue_function)}()"
    )


def _v3_up(n: Names) -> list[str]:
    return [
        _function(qualify(n.schema, n.notify_function), _V3_NOTIFY_BODY, replace=True),
        _function(qualify(n.schema, n.notify_requeue_function), _V3_REQUEUE_BODY),
        _requeue_trigger(n),
    ]


def _v3_down(n: Names) -> list[str]:
    return [
        f"DROP TRIGGER {quote_ident(n.notify_requeue_trigger)} ON {n.qualified}",
        f"DROP FUNCTION {qualify(n.schema, n.notify_requeue_function)}()",
        _function(qualify(n.schema, n.notify_function), _v1_notify_body(n), replace=True),
    ]


def repair_statements(n: Names) -> list[str]:
    """The NOTIFY functions and triggers as the latest step leaves them, re-created.

    A current table whose triggers were dropped or disabled makes every job
    (or, for the queue settings' trigger, every resumed queue) wait for the
    workers' fallback poll; `jobq migrate` runs these on it. They
    change no schema version, so they are not a step.

    Step 6's autovacuum settings are not re-applied: they tune the table, it
    works without them, and an operator may have changed them on purpose
    (`jobq doctor` reports settings that differ, without warning).
    """
    table = n.qualified
    return [
        _function(qualify(n.schema, n.notify_function), _V3_NOTIFY_BODY, replace=True),
        _function(qualify(n.schema, n.notify_requeue_function), _V3_REQUEUE_BODY, replace=True),
        f"DROP TRIGGER IF EXISTS {quote_ident(n.notify_trigger)} ON {table}",
        _insert_trigger(n),
        f"DROP TRIGGER IF EXISTS {quote_ident(n.notify_requeue_trigger)} ON {table}",
        _requeue_trigger(n),
        *_v5_triggers(n, replace=True),
        *_queues_trigger(n, replace=True),
    ]


def _v4_up(n: Names) -> list[str]:
    # The archive copies whole rows by column name, so it takes the new column too.
    schedules = n.schedules_qualified
    return [
        f"""CREATE TABLE {schedules} (
  name        text        CONSTRAINT {quote_ident(n.schedules_pkey)} PRIMARY KEY,
  last_fire   timestamptz NOT NULL,
  last_job_id bigint,
  updated_at  timestamptz NOT NULL DEFAULT now()
)""",
        f"COMMENT ON TABLE {schedules} IS {quote_literal(version_comment(4))}",
        f"ALTER TABLE {n.qualified} ADD COLUMN scheduled_for timestamptz",
        f"ALTER TABLE {n.archive_qualified} ADD COLUMN scheduled_for timestamptz",
        f"COMMENT ON TABLE {n.archive_qualified} IS {quote_literal(version_comment(4))}",
    ]


def _v4_down(n: Names) -> list[str]:
    # IF EXISTS: an archive dropped and re-created by step 2 alone lacks the column.
    return [
        f"ALTER TABLE {n.archive_qualified} DROP COLUMN IF EXISTS scheduled_for",
        f"COMMENT ON TABLE {n.archive_qualified} IS {quote_literal(version_comment(2))}",
        f"ALTER TABLE {n.qualified} DROP COLUMN scheduled_for",
        f"DROP TABLE {n.schedules_qualified}",
    ]


_V5_FINISHED_BODY = f"""
BEGIN
  PERFORM pg_notify({_CHANNEL}, '#finished ' || NEW.id);
  RETURN NULL;
END;
"""

_V5_CANCEL_BODY = f"""
BEGIN
  PERFORM pg_notify({_CHANNEL}, '#cancel ' || NEW.id);
  RETURN NULL;
END;
"""


def _row_trigger(n: Names, name: str, when: str) -> str:
    return (
        f"CREATE TRIGGER {quote_ident(name)} AFTER UPDATE OF status ON {n.qualified} "
        f"FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION {qualify(n.schema, name)}()"
    )


# Only rows someone waits on (`wait_for` sets `awaited`) and running jobs
# cancelled call plpgsql; every other completion passes on the WHEN alone.
_FINISHED_WHEN = (
    "NEW.awaited AND NEW.status IN ('done', 'failed', 'cancelled') "
    "AND OLD.status IS DISTINCT FROM NEW.status"
)
_CANCEL_WHEN = "NEW.status = 'cancelled' AND OLD.status = 'running'"
_V5_COLUMNS = (
    "ADD COLUMN cancel_requested_at timestamptz, ADD COLUMN result jsonb, "
    "ADD COLUMN traceparent text, ADD COLUMN awaited boolean NOT NULL DEFAULT false"
)


def _v5_triggers(n: Names, *, replace: bool) -> list[str]:
    sql: list[str] = []
    for name, body, when in (
        (n.notify_finished, _V5_FINISHED_BODY, _FINISHED_WHEN),
        (n.notify_cancel, _V5_CANCEL_BODY, _CANCEL_WHEN),
    ):
        sql.append(_function(qualify(n.schema, name), body, replace=replace))
        if replace:
            sql.append(f"DROP TRIGGER IF EXISTS {quote_ident(name)} ON {n.qualified}")
        sql.append(_row_trigger(n, name, when))
    return sql


def _status_check(n: Names, statuses: str) -> list[str]:
    table = n.qualified
    return [
        f"ALTER TABLE {table} DROP CONSTRAINT {quote_ident(n.status_check)}",
        f"ALTER TABLE {table} ADD CONSTRAINT {quote_ident(n.status_check)} "
        f"CHECK (status IN ({statuses}))",
    ]


def _claim_slots_body(n: Names, running: str = "status = 'running'") -> str:
    """How many jobs a claim may take from `queue_name` now: NULL (no setting:
    the claim's own limit alone), 0 (paused), or its limit minus its running
    jobs. Claimers of one limited queue take turns on a transaction-level
    advisory lock, held until they commit; each then counts in a snapshot of
    its own, taken after its turn began, so it sees every claim committed
    before. (The claim statement's snapshot predates its wait for the lock:
    counting there would miss the claim it waited for, and over-admit.)"""
    queues, key = n.queues_qualified, quote_literal(n.qualified)
    return f"""
DECLARE
  halted boolean;
  cap int;
  busy bigint;
BEGIN
  SELECT paused, concurrency_limit INTO halted, cap FROM {queues} WHERE name = queue_name;
  IF halted THEN
    RETURN 0;
  ELSIF cap IS NULL THEN
    RETURN NULL;
  ELSIF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'queue % has a concurrency limit: claim it under READ COMMITTED', queue_name;
  END IF;
  PERFORM pg_advisory_xact_lock(hashtext({key}), hashtext(queue_name));
  SELECT paused, concurrency_limit INTO halted, cap FROM {queues} WHERE name = queue_name;
  IF halted THEN
    RETURN 0;
  ELSIF cap IS NULL THEN
    RETURN NULL;
  END IF;
  SELECT count(*) INTO busy FROM {n.qualified} WHERE queue = queue_name AND {running};
  RETURN greatest(cap - busy, 0);
END;
"""


def _claim_quotas_body(n: Names) -> str:
    """`claim_slots` of each distinct queue named, NULL for the queues with no
    setting without calling it. The limited queues' locks are taken in the
    order of their keys, the same in every claim, so two claims of
    overlapping lists cannot deadlock whatever order they list them in."""
    return f"""
DECLARE
  halted boolean;
  cap int;
BEGIN
  FOR queue_name, halted, cap IN
    SELECT g.name, s.paused, s.concurrency_limit
    FROM (SELECT DISTINCT unnest(queue_names) AS name) AS g
    LEFT JOIN {n.queues_qualified} AS s ON s.name = g.name
    ORDER BY hashtext(g.name), g.name
  LOOP
    slots := CASE WHEN halted OR cap IS NOT NULL
                  THEN {qualify(n.schema, n.claim_slots)}(queue_name) END;
    RETURN NEXT;
  END LOOP;
END;
"""


def _grant_queues_body(n: Names) -> str:
    """Every role that may read the jobs table may read the queue settings:
    its claims read them, so an upgrade must not lock its workers out."""
    queues = quote_literal(n.queues_qualified)
    return f"""
DECLARE
  grantee text;
BEGIN
  FOR grantee IN
    SELECT DISTINCT CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
    FROM pg_class c, aclexplode(c.relacl) a
    WHERE c.oid = {quote_literal(n.qualified)}::regclass
      AND a.privilege_type = 'SELECT' AND a.grantee <> c.relowner
  LOOP
    EXECUTE format('GRANT SELECT ON %s TO %s', {queues}, grantee);
  END LOOP;
END;
"""


def _queues_notify_body(n: Names) -> str:
    # The jobs table's channel (see _CHANNEL): it lives in the same schema.
    return f"""
BEGIN
  PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || {quote_literal(n.table)}, NEW.name);
  RETURN NULL;
END;
"""


def _v5_queue_control(n: Names) -> list[str]:
    """The claim's gate, and a wake-up for workers when a queue is resumed or
    its limit changes, so they claim at once rather than at their next poll."""
    quotas = qualify(n.schema, n.claim_quotas)
    signature = (
        "(queue_names text[]) RETURNS TABLE (queue_name text, slots int) LANGUAGE plpgsql VOLATILE"
    )
    return [
        _claim_slots(n, _claim_slots_body(n), replace=False),
        _function(quotas, _claim_quotas_body(n), signature=signature),
        *_queues_trigger(n, replace=False),
        f"DO {quote_literal(_grant_queues_body(n))}",
    ]


def _claim_slots(n: Names, body: str, *, replace: bool) -> str:
    signature = "(queue_name text) RETURNS int LANGUAGE plpgsql VOLATILE"
    return _function(qualify(n.schema, n.claim_slots), body, replace=replace, signature=signature)


def _queues_trigger(n: Names, *, replace: bool) -> list[str]:
    notify = qualify(n.schema, n.queues_notify)
    sql = [_function(notify, _queues_notify_body(n), replace=replace)]
    if replace:
        sql.append(f"DROP TRIGGER IF EXISTS {quote_ident(n.queues_notify)} ON {n.queues_qualified}")
    sql.append(
        f"CREATE TRIGGER {quote_ident(n.queues_notify)} AFTER INSERT OR UPDATE "
        f"ON {n.queues_qualified} FOR EACH ROW WHEN (NOT NEW.paused) EXECUTE FUNCTION {notify}()"
    )
    return sql


def _v5_up(n: Names) -> list[str]:
    queues, workers = n.queues_qualified, n.workers_qualified
    return [
        *_status_check(n, "'queued', 'running', 'done', 'failed', 'cancelled'"),
        f"ALTER TABLE {n.qualified} {_V5_COLUMNS}",
        f"ALTER TABLE {n.archive_qualified} {_V5_COLUMNS}",
        f"ALTER TABLE {n.archive_qualified} ALTER COLUMN awaited DROP DEFAULT",
        f"COMMENT ON TABLE {n.archive_qualified} IS {quote_literal(version_comment(5))}",
        *_v5_triggers(n, replace=False),
        f"""CREATE TABLE {queues} (
  name              text        CONSTRAINT {quote_ident(n.queues_pkey)} PRIMARY KEY,
  paused            boolean     NOT NULL DEFAULT false,
  concurrency_limit int         CONSTRAINT {quote_ident(n.queues + "_limit_check")}
                                CHECK (concurrency_limit > 0),
  updated_at        timestamptz NOT NULL DEFAULT now()
)""",
        f"COMMENT ON TABLE {queues} IS {quote_literal(version_comment(5))}",
        *_v5_queue_control(n),
        f"""CREATE TABLE {workers} (
  id           text        CONSTRAINT {quote_ident(n.workers_pkey)} PRIMARY KEY,
  host         text        NOT NULL,
  pid          int         NOT NULL,
  queues       text[]      NOT NULL,
  concurrency  int         NOT NULL,
  started_at   timestamptz NOT NULL DEFAULT now(),
  heartbeat_at timestamptz NOT NULL DEFAULT now(),
  jobs_done    bigint      NOT NULL DEFAULT 0,
  beat_interval interval   NOT NULL
)""",
        f"COMMENT ON TABLE {workers} IS {quote_literal(version_comment(5))}",
    ]


def _v5_down(n: Names) -> list[str]:
    table = n.qualified
    columns = ("cancel_requested_at", "result", "traceparent", "awaited")
    drop_columns = ", ".join(f"DROP COLUMN {c}" for c in columns)
    # IF EXISTS: an archive dropped and re-created by step 2 alone lacks them.
    drop_archived = ", ".join(f"DROP COLUMN IF EXISTS {c}" for c in columns)
    return [
        f"DROP TABLE {n.workers_qualified}",
        f"DROP FUNCTION {qualify(n.schema, n.claim_quotas)}(text[])",
        f"DROP FUNCTION {qualify(n.schema, n.claim_slots)}(text)",
        f"DROP TABLE {n.queues_qualified}",
        f"DROP FUNCTION {qualify(n.schema, n.queues_notify)}()",
        f"DROP TRIGGER {quote_ident(n.notify_cancel)} ON {table}",
        f"DROP FUNCTION {qualify(n.schema, n.notify_cancel)}()",
        f"DROP TRIGGER {quote_ident(n.notify_finished)} ON {table}",
        f"DROP FUNCTION {qualify(n.schema, n.notify_finished)}()",
        # A cancelled job did not exist before version 5: it reads as failed.
        f"UPDATE {table} SET status = 'failed', last_error = coalesce(last_error, 'cancelled') "
        "WHERE status = 'cancelled'",
        *_status_check(n, "'queued', 'running', 'done', 'failed'"),
        f"ALTER TABLE {table} {drop_columns}",
        f"ALTER TABLE {n.archive_qualified} {drop_archived}",
        f"COMMENT ON TABLE {n.archive_qualified} IS {quote_literal(version_comment(4))}",
    ]


def _running_index(n: Names, where: str) -> list[str]:
    return [
        f"DROP INDEX {qualify(n.schema, n.running_index)}",
        f"CREATE INDEX {quote_ident(n.running_index)} ON {n.qualified} (locked_until) "
        f"WHERE {where}",
    ]


def _v6_up(n: Names) -> list[str]:
    # Autovacuum settings take a SHARE UPDATE EXCLUSIVE lock: claims, enqueues
    # and completions go on while this runs; only another VACUUM or DDL waits.
    options = ", ".join(f"{name} = {value}" for name, value in QUEUE_TABLE_SETTINGS.items())
    # The running index, rebuilt (it holds running jobs only: a moment's work)
    # with a predicate only a statement bounding `locked_until` implies.
    return [f"ALTER TABLE {n.qualified} SET ({options})", *_running_index(n, RUNNING_WHERE)]


def _v6_down(n: Names) -> list[str]:
    # Only these names: any other storage parameter set by hand stays.
    return [
        f"ALTER TABLE {n.qualified} RESET ({', '.join(QUEUE_TABLE_SETTINGS)})",
        *_running_index(n, "status = 'running'"),
    ]


def _ready_index(n: Names, columns: str) -> list[str]:
    # Built beside the old one and renamed into place: the build reads the
    # whole table under a SHARE lock (reads go on, writes wait); the old
    # index's name is only unavailable for the moment of the swap.
    building = f"{n.table}_ready_idx_new"
    return [
        f"CREATE INDEX {quote_ident(building)} ON {n.qualified} ({columns}) "
        "WHERE status = 'queued'",
        f"DROP INDEX {qualify(n.schema, n.ready_index)}",
        f"ALTER INDEX {qualify(n.schema, building)} RENAME TO {quote_ident(n.ready_index)}",
    ]


def _v7_up(n: Names) -> list[str]:
    # The limit's count of running jobs names the running index's predicate,
    # which step 6 narrowed: counted by `status` alone it read the whole table.
    # Only a claim through `statements.claim` consults the limit, and every
    # such claim sets `locked_until`.
    return [
        *_ready_index(n, "queue, run_at, id"),
        _claim_slots(n, _claim_slots_body(n, RUNNING_WHERE), replace=True),
    ]


def _v7_down(n: Names) -> list[str]:
    return [*_ready_index(n, "queue, run_at"), _claim_slots(n, _claim_slots_body(n), replace=True)]


def _v8_up(n: Names) -> list[str]:
    # A SHARE UPDATE EXCLUSIVE lock, as step 6's: claims and completions go on.
    options = ", ".join(f"{name} = {value}" for name, value in NO_TRUNCATE_SETTINGS.items())
    return [f"ALTER TABLE {n.qualified} SET ({options})"]


def _v8_down(n: Names) -> list[str]:
    return [f"ALTER TABLE {n.qualified} RESET ({', '.join(NO_TRUNCATE_SETTINGS)})"]


def _v9_up(n: Names) -> list[str]:
    # The build reads the whole table under a SHARE lock, as step 7's: reads
    # go on, writes wait. Archiving at completion keeps done jobs out of the
    # table, so it is usually small by now.
    return [f"CREATE INDEX {quote_ident(n.done_index)} ON {n.qualified} (id) WHERE {DONE_WHERE}"]


def _v9_down(n: Names) -> list[str]:
    return [f"DROP INDEX {qualify(n.schema, n.done_index)}"]


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
    Step(
        3,
        "one canonical NOTIFY channel, `schema.table` as the server resolves it, and "
        "announcements of jobs put back to queued by an UPDATE (release, reap, retry, a "
        "failure to be retried) from a row trigger the hot path passes with its WHEN alone",
        _v3_up,
        _v3_down,
    ),
    Step(
        4,
        "periodic tasks: the schedules table `<name>_schedules` (one row per schedule, "
        "its last fire time, so each fire time is enqueued once across all workers) and "
        "the nullable `scheduled_for` column, the fire time, on the jobs and archive tables",
        _v4_up,
        _v4_down,
    ),
    Step(
        5,
        "scheduling and control: the `cancelled` status and `cancel_requested_at`; "
        "`result` (a task's return value), `traceparent` (the enqueuing trace) and "
        "`awaited` (someone waits on the job) on the jobs and archive tables; row "
        "triggers announcing awaited jobs' ends and running jobs cancelled; the queue "
        "settings table `<name>_queues` (paused, concurrency limit) and the worker "
        "registry `<name>_workers`",
        _v5_up,
        _v5_down,
    ),
    Step(
        6,
        "autovacuum settings on the jobs table (`schema.QUEUE_TABLE_SETTINGS`): vacuum "
        "and analyze it once 5,000 tuples are dead or changed, whatever its size, "
        "unthrottled, since every job leaves two dead row versions that no HOT update saves; "
        "the running index's predicate adds `locked_until IS NOT NULL`, so only the reaper "
        "(which bounds `locked_until`) uses it and fenced statements take the primary key",
        _v6_up,
        _v6_down,
    ),
    Step(
        7,
        "the ready index gains `id` as its last column, `(queue, run_at, id)`, so a "
        "claim past a position in `(run_at, id)` order is one index range whichever "
        "index the planner takes: on `(queue, run_at)` it sorted the whole backlog past "
        "the position under its lock (PostgreSQL 15, statistics of a short queue); "
        "`<name>_claim_slots` counts a limited queue's running jobs with the running "
        "index's predicate, so the count uses that index instead of reading the table",
        _v7_up,
        _v7_down,
    ),
    Step(
        8,
        "VACUUM never truncates the jobs table (`vacuum_truncate = off`): truncation "
        "takes an ACCESS EXCLUSIVE lock that stops every claim and completion while "
        "held, and a queue table's tail is empty again and again; the empty pages are "
        "reused for new jobs instead",
        _v8_up,
        _v8_down,
    ),
    Step(
        9,
        "a partial index on the done jobs still in the table, `(id) WHERE status = "
        "'done'`, so the archiver's sweep reads what it moves instead of the whole "
        "table: after a held snapshot that was hundreds of MB every 30 s, read through "
        "shared buffers past the pages claims need",
        _v9_up,
        _v9_down,
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
