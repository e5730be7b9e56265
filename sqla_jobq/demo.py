"""`jobq demo`: the article's race, its fix, and a lease expiring, on a real server (internal).

Three phases, each a claim the reader can check with their own eyes:

1. the naive claim (`UPDATE ... WHERE id = (SELECT ... LIMIT 1)`), run the way
   the article runs it with pgbench: N clients, each making jobs/N claims, each
   claim its own BEGIN ... COMMIT. Far fewer jobs end done than claims were
   made, and one job is taken by several workers;
2. the same workers on `statements.claim` (FOR UPDATE SKIP LOCKED) and
   `statements.complete_many`: every job done exactly once;
3. a lease expiring under a stalled worker: the reaper hands the job to
   another worker, and the fencing token (`attempts`) turns the stale
   worker's completion into `UPDATE 0`.

Everything happens in a schema of its own (`jobq_demo_<random>`), built with
the migration steps and dropped at the end (on errors and Ctrl-C too), so
the demo can run against any database without touching anything else.

The phase functions print nothing and return result objects (the tests
assert on them); `run_demo` reports through a `Screen`, and the terminal one,
`demo_screen.RichScreen`, lives in its own module.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, MetaData, Table, Update, create_engine, select
from sqlalchemy.pool import NullPool

from . import embedded, statements
from .db import conninfo, sqlalchemy_url
from .migrations.steps import LATEST, up_statements
from .schema import Names, jobs_table, quote_ident

# The article's statement, verbatim but for marking the job done at once (as
# its pgbench script does), so every claim is also a completion.
NAIVE_CLAIM = """\
UPDATE jobs SET status = 'done', attempts = attempts + 1
WHERE id = (
  SELECT id FROM jobs WHERE status = 'queued' ORDER BY run_at LIMIT 1
)
RETURNING id"""

CLAIM_BATCH = 10
DEFAULT_LEASE = timedelta(seconds=1)
POLL_SECONDS = 0.05
DROP_LOCK_TIMEOUT = "10s"

_TALLY = """\
SELECT count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status = 'queued'),
       coalesce(max(attempts), 0), count(*) FILTER (WHERE attempts > 1),
       coalesce(sum(attempts), 0)
FROM {table}"""

Progress = Callable[[int], None]
Say = Callable[[str], None]
RawConnection = psycopg.Connection[tuple[Any, ...]]


def _ignore(_: Any) -> None:
    """The default progress and narration callback: tests need neither."""


@dataclass(frozen=True)
class RaceResult:
    """How one claim strategy did with N concurrent workers over the same queue."""

    jobs: int
    workers: int
    claims: int  # rows the workers' claims returned
    done: int
    queued: int
    max_taken: int  # max(attempts): the most times one job was handed out
    taken_more_than_once: int
    seconds: float

    @property
    def done_per_second(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class LeaseResult:
    """The lease story, step by step, with the row counts that prove the fence works."""

    job_id: int
    lease: timedelta
    stale_attempts: int
    reaped: int
    owner_attempts: int
    stale_rowcount: int
    owner_rowcount: int
    final_status: str
    final_attempts: int
    steps: tuple[str, ...]


@dataclass(frozen=True)
class DemoResult:
    schema: str
    naive: RaceResult
    skip_locked: RaceResult
    lease: LeaseResult


# --- the throwaway schema --------------------------------------------------


def _connect(url: str) -> RawConnection:
    return psycopg.connect(conninfo(url), autocommit=True)


@contextmanager
def demo_schema(url: str) -> Iterator[Table]:
    """A migrated `jobs` table in a fresh schema, dropped however the block ends."""
    schema = f"jobq_demo_{secrets.token_hex(4)}"
    names = Names("jobs", schema)
    with _connect(url) as conn, conn.transaction():  # all of it or nothing
        conn.execute(f"CREATE SCHEMA {quote_ident(schema)}".encode())
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())
    try:
        yield jobs_table(MetaData(), names.table, schema)
    finally:
        drop_schema(url, schema)


def drop_schema(url: str, schema: str) -> None:
    """Drop the demo's schema; a lock timeout keeps a stuck session from hanging us."""
    with _connect(url) as conn:
        conn.execute(f"SET lock_timeout = '{DROP_LOCK_TIMEOUT}'".encode())
        conn.execute(f"DROP SCHEMA IF EXISTS {quote_ident(schema)} CASCADE".encode())


