"""`jobq` subprocesses: the script itself, and `jobq worker faultapp:registry`
processes (one test's fleet), each killed with its process group after the test."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import APP_DIR
from .waiting import wait_until

if TYPE_CHECKING:
    from .faultqueue import FaultQueue

_BESIDE = Path(sys.executable).with_name("jobq")
JOBQ = str(_BESIDE) if _BESIDE.exists() else "jobq"
"""The `jobq` script beside this interpreter (a venv's, in CI), else the one on PATH."""


def jobq_command() -> list[str]:
    """The `jobq` script installed beside this interpreter (a venv's, in CI)."""
    beside = Path(sys.executable).parent / "jobq"
    found = str(beside) if beside.exists() else shutil.which("jobq")
    assert found, "the jobq script is not installed"
    return [found]


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class WorkerProcess:
    """One `jobq worker faultapp:registry` process, logging to a file."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*jobq_command(), "worker", "faultapp:registry", *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=APP_DIR,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def app_name(self) -> str:
        """The `application_name` of this process's sessions."""
        return f"jobq worker {socket.gethostname()}:{self.pid}"[:63]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        kill_group(self.proc, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not leave within `timeout`."""
        if self.alive():
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        if self.alive():
            self.kill(signal.SIGKILL)
        code = self.proc.wait(10)
        kill_group(self.proc)  # anything it left in its group
        self._log.close()
        return code

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


class Workers:
    """Starts worker processes for one test and guarantees they all die after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[WorkerProcess] = []

    def env(self, queue: FaultQueue, lease: float = 2.0, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(APP_DIR), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
            PYTHONUNBUFFERED="1",
            JOBQ_FAULT_TABLE=queue.names.table,
            JOBQ_FAULT_DSN=queue.url,
            JOBQ_FAULT_LEASE=str(lease),
            # The scenarios prove their outcome from the jobs table's rows
            # (statuses, attempts, who ran what): workers keep done jobs there
            # unless a scenario is about archiving (test_kill's, which passes
            # JOBQ_ARCHIVE_AFTER itself).
            JOBQ_ARCHIVE_AFTER="never",
        )
        env.update(extra)
        return env

    def start(
        self,
        queue: FaultQueue,
        *args: str,
        database_url: str | None = None,
        lease: float = 2.0,
        env: dict[str, str] | None = None,
    ) -> WorkerProcess:
        log = self.tmp / f"worker-{len(self.started)}.log"
        argv = ["--database-url", database_url or queue.url, *args]
        proc = WorkerProcess(argv, env or self.env(queue, lease), log)
        self.started.append(proc)
        return proc

    def logs(self) -> str:
        parts = []
        for w in self.started:
            text = w.output() if w.log_path.exists() else ""
            parts.append(f"--- worker pid {w.pid} ---\n{text[-3000:]}")
        return "\n".join(parts)

    def stop_all(self) -> None:
        for w in self.started:
            if w.alive() or not w._log.closed:
                w.stop()


class Fleet:
    """N worker slots; a slot whose process died is restarted (the harness's job)."""

    def __init__(self, workers: Workers, queue: FaultQueue, size: int, *args: str, **kw: Any):
        self.workers = workers
        self.queue = queue
        self.args = args
        self.kw = kw
        self.slots = [workers.start(queue, *args, **kw) for _ in range(size)]
        self.deaths = 0

    def restart_dead(self) -> None:
        for i, w in enumerate(self.slots):
            if not w.alive():
                self.deaths += 1
                w.stop()
                self.slots[i] = self.workers.start(self.queue, *self.args, **self.kw)

    def run_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        def check() -> Any:
            self.restart_dead()
            return predicate()

        return wait_until(check, timeout, what, interval=0.1)
