"""`python -m bench.tools.trickle`: a worker fed one job per transaction, at a steady rate.

Not part of the suite. What the idle-pickup path (`sqla_jobq/pickup.py`)
costs and buys where it matters most: every job is its own commit and
notification, so the worker spends its life waking from idle. For each rate,
`jobq worker bench.tasks:registry -c 8 --log-level WARNING --poll-interval 60`
works `stamp` jobs committed one at a time for `--seconds`; reported are the
pickup latency (COMMIT sent to the handler's first line, p50 and p99) and the
worker's CPU per job.

`--code DIR` (repeatable) runs the worker from another checkout of the
project (a `git worktree` of an older commit, say), rounds interleaved with
this one's, so two versions are compared in one run: the first `--code` is
the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from .. import common
from ..suite.latency import _read_stamps, _wait_for_listener


def _worker(bench: common.Bench, code: Path, stamps: Path) -> subprocess.Popen[str]:
    cmd = common.worker_command(
        bench, concurrency=8, burst=False, extra=["--poll-interval", "60"]
    )
    env = dict(os.environ, PYTHONPATH=str(code), JOBQ_BENCH_STAMPS=str(stamps))
    return subprocess.Popen(
        [sys.executable, "-c", "from sqla_jobq.cli import main; main()", *cmd[1:]],
        cwd=code,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _produce(bench: common.Bench, rate: float, seconds: float, first: int) -> dict[int, float]:
    """Commit one `stamp` job at a time, `rate` a second; when each COMMIT was sent."""
    sent: dict[int, float] = {}
    insert = "INSERT INTO jobs (task, payload) VALUES ('stamp', %s::jsonb)"
    with psycopg.connect(bench.dsn) as conn:
        start = time.monotonic()
        n = 0
        while (now := time.monotonic()) - start < seconds:
            due = start + n / rate
            if due > now:
                time.sleep(due - now)
            seq = first + n
            conn.execute(insert, (json.dumps({"seq": seq}),))
            sent[seq] = time.time()
            conn.commit()
            n += 1
    return sent


def _round(bench: common.Bench, code: Path, rate: float, seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="jobq-trickle-") as tmp:
        stamps = Path(tmp) / "stamps"
        worker = _worker(bench, code, stamps)
        try:
            _wait_for_listener(bench)
            _produce(bench, 50, 1.0, -1000)  # warm up: connections, statements, code
            time.sleep(0.5)
            cpu0 = common.proc_cpu(worker.pid) or 0.0
            sent = _produce(bench, rate, seconds, 0)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                started = _read_stamps(stamps)
                if all(seq in started for seq in sent):
                    break
                time.sleep(0.05)
            cpu = (common.proc_cpu(worker.pid) or 0.0) - cpu0
        finally:
            worker.terminate()
            worker.wait(30)
    missing = [seq for seq in sent if seq not in started]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(sent)} jobs never started ({code})")
    latency = [(started[seq] - at) * 1000 for seq, at in sent.items()]
    return {
        "jobs": len(sent),
        "p50_ms": common.percentile(latency, 50),
        "p99_ms": common.percentile(latency, 99),
        "cpu_us_per_job": cpu / len(sent) * 1e6,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.trickle", description=__doc__)
    parser.add_argument("--rate", type=float, action="append", help="jobs a second (repeatable)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--code", type=Path, action="append", help="a checkout to run")
    args = parser.parse_args(argv)
    rates = args.rate or [200.0, 1000.0]
    codes = [c.resolve() for c in args.code or [common.REPO]]
    results: dict[tuple[float, Path], list[dict[str, float]]] = {}
    with common.scratch_database(common.Sizes(), args.rounds) as bench:
        for r in range(args.rounds):
            for rate in rates:
                for code in codes if r % 2 == 0 else codes[::-1]:
                    common.create_table(bench)
                    got = _round(bench, code, rate, args.seconds)
                    results.setdefault((rate, code), []).append(got)
                    print(f"round {r + 1} {rate:g}/s {code}: {_line(got)}", flush=True)
    print("\nmedians of the rounds" + (f"; ratios against {codes[0]}" if len(codes) > 1 else ""))
    for rate in rates:
        base = _medians(results[(rate, codes[0])])
        for code in codes:
            got = _medians(results[(rate, code)])
            ratios = "" if code == codes[0] else "  " + _ratios(got, base)
            print(f"  {rate:g}/s {code}: {_line(got)}{ratios}")
    return 0


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: common.median([r[key] for r in rounds]) for key in rounds[0]}


def _line(got: dict[str, Any]) -> str:
    return (
        f"pickup p50 {got['p50_ms']:.2f} ms, p99 {got['p99_ms']:.2f} ms, "
        f"worker CPU {got['cpu_us_per_job']:.0f} us/job"
    )


def _ratios(got: dict[str, float], base: dict[str, float]) -> str:
    keys = ("p50_ms", "p99_ms", "cpu_us_per_job")
    return "(" + ", ".join(f"{k} {got[k] / base[k]:.2f}x" for k in keys) + ")"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