def schema_exists(url: str, schema: str) -> bool:
    with _connect(url) as conn:
        row = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (schema,)).fetchone()
    return bool(row and row[0])


def fill(url: str, table: Table, jobs: int) -> None:
    """Empty the table and queue `jobs` jobs in one statement, as the article does."""
    qualified = Names(table.name, table.schema).qualified
    with _connect(url) as conn:
        conn.execute(f"TRUNCATE {qualified} RESTART IDENTITY".encode())
        conn.execute(
            f"INSERT INTO {qualified} (payload) "
            "SELECT jsonb_build_object('email_id', g) FROM generate_series(1, %s) AS g".encode(),
            (jobs,),
        )


def _tally(url: str, table: Table) -> tuple[int, int, int, int, int]:
    """done, queued, max(attempts), jobs taken more than once, sum(attempts)."""
    qualified = Names(table.name, table.schema).qualified
    with _connect(url) as conn:
        row = conn.execute(_TALLY.format(table=qualified).encode()).fetchone()
    assert row is not None
    return (int(row[0]), int(row[1]), int(row[2]), int(row[3]), int(row[4]))


# --- running N workers at once ----------------------------------------------


class _Race:
    """What one phase's worker threads share: a start line, a counter, a stop flag.

    The barrier makes every worker connect before any claims, as pgbench's
    clients do; otherwise the first thread would drain a small queue alone
    and there would be no race to show.
    """

    def __init__(self, workers: int) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.started = 0.0
        self.finished = 0.0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.barrier = threading.Barrier(workers, action=self._start)

    def _start(self) -> None:
        self.started = self.finished = time.perf_counter()

    def ready(self) -> bool:
        """Wait at the start line; False means the race was called off."""
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            return False
        return True

    def add(self, n: int) -> None:
        with self.lock:
            self.count += n
            self.finished = time.perf_counter()

    def guard(self, work: Callable[[_Race], None]) -> Callable[[], None]:
        """Run `work`, and on any error stop the others instead of leaving them waiting."""

        def run() -> None:
            try:
                work(self)
            except BaseException as exc:
                self.errors.append(exc)
                self.stop.set()
                self.barrier.abort()

        return run


def _run(workers: list[Callable[[_Race], None]], progress: Progress) -> tuple[int, float]:
    """Run the workers in threads; report progress from this thread; return count, seconds.

    Ctrl-C lands here (the main thread): the finally stops the workers and
    waits for them, so their connections are closed before the schema drops.
    """
    race = _Race(len(workers))
    threads = [
        threading.Thread(target=race.guard(work), name=f"jobq-demo-{i}", daemon=True)
        for i, work in enumerate(workers)
    ]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            time.sleep(POLL_SECONDS)
            progress(race.count)
    finally:
        race.stop.set()
        race.barrier.abort()
        for thread in threads:
            thread.join()
    if race.errors:
        raise race.errors[0]
    progress(race.count)
    return race.count, race.finished - race.started


def shares_of(total: int, parts: int) -> list[int]:
    """Split `total` claims over `parts` workers, like pgbench -t jobs/clients."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# --- phase 1: the naive claim -----------------------------------------------


def _naive_worker(url: str, schema: str, claims: int) -> Callable[[_Race], None]:
    def work(race: _Race) -> None:
        with _connect(url) as conn:
            conn.execute(f"SET search_path TO {quote_ident(schema)}".encode())
            if not race.ready():
                return
            for _ in range(claims):
                if race.stop.is_set():
                    return
                with conn.transaction():  # BEGIN; claim; COMMIT, one claim per transaction
                    taken = len(conn.execute(NAIVE_CLAIM.encode()).fetchall())
                race.add(taken)

    return work


def run_naive(
    url: str, table: Table, *, jobs: int, workers: int, progress: Progress = _ignore
) -> RaceResult:
    """Phase 1: `jobs` claims of the article's statement by `workers` clients."""
    assert table.schema is not None
    fill(url, table, jobs)
    work = [_naive_worker(url, table.schema, n) for n in shares_of(jobs, workers)]
    claims, seconds = _run(work, progress)
    return _result(url, table, jobs, workers, claims, seconds)


