"""`Harness`: the testing helpers bound to one connection and one registry,
as the plugin's `jobq` fixture hands them to a test."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ..registry import Registry, Task
from ..statements import Queues
from .drain import drain
from .enqueued import EnqueuedJob, assert_enqueued, enqueued_jobs
from .steps import MAX_JOBS, Ran


class Harness:
    """`drain`, `enqueued_jobs` and `assert_enqueued` without repeating the
    connection and the registry in every call."""

    def __init__(self, conn: Connection | Session, registry: Registry) -> None:
        self.conn = conn
        self.registry = registry

    def drain(
        self, queues: Queues | None = None, now: datetime | None = None, *, max_jobs: int = MAX_JOBS
    ) -> list[Ran]:
        return drain(self.conn, self.registry, queues, now, max_jobs=max_jobs)

    def enqueued(self, task: str | Task[Any, Any] | None = None) -> list[EnqueuedJob]:
        return enqueued_jobs(self.conn, self.registry, task)

    def assert_enqueued(
        self, task: str | Task[Any, Any], /, **payload_subset: Any
    ) -> list[EnqueuedJob]:
        return assert_enqueued(self.conn, self.registry, task, **payload_subset)
