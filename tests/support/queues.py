"""Create and drop a migrated queue table (the `table` fixture's, and tests' own)."""

from __future__ import annotations

import psycopg

from sqla_jobq.db import conninfo
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names, parse_version_comment


def create_queue_table(database_url: str, names: Names) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        if names.schema:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{names.schema}"')
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())


def drop_queue_table(database_url: str, names: Names) -> None:
    """Down from the version the table is at (a test may have left it older)."""
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT obj_description(to_regclass(%s), 'pg_class')", [names.qualified]
        ).fetchone()
        current = parse_version_comment(row[0] if row else None) or LATEST
        for sql in down_statements(names, current, 0):
            conn.execute(sql.encode())
