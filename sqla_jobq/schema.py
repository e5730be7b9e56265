"""The jobs table as SQLAlchemy Core metadata.

Every name the database knows (indexes, constraints, trigger, function, NOTIFY
channel) is derived here from the table's name and schema, in one place, so two
queues can live side by side in one database and the migrations, the
statements and the worker always agree on what they are called.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Identity,
    Index,
    Integer,
    Interval,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP

STATUSES = ("queued", "running", "done", "failed", "cancelled")
MAX_IDENTIFIER_BYTES = 63
UNIQUE_WHERE = "unique_key IS NOT NULL AND status IN ('queued', 'running')"
# The running index's predicate (schema step 6). `locked_until IS NOT NULL`
# is there so that only a statement bounding `locked_until` (the reaper's
# `locked_until < now()` implies it) can use the index. Without it, a fenced
# statement (`WHERE id = ... AND status = 'running'`) matched the predicate,
# and the generic plan of a prepared batch completion walked the whole index
# instead of the primary key: cheap while the index holds only running jobs,
# but while a snapshot is held it keeps an entry for every job run since, and
# completions fell to 50 ms each (bench.scenes held-snapshot).
RUNNING_WHERE = "status = 'running' AND locked_until IS NOT NULL"
# The done index's predicate (schema step 9): the done jobs still in the
# table, which the archiver's sweep looks for (the dashboard's list of done
# jobs walks it too). With archiving at
# completion (the default) they are few, so the index is small; its only key,
# `id`, never changes, and `status` is in every other partial index's
# predicate already, so it makes no update that was HOT non-HOT.
DONE_WHERE = "status = 'done'"

# The schema version this code needs. The migrations record the version they
# applied as the table's comment (as Oban does), so a worker can refuse to run
# on a missing or outdated table, and a custom-named table carries its own.
SCHEMA_VERSION = 9
# The version of the step that last changed the archive table's shape. Its
# comment carries it, so a host's `include_object` recognises the archive too.
ARCHIVE_VERSION = 5
# The same for the periodic tasks' schedules table, the queue settings and the
# worker registry.
SCHEDULES_VERSION = 4
QUEUES_VERSION = 5
WORKERS_VERSION = 5
_COMMENT_PREFIX = "sqla_jobq schema version "

# Autovacuum storage parameters of the jobs table (schema version 6; values as
# PostgreSQL spells them in `pg_class.reloptions`). A queue table is small and
# hot, and every job leaves two dead row versions in it: the claim and the
# completion both change `status`, which the partial indexes' predicates name,
# so neither update can be HOT. The default scale factor, 0.2, waits for dead
# tuples to reach a fifth of a table that, unpruned, holds every finished job,
# then a throttled vacuum (cost delay 2 ms) crawls through it. With scale 0 and
# threshold 5000 autovacuum takes the table at each visit with that many dead
# (or changed, for analyze) tuples, whatever its size; autovacuum_naptime, a
# server setting (60 s by default), still bounds how often it visits. Cost
# delay 0 because a small hot table's vacuum should finish in a fraction of
# the time its dead tuples take to pile up. fillfactor stays at 100: free room
# in a page only serves HOT updates, and no per-job update can be HOT.
# Step 6 applies these values: changing them is a new step, not an edit here.
QUEUE_TABLE_SETTINGS: dict[str, str] = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "5000",
    "autovacuum_vacuum_cost_delay": "0",
    "autovacuum_analyze_scale_factor": "0",
    "autovacuum_analyze_threshold": "5000",
}

# Schema version 8: VACUUM never truncates the jobs table. Truncating the
# empty pages at a table's end takes an ACCESS EXCLUSIVE lock, which stops
# every claim, enqueue and completion while it is held. A queue table's tail
# is empty often (its rows come and go within seconds, and even more so when
# completions move jobs to the archive), and after a long transaction
# elsewhere has let it grow, each VACUUM that finds its tail empty takes that
# lock again: in bench.scenes held-snapshot the slowest seconds after the
# release were those truncations. The pages stay allocated and are reused
# for new jobs instead; `VACUUM (TRUNCATE)` by hand gives them back.
NO_TRUNCATE_SETTINGS: dict[str, str] = {"vacuum_truncate": "off"}


def version_comment(version: int) -> str:
    return f"{_COMMENT_PREFIX}{version}"


def parse_version_comment(comment: str | None) -> int | None:
    if comment is None or not comment.startswith(_COMMENT_PREFIX):
        return None
    tail = comment.removeprefix(_COMMENT_PREFIX)
    return int(tail) if tail.isdigit() else None


@dataclass(frozen=True)
class Names:
    """Database object names of one queue table."""

    table: str
    schema: str | None

    def __post_init__(self) -> None:
        for part in (self.table, self.schema):
            if part is None:
                continue
            if not part or "\x00" in part or len(part.encode()) > MAX_IDENTIFIER_BYTES - 16:
                raise ValueError(
                    f"invalid queue table name {part!r}: use 1 to "
                    f"{MAX_IDENTIFIER_BYTES - 16} bytes and no NUL"
                )
        # pg_notify refuses a channel name over 63 bytes, which would fail every
        # enqueue. Without a schema the server resolves it: check_schema checks.
        if self.schema is not None:
            channel = canonical_channel(self.schema, self.table)
            if len(channel.encode()) > MAX_IDENTIFIER_BYTES:
                raise ValueError(
                    f"invalid queue table name {channel!r}: schema and table together "
                    f"(the NOTIFY channel) must fit in {MAX_IDENTIFIER_BYTES} bytes"
                )

    @property
    def qualified(self) -> str:
        """The table's quoted, schema-qualified name, ready to splice into SQL."""
        return qualify(self.schema, self.table)

    @property
    def ready_index(self) -> str:
        """Partial index on the classic `(queue, run_at)`, serving hand-written
        claims; `id` last (schema version 7) makes it serve the positional claim's
        `(run_at, id)` order as a range, should the planner pick it."""
        return f"{self.table}_ready_idx"

    @property
    def claim_index(self) -> str:
        """Partial index in the exact order `claim` walks: priority first."""
        return f"{self.table}_claim_idx"

    @property
    def running_index(self) -> str:
        """Partial index on the leases of running jobs, for the reaper."""
        return f"{self.table}_running_idx"

    @property
    def unique_index(self) -> str:
        return f"{self.table}_unique_key_idx"

    @property
    def done_index(self) -> str:
        """Partial index on the done jobs still in the table, for the archiver's sweep."""
        return f"{self.table}_done_idx"

    @property
    def status_check(self) -> str:
        return f"{self.table}_status_check"

    @property
    def notify_function(self) -> str:
        return f"{self.table}_notify"

    @property
    def notify_trigger(self) -> str:
        return f"{self.table}_notify"

    @property
    def literal_channel(self) -> str:
        """The channel schema versions 1 and 2 spelled into the INSERT trigger.

        It followed the spelling of the table name, so a table migrated as
        `public.jobs` and used as `jobs` sent where no worker listened. Only the
        frozen steps (and the downgrade back to them) still use it; listeners
        use the channel `check_schema` resolves (see `canonical_channel`).
        """
        return self.table if self.schema is None else f"{self.schema}.{self.table}"

    @property
    def notify_requeue_function(self) -> str:
        """Row trigger function announcing jobs put back to `queued` (schema version 3)."""
        return f"{self.table}_notify_requeue"

    @property
    def notify_requeue_trigger(self) -> str:
        return f"{self.table}_notify_requeue"

    @property
    def archive(self) -> str:
        """Where `prune --archive` moves finished jobs (schema version 2)."""
        return f"{self.table}_archive"

    @property
    def archive_qualified(self) -> str:
        return qualify(self.schema, self.archive)

    @property
    def archive_pkey(self) -> str:
        return f"{self.table}_archive_pkey"

    @property
    def archive_index(self) -> str:
        """Index on `archived_at`, so the archive can be pruned in turn."""
        return f"{self.table}_archived_at_idx"

    @property
    def notify_finished(self) -> str:
        """Row trigger (and function) announcing an awaited job's end (schema version 5)."""
        return f"{self.table}_notify_finished"

    @property
    def notify_cancel(self) -> str:
        """Row trigger (and function) announcing a running job cancelled (schema version 5)."""
        return f"{self.table}_notify_cancel"

    @property
    def queues(self) -> str:
        """One row per queue with a setting: paused, concurrency limit (schema version 5)."""
        return f"{self.table}_queues"

    @property
    def queues_qualified(self) -> str:
        return qualify(self.schema, self.queues)

    @property
    def queues_pkey(self) -> str:
        return f"{self.table}_queues_pkey"

    @property
    def claim_slots(self) -> str:
        """SQL function the claim asks how many jobs a queue may hand out now (schema version 5)."""
        return f"{self.table}_claim_slots"

    @property
    def claim_quotas(self) -> str:
        """SQL function: `claim_slots` of each queue a claim names, locks in one order (v5)."""
        return f"{self.table}_claim_quotas"

    @property
    def queues_notify(self) -> str:
        """Row trigger (and function) waking workers when a queue may hand out more (version 5)."""
        return f"{self.table}_queues_notify"

    @property
    def workers(self) -> str:
        """One row per live worker, kept by its heartbeat (schema version 5)."""
        return f"{self.table}_workers"

    @property
    def workers_qualified(self) -> str:
        return qualify(self.schema, self.workers)

    @property
    def workers_pkey(self) -> str:
        return f"{self.table}_workers_pkey"

    @property
    def schedules(self) -> str:
        """One row per periodic task: its last fire time (schema version 4)."""
        return f"{self.table}_schedules"

    @property
    def schedules_qualified(self) -> str:
        return qualify(self.schema, self.schedules)

    @property
    def schedules_pkey(self) -> str:
        return f"{self.table}_schedules_pkey"


