"""`python -m bench` (or `jobq bench`): run the suite, print a table, write JSON."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import common
from ..common import Bench
from . import enqueue, footprint, history, latency, limits, observers, throughput
from .result_cost import run as result_cost_run

SUITE: dict[str, Callable[[Bench, Callable[[str], None]], dict[str, Any]]] = {
    "throughput": throughput.run,
    "latency": latency.run,
    "enqueue": enqueue.run,
    "history": history.run,
    "limits": limits.run,
    "results": result_cost_run,
    "footprint": footprint.run,
    "observers": observers.run,
}
DEFAULT_JSON = common.REPO / "bench" / "results" / "latest.json"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="sqla_jobq benchmarks against the local PostgreSQL, in a scratch database.",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per figure (median)")
    parser.add_argument("--quick", action="store_true", help="smoke run with small sizes")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SUITE),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(SUITE)}",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psycopg

    from sqla_jobq.db import conninfo

    with psycopg.connect(conninfo(common.SERVER_URL)) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('synchronous_commit', 'fsync', 'full_page_writes', 'shared_buffers', "
                "'work_mem', 'autovacuum', 'max_connections')"
            ).fetchall()
        )
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "postgresql": row[0] if row else "?",
        "pg_settings": settings,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = common.Sizes.quick() if args.quick else common.Sizes()
    names = args.only or list(SUITE)
    started = time.perf_counter()

    def log(line: str) -> None:
        print(line, flush=True)

    results: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        "rounds": args.rounds,
        "quick": args.quick,
        "sizes": vars(sizes),
    }
    log(
        f"sqla_jobq benchmarks: {results['machine']['nproc']} cores, "
        f"{results['machine']['cpu_model']}, PostgreSQL {results['machine']['postgresql']}, "
        f"load {results['machine']['loadavg_start'][0]:.1f}, {args.rounds} rounds"
    )
    with common.scratch_database(sizes, args.rounds) as bench:
        for name in names:
            t0 = time.perf_counter()
            log(f"[{name}]")
            results[name] = SUITE[name](bench, log)
            results[name]["elapsed_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    rows = table(results)
    results["table"] = rows
    log("")
    log(render(rows))
    log(f"\n{results['elapsed_s']:.0f}s; JSON in {args.json}")
    common.dump_json(args.json, results)
    return 0


Row = dict[str, str]


def _fmt(value: float, unit: str = "") -> str:
    if value != value:  # NaN
        return "-"
    if abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text}{unit}"


def table(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []

    def add(figure: str, ours: str, base: str, ratio: str, target: str, met: bool | None) -> None:
        mark = "" if met is None else ("yes" if met else "NO")
        rows.append(
            {
                "figure": figure,
                "ours": ours,
                "baseline": base,
                "ratio": ratio,
                "target": target,
                "met": mark,
            }
        )

    def vs(
        figure: str,
        ours: float,
        base: float,
        unit: str,
        ratio: float | None = None,
        target: str = "",
        met: bool | None = None,
    ) -> None:
        """A row of two figures in one unit and their ratio (ours / base unless given)."""
        if ratio is None:
            ratio = common.ratio(ours, base)
        add(figure, _fmt(ours, unit), _fmt(base, unit), _fmt(ratio, "x"), target, met)

    if "throughput" in results:
        t = results["throughput"]
        c = t["contenders"]
        rate = {name: v["median"]["jobs_per_s"] for name, v in c.items()}
        loop, pgb = rate["psycopg loop 8 threads"], rate["pgbench -c 8 -j 2"]
        for ours in ("worker 1x8", "worker 2x4", "worker 1x8 async"):
            r1 = t["ratios"][f"{ours} / psycopg loop"]
            r2 = t["ratios"][f"{ours} / pgbench"]
            vs(
                f"throughput {ours} vs psycopg loop",
                rate[ours],
                loop,
                "/s",
                r1,
                ">= 0.6x",
                r1 >= 0.6,
            )
            vs(f"throughput {ours} vs pgbench", rate[ours], pgb, "/s", r2, ">= 0.35x", r2 >= 0.35)
        info = t["ratios"]["worker 1x8 INFO / worker 1x8"]
        vs(
            "throughput with INFO logging vs WARNING",
            rate["worker 1x8 INFO"],
            rate["worker 1x8"],
            "/s",
            info,
            "(cost of per-job log)",
        )
        vs(
            "throughput with startup frozen out of the GC vs not (--no-gc-freeze)",
            rate["worker 1x8"],
            rate["worker 1x8 no gc freeze"],
            "/s",
            t["ratios"]["worker 1x8 / worker 1x8 no gc freeze"],
            "(gain of gc.freeze)",
        )
        w = c["worker 1x8"]["median"]
        p = c["pgbench -c 8 -j 2"]["median"]
        vs(
            "postgres CPU per 10k jobs, worker 1x8 vs pgbench",
            w["pg_cpu_s_per_10k"],
            p["pg_cpu_s_per_10k"],
            " s",
        )
        lp = c["psycopg loop 8 threads"]["median"]
        vs(
            "client CPU per 10k jobs, worker 1x8 vs psycopg loop",
            w["client_cpu_s_per_10k"],
            lp["client_cpu_s_per_10k"],
            " s",
        )
    if "latency" in results:
        lat = results["latency"]
        r = lat["ratio_p50_from_commit_sent"]
        vs(
            "pickup p50 (from COMMIT sent) vs raw LISTEN/NOTIFY",
            lat["ours_sent"]["p50_ms"],
            lat["raw_sent"]["p50_ms"],
            " ms",
            r,
            "<= 1.25x",
            r <= 1.25,
        )
        # The floor claiming as a hand-written loop would, and as ours does (the goal's).
        for floor, claiming, target in (
            ("floor", "psycopg execute", None),
            ("libpq_floor", "libpq, as ours", 1.1),
        ):
            rf = lat[f"ratio_p50_vs_{floor}"]
            vs(
                f"pickup p50 vs raw LISTEN/NOTIFY + one claim ({claiming})",
                lat["ours_sent"]["p50_ms"],
                lat[f"{floor}_sent"]["p50_ms"],
                " ms",
                rf,
                f"<= {target}x" if target else "",
                rf <= target if target else None,
            )
        p99 = lat["ours_sent"]["p99_ms"]
        add(
            "pickup p99 (from COMMIT sent)",
            _fmt(p99, " ms"),
            _fmt(lat["raw_sent"]["p99_ms"], " ms"),
            "",
            "< 20 ms",
            p99 < 20,
        )
        add(
            "pickup p50 / p99 from COMMIT returned",
            f"{_fmt(lat['ours_ret']['p50_ms'])} / {_fmt(lat['ours_ret']['p99_ms'], ' ms')}",
            f"{_fmt(lat['raw_ret']['p50_ms'])} / {_fmt(lat['raw_ret']['p99_ms'], ' ms')}",
            "",
            "",
            None,
        )
    if "enqueue" in results:
        e = results["enqueue"]
        vs(
            f"enqueue_many {results['sizes']['enqueue_jobs']:,} in one transaction vs COPY",
            e["enqueue_many_jobs_per_s"],
            e["copy_jobs_per_s"],
            "/s",
            e["ratio"],
            ">= 0.5x",
            e["ratio"] >= 0.5,
        )
        s = e["single"]
        add(
            "single task.enqueue (in a transaction): latency, round trips",
            f"{_fmt(s['median_ms'], ' ms')}, {s['round_trips_per_call']:.0f} RT",
            "",
            "",
            "1 round trip",
            s["round_trips_per_call"] == 1,
        )
    if "history" in results:
        h = results["history"]
        vs(
            f"claim 10 + complete with {h['history_rows']:,} finished rows vs none",
            h["history_ms"],
            h["empty_ms"],
            " ms",
            h["ratio"],
            "<= 1.3x",
            h["ratio"] <= 1.3,
        )
    if "limits" in results:
        for name, f in results["limits"]["figures"].items():
            goal = f["target"] == ">= 0.8x"
            met = f["ratio"] >= 0.8 if goal else None
            vs(f"throughput {name}", f["ours"], f["baseline"], "/s", f["ratio"], f["target"], met)
    if "results" in results:
        rc = results["results"]
        rate = rc["jobs_per_s"]
        vs(
            "no-op throughput with results stored vs returning None",
            rate["returning a result"],
            rate["returning None"],
            "/s",
            rc["ratio"],
            ">= 0.9x",
            rc["ratio"] >= 0.9,
        )
        cpu = rc["cpu_us_per_job"]
        vs(
            "worker CPU per job with results stored vs returning None",
            cpu["returning a result"],
            cpu["returning None"],
            " us",
            rc["cpu_ratio"],
        )
    if "footprint" in results:
        f = results["footprint"]
        add(
            f"worker peak RSS (VmHWM) after {results['sizes']['footprint_jobs']:,} jobs",
            _fmt(f["vmhwm_mb"], " MB"),
            f"idle {_fmt(f['rss_idle_mb'], ' MB')}",
            "",
            "< 100 MB",
            f["vmhwm_mb"] < 100,
        )
        add(
            "worker RSS growth from 10% to 100% of the jobs",
            _fmt(f["rss_growth_mb"], " MB"),
            "",
            "",
            "flat",
            f["rss_growth_mb"] < 5,
        )
        add(
            "postgres CPU per 10k jobs (idle worker woken by NOTIFY)",
            _fmt(f["pg_cpu_s_per_10k"], " s"),
            "",
            "",
            "",
            None,
        )
        add("worker CPU per 10k jobs", _fmt(f["worker_cpu_s_per_10k"], " s"), "", "", "", None)
    if "observers" in results:
        o = results["observers"]
        rate, base = o["jobs_per_s"], o["jobs_per_s"][observers.BASELINE]
        with_metrics = "worker 1x8 --metrics-port"
        metrics = o["ratios"][with_metrics]
        vs(
            "throughput with --metrics-port vs without",
            rate[with_metrics],
            base,
            "/s",
            metrics,
            ">= 0.95x",
            metrics >= 0.95,
        )
        cpu = o["cpu_us_per_job"]
        vs(
            "worker CPU per job with --metrics-port vs without",
            cpu[with_metrics],
            cpu[observers.BASELINE],
            " us",
            o["cpu_ratios"][with_metrics],
        )
        with_otel = "worker 1x8 --otel (no provider)"
        vs(
            "throughput with --otel, no provider, vs without",
            rate[with_otel],
            base,
            "/s",
            o["ratios"][with_otel],
            "(why --otel is not implied)",
        )
    return rows


def render(rows: list[Row]) -> str:
    cols = ["figure", "ours", "baseline", "ratio", "target", "met"]
    width = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in cols}
    lines = [" | ".join(c.ljust(width[c]) for c in cols)]
    lines.append("-+-".join("-" * width[c] for c in cols))
    lines += [" | ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)
