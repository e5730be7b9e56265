"""A real `Worker` run in-process, on a thread with its own event loop.

For tests whose handlers must misbehave in ways a subprocess cannot be told
about in advance (raise anything, return coroutines, outlive leases), and
that need to look inside the worker (count its claims) while it runs.
Handlers record what they do in a side table from connections of their own.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from sqla_jobq import Registry, current_job
from sqla_jobq.db import conninfo
from sqla_jobq.observe import Observer
from sqla_jobq.worker import Worker, WorkerOptions

from .waiting import wait_until

SIDE_DDL = """CREATE TABLE IF NOT EXISTS "{side}" (
  n        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  job_id   bigint NOT NULL,
  attempt  int    NOT NULL,
  event    text   NOT NULL,
  at       timestamptz NOT NULL DEFAULT clock_timestamp()
)"""


class Side:
    """The side table handlers write their executions to."""

    def __init__(self, url: str, name: str) -> None:
        self.url = conninfo(url)
        self.name = name
        self._local = threading.local()
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(SIDE_DDL.format(side=name))

    def record(self, event: str) -> None:
        """One row for the running job (call from a handler, sync or async)."""
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self.url, autocommit=True, application_name="jobq test handler")
            self._local.conn = conn
        job = current_job()
        conn.execute(
            f'INSERT INTO "{self.name}" (job_id, attempt, event) VALUES (%s, %s, %s)',
            (job.id, job.attempts, event),
        )

    def events(self, job_id: int | None = None) -> list[dict[str, Any]]:
        where = "" if job_id is None else f"WHERE job_id = {int(job_id)}"
        with psycopg.connect(self.url, row_factory=dict_row) as conn:
            return conn.execute(f'SELECT * FROM "{self.name}" {where} ORDER BY n').fetchall()


class Running:
    """A worker running on its own thread and loop until `stop()`."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.loop: asyncio.AbstractEventLoop | None = None
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.started = threading.Event()

    def _main(self) -> None:
        async def main() -> int:
            self.loop = asyncio.get_running_loop()
            self.started.set()
            return await self.worker.run(handle_signals=False)

        try:
            self.code = asyncio.run(main())
        except BaseException as exc:  # reported by join(), not lost on the thread
            self.error = exc
        finally:
            self.started.set()

    def call(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the worker's loop."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        self.call(self.worker.stop)

    def settle(self) -> None:
        """Wait out what an idle worker still sends after its last jobs: the
        one claim from the head its cursor makes when a claim was slow (a
        loaded machine is enough; see `claim_cursor`), then the job log's
        batch and the presence beat. From here on it should send nothing."""
        wait_until(lambda: not self.worker.cursor.engaged, 30, "the cursor back at the head")
        time.sleep(0.5)

    def join(self, timeout: float = 60) -> int:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the worker did not stop within {timeout}s"
        if self.error is not None:
            raise AssertionError(f"Worker.run raised {self.error!r}") from self.error
        assert self.code is not None
        return self.code


@contextmanager
def running(
    registry: Registry, url: str, observers: Sequence[Observer] = (), **options: Any
) -> Iterator[Running]:
    """Run a Worker until the block ends (then stop it and wait for it)."""
    run = Running(Worker(registry, WorkerOptions(database_url=url, **options), observers))
    run.thread.start()
    run.started.wait(30)
    try:
        yield run
    finally:
        if run.thread.is_alive():
            run.stop()
        run.thread.join(60)


def burst(
    registry: Registry,
    url: str,
    timeout: float = 60,
    observers: Sequence[Observer] = (),
    **options: Any,
) -> int:
    """Run a burst worker until nothing is ready; its exit status."""
    options = {"database_url": url, "burst": True, **options}
    run = Running(Worker(registry, WorkerOptions(**options), observers))
    run.thread.start()
    return run.join(timeout)
