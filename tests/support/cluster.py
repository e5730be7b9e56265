"""A throwaway PostgreSQL 15 cluster: initdb and pg_ctl on a free port, removed afterwards.

initdb and pg_ctl refuse to run as root, so as root they run as the `postgres`
user (`runuser`), in a directory that user owns. Used by the fault suite's
`cluster` fixture (fast, unsafe settings), and with PostgreSQL's defaults (so
autovacuum works as in production) by `python -m bench.tools.soak` and the
scenes (`bench/scenes/base.py`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PG_BIN = Path("/usr/lib/postgresql/15/bin")

FAST_SETTINGS = ("fsync=off", "full_page_writes=off", "max_connections=60")
"""Server settings for tests: durability off, connections capped."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_postgres(*argv: str) -> list[str]:
    """`argv`, run as the postgres user when we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return list(argv)


def postgres_owned_tempdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")
    path.chmod(0o700)
    return path


def server_installed() -> bool:
    return (PG_BIN / "initdb").exists()


@dataclass
class Cluster:
    datadir: Path
    port: int
    logfile: Path
    settings: Sequence[str] = FAST_SETTINGS

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def pg_ctl(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), *args),
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1"
        options += "".join(f" -c {setting}" for setting in self.settings)
        self.pg_ctl("-o", options, "-l", str(self.logfile), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-m", mode, "-w", "stop")

    def running(self) -> bool:
        return (self.datadir / "postmaster.pid").exists()


@contextlib.contextmanager
def throwaway_cluster(
    settings: Sequence[str] = FAST_SETTINGS, stop_mode: str = "immediate"
) -> Iterator[Cluster]:
    """A started cluster of its own on a free port; stopped (`stop_mode`) and removed after."""
    base = postgres_owned_tempdir("jobq-cluster-")
    datadir = base / "data"
    try:
        subprocess.run(
            as_postgres(
                str(PG_BIN / "initdb"), "-D", str(datadir), "-U", "postgres", "--auth=trust", "-N"
            ),
            check=True,
            timeout=120,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        node = Cluster(datadir, free_port(), base / "server.log", tuple(settings))
        try:
            node.start()
            yield node
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                if node.running():
                    node.stop(stop_mode)
    finally:
        shutil.rmtree(base, ignore_errors=True)
