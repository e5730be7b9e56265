"""sqla_jobq: a PostgreSQL job queue built on SQLAlchemy Core.

The public names are these; `statements` (pure builders), `client` (their
execution on a Connection or Session), `migrations`, `testing` and
`dashboard` are public modules. Every other module is internal.
"""

from .job import Job, JobCancelled, LeaseLost, current_job
from .registry import Registry, Task
from .schema import default_jobs as jobs
from .schema import default_metadata as metadata
from .schema import jobs_table
from .waiting import JobFailed, wait_for, wait_for_async

__all__ = [
    "Job",
    "JobCancelled",
    "JobFailed",
    "LeaseLost",
    "Registry",
    "Task",
    "current_job",
    "jobs",
    "jobs_table",
    "metadata",
    "wait_for",
    "wait_for_async",
]