def _result(
    url: str, table: Table, jobs: int, workers: int, claims: int, seconds: float
) -> RaceResult:
    done, queued, max_taken, repeated, _ = _tally(url, table)
    return RaceResult(jobs, workers, claims, done, queued, max_taken, repeated, seconds)


# --- phase 2: FOR UPDATE SKIP LOCKED ----------------------------------------


def _skip_locked_worker(engine: Engine, table: Table, batch: int) -> Callable[[_Race], None]:
    claim = statements.claim(table, limit=batch)

    def work(race: _Race) -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            if race.ready():
                _drain(conn, table, claim, race)

    return work


def _drain(conn: Connection, table: Table, claim: Update, race: _Race) -> None:
    """Claim and complete until the queue is empty, each one statement in autocommit:
    both are atomic on their own, so a transaction around them would only add
    round trips."""
    while not race.stop.is_set():
        rows = conn.execute(claim).all()
        if not rows:
            return
        owned = [(row.id, row.attempts) for row in rows]
        completed = conn.execute(statements.complete_many(table, owned)).all()
        race.add(len(completed))


def run_skip_locked(
    url: str,
    table: Table,
    *,
    jobs: int,
    workers: int,
    batch: int = CLAIM_BATCH,
    progress: Progress = _ignore,
) -> RaceResult:
    """Phase 2: the same queue drained with `statements.claim` + `complete_many`."""
    fill(url, table, jobs)
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        _, seconds = _run([_skip_locked_worker(engine, table, batch)] * workers, progress)
    finally:
        engine.dispose()
    *_, claims = _tally(url, table)
    return _result(url, table, jobs, workers, claims, seconds)


# --- phase 3: a lease runs out ----------------------------------------------


class _Story:
    """Collects the lease story's lines and tells them as they happen."""

    def __init__(self, say: Say) -> None:
        self.say = say
        self.lines: list[str] = []
        self.t0 = time.perf_counter()

    def __call__(self, line: str) -> None:
        text = f"+{time.perf_counter() - self.t0:4.2f}s  {line}"
        self.lines.append(text)
        self.say(text)


def _reap_when_expired(conn: Connection, table: Table, lease: timedelta) -> int:
    """Run the reaper once the lease has run out by the server's clock.

    Polling after the nominal expiry, rather than sleeping a fixed margin,
    keeps the story free of timing flakes.
    """
    time.sleep(lease.total_seconds())
    deadline = time.monotonic() + 5.0
    while True:
        reaped = len(conn.execute(statements.reap(table)).all())
        if reaped or time.monotonic() > deadline:
            return reaped
        time.sleep(POLL_SECONDS)


def run_lease(
    url: str, table: Table, *, lease: timedelta = DEFAULT_LEASE, say: Say = _ignore
) -> LeaseResult:
    """Phase 3: worker A stalls past its lease; the fence stops its late completion."""
    fill(url, table, 0)
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        with (
            engine.connect().execution_options(isolation_level="AUTOCOMMIT") as a,
            engine.connect().execution_options(isolation_level="AUTOCOMMIT") as b,
        ):
            return _lease_story(a, b, table, lease, _Story(say))
    finally:
        engine.dispose()


