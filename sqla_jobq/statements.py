"""Pure builders for every statement of a job's life.

Each function returns a SQLAlchemy Core construct and executes nothing: the
caller runs it on its own `Connection`, `Session` or their async twins, inside
its own transaction. That is what makes `enqueue` transactional with the app's
data, and what lets the worker run a claim or a completion as one atomic
statement with no transaction wrapped around it.

The invariant everything here rests on
--------------------------------------
`attempts` is the fencing token. A claim increments it; nothing ever lowers it
or resets it (a manual `retry` raises `max_attempts` instead). Every statement
a worker runs after claiming (`complete`, `fail`, `extend_lease`, `release`) is
fenced by ``WHERE id = :id AND status = 'running' AND attempts = :attempts``,
so a worker whose lease expired and whose job was reaped and claimed again can
change nothing: its statement matches 0 rows, and 0 rows means "stop, this job
is no longer yours".

Status literals are rendered inline, never as bind parameters: a partial index
(``WHERE status = 'queued'``) can only serve a query whose predicate provably
implies it, which a parameter does not once the statement is prepared.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    ColumnElement,
    CompoundSelect,
    Delete,
    Insert,
    Integer,
    Interval,
    MetaData,
    Select,
    Table,
    Text,
    TextualSelect,
    Update,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    func,
    insert,
    literal_column,
    null,
    select,
    text,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.dml import ReturningInsert
from sqlalchemy.sql.elements import BindParameter, Grouping, quoted_name
from sqlalchemy.sql.functions import Function

from .job import (
    MAX_KEY_BYTES,
    InvalidJob,
    NewJob,
    check_job,
    check_job_fields,
    check_text,
    encode_payload,
    encode_result,
    error_text,
)
from .schema import STATUSES, UNIQUE_WHERE, archive_table, names_of, queues_table
from .units import setting_ms

# The builders, and what they take and refuse (`NewJob`, `InvalidJob`, from `job`).
__all__ = [
    "DEFAULT_LEASE",
    "FINISHED_STATUSES",
    "MAX_KEY_BYTES",
    "InvalidJob",
    "NewJob",
    "Position",
    "Queues",
    "archive",
    "archive_estimate",
    "cancel",
    "claim",
    "claim_columns",
    "complete",
    "complete_many",
    "complete_to_archive",
    "copy_command",
    "copy_payload_rows",
    "copy_rows",
    "enqueue",
    "enqueue_many",
    "extend_lease",
    "extend_leases",
    "fail",
    "fates",
    "job_outcome",
    "mark_awaited",
    "newest_first",
    "next_run_at",
    "prune",
    "prune_archive",
    "reap",
    "release",
    "release_many",
    "reserve_ids",
    "retry",
    "retry_many",
    "stats",
    "status_in",
    "status_is",
    "unique_key_holder",
    "waiting_at_most",
]

DEFAULT_LEASE = timedelta(minutes=5)
# A job's place in claim order, (priority, run_at, id): where `claim(after=True)` starts.
Position = tuple[int, datetime, int]
BACKOFF_BASE = "interval '10 seconds'"
BACKOFF_CAP = "interval '1 hour'"
# 10 s * 2^20 is four months, far past the one-hour cap; capping the exponent
# keeps a huge max_attempts from overflowing the interval arithmetic.
BACKOFF_MAX_EXPONENT = 20
ACTIVE_STATUSES = ("queued", "running")
FINISHED_STATUSES = ("done", "failed", "cancelled")

Queues = str | Sequence[str]


def status_is(column: ColumnElement[Any], status: str) -> ColumnElement[bool]:
    """`status = 'literal'`, inline so partial indexes stay usable when prepared."""
    return column == _status_literal(status)


def status_in(column: ColumnElement[Any], statuses: Sequence[str]) -> ColumnElement[bool]:
    """`status IN ('literal', ...)`, inline for the same reason as `status_is`."""
    return column.in_([_status_literal(s) for s in statuses])


def _status_literal(status: str) -> ColumnElement[str]:
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}")
    return literal_column(f"'{status}'", Text)


def _queue_filter(column: ColumnElement[str], queue: Queues) -> ColumnElement[bool]:
    if isinstance(queue, str):
        return column == bindparam("queue", check_text("queue", queue), type_=Text)
    queues = [check_text("queue", q) for q in queue]
    if not queues:
        raise InvalidJob("at least one queue name is required")
    return column == any_(bindparam("queues", queues, type_=ARRAY(Text)))


def enqueue(
    table: Table,
    task: str | None,
    payload: Any,
    *,
    queue: str = "default",
    run_at: datetime | None = None,
    delay: timedelta | None = None,
    priority: int = 0,
    max_attempts: int = 5,
    unique_key: str | None = None,
    traceparent: str | None = None,
) -> ReturningInsert[Any] | CompoundSelect[Any]:
    """One job; selects its id.

    `traceparent`: the W3C trace context the job was enqueued in (`client`
    passes the current span's, see `sqla_jobq.traceparent`), stored with it.

    With a `unique_key`, a duplicate of a queued or running job inserts nothing
    and selects the existing job's id (the partial unique index decides, so
    there is no check-then-insert race). If the conflicting job was inserted by
    a transaction that committed while this statement waited on it, the
    statement's snapshot cannot see that job and selects no row: run it again.
    """
    job = NewJob(task, payload, queue, run_at, delay, priority, max_attempts, unique_key)
    encoded = check_job(job)
    c = table.c
    values: dict[str, Any] = {
        "task": task,
        "payload": cast(bindparam("payload", encoded, type_=Text), JSONB),
        "queue": queue,
        "priority": priority,
        "max_attempts": max_attempts,
        "unique_key": unique_key,
    }
    if run_at is not None:
        values["run_at"] = run_at
    elif delay is not None:
        values["run_at"] = func.now() + bindparam("delay", delay, type_=Interval)
    if traceparent is not None:
        values["traceparent"] = _check_traceparent(traceparent)
    insert = pg_insert(table).values(**values)
    if unique_key is None:
        return insert.returning(c.id)
    inserted = (
        insert.on_conflict_do_nothing(index_elements=[c.unique_key], index_where=text(UNIQUE_WHERE))
        .returning(c.id)
        .cte("inserted")
    )
    existing = select(c.id).where(
        c.unique_key == unique_key, status_in(c.status, ACTIVE_STATUSES)
    )
    return select(inserted.c.id).union_all(existing).limit(1)


# W3C trace context, version 00: 2 hex, 32 hex trace id, 16 hex span id, 2 hex flags.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def _check_traceparent(value: str) -> str:
    if not isinstance(value, str) or _TRACEPARENT.fullmatch(value) is None:
        raise InvalidJob(f"traceparent must look like 00-<32 hex>-<16 hex>-<2 hex>, got {value!r}")
    return value


def enqueue_many(
    table: Table, rows: Iterable[NewJob], traceparent: str | None = None
) -> TextualSelect:
    """Many jobs in one statement; selects one id per row, in input order.

    The rows travel as one array per column and are unnested server-side, so a
    page of thousands costs one round trip and one NOTIFY per queue. A row
    whose `unique_key` matches a queued or running job (or an earlier row of
    the same call) selects that job's id instead of inserting.
    """
    rows = list(rows)
    encoded = [check_job(row) for row in rows]
    if traceparent is not None:
        _check_traceparent(traceparent)
    names = names_of(table)
    # No joins between the CTEs: a page is prepared server-side after a few
    # executions, and PostgreSQL's generic plan, which cannot see the arrays'
    # lengths, would join them with nested loops, quadratic in the page size
    # (5 s instead of 70 ms a page). Ids are picked by array subscript (the
    # n-th plain row gets the n-th smallest new id) and from a jsonb map (a
    # keyed row gets its key's id), in one pass over the input.
    sql = f"""
