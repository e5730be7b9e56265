"""sqla_jobq: a PostgreSQL job queue built on SQLAlchemy Core."""

from sqlalchemy import MetaData

from .schema import jobs_table

metadata = MetaData()
jobs = jobs_table(metadata)

__all__ = ["jobs", "jobs_table", "metadata"]
