"""`jobq migrate`: bring a database's queue table to the latest schema version."""

from __future__ import annotations

from alembic.config import Config
from sqlalchemy import Table, create_engine, text
from sqlalchemy.pool import NullPool

from alembic import command

from ..schema import Names
from . import schema_version
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
    if names == Names("jobs", None):
        command.upgrade(alembic_config(url), "sqla_jobq@head")
        return LATEST
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            if names.schema:
                conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {names.qualified.split('.')[0]}"))
            for sql in up_statements(names, schema_version(conn, names), LATEST):
                conn.execute(text(sql))
    finally:
        engine.dispose()
    return LATEST
