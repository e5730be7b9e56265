"""The `jobq` command line.

Each command is a thin wrapper: parse options, call the module that does the
work, print. Errors a user can cause become one line on stderr and exit 2.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Annotated, Any, TypeVar

import typer
from sqlalchemy import Engine, MetaData, Table, create_engine
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from . import client, queue_statements, statements
from .db import BadDatabaseURL, sqlalchemy_url
from .errors import CONNECTION_ERRORS, USER_ERRORS, UsageError, describe_connection_error
from .migrations.check import check_schema
from .schema import jobs_table, names_of

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="sqla_jobq: a PostgreSQL job queue on SQLAlchemy.",
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="JOBQ_DATABASE_URL",
        help="PostgreSQL URL, e.g. postgresql://user@host:5432/db.",
        show_default=False,
    ),
]
TableName = Annotated[
    str,
    typer.Option("--table", envvar="JOBQ_TABLE", help="Queue table, NAME or SCHEMA.NAME."),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"jobq: error: {message}", err=True)
    return typer.Exit(code)


def friendly(fn: F) -> F:
    """Turn the errors a user can cause into one line on stderr and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise fail(str(exc)) from None
        except CONNECTION_ERRORS as exc:
            raise fail(describe_connection_error(exc)) from None

    return wrapper  # type: ignore[return-value]


def require_url(url: str | None) -> str:
    """The URL given, or the embedded server for the literal `embedded` (never implied)."""
    if not url:
        raise UsageError("no database: pass --database-url or set JOBQ_DATABASE_URL")
    if url == "embedded":
        from .embedded import EmbeddedError, embedded_url
        from .migrations.runner import migrate_to_latest

        try:
            url = embedded_url()
        except EmbeddedError as exc:
            raise UsageError(str(exc)) from None
        # A server started for trying the queue out: give it the default table.
        migrate_to_latest(sqlalchemy_url(url), jobs_table(MetaData()))
    return sqlalchemy_url(url)


