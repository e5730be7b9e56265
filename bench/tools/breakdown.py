"""Where pickup latency goes: `python -m bench.tools.breakdown [JOBS]`.

Not part of the suite: it runs the worker in this process (non-burst, LISTEN
active) with its claim and its wake-up timed, enqueues JOBS `stamp` jobs one
at a time from a thread, and prints, from COMMIT sent, when the worker was
woken (the notification arrived), when its claim was sent, when the claim
returned and when the handler started.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from sqla_jobq import driver
from sqla_jobq.worker import Worker, WorkerOptions

from .. import common, tasks


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 200
    claims: dict[int, tuple[float, float]] = {}
    wakes: list[float] = []
    original = driver.Driver.claim

    async def timed_claim(
        self: driver.Driver, limit: int, after: Any = None
    ) -> list[dict[str, Any]]:
        sent = time.time()
        rows = await original(self, limit, after)
        back = time.time()
        for row in rows:  # the driver hands payloads over as JSON text
            payload = json.loads(row["payload"])
            if isinstance(payload, dict) and "seq" in payload:
                claims[payload["seq"]] = (sent, back)
        return rows

    driver.Driver.claim = timed_claim  # type: ignore[method-assign]
    with common.scratch_database(common.Sizes(), 1) as bench, tempfile.TemporaryDirectory() as tmp:
        common.create_table(bench)
        stamps = Path(tmp) / "stamps"
        os.environ["JOBQ_BENCH_STAMPS"] = str(stamps)
        worker = Worker(
            tasks.registry,
            WorkerOptions(database_url=bench.url, concurrency=8, poll_interval=60),
        )
        wake = worker.wake

        def timed_wake() -> None:
            wakes.append(time.time())
            wake()

        worker.wake = timed_wake  # type: ignore[method-assign]
        sent: dict[int, float] = {}

        def enqueue() -> None:
            time.sleep(1.0)
            engine = create_engine(bench.url, poolclass=NullPool)
            with engine.connect() as conn:
                for seq in range(-20, count):  # the first 20 warm up
                    trans = conn.begin()
                    tasks.stamp.enqueue(conn, seq=seq)
                    sent[seq] = time.time()
                    trans.commit()
                    time.sleep(0.015)
            engine.dispose()
            time.sleep(0.5)
            worker.stop()

        thread = threading.Thread(target=enqueue)
        thread.start()
        asyncio.run(worker.run(handle_signals=False))
        thread.join()
        started = {
            int(seq): float(at)
            for seq, at in (ln.split() for ln in stamps.read_text().splitlines())
        }
    stages: dict[str, list[float]] = {
        "notification (worker woken)": [],
        "claim sent": [],
        "claim returned": [],
        "handler started": [],
    }
    for seq in range(count):
        t0 = sent[seq]
        woken = wakes[min(bisect.bisect_left(wakes, t0), len(wakes) - 1)]
        values: list[Any] = [woken, *claims[seq], started[seq]]
        for name, at in zip(stages, values, strict=True):
            stages[name].append((at - t0) * 1000)
    print(f"{count} jobs, ms after COMMIT was sent (one job at a time, 15 ms apart):")
    print(f"  {'stage':<30} {'p50':>7} {'p90':>7}")
    for name, values in stages.items():
        p50, p90 = common.percentile(values, 50), common.percentile(values, 90)
        print(f"  {name:<30} {p50:7.2f} {p90:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