WITH input AS (
  SELECT r.*, count(*) FILTER (WHERE r.unique_key IS NULL) OVER (ORDER BY r.ord) AS n
  FROM unnest(
    CAST(:task AS text[]), CAST(:payload AS text[]), CAST(:queue AS text[]),
    CAST(:run_at AS timestamptz[]), CAST(:delay AS interval[]),
    CAST(:priority AS int[]), CAST(:max_attempts AS int[]), CAST(:unique_key AS text[])
  ) WITH ORDINALITY AS r(task, payload, queue, run_at, delay, priority, max_attempts,
                         unique_key, ord)
),
inserted AS (
  INSERT INTO {names.qualified}
    (task, payload, queue, run_at, priority, max_attempts, unique_key, traceparent)
  SELECT task, payload::jsonb, queue, coalesce(run_at, now() + coalesce(delay, interval '0')),
         priority, max_attempts, unique_key, CAST(:traceparent AS text)
  FROM input ORDER BY ord
  ON CONFLICT (unique_key) WHERE {UNIQUE_WHERE} DO NOTHING
  RETURNING id, unique_key
),
found AS (
  SELECT
    (SELECT array_agg(id ORDER BY id) FROM inserted WHERE unique_key IS NULL) AS plain,
    (SELECT jsonb_object_agg(unique_key, id) FROM (
       SELECT DISTINCT ON (unique_key) unique_key, id FROM (
         SELECT unique_key, id, 0 AS pick FROM inserted WHERE unique_key IS NOT NULL
         UNION ALL
         SELECT j.unique_key, j.id, 1 FROM {names.qualified} j
         WHERE j.unique_key IN (SELECT unique_key FROM input WHERE unique_key IS NOT NULL)
           AND j.status IN ('queued', 'running')
       ) k
       ORDER BY unique_key, pick
    ) d) AS keyed
)
SELECT CASE WHEN input.unique_key IS NULL THEN found.plain[input.n]
            ELSE (found.keyed ->> input.unique_key)::bigint END AS id
