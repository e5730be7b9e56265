"""The Alembic environment shared by `alembic/env.py` and `jobq migrate`."""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

from ..db import sqlalchemy_url


def run() -> None:
    """Run the migrations Alembic asked for, online or as SQL (`--sql`)."""
    config = context.config
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("JOBQ_DATABASE_URL")
    if not url:
        raise SystemExit("set JOBQ_DATABASE_URL (or sqlalchemy.url in alembic.ini)")
    url = sqlalchemy_url(url)
    if context.is_offline_mode():
        context.configure(url=url, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
