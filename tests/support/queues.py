"""Create and drop a migrated queue table (the `table` fixture's, and tests' own)."""

from __future__ import annotations

import psycopg

from sqla_jobq.db import conninfo
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names


def create_queue_table(database_url: str, names: Names) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        if names.schema:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{names.schema}"')
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())


def drop_queue_table(database_url: str, names: Names) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        for sql in down_statements(names, LATEST, 0):
            conn.execute(sql.encode())
