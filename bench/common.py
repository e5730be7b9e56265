"""What every benchmark shares: the scratch database, the queue table, the
worker subprocess, /proc readers and the statistics.

Nothing here is a test: these are measuring scripts. Every figure is taken
against a baseline measured in the same run, rounds interleaved, because the
machine is shared and absolute numbers drift.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names

REPO = Path(__file__).resolve().parent.parent
SERVER_URL = os.environ.get(
    "JOBQ_BENCH_SERVER_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Sizes:
    """Problem sizes; `--quick` shrinks them all."""

    throughput_jobs: int = 20_000
    latency_jobs: int = 200
    latency_gap: float = 0.015
    enqueue_jobs: int = 100_000
    single_enqueues: int = 300
    history_rows: int = 1_000_000
    history_cycles: int = 400
    footprint_jobs: int = 100_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            throughput_jobs=3_000,
            latency_jobs=40,
            latency_gap=0.01,
            enqueue_jobs=10_000,
            single_enqueues=50,
            history_rows=50_000,
            history_cycles=100,
            footprint_jobs=5_000,
        )


@dataclass
class Bench:
    """The scratch database one `python -m bench` run works in."""

    name: str
    url: str
    sizes: Sizes
    rounds: int
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        return conninfo(self.url)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)


@contextmanager
def scratch_database(sizes: Sizes, rounds: int) -> Iterator[Bench]:
    name = f"jobq_bench_{os.getpid()}"
    admin = conninfo(SERVER_URL)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = parse_url(SERVER_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield Bench(name, url, sizes, rounds)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def create_table(bench: Bench, name: str = "jobs") -> None:
    names = Names(name, None)
    with bench.connect() as conn:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (names.qualified,)).fetchone()
        if exists and exists[0]:
            for sql in down_statements(names, LATEST, 0):
                conn.execute(sql.encode())
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())


def drop_table(bench: Bench, name: str) -> None:
    with bench.connect() as conn:
        for sql in down_statements(Names(name, None), LATEST, 0):
            conn.execute(sql.encode())


def fill(bench: Bench, count: int, *, task: str = "noop", table: str = "jobs") -> None:
    """A fresh queue: TRUNCATE, `count` ready no-op jobs, VACUUM ANALYZE, CHECKPOINT.

    Every contender starts from exactly this state (the CHECKPOINT too: after
    one, the first change to each page writes the whole page to the WAL, and a
    checkpoint falling inside one contender's run would cost it alone).
    """
    with bench.connect() as conn:
        conn.execute(f"TRUNCATE {table}")
        conn.execute(
            f"INSERT INTO {table} (task, payload, run_at) "
            "SELECT %s, '{}'::jsonb, now() - interval '1 second' FROM generate_series(1, %s)",
            (task, count),
        )
        conn.execute(f"VACUUM ANALYZE {table}")
        conn.execute("CHECKPOINT")


@dataclass(frozen=True)
class Outcome:
    """What the database says about one drain of the queue."""

    total: int
    done_once: int
    seconds: float  # min(started_at) .. max(finished_at)

    @property
    def rate(self) -> float:
        return self.done_once / self.seconds if self.seconds > 0 else 0.0


def outcome(bench: Bench, table: str = "jobs") -> Outcome:
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'done' AND attempts = 1), "
            f"extract(epoch FROM max(finished_at) - min(started_at)) FROM {table}"
        ).fetchone()
    assert row is not None
    return Outcome(int(row[0]), int(row[1]), float(row[2] or 0.0))


def require_all_done(o: Outcome, what: str) -> None:
    if o.done_once != o.total:
        raise RuntimeError(
            f"{what}: only {o.done_once} of {o.total} jobs are done with attempts = 1"
        )


def jobq_command() -> list[str]:
    """`jobq` from this interpreter's environment."""
    script = Path(sys.executable).parent / "jobq"
    if script.exists():
        return [str(script)]
    found = shutil.which("jobq")
    if found:
        return [found]
    return [sys.executable, "-c", "from sqla_jobq.cli import main; main()"]


def worker_command(
    bench: Bench,
    *,
    concurrency: int,
    burst: bool,
    log_level: str = "WARNING",
    extra: Sequence[str] = (),
) -> list[str]:
    cmd = [
        *jobq_command(),
        "worker",
        "bench.tasks:registry",
        "--database-url",
        bench.url,
        "-c",
        str(concurrency),
        "--log-level",
        log_level,
        *extra,
    ]
    if burst:
        cmd.append("--burst")
    return cmd


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@dataclass(frozen=True)
class Finished:
    code: int
    wall: float
    cpu: float  # user + system seconds of the child
    stderr: str


def run_children(cmds: Sequence[Sequence[str]], *, timeout: float = 300.0) -> list[Finished]:
    """Start all commands at once, wait for all, with each child's CPU time."""
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            list(cmd),
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd in cmds
    ]
    errs: dict[int, list[str]] = {p.pid: [] for p in procs}
    readers = [threading.Thread(target=_drain, args=(p, errs[p.pid]), daemon=True) for p in procs]
    for r in readers:
        r.start()
    done: list[Finished] = []
    deadline = started + timeout
    for proc in procs:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                raise RuntimeError(f"{' '.join(cmds[0][:3])}... did not finish in {timeout}s")
            time.sleep(0.005)
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.append(
            Finished(
                proc.returncode,
                time.perf_counter() - started,
                usage.ru_utime + usage.ru_stime,
                "",
            )
        )
    for r in readers:
        r.join(timeout=5)
    result = [
        Finished(f.code, f.wall, f.cpu, "".join(errs[p.pid]))
        for f, p in zip(done, procs, strict=True)
    ]
    for f, cmd in zip(result, cmds, strict=True):
        if f.code != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} exited {f.code}:\n{f.stderr[-3000:]}")
    return result


def _drain(proc: subprocess.Popen[str], sink: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        sink.append(line)


# --- /proc -----------------------------------------------------------------


def proc_cpu(pid: int) -> float | None:
    """utime + stime of a process in seconds, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status(pid: int, key: str) -> int | None:
    """A `VmRSS`-style line of /proc/<pid>/status, in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def backends_of(database: str) -> list[int]:
    """Pids of the postgres backends serving `database` (from their process titles)."""
    needle = f" {database} ".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        if title.startswith(b"postgres: ") and needle in title:
            pids.append(int(entry))
    return pids


class BackendCPU:
    """CPU seconds spent by the backends of one database during a window.

    A sampler thread re-reads /proc every `interval`, remembering each
    backend's last value, so backends that come and go are counted up to their
    last sample (an error of at most one interval per backend). Our own
    connections (`exclude`) are left out.
    """

    def __init__(self, database: str, exclude: Sequence[int] = (), interval: float = 0.05):
        self.database = database
        self.exclude = set(exclude)
        self.interval = interval
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BackendCPU:
        self._sample(initial=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self, *, initial: bool = False) -> None:
        for pid in backends_of(self.database):
            if pid in self.exclude:
                continue
            cpu = proc_cpu(pid)
            if cpu is None:
                continue
            if initial:
                # Existing backends count from here; later ones from their birth.
                self.first[pid] = cpu
            self.last[pid] = cpu

    @property
    def seconds(self) -> float:
        return sum(self.last[p] - self.first.get(p, 0.0) for p in self.last)


def own_backend_pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


# --- statistics --------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def dump_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
