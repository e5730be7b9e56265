"""Testing an app's tasks against its own test database, with real queue SQL.

`drain` runs the ready jobs in-process on the test's connection, inside its
transaction (see `sqla_jobq.testing.drain`); `enqueued_jobs` and
`assert_enqueued` look at what is queued. The pytest plugin
(`sqla_jobq.testing.plugin`, loaded automatically once sqla_jobq is
installed) binds them to fixtures.
"""

from .drain import drain, drain_async
from .enqueued import EnqueuedJob, assert_enqueued, enqueued_jobs
from .harness import Harness
from .steps import Ran

__all__ = [
    "EnqueuedJob",
    "Harness",
    "Ran",
    "assert_enqueued",
    "drain",
    "drain_async",
    "enqueued_jobs",
]
