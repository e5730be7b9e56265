"""`jobq migrate`: bring a database's queue table to the latest schema version."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Table, create_engine, text
from sqlalchemy.pool import NullPool

from ..schema import Names, quote_ident
from . import SchemaError, schema_version
from .steps import LATEST, up_statements


def alembic_config(url: str) -> Config:
    """An Alembic config on the revisions inside the installed package."""
    cfg = Config()
    cfg.set_main_option("script_location", "sqla_jobq:migrations")
    cfg.set_main_option("path_separator", "space")
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate_to_latest(url: str, table: Table) -> int:
    """The default table goes through Alembic (so `alembic_version` agrees);
    a custom-named one gets the same steps directly."""
    names = Names(table.name, table.schema)
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            _refuse_foreign_table(conn, names)
        if names == Names("jobs", None):
            command.upgrade(alembic_config(url), "sqla_jobq@head")
            return LATEST
        with engine.begin() as conn:
            if names.schema:
                conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(names.schema)}"))
            for sql in up_statements(names, schema_version(conn, names), LATEST):
                conn.execute(text(sql))
    finally:
        engine.dispose()
    return LATEST


def _refuse_foreign_table(conn: Connection, names: Names) -> None:
    """A table of that name that sqla_jobq did not create is not ours to alter."""
    exists = conn.execute(
        text("SELECT to_regclass(:qualified) IS NOT NULL"), {"qualified": names.qualified}
    ).scalar()
    if exists and schema_version(conn, names) == 0:
        raise SchemaError(
            f"a table {names.qualified} exists but carries no sqla_jobq schema version "
            "(it was not created by sqla_jobq): rename it, or use another --table"
        )
