"""sqla_jobq: a PostgreSQL job queue built on SQLAlchemy Core."""

from sqlalchemy import MetaData

from .schema import jobs_table

metadata = MetaData()
jobs = jobs_table(metadata)

from .job import Job, current_job  # noqa: E402
from .registry import Registry, Task  # noqa: E402
from .waiting import JobFailed, wait_for, wait_for_async  # noqa: E402

__all__ = [
    "Job",
    "JobFailed",
    "Registry",
    "Task",
    "current_job",
    "jobs",
    "jobs_table",
    "metadata",
    "wait_for",
    "wait_for_async",
]
