"""Tasks: named functions a worker can run, and the enqueueing of calls to them.

A job's payload is the task's keyword arguments as JSON. Both are checked when
the job is enqueued (the arguments against the function's signature, the
payload against strict JSON), so a bad call fails in the caller's code, with
its transaction still open, not hours later in a worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar, overload

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from . import client, periodic
from .job import InvalidJob, NewJob, is_mapping
from .schema import default_jobs
from .statements import DEFAULT_LEASE

P = ParamSpec("P")
R = TypeVar("R")


# Sets of argument names remembered as fitting, per task.
FITTING_NAME_SETS = 64

# Task.enqueue's own keyword options: a task parameter of the same name could
# never be passed through it.
RESERVED_PARAMETERS = frozenset({"conn", "run_at", "delay", "unique_key"})

class Task(Generic[P, R]):
    """A registered function: still callable as itself, and enqueueable."""

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str,
        queue: str,
        max_attempts: int,
        lease: timedelta,
        priority: int,
        table: Table,
        timeout: timedelta | None = None,
        transactional: bool = False,
    ) -> None:
        self.fn = fn
        self.name = name
        self.queue = queue
        self.max_attempts = max_attempts
        self.lease = lease
        self.priority = priority
        self.table = table
        self.timeout = timeout
        self.transactional = transactional
        signature = inspect.signature(fn)
        if transactional:
            # `conn` is filled by the worker, never part of the payload.
            kept = [p for p in signature.parameters.values() if p.name != "conn"]
            signature = signature.replace(parameters=kept)
        self.signature = signature
        self.is_async = inspect.iscoroutinefunction(fn)
        self._fitting: set[frozenset[str]] = set()
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name} queue={self.queue!r}>"

    def check_payload(self, payload: Any) -> dict[str, Any]:
        """The payload as keyword arguments, or InvalidJob saying why not.

        Only the shape is checked here; the statements check (and encode) the
        JSON itself, once, before any SQL is sent.
        """
        if not is_mapping(payload):
            raise InvalidJob(
                f"payload for task {self.name} must be a JSON object of keyword arguments, "
                f"not {type(payload).__name__}"
            )
        kwargs = dict(payload)
        mismatch = self.mismatch(kwargs)
        if mismatch is not None:
            raise InvalidJob(mismatch)
        return kwargs

    def mismatch(self, kwargs: Mapping[str, Any]) -> str | None:
        """Why these keyword arguments do not fit the function, or None.

        Whether keyword arguments bind depends only on their names, so each
        set of names is checked once (the worker asks for every job it runs).
        """
        names = frozenset(kwargs)
        if names in self._fitting:
            return None
        try:
            self.signature.bind(**kwargs)
        except TypeError as exc:
            return f"payload does not match {self.name}{self.signature}: {exc}"
        if len(self._fitting) < FITTING_NAME_SETS:  # a **kwargs function takes any names
            self._fitting.add(names)
        return None

    def new_job(
        self,
        kwargs: Mapping[str, Any],
        *,
        run_at: datetime | None = None,
        delay: timedelta | None = None,
        unique_key: str | None = None,
    ) -> NewJob:
        return NewJob(
            task=self.name,
            payload=self.check_payload(kwargs),
            queue=self.queue,
            run_at=run_at,
            delay=delay,
            priority=self.priority,
            max_attempts=self.max_attempts,
            unique_key=unique_key,
        )

    @overload
    def enqueue(
        self,
        conn: client.Executor,
        *,
        run_at: datetime | None = ...,
        delay: timedelta | None = ...,
        unique_key: str | None = ...,
        **kwargs: Any,
    ) -> int: ...

    @overload
    def enqueue(
        self,
        conn: client.AsyncExecutor,
        *,
        run_at: datetime | None = ...,
        delay: timedelta | None = ...,
        unique_key: str | None = ...,
        **kwargs: Any,
    ) -> Awaitable[int]: ...

    def enqueue(
        self,
        conn: client.Executor | client.AsyncExecutor,
        *,
        run_at: datetime | None = None,
        delay: timedelta | None = None,
        unique_key: str | None = None,
        **kwargs: Any,
    ) -> int | Awaitable[int]:
        """Enqueue a call in the caller's transaction; never commits.

        On an async connection or session this returns an awaitable.
        """
        job = self.new_job(kwargs, run_at=run_at, delay=delay, unique_key=unique_key)
        options = {
            "queue": job.queue,
            "run_at": job.run_at,
            "delay": job.delay,
            "priority": job.priority,
            "max_attempts": job.max_attempts,
            "unique_key": job.unique_key,
        }
        if isinstance(conn, AsyncConnection | AsyncSession):
            return client.enqueue_async(conn, self.table, job.task, job.payload, **options)
        return client.enqueue(conn, self.table, job.task, job.payload, **options)


class Registry:
    """The tasks one application knows, and the queue table they go to."""

    def __init__(self, table: Table | None = None) -> None:
        self.table = default_jobs if table is None else table
        self.tasks: dict[str, Task[Any, Any]] = {}
        # Periodic tasks' schedules, by task name (see `sqla_jobq.scheduler`).
        self.schedules: dict[str, periodic.Schedule] = {}

    @overload
    def task(self, fn: Callable[P, R]) -> Task[P, R]: ...

    @overload
    def task(
        self,
        fn: None = ...,
        *,
        name: str | None = ...,
        queue: str = ...,
        max_attempts: int = ...,
        lease: timedelta = ...,
        priority: int = ...,
        timeout: timedelta | None = ...,
        transactional: bool = ...,
        cron: str | None = ...,
        every: timedelta | None = ...,
        timezone: str | None = ...,
        payload: Mapping[str, Any] | None = ...,
        catch_up: timedelta | float | None = ...,
    ) -> Callable[[Callable[P, R]], Task[P, R]]: ...

    def task(
        self,
        fn: Callable[P, R] | None = None,
        *,
        name: str | None = None,
        queue: str = "default",
        max_attempts: int = 5,
        lease: timedelta = DEFAULT_LEASE,
        priority: int = 0,
        timeout: timedelta | None = None,
        transactional: bool = False,
        cron: str | None = None,
        every: timedelta | None = None,
        timezone: str | None = None,
        payload: Mapping[str, Any] | None = None,
        catch_up: timedelta | float | None = None,
    ) -> Task[P, R] | Callable[[Callable[P, R]], Task[P, R]]:
        """Register a sync or `async def` function; usable bare or with options.

        With `cron=` (5 fields, in UTC unless `timezone=`) or `every=`, the task
        is also periodic: workers enqueue it once per fire time, with `payload`
        as its keyword arguments (see `sqla_jobq.periodic` for `catch_up=`).

        `timeout=`: an attempt running longer fails with TimeoutError (and is
        retried as any failure); the lease is about a dead worker, the timeout
        about a slow handler. `transactional=True`: the handler takes a `conn`
        with an open transaction on the worker's engine, and the job is
        completed in that same transaction (see `sqla_jobq.client.complete_in`).
        """

        def register(f: Callable[P, R]) -> Task[P, R]:
            task_name = name or f"{f.__module__}.{f.__qualname__}"
            if task_name in self.tasks:
                raise ValueError(f"task {task_name!r} is registered twice")
            if lease <= timedelta(0):
                raise ValueError(f"lease must be positive, got {lease}")
            if timeout is not None and timeout <= timedelta(0):
                raise ValueError(f"task {task_name!r}: timeout must be positive, got {timeout}")
            parameters = set(inspect.signature(f).parameters)
            if transactional and "conn" not in parameters:
                raise ValueError(
                    f"task {task_name!r} is transactional but takes no `conn` parameter: "
                    "add one, the worker passes the transaction's connection in it"
                )
            clashes = RESERVED_PARAMETERS & parameters - ({"conn"} if transactional else set())
            if clashes:
                raise ValueError(
                    f"task {task_name!r} has parameters named {sorted(clashes)}, which "
                    "Task.enqueue takes as its own options: rename them"
                )
            registered: Task[P, R] = Task(
                f,
                name=task_name,
                queue=queue,
                max_attempts=max_attempts,
                lease=lease,
                priority=priority,
                table=self.table,
                timeout=timeout,
                transactional=transactional,
            )
            schedule = periodic.declare(
                registered,
                cron=cron,
                every=every,
                timezone=timezone,
                payload=payload,
                catch_up=catch_up,
            )
            self.tasks[task_name] = registered
            if schedule is not None:
                self.schedules[task_name] = schedule
            return registered

        return register if fn is None else register(fn)

    def get(self, name: str | None) -> Task[Any, Any] | None:
        return None if name is None else self.tasks.get(name)

    def require(self, name: str) -> Task[Any, Any]:
        found = self.get(name)
        if found is None:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise InvalidJob(f"unknown task {name!r} (registered: {known})")
        return found

    @property
    def queues(self) -> list[str]:
        return sorted({t.queue for t in self.tasks.values()})

    @overload
    def enqueue_many(
        self, conn: client.Executor, task_name: str, calls: Iterable[Mapping[str, Any]]
    ) -> list[int]: ...

    @overload
    def enqueue_many(
        self, conn: client.AsyncExecutor, task_name: str, calls: Iterable[Mapping[str, Any]]
    ) -> Awaitable[list[int]]: ...

    def enqueue_many(
        self,
        conn: client.Executor | client.AsyncExecutor,
        task_name: str,
        calls: Iterable[Mapping[str, Any]],
    ) -> list[int] | Awaitable[list[int]]:
        """Enqueue one job per keyword-argument mapping, ids in input order."""
        task = self.require(task_name)
        job = NewJob(
            task.name, queue=task.queue, priority=task.priority, max_attempts=task.max_attempts
        )
        payloads = [task.check_payload(kwargs) for kwargs in calls]
        if isinstance(conn, AsyncConnection | AsyncSession):
            return client.enqueue_payloads_async(conn, self.table, job, payloads)
        return client.enqueue_payloads(conn, self.table, job, payloads)