FROM input, found
ORDER BY input.ord
"""
    return (
        text(sql)
        .bindparams(
            bindparam("task", [r.task for r in rows], type_=ARRAY(Text)),
            bindparam("payload", encoded, type_=ARRAY(Text)),
            bindparam("queue", [r.queue for r in rows], type_=ARRAY(Text)),
            bindparam("run_at", [r.run_at for r in rows], type_=ARRAY(TIMESTAMP(timezone=True))),
            bindparam("delay", [r.delay for r in rows], type_=ARRAY(Interval)),
            bindparam("priority", [r.priority for r in rows], type_=ARRAY(Integer)),
            bindparam("max_attempts", [r.max_attempts for r in rows], type_=ARRAY(Integer)),
            bindparam("unique_key", [r.unique_key for r in rows], type_=ARRAY(Text)),
            bindparam("traceparent", traceparent, type_=Text),
        )
        .columns(id=BigInteger)
    )


# COPY, for `client.enqueue_many`'s bulk path, writes these columns; every
# other column takes its default (status 'queued', run_at and created_at now()).
COPY_COLUMNS = ("id", "task", "payload", "queue", "priority", "max_attempts", "traceparent")


def reserve_ids(table: Table, count: int) -> TextualSelect:
    """Draw `count` new ids from the table's identity sequence; selects them
    as runs of consecutive ids, `(first, count)` in ascending order.

    COPY cannot return the ids it inserts, so the bulk path draws them first
    and writes them explicitly (COPY, unlike INSERT, accepts values for an
    identity column declared GENERATED ALWAYS). Other sessions drawing at the
    same time only split the runs; without them, 100,000 ids are one row
    instead of an array whose parsing costs more than drawing them.
    """
    return (
        text(
            # MATERIALIZED: looked up once, not once per id (a catalog lookup each).
            "WITH q AS MATERIALIZED ("
            "  SELECT CAST(pg_get_serial_sequence(:table, 'id') AS regclass) AS seq"
            ") "
            "SELECT min(v) AS first, count(*) AS count FROM ("
            "  SELECT v, v - row_number() OVER (ORDER BY v) AS run FROM ("
            "    SELECT nextval(q.seq) AS v FROM q, generate_series(1, :count)"
            "  ) drawn"
            ") numbered GROUP BY run ORDER BY first"
        )
        .bindparams(
            bindparam("count", count, type_=Integer),
            bindparam("table", names_of(table).qualified, type_=Text),
        )
        .columns(first=BigInteger, count=BigInteger)
    )


def copy_command(table: Table) -> str:
    """`COPY <table> (COPY_COLUMNS) FROM STDIN`, for the rows of `copy_rows`."""
    return f"COPY {names_of(table).qualified} ({', '.join(COPY_COLUMNS)}) FROM STDIN"


def copy_rows(
    rows: Iterable[NewJob], traceparent: str | None = None
) -> list[tuple[Any, ...]] | None:
    """The rows for `copy_command`, each still missing its id in front, checked
    as `enqueue_many` checks them; or None when some row needs `enqueue_many`
    itself: a unique key (COPY has no ON CONFLICT), or a `run_at` or `delay`
    (jobs due now are the bulk case; the server's clock decides "now")."""
    rows = list(rows)
    if any(r.unique_key is not None or r.run_at is not None or r.delay is not None for r in rows):
        return None  # decided before encoding anything: `enqueue_many` encodes them then
    if traceparent is not None:
        _check_traceparent(traceparent)
    checked: set[tuple[Any, ...]] = set()
    copied: list[tuple[Any, ...]] = []
    for r in rows:
        _check_fields_once(r, checked)
        payload = encode_payload(r.payload)
        copied.append((r.task, payload, r.queue, r.priority, r.max_attempts, traceparent))
    return copied


def copy_payload_rows(
    job: NewJob, payloads: Iterable[Any], traceparent: str | None = None
) -> list[tuple[Any, ...]] | None:
    """`copy_rows` for jobs that differ only in their payload: `job`'s fields,
    checked once, with each payload in turn. A task's bulk enqueue is this
    case, and building a `NewJob` per row would cost more than encoding it."""
    if job.unique_key is not None or job.run_at is not None or job.delay is not None:
        return None
    check_job_fields(job)
    if traceparent is not None:
        _check_traceparent(traceparent)
    task, queue, priority, max_attempts = job.task, job.queue, job.priority, job.max_attempts
    return [
        (task, encode_payload(payload), queue, priority, max_attempts, traceparent)
        for payload in payloads
    ]


def _check_fields_once(job: NewJob, checked: set[tuple[Any, ...]]) -> None:
    """`check_job_fields`, once per distinct task, queue, priority and
    max_attempts: a bulk enqueue repeats them for every row, and checking
    them again would cost about as much as encoding the payload."""
    # The types too: True == 1, but a bool priority must be refused.
    kinds = (type(job.priority), type(job.max_attempts))
    key: tuple[Any, ...] | None = (job.task, job.queue, job.priority, job.max_attempts, kinds)
    try:
        if key in checked:
            return
    except TypeError:  # unhashable, so not a str or an int: the check says so
        key = None
    check_job_fields(job)
    if key is not None:
        checked.add(key)


def claim_columns(table: Table) -> tuple[ColumnElement[Any], ...]:
    c = table.c
    return (
        c.id,
        c.task,
        c.queue,
        c.payload,
        c.attempts,
        c.max_attempts,
        c.locked_until,
        c.run_at,
        c.priority,
        c.scheduled_for,
        c.traceparent,
    )


def claim(
    table: Table,
    *,
    queue: Queues = "default",
    limit: int = 10,
    lease: timedelta = DEFAULT_LEASE,
    now: datetime | None = None,
    after: bool = False,
) -> Update:
    """Lease up to `limit` ready jobs to the caller: the only way to take work.

    The CTE locks the rows it picks with FOR UPDATE SKIP LOCKED, so concurrent
    claimers never wait on each other and never take the same row; the UPDATE
    marks them running, bumps the fencing token and writes the lease. Commit at
    once (or run it in autocommit): the lease, not an open transaction, is
    what keeps the job yours while it runs.

    The UPDATE takes the locked ids as an array (`id = ANY(ARRAY(SELECT ...))`)
    rather than joining the CTE: once the statement is prepared, PostgreSQL's
    generic plan cannot see `limit`, guesses 1,000 rows, and joins them back
    with a hash over a sequential scan of the whole table on every claim. An
    array leaves it nothing to get wrong: primary-key lookups whatever the
    guess.

    `now` replaces the server's clock (tests moving time forward, see
    `sqla_jobq.testing`); workers leave it to the server.

    A queue's pause and concurrency limit (see `queue_statements`) hold here,
    in the statement itself: its LIMIT is also capped by `<table>_claim_slots`,
    which is NULL for a queue with no setting (the plan and cost stay those of
    a plain claim), 0 for a paused one, and for a limited one its free slots,
    counted under a lock only that queue's claimers share (schema step 5).

    `after=True` (one queue only) claims within one priority, past a position
    in claim order: binds `after_priority`, `after_run_at` and `after_id`
    (the last row a previous claim took). The claim index's range then starts
    there, so the scan never steps over the entries of rows claimed before
    it. Normally those are marked dead by the first scan that meets them and
    cost nothing; while some session holds an old snapshot they cannot be, and
    a claim from the start re-reads every one (see `claim_cursor`, which
    decides when a worker claims this way).
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    c = table.c
    clock = _clock(now)
    take = bindparam("limit", limit, type_=Integer)
    if isinstance(queue, str):
        name = bindparam("queue", check_text("queue", queue), type_=Text)
        slots = func.least(take, _slots(table, name))
        if after:
            # Within one priority: ordering by it too would make a prepared
            # statement's generic plan sort (it cannot see the priority is fixed).
            where = and_(c.queue == name, *_past_position(table))
            ready = _ready(table, where, slots, clock, order=(c.run_at, c.id))
        else:
            ready = _ready(table, c.queue == name, slots, clock)
    elif after:
        raise ValueError("a claim after a position takes one queue, not a list")
    else:
        ready = _ready_among(table, queue, take, clock)
    return (
        update(table)
        .where(_id_in(table, ready.cte("next")))
        .values(
            status=_status_literal("running"),
            attempts=c.attempts + 1,
            locked_until=clock + bindparam("lease", lease, type_=Interval),
            started_at=clock,
        )
        .returning(*claim_columns(table))
    )


def _ready(
    table: Table,
    where: ColumnElement[bool],
    cap: ColumnElement[int],
    clock: ColumnElement[Any],
    *columns: ColumnElement[Any],
    order: Sequence[ColumnElement[Any]] = (),
) -> Select[Any]:
    """The first `cap` ready jobs `where` says, locked, skipping rows others
    hold, in claim order (or `order`)."""
    c = table.c
    return (
        select(*(columns or (c.id,)))
        .where(where, status_is(c.status, "queued"), c.run_at <= clock)
        .order_by(*(order or (c.priority.desc(), c.run_at, c.id)))
        .limit(cap)
        .with_for_update(skip_locked=True)
    )


def _past_position(table: Table) -> tuple[ColumnElement[bool], ...]:
    """Same priority, and `(run_at, id)` past the bound position: with the
    claim index's leading `queue` and `priority` fixed, a range of the index."""
    c = table.c
    position = tuple_(
        bindparam("after_run_at", type_=TIMESTAMP(timezone=True)),
        bindparam("after_id", type_=BigInteger),
    )
    return (
        c.priority == bindparam("after_priority", type_=Integer),
        tuple_(c.run_at, c.id) > position,
    )


def _slots(table: Table, queue: ColumnElement[str]) -> ColumnElement[int]:
    """How many jobs `queue` may hand out now: NULL (no setting), 0 (paused),
    or its free slots (see `migrations.steps._claim_slots_body`)."""
    n = names_of(table)
    schema = () if n.schema is None else (quoted_name(n.schema, quote=True),)
    name = quoted_name(n.claim_slots, quote=True)
    return Function(name, queue, type_=Integer, packagenames=schema)


def _ready_among(
    table: Table, queues: Sequence[str], take: ColumnElement[int], clock: ColumnElement[Any]
) -> Select[Any]:
    """`_ready` over several queues, each under its own pause and limit.

    One call of `<table>_claim_quotas` gives each queue its slots (see
    `_slots`), taking the limited queues' locks in one fixed order, so two
    claims of overlapping lists cannot deadlock. The queues with no setting
    share one scan, as a claim always did; each limited queue gets a scan of
    its own, capped by its slots. The rows are merged in claim order and cut
    to `take`; rows a limited queue's scan locked past that cut are left as
    they were, their locks released at commit.
    """
    names = [check_text("queue", q) for q in queues]
    if not names:
        raise InvalidJob("at least one queue name is required")
    c = table.c
    columns = (c.id, c.priority, c.run_at)
    quotas = _quotas(table, bindparam("queues", names, type_=ARRAY(Text)))
    free = select(quotas.c.queue_name).where(quotas.c.slots.is_(None)).scalar_subquery()
    shared = _ready(table, c.queue == any_(func.array(free)), take, clock, *columns)
    cap = func.least(take, func.coalesce(quotas.c.slots, literal_column("0", Integer)))
    own = _ready(table, c.queue == quotas.c.queue_name, cap, clock, *columns).lateral("own")
    limited = (
        select(own.c.id, own.c.priority, own.c.run_at)
        .select_from(quotas)
        .join(own, true())
        .where(quotas.c.slots.is_not(None))
    )
    merged = union_all(select(shared.subquery()), limited).subquery("ready")
    m = merged.c
    return select(m.id).order_by(m.priority.desc(), m.run_at, m.id).limit(take)


def _quotas(table: Table, given: ColumnElement[Any]) -> Any:
    """`(queue_name, slots)` of each given queue, once per claim (a CTE)."""
    n = names_of(table)
    schema = () if n.schema is None else (quoted_name(n.schema, quote=True),)
    name = quoted_name(n.claim_quotas, quote=True)
    rows = Function(name, given, packagenames=schema).table_valued(
        column("queue_name", Text), column("slots", Integer)
    )
    return select(rows.c.queue_name, rows.c.slots).cte("quotas")


def _clock(now: datetime | None) -> ColumnElement[Any]:
    if now is None:
        return func.now()
    if now.tzinfo is None:
        raise InvalidJob("now must be timezone-aware (e.g. datetime.now(timezone.utc))")
    return bindparam("now", now, type_=TIMESTAMP(timezone=True))


def _fence(table: Table, job_id: int, attempts: int) -> tuple[ColumnElement[bool], ...]:
    c = table.c
    return (
        c.id == bindparam("id", job_id, type_=BigInteger),
        status_is(c.status, "running"),
        c.attempts == bindparam("attempts", attempts, type_=Integer),
    )


# What `complete` and `complete_many` write.
_DONE: dict[str, Any] = {
    "status": _status_literal("done"),
    "locked_until": null(),
    "finished_at": func.now(),
}


def complete(table: Table, id: int, attempts: int, result: Any = None) -> Update:
    """Mark a job done, if it is still ours (row count 1) and not otherwise (0).

    `result`, the task's return value, is stored as JSON when it is not None.
    """
    values = dict(_DONE)
    if result is not None:
        values["result"] = cast(bindparam("result", encode_result(result), type_=Text), JSONB)
    return update(table).where(*_fence(table, id, attempts)).values(**values)


def newest_first(
    jobs: Sequence[tuple[int, int]], results: Sequence[str | None] | None = None
) -> tuple[Sequence[tuple[int, int]], Sequence[str | None] | None]:
    """The batch with each job's attempts newest first (results alongside).

    A fenced batch statement finds a row's pair at the first position of its
    id. One batch can hold two attempts of a job (its lease ran out and this
    worker claimed it again before the first attempt's outcome was sent);
    attempts only go up, so only the newest can still be the row's, and it
    must be the one found. The statements apply it to the pairs they are
    given; whoever compiles one once and binds a batch's arrays later (as the
    worker's driver does) must apply it to each batch.
    """
    if len({j[0] for j in jobs}) == len(jobs):
        return jobs, results
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i][0], -jobs[i][1]))
    return [jobs[i] for i in order], None if results is None else [results[i] for i in order]


