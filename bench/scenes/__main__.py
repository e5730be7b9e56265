"""`python -m bench.scenes NAME [--minutes M]`: see bench/scenes/__init__.py."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .. import common
from . import bloat, claim_probe, held_snapshot, many_workers

SCENES = {
    "held-snapshot": held_snapshot,
    "bloat-at-peak": bloat,
    "many-workers": many_workers,
    "claim-probe": claim_probe,
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scenes", description=__doc__)
    parser.add_argument("scene", choices=sorted(SCENES))
    parser.add_argument(
        "--minutes",
        type=float,
        default=1.0,
        help="scale factor of every phase (0.1 for a smoke run)",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="bloat-at-peak, held-snapshot: extra option for the worker (repeatable), "
        "e.g. --worker-arg=--prune-older-than=30s",
    )
    parser.add_argument(
        "--offered",
        type=float,
        default=None,
        help="held-snapshot: jobs/s to offer instead of half the saturated rate "
        "(the same load as an earlier run)",
    )
    parser.add_argument(
        "--no-hold",
        action="store_true",
        help="held-snapshot: the control run: the same phases and load, and the other "
        "session takes no snapshot (how often a 10 s bucket's p99 leaves 1.5x clean "
        "by itself)",
    )
    parser.add_argument(
        "--idle-in-transaction",
        action="store_true",
        help="held-snapshot: the other session updates a row of its own table and "
        "idles in that READ COMMITTED transaction instead of holding a snapshot",
    )
    parser.add_argument(
        "--server-setting",
        action="append",
        default=[],
        help="held-snapshot: a server setting for the throwaway cluster (repeatable), "
        "e.g. --server-setting=shared_buffers=1GB",
    )
    parser.add_argument(
        "--database-setting",
        action="append",
        default=[],
        help="held-snapshot: ALTER DATABASE scene SET name=value before the run "
        "(repeatable), e.g. --database-setting=backend_flush_after=256kB",
    )
    parser.add_argument(
        "--table-setting",
        action="append",
        default=[],
        help="held-snapshot: ALTER TABLE jobs SET (name = value) after the migration "
        "(repeatable), e.g. --table-setting=autovacuum_vacuum_cost_delay=2",
    )
    parser.add_argument(
        "--archive-setting",
        action="append",
        default=[],
        help="held-snapshot: ALTER TABLE jobs_archive SET (name = value) after the "
        "migration (repeatable), e.g. --archive-setting=autovacuum_vacuum_cost_delay=10",
    )
    parser.add_argument(
        "--on-release",
        default=None,
        help="held-snapshot: a statement another session runs in autocommit as the "
        "snapshot is released, e.g. --on-release='REINDEX TABLE CONCURRENTLY jobs'",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="many-workers: jobs per drain instead of 20,000 (a longer drain, a steadier rate)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="many-workers: rounds, interleaved")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    def log(line: str) -> None:
        print(line, flush=True)

    started = time.perf_counter()
    load = os.getloadavg()[0]
    if args.scene == "bloat-at-peak":
        result = bloat.run(args.minutes, log, args.worker_arg)
    elif args.scene == "held-snapshot":
        result = held_snapshot.run(
            args.minutes,
            log,
            args.offered,
            args.worker_arg,
            held=not args.no_hold,
            server_settings=args.server_setting,
            on_release=args.on_release,
            database_settings=args.database_setting,
            idle_in_transaction=args.idle_in_transaction,
            table_settings=args.table_setting,
            archive_settings=args.archive_setting,
        )
    elif args.scene == "many-workers":
        result = many_workers.run(args.minutes, log, args.rounds, args.jobs)
    else:
        result = SCENES[args.scene].run(args.minutes, log)
    result["command"] = " ".join(["python -m bench.scenes", *sys.argv[1:]])
    result["load_start"], result["load_end"] = load, os.getloadavg()[0]
    result["elapsed_s"] = time.perf_counter() - started
    log("")
    log(SCENES[args.scene].report(result))
    log(
        f"load average {load:.1f} at the start, {result['load_end']:.1f} at the end; "
        f"{result['elapsed_s']:.0f} s"
    )
    out = args.json or common.REPO / "bench" / "results" / f"scene-{args.scene}.json"
    common.dump_json(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
