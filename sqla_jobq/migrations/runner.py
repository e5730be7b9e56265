"""`jobq migrate`: bring a database's queue table to the latest schema version."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, Table, create_engine, text
from sqlalchemy.pool import NullPool

from ..schema import Names, names_of, quote_ident
from .check import SchemaError, missing_triggers, schema_version
from .steps import LATEST, repair_statements, up_statements


def alembic_config(url: str) -> Config:
    """An Alembic config on the revisions inside the installed package."""
    cfg = Config()
    cfg.set_main_option("script_location", "sqla_jobq:migrations")
    cfg.set_main_option("path_separator", "space")
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


# Session-level advisory lock held while migrating: two processes starting at
# once (workers on a fresh database, the embedded server) take turns.
MIGRATION_LOCK = 0x6A6F6271  # "jobq"


def migrate_to_latest(url: str, table: Table) -> int:
    """The default table goes through Alembic (so `alembic_version` agrees);
    a custom-named one gets the same steps directly. A current table whose
    NOTIFY triggers were dropped or disabled gets them back; a table already
    current and whole is left alone without taking the lock."""
    names = names_of(table)
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as lock:
            if _whole(lock, names):
                return LATEST
            _refuse_foreign_table(lock, names)
            lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
            if schema_version(lock, names) < LATEST:
                _upgrade(engine, url, names)
            if missing_triggers(lock, names):
                _repair(engine, names)
    finally:
        engine.dispose()
    return LATEST


def _whole(conn: Connection, names: Names) -> bool:
    return schema_version(conn, names) >= LATEST and not missing_triggers(conn, names)


def _repair(engine: Engine, names: Names) -> None:
    with engine.begin() as conn:
        for sql in repair_statements(names):
            conn.execute(text(sql))


def _upgrade(engine: Engine, url: str, names: Names) -> None:
    if names == Names("jobs", None):
        command.upgrade(alembic_config(url), "sqla_jobq@head")
        return
    with engine.begin() as conn:
        if names.schema:
            conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(names.schema)}"))
        for sql in up_statements(names, schema_version(conn, names), LATEST):
            conn.execute(text(sql))


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
