"""The tasks the benchmark's workers run: `jobq worker bench.tasks:registry`."""

from __future__ import annotations

import os
import time

from sqla_jobq import Registry

registry = Registry()


@registry.task(name="noop")
def noop() -> None:
    """A plain (sync) function doing nothing: the worker's own cost, per job."""


@registry.task(name="noop_result")
def noop_result() -> dict[str, bool]:
    """`noop` returning a small result, which the worker stores with the job."""
    return {"ok": True}


@registry.task(name="anoop")
async def anoop() -> None:
    """The same as an `async def`."""


@registry.task(name="echo")
def echo(n: int) -> None:
    """Takes one argument, for the enqueue benchmark's payloads."""


@registry.task(name="stamp")
def stamp(seq: int) -> None:
    """Record when the handler started, for the pickup-latency benchmark.

    The timestamp is taken first thing; appending a line to a file costs far
    less than the latency being measured and happens after the stamp.
    """
    now = time.time()
    with open(os.environ["JOBQ_BENCH_STAMPS"], "a") as f:
        f.write(f"{seq} {now:.6f}\n")
