"""Where the worker's CPU goes: `python -m bench.profile [JOBS] [CONCURRENCY] [TASK]`.

Not part of the suite (it needs py-spy: `pip install py-spy`). Fills a scratch
database with JOBS ready jobs, runs `jobq worker --burst` under `py-spy
record --gil` (only the thread holding the GIL is sampled: Python's CPU, not
its waiting), and sums the samples by where the innermost frame is.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import common

CATEGORIES = [
    ("start-up (imports)", re.compile(r"importlib|<frozen|_bootstrap|typer|click")),
    ("psycopg: send, wait, results", re.compile(r"psycopg/(?!types)")),
    ("psycopg: adapting values", re.compile(r"psycopg/types")),
    ("asyncio event loop", re.compile(r"asyncio/|selectors\.py")),
    ("payload JSON decoding", re.compile(r"json/")),
    ("logging", re.compile(r"logging/")),
    ("handler threads (wake, hand back)", re.compile(r"threading\.py|HandlerThreads")),
    ("worker bookkeeping", re.compile(r"sqla_jobq/worker\.py")),
    ("driver (statement parameters)", re.compile(r"sqla_jobq/driver\.py")),
    ("handler itself", re.compile(r"bench/tasks\.py")),
]


def categorize(frame: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(frame):
            return name
    return "other"


def main(argv: list[str]) -> int:
    jobs = int(argv[0]) if argv else 40_000
    concurrency = argv[1] if len(argv) > 1 else "8"
    task = argv[2] if len(argv) > 2 else "noop"
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    with common.scratch_database(common.Sizes(), 1) as bench, tempfile.TemporaryDirectory() as tmp:
        common.create_table(bench)
        common.fill(bench, jobs, task=task)
        raw = Path(tmp) / "profile.txt"
        cmd = [
            pyspy,
            "record",
            "--gil",
            "--rate",
            "500",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--",
            *common.worker_command(bench, concurrency=int(concurrency), burst=True),
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
        own: collections.Counter[str] = collections.Counter()
        leaf: collections.Counter[str] = collections.Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack:
                continue
            samples = int(n)
            total += samples
            frames = stack.split(";")
            own[categorize(frames[-1])] += samples
            leaf[re.sub(r" \(.*/", " (", frames[-1])] += samples
    print(
        f"{jobs:,} {task} jobs, -c {concurrency}: {o.rate:,.0f} jobs/s; "
        f"{total:,} samples of the GIL holder at 500 Hz"
    )
    print("by where the innermost frame is:")
    for name, samples in own.most_common():
        print(f"  {samples / total * 100:5.1f}%  {name}")
    print("top functions (self):")
    for name, samples in leaf.most_common(15):
        print(f"  {samples / total * 100:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
