"""Worker subprocesses and /proc readers: running children and counting their CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .database import Bench
from .paths import REPO

CLK_TCK = os.sysconf("SC_CLK_TCK")


PAGE = os.sysconf("SC_PAGE_SIZE")


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
