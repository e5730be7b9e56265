"""sqla_jobq: a PostgreSQL job queue built on SQLAlchemy Core."""

from sqlalchemy import MetaData

from .schema import jobs_table

metadata = MetaData()
jobs = jobs_table(metadata)

from .registry import Job, Registry, Task, current_job  # noqa: E402

__all__ = ["Job", "Registry", "Task", "current_job", "jobs", "jobs_table", "metadata"]