def canonical_channel(schema: str, table: str) -> str:
    """The NOTIFY channel of a queue table, formatted exactly as its triggers
    format it on the server (`TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME`, schema
    version 3): always schema-qualified, whatever spelling found the table."""
    return f"{schema}.{table}"


def quote_ident(name: str) -> str:
    """Quote an identifier the way PostgreSQL's quote_ident does, always."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def qualify(schema: str | None, name: str) -> str:
    return quote_ident(name) if schema is None else f"{quote_ident(schema)}.{quote_ident(name)}"


def names_of(table: Table) -> Names:
    return Names(table.name, table.schema)


def jobs_table(metadata: MetaData, name: str = "jobs", schema: str | None = None) -> Table:
    """Build the jobs table on the caller's metadata.

    The host app's own `MetaData` may carry it, so its models and the queue
    share one engine and one transaction. Columns beyond the classic schema all
    have defaults: `INSERT INTO jobs (payload) VALUES (...)` keeps working.
    """
    names = Names(name, schema)
    status_in = ", ".join(f"'{s}'" for s in STATUSES)
    return Table(
        name,
        metadata,
        Column("id", BigInteger, Identity(always=True), primary_key=True),
        Column("queue", Text, nullable=False, server_default=text("'default'")),
        Column("payload", JSONB, nullable=False),
        Column("status", Text, nullable=False, server_default=text("'queued'")),
        Column("run_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("max_attempts", Integer, nullable=False, server_default=text("5")),
        Column("locked_until", TIMESTAMP(timezone=True)),
        Column("last_error", Text),
        Column("created_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
        Column("task", Text),
        Column("priority", Integer, nullable=False, server_default=text("0")),
        Column("unique_key", Text),
        Column("started_at", TIMESTAMP(timezone=True)),
        Column("finished_at", TIMESTAMP(timezone=True)),
        Column("scheduled_for", TIMESTAMP(timezone=True)),
        Column("cancel_requested_at", TIMESTAMP(timezone=True)),
        Column("result", JSONB),
        Column("traceparent", Text),
        Column("awaited", Boolean, nullable=False, server_default=text("false")),
        CheckConstraint(f"status IN ({status_in})", name=names.status_check),
        Index(
            names.ready_index,
            "queue",
            "run_at",
            "id",
            postgresql_where=text("status = 'queued'"),
        ),
        Index(
            names.claim_index,
            text("queue"),
            text("priority DESC"),
            text("run_at"),
            text("id"),
            postgresql_where=text("status = 'queued'"),
        ),
        Index(
            names.running_index,
            "locked_until",
            postgresql_where=text(RUNNING_WHERE),
        ),
        Index(
            names.unique_index,
            "unique_key",
            unique=True,
            postgresql_where=text(UNIQUE_WHERE),
        ),
        Index(names.done_index, "id", postgresql_where=text(DONE_WHERE)),
        schema=schema,
        comment=version_comment(SCHEMA_VERSION),
        # So `metadata.create_all` builds the table steps 6 and 8 leave (SQLAlchemy 2.1+).
        postgresql_with={**QUEUE_TABLE_SETTINGS, **NO_TRUNCATE_SETTINGS},
    )


def archive_table(metadata: MetaData, name: str = "jobs", schema: str | None = None) -> Table:
    """Build the archive of the jobs table `name`: `<name>_archive`.

    Kept apart from `jobs_table` so metadata that declares the queue table
    alone still matches a database that also has the archive. Its columns are
    the jobs table's, derived from it so the two cannot drift, but without
    defaults, identity or status check: `archive` copies whole rows, ids
    included. `archived_at` is the archive's own clock, indexed so the
    archive can be pruned in turn.
    """
    names = Names(name, schema)
    copied = [
        Column(
            c.name, c.type, nullable=c.nullable, primary_key=c.primary_key, autoincrement=False
        )
        for c in jobs_table(MetaData(), name, schema).columns
    ]
    return Table(
        names.archive,
        metadata,
        *copied,
        Column("archived_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
        Index(names.archive_index, "archived_at"),
        schema=schema,
        comment=version_comment(ARCHIVE_VERSION),
    )


def schedules_table(metadata: MetaData, name: str = "jobs", schema: str | None = None) -> Table:
    """Build the schedules table of the jobs table `name`: `<name>_schedules`.

    A periodic task's row holds its last fire time. Enqueueing a fire first
    moves `last_fire` forward, and only a statement that moved it inserts the
    job, so a fire time is enqueued once however many workers race for it,
    and never again after its job has finished and left the jobs table.
    """
    names = Names(name, schema)
    return Table(
        names.schedules,
        metadata,
        Column("name", Text),
        Column("last_fire", TIMESTAMP(timezone=True), nullable=False),
        Column("last_job_id", BigInteger),
        Column("updated_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("name", name=names.schedules_pkey),
        schema=schema,
        comment=version_comment(SCHEDULES_VERSION),
    )


def queues_table(metadata: MetaData, name: str = "jobs", schema: str | None = None) -> Table:
    """Build the queue settings table of the jobs table `name`: `<name>_queues`.

    A queue without a row has no settings: not paused, no limit. The claim
    reads this table inside the same statement, so a pause or a limit holds
    for every worker on every host the moment it commits.
    """
    names = Names(name, schema)
    return Table(
        names.queues,
        metadata,
        Column("name", Text, primary_key=True),
        Column("paused", Boolean, nullable=False, server_default=text("false")),
        Column("concurrency_limit", Integer),
        Column("updated_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
        CheckConstraint("concurrency_limit > 0", name=f"{names.queues}_limit_check"),
        schema=schema,
        comment=version_comment(QUEUES_VERSION),
    )


def workers_table(metadata: MetaData, name: str = "jobs", schema: str | None = None) -> Table:
    """Build the worker registry of the jobs table `name`: `<name>_workers`.

    Each worker keeps its row fresh on the heartbeat it sends anyway (never an
    extra idle query) and deletes it on a clean shutdown; a row whose
    heartbeat stopped is a worker that died.
    """
    names = Names(name, schema)
    return Table(
        names.workers,
        metadata,
        Column("id", Text, primary_key=True),
        Column("host", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("queues", ARRAY(Text), nullable=False),
        Column("concurrency", Integer, nullable=False),
        Column("started_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()),
        Column(
            "heartbeat_at", TIMESTAMP(timezone=True), nullable=False, server_default=func.now()
        ),
        Column("jobs_done", BigInteger, nullable=False, server_default=text("0")),
        # The longest this worker may go without a heartbeat while alive (see
        # `sqla_jobq.presence`): silent for twice that plus a margin, it is stale.
        Column("beat_interval", Interval, nullable=False),
        schema=schema,
        comment=version_comment(WORKERS_VERSION),
    )


# The default queue table (`sqla_jobq.jobs`), on a MetaData of its own: what a
# `Registry()` works when given no table.
default_metadata = MetaData()
default_jobs = jobs_table(default_metadata)
