"""Where the worker's CPU goes: `python -m bench.tools.profile [JOBS] [CONCURRENCY] [TASK]`.

Not part of the suite (it needs py-spy: `pip install py-spy`). Fills a scratch
database with JOBS ready jobs, runs `jobq worker --burst` under `py-spy
record --gil` (only the thread holding the GIL is sampled: Python's CPU, not
its waiting), and charges each sample to the part of the worker it was in.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import common

RATE = 500
# Each sample is charged to the innermost frame on its stack that belongs to
# one of these parts of the worker (psycopg, asyncio or json frames below it
# count for the part that called them); a sample in none of them is the event
# loop's own work.
PARTS = [
    (
        "start-up (imports, CLI, schema check)",
        re.compile(r"_find_and_load|_handle_fromlist|check_schema|load_registry|make_engine"),
    ),
    ("handler threads, thread side (incl. the handler)", re.compile(r"^HandlerThreads\._work ")),
    ("handler threads, loop side (hand over, wake, deliver)", re.compile(r"^HandlerThreads\.")),
    ("claim: Driver.claim (send, wait, parse rows, payloads)", re.compile(r"^Driver\.claim ")),
    (
        "completion: Finisher (per-job future, fenced complete_many)",
        re.compile(r"^Finisher\.|^retrying "),
    ),
    (
        "per-job coroutine: _execute, _call, _finish",
        re.compile(r"^Worker\._(execute|call|finish) "),
    ),
    (
        "claim loop: _take, _dispatch, _room, _wait, _maintain",
        re.compile(r"^Worker\._(take|dispatch|room|wait|maintain|claim_loop|idle_timeout) "),
    ),
    ("heartbeat", re.compile(r"^Worker\._heartbeat ")),
    ("logging", re.compile(r"logging/")),
]
LOOP = "asyncio event loop itself (select, callbacks, task steps)"
STARTUP = PARTS[0][0]


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in PARTS:
            if pattern.search(frame):
                return name
    return LOOP


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.profile", description=__doc__)
    parser.add_argument("jobs", nargs="?", type=int, default=60_000)
    parser.add_argument("concurrency", nargs="?", type=int, default=8)
    parser.add_argument("task", nargs="?", default="noop", help="a task of bench.tasks")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    jobs, concurrency, task = args.jobs, args.concurrency, args.task
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    parts: collections.Counter[str] = collections.Counter()
    total = 0
    with common.scratch_database(common.Sizes(), 1) as bench, tempfile.TemporaryDirectory() as tmp:
        common.create_table(bench)
        common.fill(bench, jobs, task=task)
        raw = Path(tmp) / "profile.txt"
        cmd = [
            *(pyspy, "record", "--gil", "--rate", str(RATE), "--format", "raw"),
            *("--output", str(raw), "--"),
            *common.worker_command(bench, concurrency=concurrency, burst=True),
        ]
        subprocess.run(
            cmd,
            cwd=common.REPO,
            env=common.child_env(),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        o = common.outcome(bench)
        common.require_all_done(o, "profiled worker")
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack:
                continue
            total += int(n)
            frames = [re.sub(r"\(.*?([^/]+\.py)?:\d+\)", r"(\1)", f) for f in stack.split(";")]
            parts[part_of(frames)] += int(n)
    steady = total - parts[STARTUP]
    drain = jobs / o.rate if o.rate else float("nan")
    print(f"{jobs:,} {task} jobs, -c {concurrency}: {o.rate:,.0f} jobs/s, drained in {drain:.2f} s")
    print(
        f"GIL held {total / RATE:.2f} s in all, {steady / RATE:.2f} s after start-up: "
        f"{steady / RATE / jobs * 1e6:.0f} us per job, "
        f"{steady / RATE / drain * 100:.0f}% of the drain's wall time"
    )
    print(f"  {'all':>6} {'steady':>7}  part of the worker")
    for name, samples in parts.most_common():
        share = "" if name == STARTUP else f"{samples / steady * 100:6.1f}%"
        print(f"  {samples / total * 100:5.1f}% {share:>7}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