def parse_table(spec: str) -> Table:
    schema, _, name = spec.rpartition(".")
    if not name:
        raise UsageError(f"bad --table {spec!r}: expected NAME or SCHEMA.NAME")
    try:
        return jobs_table(MetaData(), name, schema or None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def make_engine(url: str | None) -> Engine:
    return create_engine(require_url(url), poolclass=NullPool)


@contextmanager
def checked_engine(url: str | None, table: Table) -> Iterator[Engine]:
    """An engine on a database whose queue schema is present and current."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            check_schema(conn, table)
        yield engine
    finally:
        engine.dispose()


@contextmanager
def checked(url: str | None, table: Table) -> Iterator[Connection]:
    """One transaction on a database whose queue schema is present and current."""
    with checked_engine(url, table) as engine, engine.begin() as conn:
        yield conn


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """`90`, `90s`, `15m`, `12h`, `7d`, `2w`."""
    match = _DURATION.match(text)
    if not match:
        raise UsageError(f"bad duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)")
    return timedelta(seconds=float(match[1]) * _UNITS[match[2]])


def parse_archive_after(text: str) -> timedelta | None:
    """A duration `parse_duration` takes, or `never` (None: keep done jobs)."""
    if text.strip().lower() == "never":
        return None
    try:
        return parse_duration(text)
    except UsageError:
        raise UsageError(
            f"bad --archive-after {text!r}: use a duration (e.g. 60s, 15m, 7d; 0: as each "
            "job completes) or never"
        ) from None


def parse_payload(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as exc:
        raise UsageError(f"--payload is not valid JSON: {exc}") from None


@app.command()
@friendly
def migrate(database_url: DatabaseUrl = None, table: TableName = "jobs") -> None:
    """Create or upgrade the queue schema (the same DDL as `alembic upgrade head`)."""
    from .migrations.runner import migrate_to_latest

    applied = migrate_to_latest(require_url(database_url), parse_table(table))
    typer.echo(f"schema version {applied}")


@app.command("alembic-revision")
@friendly
def alembic_revision(
    version_path: Annotated[
        str | None, typer.Option(help="The app's versions folder, one of its version locations.")
    ] = None,
    message: Annotated[
        str | None, typer.Option("--message", "-m", help="The revision's message.")
    ] = None,
    config: Annotated[str, typer.Option(help="The app's Alembic config file.")] = "alembic.ini",
) -> None:
    """Write one revision in your app's Alembic chain: the queue schema this sqla_jobq needs."""
    from .migrations.host import write_host_revision

    done = write_host_revision(config, version_path, message)
    if done.written:
        typer.echo(
            f"wrote {done.path}: sqla_jobq schema version {done.previous} -> {done.version}; "
            "run `alembic upgrade head`"
        )
    else:
        typer.echo(f"{done.path} already pins sqla_jobq schema version {done.version}: no change")


@app.command()
@friendly
def enqueue(
    task: Annotated[str, typer.Argument(help="Registered task name.")],
    payload: Annotated[str, typer.Option(help="Keyword arguments as a JSON object.")] = "{}",
    queue: Annotated[str | None, typer.Option(help="Queue (default: the task's).")] = None,
    delay: Annotated[float, typer.Option(help="Seconds before it may run.")] = 0.0,
    priority: Annotated[int | None, typer.Option(help="Higher runs first.")] = None,
    unique_key: Annotated[str | None, typer.Option(help="At most one active job per key.")] = None,
    app_spec: Annotated[
        str | None,
        typer.Option("--app", help="MODULE:ATTR of the Registry, to check the payload."),
    ] = None,
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """Enqueue one job and print its id."""
    if delay < 0:
        raise UsageError(f"--delay must not be negative, got {delay}")
    kwargs = parse_payload(payload)
    target = parse_table(table)
    options: dict[str, Any] = {"queue": queue or "default", "priority": priority or 0}
    if app_spec is not None:
        target, kwargs, options = _registered(app_spec, task, kwargs, queue, priority)
    elif not isinstance(kwargs, dict):
        raise UsageError("--payload must be a JSON object of keyword arguments")
    options.update(unique_key=unique_key, delay=timedelta(seconds=delay) if delay else None)
    # Build once before connecting: bad input is refused with nothing written.
    statements.enqueue(target, task, kwargs, **options)
    with checked(database_url, target) as conn:
        typer.echo(client.enqueue(conn, target, task, kwargs, **options))


def _registered(
    app_spec: str, task: str, kwargs: Any, queue: str | None, priority: int | None
) -> tuple[Table, dict[str, Any], dict[str, Any]]:
    """Table, checked payload and defaults of a task known to the app's Registry."""
    from .loader import load_registry

    registry = load_registry(app_spec)
    known = registry.require(task)
    options = {
        "queue": queue or known.queue,
        "priority": known.priority if priority is None else priority,
        "max_attempts": known.max_attempts,
    }
    return registry.table, known.check_payload(kwargs), options


@app.command()
@friendly
def stats(
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
    as_json: AsJson = False,
    workers: Annotated[
        bool, typer.Option("--workers", help="Only the registered workers, stale ones flagged.")
    ] = False,
) -> None:
    """Jobs per queue and status, the oldest ready job's age, expired leases; workers."""
    from . import worker_report

    target = parse_table(table)
    with checked(database_url, target) as conn:
        rows = [dict(r._mapping) for r in conn.execute(statements.stats(target))]
        archived = conn.execute(statements.archive_estimate(target)).first()
        settings = [dict(r._mapping) for r in conn.execute(queue_statements.settings(target))]
        registered = worker_report.collect(conn, target)
    if workers:
        shown = worker_report.to_json(registered)
        typer.echo(json.dumps(shown) if as_json else worker_report.render_text(registered))
        return
    by_queue = {s["queue"]: s for s in settings}
    for row in rows:
        age = row["oldest_ready_age"]
        row["oldest_ready_age"] = None if age is None else round(float(age), 3)
        found = by_queue.get(row["queue"], {})
        row["paused"] = found.get("paused", False)
        row["concurrency_limit"] = found.get("concurrency_limit")
    if as_json:
        typer.echo(json.dumps(rows))
        return
    typer.echo(f"{'queue':<20} {'status':<8} {'count':>8} {'oldest ready (s)':>17} {'expired':>8}")
    for row in rows:
        age = "" if row["oldest_ready_age"] is None else f"{row['oldest_ready_age']:.1f}"
        typer.echo(
            f"{row['queue']:<20} {row['status']:<8} {row['count']:>8} {age:>17} "
            f"{row['expired_leases']:>8}"
        )
    for found in settings:
        typer.echo(_setting_line(found))
    if archived is not None:
        typer.echo(_archive_line(names_of(target).archive, archived.rows, archived.bytes))
    typer.echo(f"\n{worker_report.render_text(registered)}")


def _archive_line(name: str, rows: int, size: int) -> str:
    """`archive jobs_archive: about 1,200 jobs, 1.2 MB (estimate)`: the
    planner's statistics, since counting an archive reads all of it."""
    on_disk = f"{size / 1024**2:,.1f} MB" if size >= 1024**2 else f"{size / 1024:,.0f} kB"
    if rows < 0:
        return f"archive {name}: not analyzed yet, {on_disk}"
    return f"archive {name}: about {rows:,} jobs, {on_disk} (estimate)"


def _setting_line(found: dict[str, Any]) -> str:
    """`queue mail: paused, at most 2 running (1 now)`, one per paused or limited queue."""
    words = ["paused"] if found["paused"] else []
    if found["concurrency_limit"] is not None:
        words.append(f"at most {found['concurrency_limit']} running ({found['running']} now)")
    return f"queue {found['queue']}: {', '.join(words)}"


@app.command()
@friendly
def reap(database_url: DatabaseUrl = None, table: TableName = "jobs") -> None:
    """Return jobs whose lease expired to the queue (or fail them at max_attempts)."""
    target = parse_table(table)
    with checked(database_url, target) as conn:
        rows = conn.execute(statements.reap(target)).all()
    requeued = sum(1 for r in rows if r.status == "queued")
    typer.echo(f"reaped {len(rows)} jobs: {requeued} queued again, {len(rows) - requeued} failed")


@app.command()
@friendly
def prune(
    older_than: Annotated[str, typer.Option(help="Age, e.g. 7d, 12h, 30m.")] = "7d",
    status: Annotated[str, typer.Option(help="Comma-separated: done,failed.")] = "done,failed",
    batch_size: Annotated[int, typer.Option(min=1, max=10000)] = 10000,
    to_archive: Annotated[
        bool, typer.Option("--archive", help="Move them to TABLE_archive instead of deleting.")
    ] = False,
    from_archive: Annotated[
        bool,
        typer.Option(
            "--from-archive",
            help="Delete from TABLE_archive the jobs archived longer ago than --older-than.",
        ),
    ] = False,
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """Delete (or archive) finished jobs in batches, each batch its own short transaction."""
    if to_archive and from_archive:
        raise UsageError("give --archive (move jobs there) or --from-archive (trim it), not both")
    target = parse_table(table)
    age = parse_duration(older_than)
    build: Callable[..., Any] = statements.archive if to_archive else statements.prune
    if from_archive:
        build = statements.prune_archive
    stmt = build(
        target, older_than=age, limit=batch_size, statuses=[s.strip() for s in status.split(",")]
    )
    total = 0
    with checked_engine(database_url, target) as engine:
        while True:
            with engine.begin() as conn:
                count = conn.execute(stmt).rowcount
            total += count
            if count < batch_size:
                break
    done = "archived" if to_archive else "pruned"
    typer.echo(f"{done} {total} {'archived ' if from_archive else ''}jobs")


def _one_job(
    database_url: str | None, table: str, build: Callable[[Table], Any], what: str
) -> None:
    target = parse_table(table)
    with checked(database_url, target) as conn:
        row = conn.execute(build(target)).first()
    if row is None:
        raise fail(what, code=1)
    typer.echo(row[0])


@app.command()
@friendly
def retry(
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """A failed or cancelled job back to queued now, with one more attempt (attempts is kept)."""
    missing = f"no failed or cancelled job {job_id}"
    try:
        _one_job(database_url, table, lambda t: statements.retry(t, job_id), missing)
    except IntegrityError as exc:
        raise _unique_key_held(database_url, parse_table(table), job_id, exc) from None


def _unique_key_held(
    database_url: str | None, target: Table, job_id: int, exc: IntegrityError
) -> UsageError:
    """The refusal of a retry whose unique_key an active job took meanwhile
    (the failed statement changed nothing); any other integrity error is re-raised."""
    diag = getattr(exc.orig, "diag", None)
    if getattr(diag, "constraint_name", None) != names_of(target).unique_index:
        raise exc
    with checked(database_url, target) as conn:
        holder = conn.execute(statements.unique_key_holder(target, job_id)).first()
    who = "an active job" if holder is None else f"job {holder.id} ({holder.status})"
    return UsageError(
        f"job {job_id} not retried: {who} holds its unique_key; "
        "retry it once that job has finished or been cancelled"
    )


@app.command()
@friendly
def cancel(
    job_id: Annotated[int, typer.Argument(metavar="ID")],
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """A queued or running job to cancelled (a running one's worker stops it)."""
    target = parse_table(table)
    with checked(database_url, target) as conn:
        row = conn.execute(statements.cancel(target, job_id)).first()
    if row is None:
        raise fail(f"no queued or running job {job_id}", code=1)
    note = " (its worker stops it at its next heartbeat)" if row.was == "running" else ""
    typer.echo(f"{row.id} cancelled{note}")


@app.command()
@friendly
def pause(
    queue: Annotated[str, typer.Argument(metavar="QUEUE")],
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """Hand out none of QUEUE's jobs, to any worker, until `jobq resume`; running jobs finish."""
    _queue_setting(database_url, table, lambda t: queue_statements.pause(t, queue))
    typer.echo(f"queue {queue} paused")


@app.command()
@friendly
def resume(
    queue: Annotated[str, typer.Argument(metavar="QUEUE")],
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """Hand out QUEUE's jobs again (its concurrency limit, if any, still holds)."""
    _queue_setting(database_url, table, lambda t: queue_statements.resume(t, queue))
    typer.echo(f"queue {queue} resumed")


queue_app = typer.Typer(no_args_is_help=True, help="A queue's settings (see also pause, resume).")
app.add_typer(queue_app, name="queue")


# ignore_unknown_options: `-1` is a (refused) limit, not an unknown option.
@queue_app.command("limit", context_settings={"ignore_unknown_options": True})
@friendly
def queue_limit(
    queue: Annotated[str, typer.Argument(metavar="QUEUE")],
    limit: Annotated[str, typer.Argument(metavar="N", help="Jobs; 0 or none: no limit.")],
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
) -> None:
    """At most N of QUEUE's jobs running at once, across all workers (0 or none removes it)."""
    n = parse_limit(limit)
    build = queue_statements.set_concurrency_limit
    _queue_setting(database_url, table, lambda t: build(t, queue, n))
    typer.echo(f"queue {queue}: " + (f"at most {n} running at once" if n else "no limit"))


def parse_limit(text: str) -> int | None:
    """`N`, `0` or `none` (the last two: no limit)."""
    if text.strip().lower() == "none":
        return None
    if not re.fullmatch(r"\s*[+-]?\d+\s*", text) or int(text) < 0:
        raise UsageError(
            f"bad limit {text!r}: use a whole number of jobs, or 0 or none to remove the limit"
        )
    return int(text) or None


def _queue_setting(database_url: str | None, table: str, build: Callable[[Table], Any]) -> None:
    target = parse_table(table)
    stmt = build(target)  # bad input is refused before connecting
    with checked(database_url, target) as conn:
        conn.execute(stmt)


@app.command()
@friendly
def worker(
    app_spec: Annotated[str, typer.Argument(metavar="MODULE:ATTR", help="The tasks' Registry.")],
    database_url: DatabaseUrl = None,
    listen_url: Annotated[
        str | None,
        typer.Option(
            envvar="JOBQ_LISTEN_URL",
            help="Direct connection for LISTEN when --database-url goes through a pooler.",
        ),
    ] = None,
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", "-q", envvar="JOBQ_QUEUES", help="Queue to work (repeatable)."),
    ] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", envvar="JOBQ_CONCURRENCY", help="Jobs at once.")
    ] = 10,
    burst: Annotated[
        bool, typer.Option(envvar="JOBQ_BURST", help="Work every ready job, then exit 0.")
    ] = False,
    poll_interval: Annotated[
        float,
        typer.Option(
            envvar="JOBQ_POLL_INTERVAL", help="Fallback poll, seconds (LISTEN wakes earlier)."
        ),
    ] = 5.0,
    shutdown_timeout: Annotated[
        float,
        typer.Option(envvar="JOBQ_SHUTDOWN_TIMEOUT", help="Seconds running jobs get on SIGTERM."),
    ] = 30.0,
    reap_interval: Annotated[
        float, typer.Option(envvar="JOBQ_REAP_INTERVAL", help="Seconds between reaper runs.")
    ] = 30.0,
    prepared: Annotated[
        bool,
        typer.Option(
            envvar="JOBQ_PREPARED",
            help="Server-side prepared statements (turn off behind PgBouncer < 1.21).",
        ),
    ] = True,
    gc_freeze: Annotated[
        bool,
        typer.Option(
            envvar="JOBQ_GC_FREEZE",
            help="Keep what startup made out of Python's full garbage collections "
            "(41 ms pauses each, measured, at about every 11,000 jobs).",
        ),
    ] = True,
    prune_older_than: Annotated[
        str | None,
        typer.Option(
            envvar="JOBQ_PRUNE_OLDER_THAN",
            help="Also prune finished jobs older than this (e.g. 7d), in batches.",
        ),
    ] = None,
    prune_interval: Annotated[
        float, typer.Option(envvar="JOBQ_PRUNE_INTERVAL", help="Seconds between prune runs.")
    ] = 3600.0,
    prefetch: Annotated[
        int,
        typer.Option(
            envvar="JOBQ_PREFETCH",
            help="Most jobs claimed ahead of free slots while jobs are short "
            "(about 50 ms of work); 0: off.",
        ),
    ] = 128,
    reconnect: Annotated[
        str | None,
        typer.Option(
            envvar="JOBQ_RECONNECT",
            help="eager: reopen a lost connection at once; lazy: at the next poll, so a "
            "suspended serverless compute stays asleep [default: lazy when --poll-interval "
            "is 60 or more, else eager].",
            show_default=False,
        ),
    ] = None,
    vacuum_dead_tuples: Annotated[
        int,
        typer.Option(
            envvar="JOBQ_VACUUM_DEAD_TUPLES",
            help="VACUUM the queue table (in the background, SKIP_LOCKED) once it has "
            "this many dead tuples; needs the table's owner; 0: leave it to autovacuum.",
        ),
    ] = 20_000,
    reindex_sparse_mb: Annotated[
        int,
        typer.Option(
            envvar="JOBQ_REINDEX_SPARSE_MB",
            help="After that VACUUM, rebuild (REINDEX INDEX CONCURRENTLY) a queue-table "
            "index of at least this many MB that holds fewer than 10 entries a page, as a "
            "snapshot held elsewhere leaves them; 0: never.",
        ),
    ] = 8,
    archive_after: Annotated[
        str,
        typer.Option(
            envvar="JOBQ_ARCHIVE_AFTER",
            help="Move done jobs to TABLE_archive: 0, as each one completes, in the same "
            "statement; a duration (e.g. 60s, 1h), once finished that long, in batches in "
            "the background; never: keep them in the jobs table.",
        ),
    ] = "0",
    log_level: Annotated[
        str, typer.Option(envvar="JOBQ_LOG_LEVEL", help="DEBUG, INFO, WARNING.")
    ] = "INFO",
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="JOBQ_METRICS_PORT",
            help="Serve Prometheus /metrics on this port (extra 'metrics').",
            show_default=False,
        ),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(envvar="JOBQ_METRICS_HOST", help="Address for --metrics-port.")
    ] = "127.0.0.1",
    otel: Annotated[
        bool | None,
        typer.Option(
            "--otel/--no-otel",
            envvar="JOBQ_OTEL",
            help="OpenTelemetry span per attempt (extra 'otel') [default: on when the app "
            "configured a tracer provider].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run the tasks of MODULE:ATTR: claim, execute, complete, retry, reap."""
    import asyncio
    import logging
    import os
    import threading

    from . import logs
    from .instrument import worker_observers
    from .loader import load_registry
    from .process import freeze_what_startup_made, hand_the_gil_over_sooner
    from .worker import Worker, WorkerOptions

    archive_age = parse_archive_after(archive_after)
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise UsageError(f"unknown --log-level {log_level!r}: use DEBUG, INFO, WARNING or ERROR")
    logs.configure(level)
    if reindex_sparse_mb < 0:
        raise UsageError(f"--reindex-sparse-mb must not be negative, got {reindex_sparse_mb}")
    try:
        options = WorkerOptions(
            database_url=require_url(database_url),
            listen_url=sqlalchemy_url(listen_url) if listen_url else None,
            queues=queue or (),
            concurrency=concurrency,
            burst=burst,
            poll_interval=poll_interval,
            shutdown_timeout=shutdown_timeout,
            reap_interval=reap_interval,
            prepared=prepared,
            prune_older_than=parse_duration(prune_older_than) if prune_older_than else None,
            prune_interval=prune_interval,
            prefetch=prefetch,
            reconnect=reconnect,
            vacuum_dead_tuples=vacuum_dead_tuples,
            reindex_sparse_bytes=reindex_sparse_mb * 1024 * 1024,
            archive_after=archive_age,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    registry = load_registry(app_spec)
    observers = worker_observers(metrics_port, metrics_host, otel)
    hand_the_gil_over_sooner()
    if gc_freeze:
        freeze_what_startup_made()
    code = asyncio.run(Worker(registry, options, observers).run())
    logging.shutdown()
    if threading.active_count() > 1:
        # A sync handler still running past the shutdown timeout: its job was
        # handed back already, and a thread cannot be stopped, so leave now.
        os._exit(code)
    raise typer.Exit(code)


@app.command()
@friendly
def demo(
    jobs: Annotated[int, typer.Option(min=1, help="Jobs in each race.")] = 10_000,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Concurrent workers.")] = 8,
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            envvar="JOBQ_DATABASE_URL",
            help="PostgreSQL URL (default: the embedded server). Works in a scratch schema.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """The article's naive claim racing, SKIP LOCKED fixing it, and a lease running out."""
    from .demo import embedded_left_as_found, run_demo
    from .demo_screen import RichScreen

    with embedded_left_as_found(enabled=not database_url):
        url = require_url(database_url or "embedded")
        run_demo(url, jobs=jobs, workers=workers, screen=RichScreen())


@app.command("doctor")
@friendly
def doctor_command(
    database_url: DatabaseUrl = None, table: TableName = "jobs", as_json: AsJson = False
) -> None:
    """Read-only health report: what holds VACUUM back, dead tuples, indexes, leases.

    Exit status 0 when healthy, 1 when something needs attention (see docs/hygiene.md).
    """
    from .doctor import diagnose, render_text

    target = parse_table(table)
    engine = make_engine(database_url)
    try:
        report = diagnose(engine, target)
    finally:
        engine.dispose()
    typer.echo(report.to_json() if as_json else render_text(report))
    raise typer.Exit(report.exit_status)


@app.command()
@friendly
def cron(
    app_spec: Annotated[str, typer.Argument(metavar="MODULE:ATTR", help="The tasks' Registry.")],
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Periodic tasks: each schedule, its last and next fire times, and its last job."""
    from datetime import UTC, datetime

    from .loader import load_registry
    from .schedule_report import collect, render_text, to_json

    registry = load_registry(app_spec)
    if not registry.schedules:
        typer.echo("[]" if as_json else f"{app_spec} declares no periodic tasks")
        return
    with checked(database_url, registry.table) as conn:
        states = collect(conn, registry, datetime.now(UTC))
    typer.echo(json.dumps(to_json(states)) if as_json else render_text(states))


_DASHBOARD_EXTRA = {"starlette", "jinja2", "uvicorn", "multipart", "prometheus_client"}


@app.command()
@friendly
def dashboard(
    database_url: DatabaseUrl = None,
    table: TableName = "jobs",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8090,
    read_only: Annotated[bool, typer.Option("--read-only", help="No actions at all.")] = False,
    auth_token: Annotated[
        str | None,
        typer.Option(
            envvar="JOBQ_DASHBOARD_TOKEN",
            help="Every request must show it (login form or bearer header).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve the web dashboard: queues, jobs, retry and cancel, /metrics, /healthz."""
    try:
        from .dashboard.server import serve
    except ModuleNotFoundError as exc:
        if exc.name not in _DASHBOARD_EXTRA:
            raise
        raise UsageError(
            "the dashboard needs its extra: pip install 'sqla_jobq[dashboard]'"
        ) from None
    serve(
        require_url(database_url),
        parse_table(table),
        host=host,
        port=port,
        read_only=read_only,
        auth_token=auth_token,
        announce=typer.echo,
    )


def main() -> None:
    """Entry point of the `jobq` script."""
    try:
        app()
    except BadDatabaseURL as exc:
        typer.echo(f"jobq: error: {exc}", err=True)
        sys.exit(2)
