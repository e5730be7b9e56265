"""Shared fixtures: a real PostgreSQL database, and a fresh queue table per test.

The server is `JOBQ_TEST_DATABASE_URL` when set, else 127.0.0.1:5432 when a
server answers there, else the embedded PostgreSQL of the `embedded` extra.
Each test session works in a database of its own, created here and dropped at
the end; each test gets its own uniquely named queue table, so tests never see
each other's jobs.

These fixtures serve every folder below (unit/, db/, faults/); helpers live in
tests/support/ and are imported explicitly.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, MetaData, Table, create_engine
from sqlalchemy.pool import NullPool

from sqla_jobq.db import conninfo, parse_url, sqlalchemy_url
from sqla_jobq.schema import Names, jobs_table
from tests.support.queues import create_queue_table, drop_queue_table

LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"

# Subprocesses (`jobq`, `alembic`) must be the ones installed beside this
# interpreter, also when a virtualenv's python runs pytest without activation.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def _server_url() -> str:
    explicit = os.environ.get("JOBQ_TEST_DATABASE_URL")
    if explicit:
        return explicit
    try:
        psycopg.connect(conninfo(LOCAL_URL), connect_timeout=2).close()
        return LOCAL_URL
    except psycopg.OperationalError:
        from sqla_jobq.embedded import embedded_url

        return embedded_url()


@pytest.fixture(scope="session")
def server_url() -> str:
    return _server_url()


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """A database of this session's own, dropped afterwards."""
    name = f"jobq_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = conninfo(server_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = parse_url(server_url).set(database=name).render_as_string(hide_password=False)
    yield url
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[Engine]:
    eng = create_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    yield eng
    eng.dispose()


@pytest.fixture
def table(database_url: str) -> Iterator[Table]:
    """A migrated queue table with a unique name, for this test only."""
    names = Names(f"jobs_{uuid.uuid4().hex[:10]}", None)
    create_queue_table(database_url, names)
    yield jobs_table(MetaData(), names.table)
    drop_queue_table(database_url, names)


@pytest.fixture
def raw(database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit psycopg connection for checks from outside SQLAlchemy."""
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        yield conn