def _ids(jobs: Sequence[tuple[int, int]]) -> BindParameter[Any]:
    return bindparam("ids", [j[0] for j in jobs], type_=ARRAY(BigInteger))


def _at_slot(
    job_id: ColumnElement[Any], jobs: Sequence[tuple[int, int]], array: BindParameter[Any]
) -> ColumnElement[Any]:
    """The element of a batch array at `job_id`'s position in the batch:
    `(array)[array_position(ids, id)]` (grouped: a subscript straight after
    the bind's `::type[]` cast is a syntax error)."""
    return Grouping(array)[func.array_position(_ids(jobs), job_id)]


def _owned(table: Table, jobs: Sequence[tuple[int, int]]) -> tuple[ColumnElement[bool], ...]:
    """`id = ANY(ARRAY(SELECT unnest(ids))) AND attempts =
    attempts[array_position(ids, id)]`: the rows of these exact pairs, with
    no join. `id = ANY` is an index condition on the primary key, and each
    row found checks its own attempt at its id's position in the batch (see
    `newest_first`).

    The ids reach the planner as the result of a subquery, whose length it
    cannot see and takes for 10 (`_id_among`). As a literal array of a
    few hundred ids, after an ANALYZE during a held snapshot (which counts
    the live rows and none of the versions the hold keeps, so each lookup
    looks like dozens of pages) a batch cost more than a Seq Scan of the
    whole bloated heap, which every completion then ran (held-snapshot
    scene, docs/benchmarks.md).

    A join to the unnested pairs let the planner choose how to reach the rows.
    Unprepared, with statistics taken while no job ran, it scanned the whole
    table (25 to 60 ms a completion on 20,000 rows); with the rows found by
    primary key it made the pairs the inner side of a nested loop, rescanned
    for every row (64 x 64 pairs through the join filter: 1.44 ms for a
    completion of 64, against 0.58 ms as a merge join).
    """
    jobs, _ = newest_first(jobs)
    attempts = bindparam("attempts", [j[1] for j in jobs], type_=ARRAY(Integer))
    current = _at_slot(table.c.id, jobs, attempts)
    return (_id_among(table.c.id, select(func.unnest(_ids(jobs)))), table.c.attempts == current)


