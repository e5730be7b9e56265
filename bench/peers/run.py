"""sqla_jobq against procrastinate and pgqueuer: the same scenarios, the same run.

    python -m bench.peers                 # about 5 minutes here; rewrites the table
                                          # in docs/benchmarks.md and README.md
    python -m bench.peers --quick         # smoke run, small sizes, docs untouched
    python -m bench.peers --rounds 3 --no-docs --json /tmp/peers.json

Each peer is installed from PyPI, by name and pinned version, into a
virtualenv of its own under `JOBQ_PEERS_HOME` (default
~/.cache/sqla_jobq-bench/peers), created on the first run and reused while its
requirements are unchanged. Each system gets its own scratch database on the
local server (`JOBQ_BENCH_SERVER_URL`), dropped at the end.

Scenarios, rounds interleaved (round 1 of every system, then round 2, ...),
every ratio the median of the per-round ratios:

* **bulk enqueue**: 10,000 jobs `{"n": i}` in one call of each library's bulk
  API (ours `registry.enqueue_many` in one transaction, pgqueuer
  `Queries.enqueue` with lists, procrastinate `batch_defer_async`), timed from
  the call to the commit's return; baseline: psycopg `COPY` into our table.
* **drain**: 20,000 ready no-op jobs (each library's own enqueue for the
  peers, the same rows by SQL for us; then `VACUUM ANALYZE` and `CHECKPOINT`,
  as autovacuum is off on the shared server), drained by each system's default
  worker. The rate comes from the server: jobs / (last completion - first
  claim). Exactly-once is checked on the server: ours every row `done` with
  `attempts = 1` (one claim); pgqueuer one `picked` and one `successful` row in
  `pgqueuer_log` per job and the queue table empty; procrastinate every job
  `succeeded` with exactly one `started` event.
* **pickup**: an idle worker of each system with its default settings; 200
  jobs committed one at a time, 20 ms apart, each through the library's
  enqueue inside a transaction; time.time() just before COMMIT against the
  handler's first act. Baselines, same round: raw LISTEN/NOTIFY, and raw plus
  one claim round trip (bench/suite/latency.py).

Workers: ours `jobq worker bench.tasks:registry -c 8 --burst` at its default
log level (INFO) and at `--log-level WARNING`; pgqueuer `pgq run
pgqueuer_app:factory --mode drain` (one QueueManager on one asyncpg
connection, batch 10, log level INFO); procrastinate `procrastinate worker
--one-shot` (concurrency 1). Output of every worker goes to a pipe that is read.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from sqla_jobq.db import conninfo, parse_url

from .. import common
from ..common import BackendCPU, Bench
from ..suite import latency

HERE = Path(__file__).resolve().parent
DOCS = common.REPO / "docs" / "benchmarks.md"
README = common.REPO / "README.md"
BEGIN, END = "<!-- bench.peers:begin -->", "<!-- bench.peers:end -->"
PEERS_HOME = Path(os.environ.get("JOBQ_PEERS_HOME", "~/.cache/sqla_jobq-bench/peers")).expanduser()


@dataclass(frozen=True)
class Sizes:
    bulk: int = 10_000
    drain: int = 20_000
    pickup: int = 200
    gap: float = 0.02

    @classmethod
    def quick(cls) -> Sizes:
        return cls(bulk=2_000, drain=2_000, pickup=30, gap=0.01)


# --- the peers' virtualenvs --------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    version: str
    # Pinned. pgqueuer 1.6.0's `pgq run` fails at its default --log-level with
    # typer 0.29 (the option reaches its logging setup as a str: "'str' object
    # has no attribute 'name'"), so typer is pinned to a release it works with.
    requirements: tuple[str, ...]
    app: str

    @property
    def venv(self) -> Path:
        return PEERS_HOME / f"{self.name}-{self.version}"

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def ensure(self, log: Callable[[str], None]) -> dict[str, str]:
        """Create the virtualenv if missing or its pins changed; the installed versions."""
        marker = self.venv / "bench-requirements.txt"
        wanted = "\n".join(self.requirements) + "\n"
        if not (marker.exists() and marker.read_text() == wanted):
            log(f"  installing {' '.join(self.requirements)} into {self.venv}")
            shutil.rmtree(self.venv, ignore_errors=True)
            self.venv.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([_base_python(), "-m", "venv", str(self.venv)], check=True)
            pip = subprocess.run(
                [
                    self.bin("python"),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    *self.requirements,
                ],
                capture_output=True,
                text=True,
            )
            if pip.returncode != 0:
                raise RuntimeError(f"pip install into {self.venv} failed:\n{pip.stderr[-3000:]}")
            marker.write_text(wanted)
        frozen = subprocess.run(
            [self.bin("python"), "-m", "pip", "freeze", "--disable-pip-version-check"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return dict(line.split("==", 1) for line in frozen.splitlines() if "==" in line)


def _base_python() -> str:
    """The interpreter this venv was made from (peers get the same Python)."""
    base = getattr(sys, "_base_executable", None)
    return base if base and Path(base).exists() else sys.executable


PGQUEUER = Peer(
    "pgqueuer",
    "1.6.0",
    ("pgqueuer[asyncpg]==1.6.0", "asyncpg==0.32.0", "typer==0.16.0"),
    "pgqueuer_app.py",
)
PROCRASTINATE = Peer(
    "procrastinate",
    "3.10.0",
    ("procrastinate==3.10.0", "psycopg[binary,pool]==3.3.9"),
    "procrastinate_app.py",
)


# --- processes ---------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    wall: float
    cpu: float
    lines: int


def run_child(cmd: Sequence[str], env: dict[str, str], cwd: Path, timeout: float) -> Ran:
    """Run to the end; stdout and stderr read from pipes; wall, CPU, lines written."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    out: list[bytes] = []
    readers = [
        threading.Thread(target=_read, args=(stream, out), daemon=True)
        for stream in (proc.stdout, proc.stderr)
    ]
    for r in readers:
        r.start()
    deadline = started + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{' '.join(cmd[:4])} did not finish in {timeout:.0f}s")
        time.sleep(0.005)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    for r in readers:
        r.join(timeout=10)
    text = b"".join(out)
    if proc.returncode != 0:
        tail = text[-3000:].decode(errors="replace")
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {proc.returncode}:\n{tail}")
    return Ran(wall, usage.ru_utime + usage.ru_stime, text.count(b"\n"))