def _lease_story(
    a: Connection, b: Connection, table: Table, lease: timedelta, story: _Story
) -> LeaseResult:
    job = a.execute(statements.enqueue(table, "send_email", {"email_id": 42})).scalar_one()
    story(f"job {job} queued")
    claim = statements.claim(table, limit=1, lease=lease)
    stale = a.execute(claim).one()
    story(f"worker A claims job {job}: attempts = {stale.attempts}, lease {_secs(lease)}")
    story("worker A stalls past its lease (a GC pause, a slow API call ...)")
    reaped = _reap_when_expired(b, table, lease)
    story(f"reaper: job {job}'s lease has expired, back to queued")
    owner = b.execute(claim).one()
    story(f"worker B claims job {job}: attempts = {owner.attempts}")
    stale_rows = a.execute(statements.complete(table, job, stale.attempts)).rowcount
    story(f"worker A wakes up, completes with attempts = {stale.attempts}: UPDATE {stale_rows}")
    owner_rows = b.execute(statements.complete(table, job, owner.attempts)).rowcount
    story(f"worker B completes with attempts = {owner.attempts}: UPDATE {owner_rows}")
    c = table.c
    final = b.execute(select(c.status, c.attempts).where(c.id == job)).one()
    return LeaseResult(
        job_id=job,
        lease=lease,
        stale_attempts=stale.attempts,
        reaped=reaped,
        owner_attempts=owner.attempts,
        stale_rowcount=stale_rows,
        owner_rowcount=owner_rows,
        final_status=final.status,
        final_attempts=final.attempts,
        steps=tuple(story.lines),
    )


def _secs(delta: timedelta) -> str:
    return f"{delta.total_seconds():g}s"


# --- all three phases -------------------------------------------------------


class Screen:
    """Hooks `run_demo` calls as the phases go; this base shows nothing (tests)."""

    def start(self, server: str, schema: str, jobs: int, workers: int) -> None:
        pass

    @contextmanager
    def naive(self, jobs: int, workers: int) -> Iterator[Progress]:
        yield _ignore

    @contextmanager
    def skip_locked(self, jobs: int, workers: int) -> Iterator[Progress]:
        yield _ignore

    def naive_done(self, result: RaceResult) -> None:
        pass

    def skip_locked_done(self, result: RaceResult) -> None:
        pass

    def lease(self) -> None:
        pass

    def say(self, line: str) -> None:
        pass

    def lease_done(self, result: LeaseResult) -> None:
        pass

    def finish(self, result: DemoResult) -> None:
        pass


@contextmanager
def embedded_left_as_found(enabled: bool = True) -> Iterator[None]:
    """Stop the embedded server after the block if the block started it.

    A demo on the embedded server should leave no PostgreSQL running that was
    not running before; `--database-url embedded` elsewhere keeps it up.
    """
    was_running = not enabled or embedded.is_running()
    try:
        yield
    finally:
        if not was_running and embedded.is_running():
            embedded.stop()


def describe_server(url: str) -> str:
    """`PostgreSQL 18.4 at /socket/dir:5432/postgres`, for the header."""
    with _connect(url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        where = f"{conn.info.host}:{conn.info.port}/{conn.info.dbname}"
    version = str(row[0]).split()[0] if row else "?"
    return f"PostgreSQL {version} at {where}"


def run_demo(
    url: str,
    *,
    jobs: int = 10_000,
    workers: int = 8,
    lease: timedelta = DEFAULT_LEASE,
    screen: Screen | None = None,
) -> DemoResult:
    """All three phases in one throwaway schema, dropped before this returns."""
    show = screen or Screen()
    server = describe_server(url)
    with demo_schema(url) as table:
        assert table.schema is not None
        show.start(server, table.schema, jobs, workers)
        with show.naive(jobs, workers) as progress:
            naive = run_naive(url, table, jobs=jobs, workers=workers, progress=progress)
        show.naive_done(naive)
        with show.skip_locked(jobs, workers) as progress:
            fixed = run_skip_locked(url, table, jobs=jobs, workers=workers, progress=progress)
        show.skip_locked_done(fixed)
        show.lease()
        story = run_lease(url, table, lease=lease, say=show.say)
        show.lease_done(story)
        result = DemoResult(table.schema, naive, fixed, story)
    show.finish(result)
    return result