def _fence_many(table: Table, jobs: Sequence[tuple[int, int]]) -> tuple[ColumnElement[bool], ...]:
    return (*_owned(table, jobs), status_is(table.c.status, "running"))


def _result_at_slot(
    job_id: ColumnElement[Any], jobs: Sequence[tuple[int, int]], results: Sequence[str | None]
) -> ColumnElement[Any]:
    return cast(
        _at_slot(job_id, jobs, bindparam("results", list(results), type_=ARRAY(Text))), JSONB
    )


def _lockable(table: Table, jobs: Sequence[tuple[int, int]]) -> ColumnElement[bool]:
    """`id = ANY(ids of the fenced rows we could lock now)`, for a batch update.

    Rows another session holds locked (an admin's open transaction, an app's
    `SELECT ... FOR UPDATE`, another worker's reaper) are skipped, not waited
    on: one locked row must not stall a whole batch, nor the connection that
    runs it. The caller tells a skipped row (still ours, retry it) from a lost
    one with `held`.
    """
    fenced = (
        select(table.c.id)
        .where(*_fence_many(table, jobs))
        .with_for_update(skip_locked=True)
        .cte("fenced")
    )
    return _id_in(table, fenced)


def _id_in(table: Table, locked: Any) -> ColumnElement[bool]:
    """`id = ANY(ARRAY(SELECT id FROM locked))`: primary-key lookups whatever
    row count a generic plan guesses for the CTE (see `claim`)."""
    return _id_among(table.c.id, select(locked.c.id))


def complete_many(
    table: Table,
    jobs: Sequence[tuple[int, int]],
    results: Sequence[str | None] | None = None,
    *,
    skip_locked: bool = False,
    lock_timeout: timedelta | None = None,
) -> Update:
    """`complete` for a batch of `(id, attempts)` pairs in one round trip.

    Returns the `(id, attempts)` pairs it completed; a pair missing from the
    result was taken away (or, with `skip_locked`, is locked by another
    session right now: `fates` tells which). With `results` (JSON text per
    pair, None for none; see `encode_result`), each job's return value is
    stored in the same statement.

    Plain, it waits on a row another session holds locked, as any UPDATE
    does: claimers lock rows for a moment as they pass them, so this is the
    fast path, run under a short `lock_timeout` (see `waiting_at_most`).
    `skip_locked` is the way round a row held longer (an admin's open
    transaction): the rest of the batch is recorded and the held row retried
    later.
    """
    jobs, results = newest_first(jobs, results)  # results stay beside their pairs
    return _done_in_place(table, jobs, results, _ours(table, jobs, skip_locked, lock_timeout))


def _ours(
    table: Table,
    jobs: Sequence[tuple[int, int]],
    skip_locked: bool,
    lock_timeout: timedelta | None,
) -> tuple[ColumnElement[bool], ...]:
    """The rows of a batch still ours: fenced, or, with `skip_locked`, those
    of them no other session holds (`_lockable`)."""
    if skip_locked:
        return (_lockable(table, jobs),)
    return (*_fence_many(table, jobs), *waiting_at_most(lock_timeout))


def waiting_at_most(lock_timeout: timedelta | None) -> tuple[ColumnElement[bool], ...]:
    """`(SELECT set_config('lock_timeout', '200ms', true)) IS NOT NULL`: a
    condition that is always true and, evaluated once before the statement
    touches a row (PostgreSQL plans it as a one-time filter), bounds how long
    the statement waits for a row another session holds.

    A session's own `lock_timeout` does not survive a transaction-mode
    pooler: PgBouncer drops the startup options that set it, and a `SET`
    would hold on whichever server connection it happened to run. Inside the
    statement, the setting holds wherever the statement runs, until its
    transaction ends (`is_local`: in autocommit, with the statement; in a
    caller's transaction, for the rest of it). It does not cover the table-level lock
    taken while the statement is planned (a `DROP` or `VACUUM FULL` under
    way still makes it wait). None: no condition, the session's setting
    holds.
    """
    if lock_timeout is None:
        return ()
    value = bindparam("lock_timeout", setting_ms(lock_timeout), type_=Text)
    setting = func.set_config(literal_column("'lock_timeout'", Text), value, true())
    return (select(setting).scalar_subquery().is_not(None),)


def _done_in_place(
    table: Table,
    jobs: Sequence[tuple[int, int]],
    results: Sequence[str | None] | None,
    where: tuple[ColumnElement[bool], ...],
) -> Update:
    """`UPDATE ... SET status = 'done' ... WHERE <where>`, each job's result
    beside it, returning the pairs it completed (`jobs` in `newest_first` order)."""
    c = table.c
    stmt = update(table).values(**_DONE).returning(c.id, c.attempts).where(*where)
    if results is not None:
        stmt = stmt.values(result=_result_at_slot(c.id, jobs, results))
    return stmt


def complete_to_archive(
    table: Table,
    jobs: Sequence[tuple[int, int]],
    results: Sequence[str | None] | None = None,
    *,
    skip_locked: bool = False,
    lock_timeout: timedelta | None = None,
) -> CompoundSelect[Any]:
    """`complete_many` that moves each job it completes into `<table>_archive`
    in the same statement, instead of leaving it `done` in the jobs table for
    an archiver pass to move later.

    Completed in place, a job writes one more row version into the jobs table
    (the done one, with its index entries), and an archiver pass later moves
    tens of thousands of those at once, every few seconds. Moved here, the
    running version is the job's last in the jobs table, and the cost of the
    move is spread over the completions. Both matter most while a long
    transaction elsewhere keeps VACUUM from reclaiming anything: the table and
    its indexes grow by one version less per job, and no pass competes with
    claims in bursts (bench.scenes held-snapshot, docs/benchmarks.md).

    Returns the `(id, attempts)` pairs completed, as `complete_many` does. A
    job someone waits on (`awaited`) is completed in place instead, so the
    row trigger that announces its end fires; the next archiver pass moves
    it. Both parts read one snapshot and touch disjoint rows: a job marked
    awaited while this runs matches neither, and is retried as a busy row.
    """
    c = table.c
    jobs, results = newest_first(jobs, results)
    ours = _ours(table, jobs, skip_locked, lock_timeout)
    completed = table.delete().where(*ours, ~c.awaited).returning(*c).cte("completed")
    done = dict(_DONE)
    if results is not None:
        done["result"] = _result_at_slot(completed.c.id, jobs, results)
    copy = _copy(table, completed, done)
    archived = copy.returning(copy.table.c.id, copy.table.c.attempts).cte("archived")
    kept = _done_in_place(table, jobs, results, (*ours, c.awaited)).cte("kept")
    return union_all(
        select(archived.c.id, archived.c.attempts), select(kept.c.id, kept.c.attempts)
    )


