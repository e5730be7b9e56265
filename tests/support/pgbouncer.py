"""PgBouncer in transaction mode, in the foreground, as the postgres user."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

from sqla_jobq.db import conninfo, parse_url

from .cluster import as_postgres, free_port, postgres_owned_tempdir
from .processes import kill_group
from .waiting import wait_until

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

PGBOUNCER_INI = """\
[databases]
{dbname} = host=127.0.0.1 port={pg_port} dbname={dbname}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
pool_mode = transaction
ignore_startup_parameters = extra_float_digits, options
max_client_conn = 200
default_pool_size = {pool_size}
"""


@dataclass
class Bouncer:
    port: int
    dbname: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.dbname}"


def installed() -> bool:
    return Path(PGBOUNCER).exists()


@contextlib.contextmanager
def running_pgbouncer(database_url: str, pool_size: int = 10) -> Iterator[Bouncer]:
    """PgBouncer (transaction pooling) in front of `database_url`'s database,
    for the block; `pool_size` server connections per user and database."""
    url = parse_url(database_url)
    base = postgres_owned_tempdir("jobq-pgbouncer-")
    port = free_port()
    ini = base / "pgbouncer.ini"
    ini.write_text(
        PGBOUNCER_INI.format(
            dbname=url.database, pg_port=url.port or 5432, port=port, dir=base, pool_size=pool_size
        )
    )
    (base / "userlist.txt").write_text('"postgres" ""\n')
    for path in (ini, base / "userlist.txt"):
        if os.geteuid() == 0:
            shutil.chown(path, "postgres", "postgres")
    log = base / "pgbouncer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            as_postgres(PGBOUNCER, str(ini)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    bouncer = Bouncer(port, str(url.database), proc, log)
    try:

        def answers() -> bool:
            try:
                psycopg.connect(conninfo(bouncer.url), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                assert proc.poll() is None, f"pgbouncer exited: {log.read_text()}"
                return False

        wait_until(answers, 15, "pgbouncer to accept connections")
        yield bouncer
    finally:
        kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
