"""Where pickup latency goes: `python -m bench.tools.breakdown [JOBS]`.

Not part of the suite. The worker runs in this process (non-burst, LISTEN
active) with its idle claim timed (the listening thread hearing the
notification, its claim sent and returned: see `sqla_jobq.pickup`); a
producer in a process of its own commits JOBS `stamp` jobs one at a time,
and after each, 8 ms later, one row into a second table, which a raw
baseline in a third process hears with a blocking LISTEN and claims with the
worker's own claim statement. The jobs of the two never overlap, so neither
pays for the other's CPU. Prints, from COMMIT sent, when each stage was
reached (p50 and p90), the baseline's notification and claim, and how many
jobs the idle claim took (the others were claimed by the worker's loop).
"""

from __future__ import annotations

import asyncio
import bisect
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqla_jobq import pickup
from sqla_jobq.worker import Worker, WorkerOptions

from .. import common, tasks

GAP = 0.008  # between a job of ours and the baseline's, and on to the next job
FLOOR = "jobs_floor"

PRODUCER = """
import json, sys, time, psycopg
dsn, count, out, gap, floor = sys.argv[1:]
count, gap = int(count), float(gap)
conn = psycopg.connect(dsn)
time.sleep(2.0)
lines = []
for seq in range(-20, count):  # the first 20 warm up
    for table in ("jobs", floor):
        conn.execute(
            f"INSERT INTO {table} (task, payload) VALUES ('stamp', %s::jsonb)",
            (json.dumps({"seq": seq}),),
        )
        sent = time.time()
        conn.commit()
        lines.append(f"{table} {seq} {sent:.6f}")
        time.sleep(gap)
open(out, "w").write("\\n".join(lines))
"""

BASELINE = """
import json, sys, time, psycopg
from datetime import timedelta
from sqlalchemy import MetaData
from sqla_jobq.driver import Compiled
from sqla_jobq.schema import jobs_table
from sqla_jobq.statements import claim
dsn, out, count, floor = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
table = jobs_table(MetaData(), floor)
stmt = Compiled.of(claim(table, queue="default", lease=timedelta(minutes=5)))
params = stmt.params(limit=8)
listener = psycopg.connect(dsn, autocommit=True)
claimer = psycopg.connect(dsn, autocommit=True, prepare_threshold=0)
listener.execute(f'LISTEN "public.{floor}"')
lines = []
for _ in listener.notifies():
    heard = time.time()
    rows = claimer.execute(stmt.sql, params).fetchall()
    claimed = time.time()
    for row in rows:
        payload = row[3] if isinstance(row[3], dict) else json.loads(row[3])
        lines.append(f"{payload['seq']} {heard:.6f} {claimed:.6f}")
    if len(lines) >= count:
        break
open(out, "w").write("\\n".join(lines))
"""


def _timed(marks: list[float], call: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        marks.append(time.time())
        return call(*args, **kwargs)

    return timed


def _instrument(heard: list[float], claims: list[tuple[float, float]]) -> None:
    original = pickup.IdlePickup._claim

    def timed_claim(self: pickup.IdlePickup, query: Any) -> Any:
        sent = time.time()
        rows, took = original(self, query)
        if rows:
            claims.append((sent, time.time()))
        return rows, took

    pickup.IdlePickup._claim = timed_claim  # type: ignore[method-assign]
    pickup.IdlePickup.heard = _timed(heard, pickup.IdlePickup.heard)  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 200
    woken: list[float] = []
    claims: list[tuple[float, float]] = []
    _instrument(woken, claims)
    with common.scratch_database(common.Sizes(), 1) as bench, tempfile.TemporaryDirectory() as tmp:
        common.create_table(bench)
        common.create_table(bench, FLOOR)
        files = {name: Path(tmp) / name for name in ("stamps", "sent", "baseline")}
        os.environ["JOBQ_BENCH_STAMPS"] = str(files["stamps"])
        env = common.child_env()
        listen = [str(files["baseline"]), str(count + 20), FLOOR]
        baseline = subprocess.Popen([sys.executable, "-c", BASELINE, bench.dsn, *listen], env=env)
        produce = [str(count), str(files["sent"]), str(GAP), FLOOR]
        producer = subprocess.Popen([sys.executable, "-c", PRODUCER, bench.dsn, *produce], env=env)
        worker = Worker(
            tasks.registry,
            WorkerOptions(database_url=bench.url, concurrency=8, poll_interval=60),
        )

        def stop_when_done() -> None:
            producer.wait()
            baseline.wait()
            time.sleep(0.5)
            worker.stop()

        threading.Thread(target=stop_when_done, daemon=True).start()
        asyncio.run(worker.run(handle_signals=False))
        if producer.returncode or baseline.returncode:
            print("the producer or the baseline failed", file=sys.stderr)
            return 1
        sent: dict[tuple[str, int], float] = {}
        for line in files["sent"].read_text().splitlines():
            table, job, at = line.split()
            sent[(table, int(job))] = float(at)
        started = _pairs(files["stamps"])
        floor: dict[int, tuple[float, float]] = {}
        for line in files["baseline"].read_text().splitlines():
            job, heard, claimed = line.split()
            floor[int(job)] = (float(heard), float(claimed))
    stages: dict[str, list[float]] = {
        "baseline: notification": [],
        "baseline: claim returned": [],
        "ours: listening thread woken": [],
        "ours: idle claim sent": [],
        "ours: idle claim returned": [],
        "ours: handler started": [],
    }
    woken.sort()
    claims.sort()
    picked = 0
    for seq in range(count):
        t0, f0 = sent[("jobs", seq)], sent[(FLOOR, seq)]
        i = bisect.bisect_left(claims, (t0, 0.0))
        claim = claims[i] if i < len(claims) else (float("nan"), float("nan"))
        if not claim[1] < started[seq]:  # claimed by the loop: no idle claim before it
            claim = (float("nan"), float("nan"))
        picked += claim[1] == claim[1]
        ours = [_next(woken, t0), *claim, started[seq]]
        values = [floor[seq][0] - f0, floor[seq][1] - f0, *(at - t0 for at in ours)]
        for name, value in zip(stages, values, strict=True):
            stages[name].append(value * 1000)
    print(f"{count} jobs, ms after COMMIT was sent (ours and the baseline's interleaved);")
    print(f"{picked} claimed by the listening thread, the rest by the worker's loop:")
    print(f"  {'stage':<30} {'p50':>7} {'p90':>7}")
    for name, values in stages.items():
        known = [v for v in values if v == v]  # NaN: a stage this job did not pass
        p50, p90 = common.percentile(known, 50), common.percentile(known, 90)
        print(f"  {name:<30} {p50:7.2f} {p90:7.2f}")
    handler_p50 = common.percentile(stages["ours: handler started"], 50)
    floor_p50 = common.percentile(stages["baseline: claim returned"], 50)
    print(f"  handler started / baseline claim returned, p50: {handler_p50 / floor_p50:.2f}x")
    return 0


def _pairs(path: Path) -> dict[int, float]:
    return {int(a): float(b) for a, b in (ln.split() for ln in path.read_text().splitlines())}


def _next(ordered: list[float], after: float) -> float:
    i = bisect.bisect_left(ordered, after)
    return ordered[i] if i < len(ordered) else float("nan")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