def fates(table: Table, jobs: Sequence[tuple[int, int]]) -> Select[Any]:
    """The status of each of these `(id, attempts)` pairs whose attempt is
    still the row's current one; a pair missing from the result was reclaimed.

    A plain read, so it never waits on a lock: the answer for a pair a batch
    statement skipped, telling "running but locked by someone, try again"
    (`running`) from "cancelled" from "taken away" (anything else, or absent).
    """
    c = table.c
    return select(c.id, c.attempts, c.status).where(*_owned(table, jobs))


def _backoff(table: Table) -> ColumnElement[Any]:
    exponent = func.least(table.c.attempts, BACKOFF_MAX_EXPONENT)
    # .op("*"): SQLAlchemy 2.1 deprecates `*` on Interval (not in its operator classes).
    step = literal_column(BACKOFF_BASE, Interval).op("*")(func.power(2, exponent))
    return func.now() + func.least(literal_column(BACKOFF_CAP, Interval), step)


def fail(
    table: Table,
    id: int,
    attempts: int,
    error: str,
    *,
    lock_timeout: timedelta | None = None,
) -> Update:
    """Record a failed attempt: retry after 10 s * 2^attempts (at most 1 h), or
    give up as `failed` once `attempts >= max_attempts`. `last_error` is kept
    either way. Returns the row's new status and run_at if it was still ours.
    `lock_timeout`: see `waiting_at_most`.
    """
    c = table.c
    final = c.attempts >= c.max_attempts
    return (
        update(table)
        .where(*_fence(table, id, attempts), *waiting_at_most(lock_timeout))
        .values(
            status=case((final, _status_literal("failed")), else_=_status_literal("queued")),
            run_at=case((final, c.run_at), else_=_backoff(table)),
            locked_until=null(),
            finished_at=case((final, func.now()), else_=null()),
            # An exception's text may hold NUL, which text cannot store: strip it
            # (refusing it would make a failing job impossible to record).
            last_error=bindparam("error", error_text(error), type_=Text),
        )
        .returning(c.id, c.status, c.attempts, c.run_at, (c.run_at - func.now()).label("retry_in"))
    )


def extend_lease(table: Table, id: int, attempts: int, lease: timedelta = DEFAULT_LEASE) -> Update:
    """Push the lease of a job still running; 0 rows means it is no longer ours."""
    return (
        update(table)
        .where(*_fence(table, id, attempts))
        .values(locked_until=func.now() + bindparam("lease", lease, type_=Interval))
    )


def extend_leases(table: Table, jobs: Sequence[tuple[int, int]], lease: timedelta) -> Update:
    """`extend_lease` for a batch; returns the `(id, attempts)` pairs extended.

    Like `complete_many`, it skips rows another session holds locked: a
    heartbeat must never wait behind anyone, or every lease it keeps would run
    out while it waits.
    """
    c = table.c
    return (
        update(table)
        .where(_lockable(table, jobs))
        .values(locked_until=func.now() + bindparam("lease", lease, type_=Interval))
        .returning(c.id, c.attempts)
    )


def release(table: Table, id: int, attempts: int) -> Update:
    """Hand a job back to the queue unfinished (a worker shutting down).

    `attempts` stays as it is: the interrupted attempt counts, and the fencing
    token must never go down.
    """
    return (
        update(table)
        .where(*_fence(table, id, attempts))
        .values(status=_status_literal("queued"), locked_until=null(), run_at=func.now())
    )


def release_many(table: Table, jobs: Sequence[tuple[int, int]], *, refund: bool) -> Update:
    """Hand a batch of attempts back to the queue; returns the pairs handed back.

    With `refund`, the attempts never started (claimed ahead, then the worker
    stopped or its slots stayed busy): each gets its attempt back by raising
    `max_attempts` by one, as `retry` does, so a deploy never costs a job one
    of its tries while `attempts`, the fencing token, still only goes up.
    Rows locked by another session are skipped, as in `complete_many`.
    """
    c = table.c
    values: dict[str, Any] = {
        "status": _status_literal("queued"),
        "locked_until": null(),
        "run_at": func.now(),
    }
    if refund:
        values["max_attempts"] = c.max_attempts + 1
    return update(table).where(_lockable(table, jobs)).values(**values).returning(c.id, c.attempts)


REAP_BATCH = 1000


