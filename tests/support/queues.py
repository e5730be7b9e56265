"""Create and drop a migrated queue table (the `table` fixture's, and tests' own)."""

from __future__ import annotations

import psycopg
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.migrations.check import schema_version
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names


def create_queue_table(database_url: str, names: Names) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        if names.schema:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{names.schema}"')
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())


def drop_queue_table(database_url: str, names: Names) -> None:
    """Down from the version the table is at (a test may have left it older)."""
    engine = create_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for sql in down_statements(names, schema_version(conn, names) or LATEST, 0):
                conn.execute(text(sql))  # as `migrations.downgrade` runs them, through op.execute
    finally:
        engine.dispose()
