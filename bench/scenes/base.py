"""What the scenes share: a throwaway cluster, producers, workers, 10-second samples.

Every scene runs on a PostgreSQL 15 cluster of its own (initdb as the
`postgres` user, a free port, PostgreSQL's default settings: autovacuum on,
naptime 1 min), because the shared development server has autovacuum off.
The cluster is stopped and removed when the scene ends, whatever happens.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from sqla_jobq import jobs, statements
from sqla_jobq.db import conninfo
from tests.support.cluster import throwaway_cluster as throwaway_server

from .. import common

SAMPLE_SECONDS = 10.0


@dataclass(frozen=True)
class Cluster:
    port: int

    def url(self, database: str = "scene") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "scene") -> str:
        return conninfo(self.url(database))

    def connect(self, database: str = "scene") -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn(database), autocommit=True)

    def bench(self) -> common.Bench:
        """A `common.Bench` on the scene database, for `common.fill` and `common.outcome`."""
        return common.Bench("scene", self.url(), common.Sizes(), 1)

    def settings(self) -> dict[str, str]:
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', "
                "'autovacuum_naptime', 'autovacuum_vacuum_scale_factor', "
                "'autovacuum_vacuum_threshold', 'autovacuum_vacuum_insert_scale_factor', "
                "'autovacuum_vacuum_cost_limit', 'autovacuum_vacuum_cost_delay', "
                "'shared_buffers', 'synchronous_commit', 'max_connections')"
            ).fetchall()
            version = conn.execute("SHOW server_version").fetchone()
        out = {str(k): str(v) for k, v in rows}
        out["server_version"] = str(version[0]) if version else "?"
        return out


@contextmanager
def throwaway_cluster(settings: Sequence[str] = ()) -> Iterator[Cluster]:
    """A fresh PostgreSQL 15 cluster with default settings (but `settings`,
    `name=value` each), a migrated `scene` database."""
    with throwaway_server(settings=settings) as server:
        scene = Cluster(server.port)
        with scene.connect("postgres") as conn:
            conn.execute("CREATE DATABASE scene")
        subprocess.run(
            [*common.jobq_command(), "migrate", "--database-url", scene.url()],
            check=True,
            capture_output=True,
            cwd=common.REPO,
            env=common.child_env(),
        )
        yield scene


# --- workers ---------------------------------------------------------------------


def worker_cmd(url: str, concurrency: int, *extra: str, burst: bool = False) -> list[str]:
    cmd = [
        *common.jobq_command(),
        "worker",
        "bench.tasks:registry",
        "--database-url",
        url,
        "-c",
        str(concurrency),
        "--log-level",
        "WARNING",
        *extra,
    ]
    return cmd + (["--burst"] if burst else [])


@contextmanager
def workers(cmds: Sequence[Sequence[str]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Long-running workers, output read and dropped, SIGTERM (then SIGKILL) at the end."""
    procs = [
        subprocess.Popen(
            list(cmd),
            cwd=common.REPO,
            env=common.child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for cmd in cmds
    ]
    readers = [threading.Thread(target=_drop, args=(p,), daemon=True) for p in procs]
    for r in readers:
        r.start()
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(45)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _drop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for _ in iter(lambda: proc.stdout.read(65536), b""):  # type: ignore[union-attr]
        pass


def saturated_rate(
    cluster: Cluster, jobs_count: int, concurrency: int = 8, rounds: int = 3
) -> float:
    """Jobs/s of one burst worker draining `jobs_count` ready no-op jobs (server
    clock), the median of `rounds` drains: one drain of 20,000 jobs measured
    from 8,459 to 17,561 jobs/s in four runs of the same code on one day, and
    the offered load of a scene is half of it."""
    bench = cluster.bench()
    rates = []
    for _ in range(rounds):
        common.fill(bench, jobs_count)
        common.run_children([worker_cmd(cluster.url(), concurrency, burst=True)], timeout=600)
        o = common.outcome(bench)
        common.require_all_done(o, "saturation drain")
        rates.append(o.rate)
    with cluster.connect() as conn:
        conn.execute("TRUNCATE jobs, jobs_archive")
    return statistics.median(rates)


# --- producers -------------------------------------------------------------------


def _compiled_enqueue(count: int) -> tuple[str, dict[str, Any]]:
    from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

    rows = [statements.NewJob("noop", {}) for _ in range(count)]
    stmt = statements.enqueue_many(jobs, rows).compile(dialect=pg_psycopg.dialect())  # type: ignore[no-untyped-call]
    return stmt.string, dict(stmt.params)


class SteadyProducer(threading.Thread):
    """Offers `rate` no-op jobs a second in `ticks` small transactions a second.

    The schedule is absolute (tick k at start + k / ticks); a tick that comes
    late is sent at once, so a slow server delays jobs but does not lower the
    offered load. What was offered is read back from the rows' `created_at`.
    """

    def __init__(self, dsn: str, rate: float, ticks: int = 20) -> None:
        super().__init__(daemon=True)
        self.dsn, self.ticks = dsn, ticks
        self.per_tick = max(1, round(rate / ticks))
        self.rate = self.per_tick * ticks
        self.sent = 0
        self.late_ticks = 0
        self.stop = threading.Event()

    def run(self) -> None:
        sql, params = _compiled_enqueue(self.per_tick)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            start = time.monotonic()
            k = 0
            while not self.stop.is_set():
                conn.execute(sql, params)
                self.sent += self.per_tick
                k += 1
                wait = start + k / self.ticks - time.monotonic()
                if wait > 0:
                    self.stop.wait(wait)
                else:
                    self.late_ticks += 1


class TopUpProducer(threading.Thread):
    """Keeps about `ready` jobs queued: every 20 ms, tops the queue back up."""

    def __init__(self, dsn: str, ready: int, chunk: int = 1000) -> None:
        super().__init__(daemon=True)
        self.dsn, self.ready, self.chunk = dsn, ready, chunk
        self.sent = 0
        self.stop = threading.Event()

    def run(self) -> None:
        sql, params = _compiled_enqueue(self.chunk)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'queued'").fetchone()
                missing = self.ready - int(row[0]) if row else 0
                while missing >= self.chunk // 2 and not self.stop.is_set():
                    conn.execute(sql, params)
                    self.sent += self.chunk
                    missing -= self.chunk
                self.stop.wait(0.02)


# --- samples -----------------------------------------------------------------------


Ticks = tuple[int, int, int]  # busy, steal, all: see `machine_ticks`


@dataclass
class Sample:
    t: float  # seconds since the scene's clock started
    n_live_tup: int
    n_dead_tup: int
    table_bytes: int  # heap (main fork)
    index_bytes: int  # all indexes of the jobs table
    total_bytes: int  # heap + indexes + TOAST + FSM/VM
    autovacuums: int
    autoanalyzes: int
    queued: int
    indexes: dict[str, int]
    archive_bytes: int = 0  # heap + indexes + TOAST of jobs_archive
    archived: int = 0  # rows inserted into jobs_archive (statistics, about a second late)
    archive_autovacuums: int = 0  # autovacuums of jobs_archive (its inserts trigger them)
    wal_bytes: int = 0  # WAL written by the cluster so far (pg_stat_wal)
    wal_fpi: int = 0  # full-page images in it: a page's first change after a checkpoint
    checkpoints: int = 0  # checkpoints started so far, timed and requested
    heap_read: int = 0  # jobs heap blocks not found in shared_buffers (read from the OS)
    idx_read: int = 0  # the same for all of the jobs table's indexes
    backend_writes: int = 0  # dirty buffers a backend had to write out itself to reuse
    # `machine_ticks()` at this sample: whether a slow bucket had the cores to itself.
    machine: Ticks | None = None


def sample(conn: psycopg.Connection[Any], t: float) -> Sample:
    row = conn.execute(
        """
        SELECT j.n_live_tup, j.n_dead_tup, pg_relation_size(j.relid), pg_indexes_size(j.relid),
               pg_total_relation_size(j.relid), j.autovacuum_count, j.autoanalyze_count,
               (SELECT count(*) FROM jobs WHERE status = 'queued'),
               coalesce(pg_total_relation_size(to_regclass('jobs_archive')), 0),
               coalesce(a.n_tup_ins, 0), coalesce(a.autovacuum_count, 0),
               coalesce(io.heap_blks_read, 0), coalesce(io.idx_blks_read, 0)
        FROM pg_stat_user_tables j
        JOIN pg_statio_user_tables io ON io.relid = j.relid
        LEFT JOIN pg_stat_user_tables a ON a.relname = 'jobs_archive'
        WHERE j.relname = 'jobs'
        """
    ).fetchone()
    assert row is not None
    indexes = dict(
        conn.execute(
            "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes "
            "WHERE relname = 'jobs' ORDER BY indexrelname"
        ).fetchall()
    )
    live, dead, heap, idx, total, vac, an, queued, archive, archived, archive_vac = (
        int(v) for v in row[:11]
    )
    heap_read, idx_read = (int(v) for v in row[11:])
    wal = conn.execute(
        "SELECT w.wal_bytes, w.wal_fpi, b.checkpoints_timed + b.checkpoints_req, "
        "b.buffers_backend FROM pg_stat_wal w, pg_stat_bgwriter b"
    ).fetchone()
    assert wal is not None
    wal_bytes, wal_fpi, checkpoints, backend_writes = (int(v) for v in wal)
    return Sample(
        t,
        live,
        dead,
        heap,
        idx,
        total,
        vac,
        an,
        queued,
        {str(k): int(v) for k, v in indexes.items()},
        archive,
        archived,
        archive_vac,
        wal_bytes,
        wal_fpi,
        checkpoints,
        heap_read,
        idx_read,
        backend_writes,
        machine_ticks(),
    )


def machine_ticks() -> Ticks:
    """(busy, steal, all) ticks of every core since boot, from /proc/stat's first line."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal, sum(fields)


def machine_use(before: Ticks | None, after: Ticks | None) -> tuple[float, float]:
    """Between two readings of `machine_ticks`: the machine's busy cores, and
    the share of its time the hypervisor took (steal)."""
    if before is None or after is None or after[2] <= before[2]:
        return float("nan"), float("nan")  # the first bucket, or a missing sample
    ticks = after[2] - before[2]
    return (os.cpu_count() or 1) * (after[0] - before[0]) / ticks, (after[1] - before[1]) / ticks


def sample_ticks(row: dict[str, Any]) -> Ticks | None:
    """A sample's (as a dict, where JSON made the tuple a list) machine ticks."""
    ticks = row.get("machine")
    return None if ticks is None else (ticks[0], ticks[1], ticks[2])


class Sampler(threading.Thread):
    """`sample()` every `every` seconds on its own connection, from `t0` on."""

    def __init__(self, dsn: str, t0: float, every: float = SAMPLE_SECONDS) -> None:
        super().__init__(daemon=True)
        self.dsn, self.t0, self.every = dsn, t0, every
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        self.on_sample: Any = None

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            k = 1
            while not self.stop.wait(max(0.0, self.t0 + k * self.every - time.monotonic())):
                s = sample(conn, time.monotonic() - self.t0)
                self.samples.append(s)
                if self.on_sample:
                    self.on_sample(s)
                k += 1


def sample_at(samples: list[Sample], t: float) -> Sample | None:
    """The sample taken closest to `t` (within 3 s), e.g. at the end of a bucket."""
    best = min(samples, key=lambda s: abs(s.t - t), default=None)
    return best if best is not None and abs(best.t - t) <= 3 else None


def server_epoch(conn: psycopg.Connection[Any]) -> float:
    """The server's clock as a Unix time, to line `created_at` up with the scene's clock."""
    row = conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
    assert row is not None
    return float(row[0])


@dataclass
class Bucket:
    start: float  # seconds since the scene's clock started
    offered: int  # jobs created in the bucket
    completed: int  # jobs finished in the bucket
    # started_at - created_at of the jobs created in the bucket; a job not started
    # by the end of the scene counts as started at the end (a lower bound).
    pickup_p50_ms: float
    pickup_p99_ms: float
    unstarted: int  # jobs created in the bucket and not started by the end
    archived: int = 0  # jobs moved to the archive by batches that began in the bucket


# Over a set of jobs: how many, and their pickup latency's p50 and p99 in ms
# (a job not yet started counts as started at the scene's end, `%(end)s`).
_PICKUP_PERCENTILES = """count(*),
    1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(
        epoch FROM coalesce(started_at, to_timestamp(%(end)s)) - created_at)),
    1000 * percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(
        epoch FROM coalesce(started_at, to_timestamp(%(end)s)) - created_at))"""


def span_pickup(
    conn: psycopg.Connection[Any], epoch0: float, start: float, end: float, seconds: float
) -> dict[str, float]:
    """Pickup latency of every job created from `start` to `end` s of the scene's
    clock, as one set: its p99 is that of all those pickups, where a median
    or a maximum of 10 s buckets' p99s follows a few slow seconds."""
    row = conn.execute(
        "SELECT "
        + _PICKUP_PERCENTILES
        + " FROM "
        + common.with_archive("jobs", common.FINISHED_COLUMNS)
        + " WHERE created_at >= to_timestamp(%(s)s) AND created_at < to_timestamp(%(u)s)",
        {"s": epoch0 + start, "u": epoch0 + end, "end": epoch0 + seconds},
    ).fetchone()
    n, p50, p99 = row if row else (0, None, None)
    nan = float("nan")
    return {"jobs": int(n), "p50_ms": float(p50 or nan), "p99_ms": float(p99 or nan)}


def buckets(
    conn: psycopg.Connection[Any], epoch0: float, seconds: float, every: float = SAMPLE_SECONDS
) -> list[Bucket]:
    """Per bucket of `every` seconds of the scene's clock, read back from the rows."""
    made = {
        int(b): (int(n), float(p50 or 0), float(p99 or 0), int(u))
        for b, n, p50, p99, u in conn.execute(
            """
            SELECT floor((extract(epoch FROM created_at) - %(e)s) / %(w)s) AS b, """
            + _PICKUP_PERCENTILES
            + ", count(*) FILTER (WHERE started_at IS NULL) FROM "
            + common.with_archive("jobs", common.FINISHED_COLUMNS)
            + " WHERE created_at >= to_timestamp(%(e)s) GROUP BY 1",
            {"e": epoch0, "w": every, "end": epoch0 + seconds},
        ).fetchall()
    }
    finished = common.with_archive("jobs", common.FINISHED_COLUMNS)
    done = _count_per_bucket(conn, "finished_at", finished, epoch0, every)
    # archived_at is the moving batch's transaction start.
    archived = _count_per_bucket(conn, "archived_at", "jobs_archive", epoch0, every)
    out = []
    for b in range(int(seconds // every)):
        n, p50, p99, unstarted = made.get(b, (0, float("nan"), float("nan"), 0))
        out.append(
            Bucket(b * every, n, done.get(b, 0), p50, p99, unstarted, archived.get(b, 0))
        )
    return out


def _count_per_bucket(
    conn: psycopg.Connection[Any], column: str, source: str, epoch0: float, every: float
) -> dict[int, int]:
    """Rows of `source` per bucket of `every` seconds of `column` from `epoch0` on."""
    return {
        int(b): int(n)
        for b, n in conn.execute(
            f"SELECT floor((extract(epoch FROM {column}) - %(e)s) / %(w)s), count(*) "
            f"FROM {source} WHERE {column} >= to_timestamp(%(e)s) GROUP BY 1".encode(),
            {"e": epoch0, "w": every},
        ).fetchall()
    }


MB = 1024 * 1024


def mb(n: float) -> str:
    return f"{n / MB:.1f}"


# --- what the worker waits on ---------------------------------------------------------

WATCH_SECONDS = 0.5
# pg_stat_activity's wait events of a session flushing or writing WAL: a
# commit waiting for its fsync, or for another backend's write of it.
WAL_WAITS = {"WALSync", "WALWrite", "WALInitSync", "WALInitWrite", "WALInsert", "WALBufMapping"}


@dataclass
class Glimpse:
    t: float  # seconds since the scene's clock started
    cpu_s: float  # user + system seconds the worker processes have used so far
    waits: list[str]  # one per active worker session: "CPU", "WAL", or the wait event
    # Every server process seen: pid -> (its role, user + system seconds so far).
    server: dict[int, tuple[str, float]] = field(default_factory=dict)
    # Each VACUUM in progress (pg_stat_progress_vacuum): "table: phase (who)".
    vacuums: list[str] = field(default_factory=list)
    machine: Ticks | None = None  # `machine_ticks()` at this glimpse


class Watch(threading.Thread):
    """Every WATCH_SECONDS: what each active worker session waits on
    (`pg_stat_activity`), the worker processes' CPU time, and every server
    process's CPU time with the role of its session (`/proc`; the cluster is
    local), so a stall can be placed: the server's WAL flush, a lock, the
    worker itself, or a server process (autovacuum, the archiver, the scene's
    own sampling) taking the cores."""

    def __init__(self, dsn: str, t0: float, pids: Sequence[int]) -> None:
        super().__init__(daemon=True)
        self.dsn, self.t0, self.pids = dsn, t0, list(pids)
        self.glimpses: list[Glimpse] = []
        self.roles: dict[int, str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.wait(WATCH_SECONDS):
                rows = conn.execute(
                    "SELECT pid, backend_type, application_name, state, wait_event_type, "
                    "wait_event, left(query, 40) FROM pg_stat_activity"
                ).fetchall()
                waits = [
                    _wait_class(kind, event)
                    for _, _, app, state, kind, event, _ in rows
                    if (app or "").startswith("jobq worker") and state == "active"
                ]
                server = {}
                for pid, backend, app, _, _, _, query in rows:
                    self.roles[pid] = _role(self.roles.get(pid), backend, app, query)
                    cpu = common.proc_cpu(pid)
                    if cpu is not None:
                        server[pid] = (self.roles[pid], cpu)
                vacuums = [
                    f"{table}: {phase} ({'auto' if backend == 'autovacuum worker' else 'worker'})"
                    for table, phase, backend in conn.execute(VACUUM_PROGRESS).fetchall()
                ]
                t = time.monotonic() - self.t0
                cpu = sum(common.proc_cpu(pid) or 0.0 for pid in self.pids)
                self.glimpses.append(Glimpse(t, cpu, waits, server, vacuums, machine_ticks()))


VACUUM_PROGRESS = (
    "SELECT p.relid::regclass::text, p.phase, a.backend_type "
    "FROM pg_stat_progress_vacuum p JOIN pg_stat_activity a USING (pid)"
)


def _role(known: str | None, backend: str | None, app: str | None, query: str | None) -> str:
    """What a server process works for, from its process type or the first
    words of its session's statements (the claim connection also reads the
    dead-tuple count, and the listener's connection looks up the next due
    job between claims: a session keeps the first role it showed)."""
    if backend != "client backend":
        return backend or "other"
    if known not in (None, "scene", "worker other"):
        return known
    q = " ".join((query or "").split()).upper()
    if (app or "").startswith("jobq worker"):
        return next((role for role, words in WORKER_ROLES if q.startswith(words)), "worker other")
    return "producer" if q.startswith(("INSERT", "WITH INPUT")) else "scene"


# The first words of each worker session's statements (`statements.py`).
WORKER_ROLES = (
    ("claim", ("WITH NEXT", "SELECT MIN(")),
    ("finish", ("UPDATE", "WITH COMPLETED")),
    ("archiver", ("WITH MOVED", "DELETE")),
    ("worker vacuum", ("VACUUM",)),
    ("listen", ("LISTEN",)),
)


def _wait_class(kind: str | None, event: str | None) -> str:
    if event is None:
        return "CPU"
    return "WAL" if event in WAL_WAITS else f"{kind}:{event}"


def server_cores(glimpses: Sequence[Glimpse]) -> dict[str, float]:
    """Cores each role of server process used between the first and the last
    glimpse (a process that came or went in between counts for the glimpses
    it was in), the busiest first."""
    if len(glimpses) < 2 or glimpses[-1].t <= glimpses[0].t:
        return {}
    first: dict[int, float] = {}
    last: dict[int, tuple[str, float]] = {}
    for g in glimpses:
        for pid, (role, cpu) in g.server.items():
            first.setdefault(pid, cpu)
            last[pid] = (role, cpu)
    seconds = glimpses[-1].t - glimpses[0].t
    out: dict[str, float] = {}
    for pid, (role, cpu) in last.items():
        out[role] = out.get(role, 0.0) + (cpu - first[pid]) / seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def watch_summary(glimpses: Sequence[Glimpse], start: float, end: float) -> dict[str, Any]:
    """Between two times of the scene: the worker processes' CPU in cores,
    the share of active worker-session glimpses per wait class, and the
    server's cores per role."""
    inside = [g for g in glimpses if start <= g.t < end]
    if len(inside) < 2:
        return {"worker_cpu_cores": float("nan"), "waits": {}, "server_cores": {}, "vacuums": {}}
    first, last = inside[0], inside[-1]
    cores = (last.cpu_s - first.cpu_s) / (last.t - first.t) if last.t > first.t else float("nan")
    counts: dict[str, int] = {}
    for g in inside:
        for w in g.waits:
            counts[w] = counts.get(w, 0) + 1
    total = sum(counts.values()) or 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    return {
        "worker_cpu_cores": cores,
        "waits": {k: v / total for k, v in top},
        "server_cores": server_cores(inside),
        "vacuums": vacuum_shares(inside),
    }


def machine_between(glimpses: Sequence[Glimpse], start: float, end: float) -> dict[str, float]:
    """The machine's busy cores and steal share from the last glimpse at or
    before `start` to the first at or after `end`: whether a slow second had
    the cores to itself."""
    before = [g for g in glimpses if g.t <= start]
    after = [g for g in glimpses if g.t >= end]
    cores, steal = machine_use(
        before[-1].machine if before else None, after[0].machine if after else None
    )
    return {"machine_cores": cores, "steal": steal}


def vacuum_shares(glimpses: Sequence[Glimpse]) -> dict[str, float]:
    """The share of glimpses in which each table's VACUUM was in each phase:
    which vacuum, doing what, overlapped a stretch of the scene."""
    counts: dict[str, int] = {}
    for g in glimpses:
        for v in g.vacuums:
            counts[v] = counts.get(v, 0) + 1
    return {k: n / len(glimpses) for k, n in sorted(counts.items(), key=lambda kv: -kv[1])}
