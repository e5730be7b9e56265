"""Registry and Job without a database: the default table, and `current_job`'s
context (the rest of the registry's tests are in tests/db/test_registry.py)."""

from __future__ import annotations

import pytest

import sqla_jobq
from sqla_jobq import Job, Registry, current_job
from sqla_jobq.job import set_current_job


def test_registry_defaults_to_the_packages_jobs_table() -> None:
    assert Registry().table is sqla_jobq.jobs


def test_current_job_outside_a_job_raises_lookup_error() -> None:
    with pytest.raises(LookupError, match="only available inside a running job"):
        current_job()


def test_current_job_returns_the_job_bound_in_its_context() -> None:
    import contextvars

    job = Job(id=7, task="t", queue="q", payload={"a": 1}, attempts=2, max_attempts=5)
    context = contextvars.copy_context()
    context.run(set_current_job, job)
    assert context.run(current_job) is job
    with pytest.raises(LookupError):
        current_job()  # the caller's context is untouched