def _read(stream: Any, sink: list[bytes]) -> None:
    for chunk in iter(lambda: stream.read(65536), b""):
        sink.append(chunk)


@contextmanager
def background(cmd: Sequence[str], env: dict[str, str], cwd: Path) -> Iterator[None]:
    """A long-running worker whose output is read and dropped; SIGTERM at the end."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    sink: list[bytes] = []
    reader = threading.Thread(target=_read, args=(proc.stdout, sink), daemon=True)
    reader.start()
    try:
        yield
        if proc.poll() is not None:
            tail = b"".join(sink)[-2000:].decode(errors="replace")
            raise RuntimeError(f"{' '.join(cmd[:3])} exited early ({proc.returncode}):\n{tail}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)


# --- the three systems ------------------------------------------------------------


class System:
    """One queue library in its own scratch database."""

    key: str
    label: str

    def __init__(self, bench: Bench) -> None:
        self.bench = bench

    @property
    def dsn(self) -> str:
        return self.bench.dsn

    def sql(self, *statements: str) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = []
        with self.bench.connect() as conn:
            for statement in statements:
                cur = conn.execute(statement.encode())
                rows = cur.fetchall() if cur.description else []
        return rows

    def settle(self) -> None:
        self.sql(*(f"VACUUM ANALYZE {t}" for t in self.tables), "CHECKPOINT")

    tables: tuple[str, ...] = ()

    def setup(self) -> None: ...
    def reset(self) -> None: ...
    def fill(self, n: int) -> None: ...
    def bulk(self, n: int) -> float: ...
    def drain_cmd(self, variant: str) -> list[str]: ...
    def drained(self, n: int) -> tuple[float, str]: ...
    def idle_worker(self, stamps: Path) -> Any: ...
    def producer(self) -> Any: ...  # a context manager yielding one(seq) -> (before, after)


class Ours(System):
    key, label = "sqla_jobq", "sqla_jobq"
    tables = ("jobs",)

    def env(self, **extra: str) -> dict[str, str]:
        return common.child_env(**extra)

    def setup(self) -> None:
        common.create_table(self.bench)
        common.create_table(self.bench, latency.FLOOR_TABLE)

    def reset(self) -> None:
        self.sql("TRUNCATE jobs")

    def fill(self, n: int) -> None:
        common.fill(self.bench, n)  # TRUNCATE, n ready no-op rows, VACUUM ANALYZE, CHECKPOINT

    def bulk(self, n: int) -> float:
        from bench.tasks import registry

        calls = [{"n": i} for i in range(n)]
        engine = create_engine(self.bench.url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
                conn.commit()
                started = time.perf_counter()
                with conn.begin():
                    ids = registry.enqueue_many(conn, "echo", calls)
                elapsed = time.perf_counter() - started
        finally:
            engine.dispose()
        if len(ids) != n:
            raise RuntimeError(f"enqueue_many returned {len(ids)} ids for {n}")
        return elapsed

    def copy(self, n: int) -> float:
        from sqla_jobq.statements import NewJob

        from ..suite import enqueue

        rows = [NewJob(task="echo", payload={"n": i}) for i in range(n)]
        return n / enqueue._copy(self.bench, rows)

    def drain_cmd(self, variant: str) -> list[str]:
        cmd = [
            *common.jobq_command(),
            "worker",
            "bench.tasks:registry",
            "--database-url",
            self.bench.url,
            "-c",
            "8",
            "--burst",
        ]
        return cmd + (["--log-level", "WARNING"] if variant == "WARNING" else [])

    def drained(self, n: int) -> tuple[float, str]:
        o = common.outcome(self.bench)
        if o.total != n or o.done_once != n:
            raise RuntimeError(f"sqla_jobq: {o.done_once} of {o.total} done once (want {n})")
        return o.seconds, f"{n:,} rows done, attempts = 1"

    def idle_worker(self, stamps: Path) -> Any:
        cmd = [
            *common.jobq_command(),
            "worker",
            "bench.tasks:registry",
            "--database-url",
            self.bench.url,
            "-c",
            "8",
        ]
        return background(cmd, self.env(JOBQ_BENCH_STAMPS=str(stamps)), common.REPO)

    @contextmanager
    def producer(self) -> Iterator[Callable[[int], tuple[float, float]]]:
        """`stamp.enqueue` in a transaction; time.time() before COMMIT and after it."""
        from bench.tasks import stamp

        engine = create_engine(self.bench.url, poolclass=NullPool)
        try:
            with engine.connect() as conn:

                def one(seq: int) -> tuple[float, float]:
                    trans = conn.begin()
                    stamp.enqueue(conn, seq=seq)
                    before = time.time()
                    trans.commit()
                    return before, time.time()

                yield one
        finally:
            engine.dispose()


class PeerSystem(System):
    peer: Peer

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBQ_", "PYTHON"))}
        env.pop("VIRTUAL_ENV", None)
        env.update(BENCH_DSN=self.dsn, PYTHONPATH=str(HERE), **extra)
        return env

    def app(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            [self.peer.bin("python"), str(HERE / self.peer.app), *args],
            cwd=HERE,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{self.peer.app} {args[0]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def bulk(self, n: int) -> float:
        return float(json.loads(self.app("bulk", str(n)).splitlines()[-1])["seconds"])

    def fill(self, n: int) -> None:
        self.reset()
        self.app("fill", str(n))
        self.settle()

    @contextmanager
    def producer(self) -> Iterator[Callable[[int], tuple[float, float]]]:
        """The app's `serve` loop: one seq a line in, "seq before after" back."""
        proc = subprocess.Popen(
            [self.peer.bin("python"), str(HERE / self.peer.app), "serve"],
            cwd=HERE,
            env=self.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert proc.stdin is not None and proc.stdout is not None
        stdin, stdout = proc.stdin, proc.stdout

        def one(seq: int) -> tuple[float, float]:
            stdin.write(f"{seq}\n")
            stdin.flush()
            got, before, after = stdout.readline().split()
            if int(got) != seq:
                raise RuntimeError(f"{self.key} producer answered {got} for {seq}")
            return float(before), float(after)

        try:
            yield one
        finally:
            stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class PgQueuer(PeerSystem):
    key, label, peer = "pgqueuer", "pgqueuer", PGQUEUER
    tables = ("pgqueuer", "pgqueuer_log")

    def setup(self) -> None:
        subprocess.run(
            [self.peer.bin("pgq"), "--pg-dsn", self.dsn, "install"],
            check=True,
            env=self.env(),
            cwd=HERE,
            capture_output=True,
        )

    def reset(self) -> None:
        self.sql("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")

    def drain_cmd(self, variant: str) -> list[str]:
        return [self.peer.bin("pgq"), "run", "pgqueuer_app:factory", "--mode", "drain"]

    def drained(self, n: int) -> tuple[float, str]:
        ((left, picks, picked, done, succeeded, seconds),) = self.sql(
            """SELECT (SELECT count(*) FROM pgqueuer),
                 count(*) FILTER (WHERE status = 'picked'),
                 count(DISTINCT job_id) FILTER (WHERE status = 'picked'),
                 count(*) FILTER (WHERE status = 'successful'),
                 count(DISTINCT job_id) FILTER (WHERE status = 'successful'),
                 extract(epoch FROM max(created) FILTER (WHERE status = 'successful')
                                  - min(created) FILTER (WHERE status = 'picked'))
               FROM pgqueuer_log"""
        )
        if left or not picks == picked == done == succeeded == n:
            raise RuntimeError(
                f"pgqueuer: {left} left, {picks} picks of {picked} jobs, "
                f"{done} successes of {succeeded} jobs (want {n})"
            )
        return float(seconds), f"{n:,} jobs picked once and successful once"

    def idle_worker(self, stamps: Path) -> Any:
        return background(
            [self.peer.bin("pgq"), "run", "pgqueuer_app:factory"],
            self.env(BENCH_STAMPS=str(stamps)),
            HERE,
        )


class Procrastinate(PeerSystem):
    key, label, peer = "procrastinate", "procrastinate", PROCRASTINATE
    tables = ("procrastinate_jobs", "procrastinate_events")

    def worker(self, *extra: str) -> list[str]:
        return [self.peer.bin("procrastinate"), "--app=procrastinate_app.app", "worker", *extra]

    def setup(self) -> None:
        subprocess.run(
            [self.peer.bin("procrastinate"), "--app=procrastinate_app.app", "schema", "--apply"],
            check=True,
            env=self.env(),
            cwd=HERE,
            capture_output=True,
        )

    def reset(self) -> None:
        self.sql("TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers")

    def drain_cmd(self, variant: str) -> list[str]:
        return self.worker("--one-shot")

    def drained(self, n: int) -> tuple[float, str]:
        ((jobs, succeeded, starts, started, seconds),) = self.sql(
            """SELECT (SELECT count(*) FROM procrastinate_jobs),
                 (SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'),
                 count(*) FILTER (WHERE type = 'started'),
                 count(DISTINCT job_id) FILTER (WHERE type = 'started'),
                 extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')
                                  - min(at) FILTER (WHERE type = 'started'))
               FROM procrastinate_events"""
        )
        if not jobs == succeeded == starts == started == n:
            raise RuntimeError(
                f"procrastinate: {succeeded} of {jobs} succeeded, {starts} "
                f"starts of {started} jobs (want {n})"
            )
        return float(seconds), f"{n:,} jobs succeeded, one started event each"

    def idle_worker(self, stamps: Path) -> Any:
        return background(self.worker(), self.env(BENCH_STAMPS=str(stamps)), HERE)


# --- scratch databases ---------------------------------------------------------


@contextmanager
def scratch(names: Sequence[str]) -> Iterator[dict[str, Bench]]:
    admin = conninfo(common.SERVER_URL)
    prefix = f"jobq_peers_{os.getpid()}"
    benches: dict[str, Bench] = {}
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names:
            db = f"{prefix}_{name}"
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'.encode())
            conn.execute(f'CREATE DATABASE "{db}"'.encode())
            url = parse_url(common.SERVER_URL).set(database=db)
            benches[name] = Bench(db, url.render_as_string(hide_password=False), common.Sizes(), 1)
    try:
        yield benches
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            for bench in benches.values():
                conn.execute(f'DROP DATABASE IF EXISTS "{bench.name}" WITH (FORCE)'.encode())


# --- scenarios -----------------------------------------------------------------


def run_bulk(
    systems: dict[str, System], sizes: Sizes, rounds: int, log: Callable[[str], None]
) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"COPY": [], **{k: [] for k in systems}}
    ours = systems["sqla_jobq"]
    assert isinstance(ours, Ours)
    for r in range(rounds + 1):  # round 0 is an untimed warm-up
        got: dict[str, float] = {}
        for key, system in systems.items():
            system.reset()
            system.settle()
            got[key] = sizes.bulk / system.bulk(sizes.bulk)
            if key == "sqla_jobq":
                ours.reset()
                ours.settle()
                got["COPY"] = sizes.bulk / ours.copy(sizes.bulk)
            system.reset()
        if r:
            for key, value in got.items():
                rates[key].append(value)
            log(f"  bulk round {r}: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in got.items()))
    return rates


DRAINS = (("sqla_jobq", "INFO"), ("sqla_jobq", "WARNING"), ("pgqueuer", ""), ("procrastinate", ""))


def run_drain(
    systems: dict[str, System], sizes: Sizes, rounds: int, log: Callable[[str], None]
) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {}
    for r in range(rounds):
        for key, variant in DRAINS:
            system = systems[key]
            name = f"{key} {variant}".strip()
            system.fill(sizes.drain)
            cwd = common.REPO if key == "sqla_jobq" else HERE
            with BackendCPU(system.bench.name) as pg:
                ran = run_child(system.drain_cmd(variant), system.env(), cwd, timeout=400)
            seconds, proof = system.drained(sizes.drain)
            sample = {
                "jobs_per_s": sizes.drain / seconds,
                "wall_s": ran.wall,
                "client_cpu_s_per_10k": ran.cpu / sizes.drain * 10_000,
                "pg_cpu_s_per_10k": pg.seconds / sizes.drain * 10_000,
                "output_lines": ran.lines,
            }
            out.setdefault(name, []).append(sample)
            log(
                f"  drain round {r + 1} {name:<18} {sample['jobs_per_s']:>8,.0f} jobs/s  "
                f"client {sample['client_cpu_s_per_10k']:.2f} s/10k  pg "
                f"{sample['pg_cpu_s_per_10k']:.2f} s/10k  {ran.lines:,} lines  ({proof})"
            )
            system.reset()
    return out


def _stamps(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            seq, at = line.split()
            out[int(seq)] = float(at)
    return out


def _picked(stamps: Path, sent: dict[int, float], what: str) -> dict[int, float]:
    """ms from COMMIT sent to the handler's stamp, per seq, once every stamp is in."""
    deadline = time.monotonic() + 15
    while True:
        got = _stamps(stamps)
        if all(s in got for s in sent):
            return {s: (got[s] - sent[s]) * 1000 for s in sent}
        if time.monotonic() > deadline:
            missing = len([s for s in sent if s not in got])
            raise RuntimeError(f"{what}: {missing} of {len(sent)} jobs never started")
        time.sleep(0.05)


def run_pickup(
    systems: dict[str, System], sizes: Sizes, rounds: int, log: Callable[[str], None]
) -> dict[str, list[list[float]]]:
    """Jobs interleaved one by one: raw, ours, pgqueuer, procrastinate, raw, ...

    The order rotates with every job, and a job of one system is `gap /
    4` after the previous one of another, `gap` after its own previous one, so
    a change in the machine's load falls on all of them alike.
    """
    out: dict[str, list[list[float]]] = {"raw": [], "raw + claim": [], **{k: [] for k in systems}}
    ours = systems["sqla_jobq"]
    order = ["raw", *systems]
    pause = sizes.gap / len(order)
    with tempfile.TemporaryDirectory(prefix="jobq-peers-") as tmp, ExitStack() as stack:
        stamps = {k: Path(tmp) / f"{k}.stamps" for k in systems}
        for system in systems.values():
            system.reset()
            system.settle()
        for key, system in systems.items():
            stack.enter_context(system.idle_worker(stamps[key]))
        one = {k: stack.enter_context(s.producer()) for k, s in systems.items()}
        raw_one, raw_received, raw_claimed = stack.enter_context(latency.raw_floor(ours.bench))
        one["raw"] = raw_one
        for key in systems:  # each worker is up: a job it ran, then a warm-up
            deadline = time.monotonic() + 60
            while True:
                try:
                    _picked(stamps[key], {-1: one[key](-1)[0]}, key)
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
        first = -1_000
        for r in range(rounds + 1):  # round 0: 20 jobs each, untimed
            count = 20 if r == 0 else sizes.pickup
            sent: dict[str, dict[int, float]] = {k: {} for k in order}
            for i in range(count):
                seq = first + i
                turn = order[i % len(order) :] + order[: i % len(order)]
                for key in turn:
                    sent[key][seq] = one[key](seq)[0]
                    time.sleep(pause)
            got = {k: _picked(stamps[k], sent[k], k) for k in systems}
            deadline = time.monotonic() + 15
            while not all(s in raw_claimed for s in sent["raw"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("raw: some notifications never arrived")
                time.sleep(0.05)
            first = r * sizes.pickup
            if r == 0:
                continue
            out["raw"].append([(raw_received[s] - t) * 1000 for s, t in sent["raw"].items()])
            out["raw + claim"].append([(raw_claimed[s] - t) * 1000 for s, t in sent["raw"].items()])
            for key in systems:
                out[key].append(list(got[key].values()))
            log(
                f"  pickup round {r} p50/p99 ms: "
                + ", ".join(
                    f"{k} {_med(out[k][-1]):.2f}/{common.percentile(out[k][-1], 99):.2f}"
                    for k in out
                )
            )
    return out


# --- the report ------------------------------------------------------------------


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _per_round(a: Sequence[float], b: Sequence[float]) -> float:
    return _med([x / y for x, y in zip(a, b, strict=True) if y])


def _n(v: float, unit: str = "") -> str:
    if v != v:
        return "-"
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return text + unit


def _x(v: float) -> str:
    return "-" if v != v else f"{v:.2f}x"


@dataclass
class Report:
    meta: dict[str, Any]
    bulk: dict[str, list[float]] = field(default_factory=dict)
    drain: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    pickup: dict[str, list[list[float]]] = field(default_factory=dict)

    def rate(self, name: str) -> list[float]:
        return [s["jobs_per_s"] for s in self.drain[name]]

    def figures(self) -> dict[str, float]:
        f: dict[str, float] = {}
        if self.bulk:
            f["bulk ours / COPY"] = _per_round(self.bulk["sqla_jobq"], self.bulk["COPY"])
            for p in ("pgqueuer", "procrastinate"):
                f[f"bulk ours / {p}"] = _per_round(self.bulk["sqla_jobq"], self.bulk[p])
        if self.drain:
            info, warn = self.rate("sqla_jobq INFO"), self.rate("sqla_jobq WARNING")
            f["drain INFO / WARNING"] = _per_round(info, warn)
            for p in ("pgqueuer", "procrastinate"):
                f[f"drain INFO / {p}"] = _per_round(info, self.rate(p))
                f[f"drain WARNING / {p}"] = _per_round(warn, self.rate(p))
        if self.pickup:
            p50 = {k: [_med(r) for r in v] for k, v in self.pickup.items()}
            f["pickup p50 ours / raw + claim"] = _per_round(p50["sqla_jobq"], p50["raw + claim"])
            f["pickup p50 ours / raw"] = _per_round(p50["sqla_jobq"], p50["raw"])
            for p in ("pgqueuer", "procrastinate"):
                f[f"pickup p50 ours / {p}"] = _per_round(p50["sqla_jobq"], p50[p])
        return f

    def markdown(self) -> str:
        m = self.meta
        v = m["versions"]
        fig = self.figures()
        lines = [
            f"Command: `{m['command']}` ({m['rounds']} rounds, interleaved), run {m['date']}, "
            f"{m['elapsed_s']:.0f} s. Machine: {m['nproc']} cores ({m['cpu_model']}), "
            f"PostgreSQL {m['postgresql']} on 127.0.0.1 (autovacuum {m['autovacuum']}), "
            f"load average {m['load_start']:.1f} at the start and {m['load_end']:.1f} at "
            f"the end.",
            "",
            f"Versions: sqla_jobq {v['sqla_jobq']}; pgqueuer {v['pgqueuer']} (asyncpg "
            f"{v['asyncpg']}, uvloop {v['uvloop']}); procrastinate {v['procrastinate']} "
            f"(psycopg {v['procrastinate psycopg']}); Python {m['python']}.",
            "",
            "Each cell is the median over the rounds; each ratio is the median of the "
            "per-round ratios (ours / peer: above 1 is better for rates, below 1 for "
            "latencies).",
            "",
            "| scenario | sqla_jobq | pgqueuer | procrastinate | ours / pgqueuer "
            "| ours / procrastinate | baseline (same run) | ours / baseline |",
            "|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        if self.bulk:
            b = {k: _med(x) for k, x in self.bulk.items()}
            lines.append(
                f"| bulk enqueue of {m['sizes']['bulk']:,} jobs in one call, jobs/s "
                f"| {_n(b['sqla_jobq'])} | {_n(b['pgqueuer'])} | {_n(b['procrastinate'])} "
                f"| {_x(fig['bulk ours / pgqueuer'])} | {_x(fig['bulk ours / procrastinate'])} "
                f"| psycopg COPY into our table: {_n(b['COPY'])} "
                f"| {_x(fig['bulk ours / COPY'])} |"
            )
        if self.drain:
            d = {k: _med(self.rate(k)) for k in self.drain}
            cpu = {k: _med([s["pg_cpu_s_per_10k"] for s in x]) for k, x in self.drain.items()}
            ccpu = {k: _med([s["client_cpu_s_per_10k"] for s in x]) for k, x in self.drain.items()}
            n = m["sizes"]["drain"]
            lines.append(
                f"| drain {n:,} no-op jobs, default worker, jobs/s "
                f"| {_n(d['sqla_jobq INFO'])} | {_n(d['pgqueuer'])} | {_n(d['procrastinate'])} "
                f"| {_x(fig['drain INFO / pgqueuer'])} "
                f"| {_x(fig['drain INFO / procrastinate'])} "
                f"| ours at `--log-level WARNING`: {_n(d['sqla_jobq WARNING'])} "
                f"| {_x(fig['drain INFO / WARNING'])} |"
            )
            lines.append(
                f"| the same, ours at `--log-level WARNING`, jobs/s "
                f"| {_n(d['sqla_jobq WARNING'])} | | "
                f"| {_x(fig['drain WARNING / pgqueuer'])} "
                f"| {_x(fig['drain WARNING / procrastinate'])} | | |"
            )
            lines.append(
                f"| exactly once, checked on the server | {n:,} x 1 | {n:,} x 1 "
                f"| {n:,} x 1 | | | | |"
            )
            lines.append(
                f"| worker process CPU per 10,000 jobs (start-up included; ours at INFO) "
                f"| {_n(ccpu['sqla_jobq INFO'], ' s')} | {_n(ccpu['pgqueuer'], ' s')} "
                f"| {_n(ccpu['procrastinate'], ' s')} | | | ours at WARNING: "
                f"{_n(ccpu['sqla_jobq WARNING'], ' s')} | |"
            )
            lines.append(
                f"| postgres CPU per 10,000 jobs drained (ours at INFO) "
                f"| {_n(cpu['sqla_jobq INFO'], ' s')} | {_n(cpu['pgqueuer'], ' s')} "
                f"| {_n(cpu['procrastinate'], ' s')} | | | | |"
            )
        if self.pickup:
            p = self.pickup
            p50 = {k: _med([_med(r) for r in x]) for k, x in p.items()}
            p99 = {k: _med([common.percentile(r, 99) for r in x]) for k, x in p.items()}
            lines.append(
                f"| pickup p50 of an idle worker, COMMIT sent to handler start, ms "
                f"| {_n(p50['sqla_jobq'])} | {_n(p50['pgqueuer'])} | {_n(p50['procrastinate'])} "
                f"| {_x(fig['pickup p50 ours / pgqueuer'])} "
                f"| {_x(fig['pickup p50 ours / procrastinate'])} "
                f"| raw LISTEN/NOTIFY + one claim: {_n(p50['raw + claim'])} "
                f"(raw alone {_n(p50['raw'])}) "
                f"| {_x(fig['pickup p50 ours / raw + claim'])} |"
            )
            lines.append(
                f"| pickup p99, ms | {_n(p99['sqla_jobq'])} | {_n(p99['pgqueuer'])} "
                f"| {_n(p99['procrastinate'])} | | | raw + claim: {_n(p99['raw + claim'])} | |"
            )
        lines += ["", "Goals of issue 13 measured here:", ""]
        # (goal, the figure as shown, met)
        goals: list[tuple[str, str, bool]] = []
        if self.drain:
            r = fig["drain INFO / pgqueuer"]
            goals.append(("default worker (INFO) >= 3x pgqueuer's default worker", _x(r), r >= 3))
            r = fig["drain INFO / WARNING"]
            goals.append(("INFO >= 0.9x WARNING", _x(r), r >= 0.9))
        if self.bulk:
            r = fig["bulk ours / COPY"]
            goals.append(("bulk enqueue >= 0.6x COPY", _x(r), r >= 0.6))
        if self.pickup:
            r = fig["pickup p50 ours / raw + claim"]
            goals.append(("pickup p50 <= 1.1x raw LISTEN/NOTIFY + one claim", _x(r), r <= 1.1))
            ms = p99["sqla_jobq"]
            goals.append(("pickup p99 < 20 ms", _n(ms, " ms"), ms < 20))
        for text, shown, met in goals:
            lines.append(f"* {text}: **{shown}**, {'met' if met else '**not met**'}")
        return "\n".join(lines)


def write_docs(markdown: str, path: Path = DOCS, quoted_in: Path = README) -> None:
    """Rewrite the block in the benchmarks page (adding its section if it has
    none) and the copy the README's performance section quotes, so the two
    never tell different runs."""
    _write_block(path, markdown, section="## Against the peers")
    _write_block(quoted_in, markdown, section=None)


def _write_block(path: Path, markdown: str, section: str | None) -> None:
    text = path.read_text()
    block = f"{BEGIN}\n{markdown}\n{END}"
    if BEGIN in text and END in text:
        text = re.sub(
            re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, count=1, flags=re.S
        )
    elif section is not None:
        text = text.rstrip("\n") + f"\n\n{section}\n\n" + block + "\n"
    else:
        return
    path.write_text(text)


# --- main ------------------------------------------------------------------------


def _ours_version() -> str:
    from importlib.metadata import version

    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=common.REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "sqla_jobq"],
        cwd=common.REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    state = f"checkout {rev}" + (" with uncommitted changes in sqla_jobq/" if dirty else "")
    return f"{version('sqla_jobq')} ({state})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes; implies --no-docs")
    parser.add_argument("--only", action="append", choices=("bulk", "drain", "pickup"))
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the docs table")
    parser.add_argument(
        "--json", type=Path, default=common.REPO / "bench" / "results" / "peers.json"
    )
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    only = args.only or ["bulk", "drain", "pickup"]
    started = time.perf_counter()

    def log(line: str) -> None:
        print(line, flush=True)

    from ..suite.runner import machine

    info = machine()
    versions = {"sqla_jobq": _ours_version()}
    log("peers: virtualenvs under " + str(PEERS_HOME))
    for peer in (PGQUEUER, PROCRASTINATE):
        frozen = peer.ensure(log)
        versions[peer.name] = frozen.get(peer.name, "?")
        if peer is PGQUEUER:
            versions["asyncpg"] = frozen.get("asyncpg", "?")
            versions["uvloop"] = frozen.get("uvloop", "?")
        else:
            versions["procrastinate psycopg"] = frozen.get("psycopg", "?")
    log(
        f"peers: {info['nproc']} cores, {info['cpu_model']}, PostgreSQL {info['postgresql']}, "
        f"load {info['loadavg_start'][0]:.1f}; "
        + "; ".join(f"{k} {v}" for k, v in versions.items())
    )
    report = Report(meta={})
    with scratch(["sqla_jobq", "pgqueuer", "procrastinate"]) as benches:
        systems: dict[str, System] = {
            "sqla_jobq": Ours(benches["sqla_jobq"]),
            "pgqueuer": PgQueuer(benches["pgqueuer"]),
            "procrastinate": Procrastinate(benches["procrastinate"]),
        }
        for system in systems.values():
            system.setup()
        if "bulk" in only:
            report.bulk = run_bulk(systems, sizes, args.rounds, log)
        if "drain" in only:
            report.drain = run_drain(systems, sizes, args.rounds, log)
        if "pickup" in only:
            report.pickup = run_pickup(systems, sizes, args.rounds, log)
    report.meta = {
        "command": " ".join(
            ["python -m bench.peers", *(argv if argv is not None else sys.argv[1:])]
        ),
        "rounds": args.rounds,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed_s": time.perf_counter() - started,
        "nproc": info["nproc"],
        "cpu_model": info["cpu_model"],
        "postgresql": info["postgresql"].split(" (")[0],
        "autovacuum": info["pg_settings"].get("autovacuum", "?"),
        "load_start": info["loadavg_start"][0],
        "load_end": os.getloadavg()[0],
        "python": info["python"],
        "versions": versions,
        "sizes": vars(sizes),
    }
    markdown = report.markdown()
    log("")
    log(markdown)
    common.dump_json(
        args.json,
        {
            "meta": report.meta,
            "bulk": report.bulk,
            "drain": report.drain,
            "pickup": report.pickup,
            "figures": report.figures(),
            "markdown": markdown,
        },
    )
    if not (args.quick or args.no_docs or args.only):
        write_docs(markdown)
        log(f"\nwrote the table into {DOCS} and {README}")
    log(f"{time.perf_counter() - started:.0f}s; JSON in {args.json}")
    return 0