def reap(table: Table, *, limit: int = REAP_BATCH) -> Update:
    """Return up to `limit` jobs whose lease expired (their worker died or stalled).

    Honours `max_attempts`, so a job that kills its worker every time ends
    `failed` instead of coming back forever. Expired rows are locked with
    SKIP LOCKED, so the reaper never waits on a row another session holds (a
    finisher completing it late, an admin's transaction, another reaper) and
    never stalls the connection it shares with claims; run it again while it
    returns `limit` rows. A row that changed before it was locked is re-checked
    and skipped when its lease is no longer expired.
    """
    c = table.c
    expired = (
        select(c.id)
        .where(status_is(c.status, "running"), c.locked_until < func.now())
        .limit(bindparam("limit", limit, type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    final = c.attempts >= c.max_attempts
    return (
        update(table)
        .where(_id_in(table, expired))
        .values(
            status=case((final, _status_literal("failed")), else_=_status_literal("queued")),
            locked_until=null(),
            finished_at=case((final, func.now()), else_=null()),
            last_error=func.coalesce(c.last_error, literal_column("'lease expired'", Text)),
        )
        .returning(c.id, c.status, c.attempts)
    )


RETRYABLE_STATUSES = ("failed", "cancelled")


def _retryable(table: Table) -> ColumnElement[bool]:
    return status_in(table.c.status, RETRYABLE_STATUSES)


def retry(table: Table, id: int) -> Update:
    """Send a failed (or cancelled) job back to the queue now, granting it one
    more attempt; a cancelled job is never retried but by this.

    It raises `max_attempts` instead of resetting `attempts`: see the fencing
    invariant at the top of this module.
    """
    c = table.c
    return (
        update(table)
        .where(c.id == bindparam("id", id, type_=BigInteger), _retryable(table))
        .values(**_retried(table))
        .returning(c.id, c.attempts, c.max_attempts)
    )


def retry_many(table: Table, ids: Sequence[int]) -> Update:
    """`retry` for a batch of ids in one round trip; returns the ids retried.

    Ids whose job is no longer failed (retried meanwhile, pruned) are skipped:
    the status is re-checked on each row, as `retry` checks it.
    """
    c = table.c
    return (
        update(table)
        .where(
            c.id == any_(bindparam("ids", list(ids), type_=ARRAY(BigInteger))),
            _retryable(table),
        )
        .values(**_retried(table))
        .returning(c.id)
    )


def _retried(table: Table) -> dict[str, Any]:
    """What a retry writes: queued now, one more attempt granted, `attempts` kept."""
    c = table.c
    return {
        "status": _status_literal("queued"),
        "run_at": func.now(),
        "max_attempts": func.greatest(c.max_attempts, c.attempts + 1),
        "locked_until": null(),
        "finished_at": null(),
    }


def unique_key_holder(table: Table, id: int) -> Select[Any]:
    """The active job holding job `id`'s unique key, if any.

    `retry` of a failed job whose key an active job took meanwhile violates
    the unique index; this finds that job, so the refusal can name it.
    """
    c = table.c
    key = select(c.unique_key).where(c.id == bindparam("id", id, type_=BigInteger))
    return select(c.id, c.status).where(c.unique_key == key.scalar_subquery(), text(UNIQUE_WHERE))


def cancel(table: Table, id: int) -> Update:
    """Cancel a queued or running job: it ends `cancelled`, never retried.

    The status changes at once, in the database: a running job's handler may
    go on until its worker hears of it (the next heartbeat, or sooner by the
    NOTIFY a trigger sends), but nothing it records afterwards matches the
    fence. Returns the id and the status the job had.
    """
    c = table.c
    before = select(c.status).where(c.id == bindparam("id", id, type_=BigInteger)).scalar_subquery()
    return (
        update(table)
        .where(
            c.id == bindparam("id", id, type_=BigInteger),
            status_in(c.status, ACTIVE_STATUSES),
        )
        .values(
            status=_status_literal("cancelled"),
            cancel_requested_at=func.now(),
            locked_until=null(),
            finished_at=func.now(),
        )
        .returning(c.id, before.label("was"))
    )


def mark_awaited(table: Table, id: int) -> Update:
    """Ask for a NOTIFY when job `id` ends (see `sqla_jobq.waiting`); returns
    its id if it was marked.

    Only a queued or running job is marked, and only if no other session
    holds its row locked right now: a waiter must never queue up behind a
    worker's completion or an admin's transaction. Unmarked, the waiter polls
    and marks again.
    """
    c = table.c
    active = (
        select(c.id)
        .where(
            c.id == bindparam("id", id, type_=BigInteger),
            status_in(c.status, ACTIVE_STATUSES),
        )
        .with_for_update(skip_locked=True)
        .cte("active")
    )
    marked: ColumnElement[bool] = literal_column("true")
    return update(table).where(_id_in(table, active)).values(awaited=marked).returning(c.id)


def job_outcome(table: Table, id: int, *, archived: bool = True) -> CompoundSelect[Any]:
    """Job `id`'s status, stored result and last error: what a waiter returns
    or raises; no row if there is no such job.

    It reads the jobs table and `<table>_archive` in one statement, so one
    snapshot: a finished job moved to the archive (by a worker's
    `archive_after`, or `jobq prune --archive`) is found there, and a job is
    never missed while it moves (it is in exactly one of them). Each side is
    one primary-key lookup. `archived=False` reads the jobs table alone (for a
    role without SELECT on the archive).
    """
    tables = [table]
    if archived:
        tables.append(archive_table(MetaData(), table.name, table.schema))
    job_id = bindparam("id", id, type_=BigInteger)
    reads = [
        select(t.c.status, t.c.result, t.c.last_error).where(t.c.id == job_id) for t in tables
    ]
    return union_all(*reads)


def prune(
    table: Table,
    *,
    older_than: timedelta,
    limit: int = 10000,
    statuses: Sequence[str] = FINISHED_STATUSES,
    skip_locked: bool = False,
) -> Delete:
    """Delete one batch of finished jobs; loop until it deletes fewer than `limit`.

    Small batches keep each transaction short, so pruning itself never holds
    VACUUM back. Rows finished by hand-written SQL that left `finished_at`
    empty are aged by `created_at`. `skip_locked`: see `archive`.
    """
    return table.delete().where(_finished_batch(table, older_than, limit, statuses, skip_locked))


def archive(
    table: Table,
    *,
    older_than: timedelta,
    limit: int = 10000,
    statuses: Sequence[str] = FINISHED_STATUSES,
    skip_locked: bool = False,
) -> Insert:
    """Move one batch of finished jobs to `<table>_archive`; loop until it
    moves fewer than `limit`.

    One statement, ``WITH moved AS (DELETE ... RETURNING *) INSERT INTO
    <table>_archive SELECT ... FROM moved``: the delete and the copy commit or
    fail together, so no job is ever in both tables or in neither. Ids are
    kept; `archived_at` takes its default. The row count is the number moved
    (`preserve_rowcount`: SQLAlchemy reports an INSERT's row count only when asked).

    `skip_locked` picks the batch with ``FOR UPDATE SKIP LOCKED``: rows another
    session holds (another worker's batch, an admin's transaction, a `retry`
    in progress) are passed by at once and left for a later batch, so several
    sessions can archive the same table at once without waiting on each
    other, each job moved by exactly one of them. Without it a batch waits on
    such a row, then re-checks it (see `_finished_batch`).
    """
    moved = (
        table.delete()
        .where(_finished_batch(table, older_than, limit, statuses, skip_locked))
        .returning(*table.c)
        .cte("moved")
    )
    return _copy(table, moved).add_cte(moved).execution_options(preserve_rowcount=True)


def _copy(table: Table, moved: CTE, values: dict[str, Any] | None = None) -> Insert:
    """The rows a DELETE ... RETURNING gave, whole, into `<table>_archive`;
    `values` replaces some of their columns."""
    target = archive_table(MetaData(), table.name, table.schema)
    columns = [c.name for c in table.c]
    given = values or {}
    copied = (given[name] if name in given else moved.c[name] for name in columns)
    return insert(target).from_select(columns, select(*copied))


# Where a pass of `archive_done` batches starts: before every id.
FIRST_ID = 0


def archive_done(
    table: Table,
    *,
    older_than: timedelta,
    limit: int = 10000,
    skip_locked: bool = False,
) -> Select[int, int | None]:
    """`archive` of done jobs, for a caller that moves a whole table's worth
    in batches: the batch takes done jobs with ids past `after_id` (FIRST_ID
    for the first), in id order, and returns ``(moved, reached)``, how many it
    moved and the last id among them, the next batch's `after_id` (NULL when
    it moved none).

    It walks the done index (`Names.done_index`, schema version 9), which
    holds only the done jobs still in the table, so a pass costs what it
    moves, not what the table holds. Found by reading the heap, every pass
    read the whole table: the failed jobs kept for inspection and, after a
    held snapshot, hundreds of MB of dead space, through shared buffers (a
    TID range scan gets no ring, unlike a sequential scan), pushing out the
    pages claims need. The position keeps a batch from stepping again over
    the index entries of jobs the batches before it moved, which stay until
    VACUUM may remove them. A job skipped while another session held it
    waits for the next pass, which starts at FIRST_ID again.
    """
    after = table.c.id > bindparam("after_id", FIRST_ID, type_=BigInteger)
    batch = _finished_batch(table, older_than, limit, ["done"], skip_locked, after, ordered=True)
    moved = table.delete().where(batch).returning(*table.c).cte("moved")
    return select(func.count().label("moved"), func.max(moved.c.id).label("reached")).add_cte(
        _copy(table, moved).cte("copied")
    )


def prune_archive(
    table: Table,
    *,
    older_than: timedelta,
    limit: int = 10000,
    statuses: Sequence[str] = FINISHED_STATUSES,
) -> Delete:
    """Delete one batch of jobs archived more than `older_than` ago from
    `<table>_archive`; loop until it deletes fewer than `limit`.

    The archive's own trimming: aged by `archived_at`, which its index
    serves, in small batches like `prune`. Archived rows never change, so
    nothing is re-checked.
    """
    _check_batch(older_than, limit, statuses)
    archived = archive_table(MetaData(), table.name, table.schema)
    c = archived.c
    old = select(c.id).where(
        c.archived_at < func.now() - bindparam("older_than", older_than, type_=Interval),
        status_in(c.status, statuses),
    )
    victims = old.limit(bindparam("limit", limit, type_=Integer))
    return archived.delete().where(_id_among(c.id, victims))


def _id_among(id: ColumnElement[int], victims: Select[Any]) -> ColumnElement[bool]:
    """`id = ANY(ARRAY(victims))`, not `id IN (victims)`: the rows are then
    found by primary key. As a semi-join, PostgreSQL 15 read the whole table
    a second time for every batch once most done jobs were too young to move."""
    return id == any_(func.array(victims.scalar_subquery(), type_=ARRAY(BigInteger)))


def _check_batch(older_than: timedelta, limit: int, statuses: Sequence[str]) -> None:
    """What every batch of `prune`, `archive` and `prune_archive` requires."""
    bad = [s for s in statuses if s not in FINISHED_STATUSES]
    if bad or not statuses:
        raise InvalidJob(
            f"prune and archive take only finished jobs ({', '.join(FINISHED_STATUSES)}), "
            f"not {bad or 'nothing'}"
        )
    if older_than < timedelta(0):
        raise InvalidJob(f"older_than must not be negative, got {older_than}")
    if limit < 1:
        raise InvalidJob(f"limit must be at least 1, got {limit}")


def _finished_batch(
    table: Table,
    older_than: timedelta,
    limit: int,
    statuses: Sequence[str],
    skip_locked: bool = False,
    *where: ColumnElement[bool],
    ordered: bool = False,
) -> ColumnElement[bool]:
    """`id = ANY(ARRAY(one batch of old finished jobs))`, and the same test again on the row.

    The subquery runs once, on its snapshot; the repeated test is what the
    DELETE re-checks on a row that changed meanwhile (a failed job sent back
    by `retry`), so a job that is queued again is never pruned or archived.
    With `skip_locked` the subquery locks its batch as it picks it (`FOR
    UPDATE SKIP LOCKED` under the LIMIT, as the claim does): a row someone
    holds is skipped, and a row changed and committed since the snapshot is
    re-tested by the lock itself before it is taken.
    """
    _check_batch(older_than, limit, statuses)
    c = table.c
    old_finished = and_(
        status_in(c.status, statuses),
        func.coalesce(c.finished_at, c.created_at)
        < func.now() - bindparam("older_than", older_than, type_=Interval),
    )
    victims = (
        select(c.id).where(old_finished, *where).limit(bindparam("limit", limit, type_=Integer))
    )
    if ordered:
        victims = victims.order_by(c.id)
    if skip_locked:
        victims = victims.with_for_update(skip_locked=True)
    return and_(_id_among(c.id, victims), old_finished)


def next_run_at(
    table: Table, *, queue: Queues = "default", future_only: bool = False
) -> Select[Any, datetime]:
    """When the earliest queued job of an unpaused queue becomes ready, and the
    server's `now()`, so an idle worker can sleep until then without trusting
    its own clock (a paused queue's jobs are not due: its resume is announced).

    `future_only` looks only past `now()`: an index range that skips the
    entries of jobs already claimed, for a worker that knows those are
    expensive to step over (see `claim`'s `after`)."""
    c = table.c
    paused = queues_table(MetaData(), table.name, table.schema).c
    future = (c.run_at > func.now(),) if future_only else ()
    return select(func.min(c.run_at), func.now()).where(
        _queue_filter(c.queue, queue),
        status_is(c.status, "queued"),
        *future,
        c.queue.not_in(select(paused.name).where(paused.paused).scalar_subquery()),
    )


def stats(table: Table) -> Select[Any]:
    """Per queue and status: count, oldest ready job's age (s), expired leases."""
    c = table.c
    ready = and_(status_is(c.status, "queued"), c.run_at <= func.now())
    expired = and_(status_is(c.status, "running"), c.locked_until < func.now())
    return (
        select(
            c.queue,
            c.status,
            func.count().label("count"),
            func.extract("epoch", func.now() - func.min(c.run_at).filter(ready)).label(
                "oldest_ready_age"
            ),
            func.count().filter(expired).label("expired_leases"),
        )
        .group_by(c.queue, c.status)
        .order_by(c.queue, c.status)
    )


def archive_estimate(table: Table) -> TextualSelect:
    """The archive's size on disk and the planner's estimate of its rows
    (`rows` is -1 before it was first analyzed): one catalog row, read in
    place of a count(*) of a table that only grows."""
    return (
        text(
            "SELECT c.reltuples::bigint AS rows, pg_total_relation_size(c.oid) AS bytes "
            "FROM pg_class c WHERE c.oid = to_regclass(:qualified)"
        )
        .bindparams(qualified=names_of(table).archive_qualified)
        .columns(rows=BigInteger, bytes=BigInteger)
    )
