"""Held snapshot: a steady load while another session holds a REPEATABLE READ snapshot.

On a throwaway cluster (autovacuum on, default settings):

1. the saturated rate: one `jobq worker -c 8 --burst --log-level WARNING`
   drains 20,000 ready no-op jobs (server clock, first claim to last
   completion), the median of three drains;
2. the same worker, not in burst mode, works a steady offered load of half
   that rate (20 small INSERT transactions a second);
3. after a warm-up (70 s: a worker that archives done jobs 60 s after they
   finish does all of its steady work only from then on; kept for every
   setting, so runs compare) and a clean minute, another session opens a `REPEATABLE READ`
   transaction, reads one row of the jobs table (which takes its snapshot)
   and holds it for 3 minutes, then commits; the scene goes on for 3 more
   minutes to see it recover. With `--idle-in-transaction`, the other
   session instead updates a row of an app table of its own in a READ
   COMMITTED transaction and leaves it idle for the 3 minutes: it holds no
   snapshot between statements, but its transaction id holds the horizon
   back all the same (an app's forgotten transaction; a read alone would
   hold nothing).

Every 10 s it samples `pg_stat_user_tables` (live and dead tuples, autovacuum
runs), the jobs table's heap and index sizes and the backlog; at the end it
reads back from the rows, per 10-second bucket, what was offered (`created_at`),
what was completed (`finished_at`), and the pickup latency (`started_at -
created_at`: the server's enqueue-to-claim time) p50 and p99, and the same
over each phase's jobs as one set: the clean minute, the hold, and from 2
minutes after the release to the end (a bucket's p99 follows a few slow
seconds; the set's, every pickup of the phase).

`--minutes` scales every phase (0.1 for a smoke run of about 40 s).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from itertools import pairwise
from typing import Any

import psycopg
from psycopg import sql

from . import base

# Goal 3's recovery bound: latency back to clean within 2 minutes of the release.
SETTLED_AFTER = 120.0


def run(
    minutes: float,
    log: Any,
    offered_rate: float | None = None,
    worker_args: list[str] | None = None,
    held: bool = True,
    server_settings: Sequence[str] = (),
    on_release: str | None = None,
    database_settings: Sequence[str] = (),
    idle_in_transaction: bool = False,
    table_settings: Sequence[str] = (),
    archive_settings: Sequence[str] = (),
) -> dict[str, Any]:
    """`offered_rate` (jobs/s) replaces half the saturated rate: the same
    absolute load as another run, when comparing two versions of the worker
    whose saturated rates differ. `worker_args` go to the steady worker only
    (an A/B of one of its options against the same saturated measure).
    `held` False is the control run: everything else the same, the other
    session reads in autocommit and holds nothing, so the "after" phase shows
    how far a clean queue's 10 s buckets stray from the clean p99 alone.
    `server_settings` (`name=value`) change the cluster's defaults;
    `database_settings` are set with `ALTER DATABASE scene SET`, as an owner
    without superuser rights can (new sessions and autovacuum take them).
    `on_release` is a statement another session runs in autocommit as the
    snapshot is released (say `REINDEX TABLE CONCURRENTLY jobs`), in the
    background so the scene's clock goes on: a remedy tried before building it.
    `idle_in_transaction`: the other session writes a row of its own table
    and idles in that transaction instead of holding a snapshot.
    `table_settings` (`name=value`) are storage parameters set on the jobs
    table after the migration (`ALTER TABLE jobs SET`): another value of one
    the migration sets, tried before a schema step changes it;
    `archive_settings` the same for `jobs_archive`."""
    extra = worker_args or []
    # The warm-up is not part of the clean baseline: with `--archive-after 60s`,
    # before the first done jobs are old enough to archive, the worker does
    # less than it does from then on, through the hold and after it.
    warm, clean, hold, after = 70 * minutes, 60 * minutes, 180 * minutes, 180 * minutes
    every = base.SAMPLE_SECONDS if minutes >= 0.5 else 5.0
    sat_jobs = 20_000 if minutes >= 0.5 else 3_000
    with base.throwaway_cluster(server_settings) as cluster:
        with cluster.connect() as conn:
            conn.execute("CREATE TABLE app_rows (id int PRIMARY KEY, n int NOT NULL)")
            conn.execute("INSERT INTO app_rows VALUES (1, 0)")
            _apply(conn, "ALTER DATABASE scene SET {} = {}", database_settings)
            _apply(conn, "ALTER TABLE jobs SET ({} = {})", table_settings)
            _apply(conn, "ALTER TABLE jobs_archive SET ({} = {})", archive_settings)
        settings = cluster.settings()
        sat = base.saturated_rate(cluster, sat_jobs)
        offered = sat / 2 if offered_rate is None else offered_rate
        log(
            f"held snapshot: saturated {sat:,.0f} jobs/s (median of 3 drains of {sat_jobs:,} "
            "jobs, burst -c 8); "
            f"offering {offered:,.0f} jobs/s to worker -c 8 {' '.join(extra)}; "
            f"warm-up {warm:.0f} s, clean {clean:.0f} s, hold {hold:.0f} s, "
            f"after {after:.0f} s; samples every {every:.0f} s"
        )
        log(
            f"  cluster: PostgreSQL {settings['server_version']}, autovacuum "
            f"{settings['autovacuum']}, naptime {settings['autovacuum_naptime']} s, "
            f"scale factor {settings['autovacuum_vacuum_scale_factor']}"
        )
        log(HEADER)
        with base.workers([base.worker_cmd(cluster.url(), 8, *extra)]) as procs:
            time.sleep(2)  # the worker connects and LISTENs
            with cluster.connect() as conn:
                epoch0 = base.server_epoch(conn)
            t0 = time.monotonic()
            producer = base.SteadyProducer(cluster.dsn(), offered)
            sampler = base.Sampler(cluster.dsn(), t0, every)
            sampler.on_sample = lambda s: log(_live_line(s))
            watch = base.Watch(cluster.dsn(), t0, [p.pid for p in procs])
            producer.start()
            sampler.start()
            watch.start()
            holder = psycopg.connect(cluster.dsn())
            try:
                time.sleep(max(0.0, t0 + warm + clean - time.monotonic()))
                holder.autocommit = not held
                what = _hold(holder, idle_in_transaction)
                hold_start = time.monotonic() - t0
                taken = "taken and held" if held else "not held (control run)"
                log(f"  -- {hold_start:.0f} s: {what} {taken}")
                time.sleep(max(0.0, t0 + warm + clean + hold - time.monotonic()))
                holder.commit()
                hold_end = time.monotonic() - t0
                log(f"  -- {hold_end:.0f} s: released (committed)")
                remedy = _Remedy(cluster.dsn(), on_release, t0, log) if on_release else None
                time.sleep(max(0.0, t0 + warm + clean + hold + after - time.monotonic()))
                if remedy is not None:
                    remedy.join()
            finally:
                holder.close()
                for thread in (producer, sampler, watch):
                    thread.stop.set()
                    thread.join()
            total = time.monotonic() - t0
            time.sleep(3)  # the worker finishes what it holds
        settled = hold_end + SETTLED_AFTER * minutes
        with cluster.connect() as conn:
            rows = base.buckets(conn, epoch0, total, every)
            seconds = base.buckets(conn, epoch0, total, 1.0)
            spans = {
                name: base.span_pickup(conn, epoch0, start, end, total)
                for name, start, end in (
                    ("clean", warm, hold_start),
                    ("hold", hold_start, hold_end),
                    ("settled", settled, total),
                )
            }
    result = summarize(
        sat,
        producer.rate,
        producer.late_ticks,
        settings,
        sampler.samples,
        rows,
        warm,
        hold_start,
        hold_end,
        every,
    )
    result["spans"] = spans
    result["settled_after_release_s"] = settled - hold_end
    result["worker_args"] = extra
    result["held"] = held
    result["hold_kind"] = "idle in transaction" if idle_in_transaction else "snapshot"
    result["server_settings"] = list(server_settings)
    result["database_settings"] = list(database_settings)
    result["table_settings"] = list(table_settings)
    result["archive_settings"] = list(archive_settings)
    result["on_release"] = on_release
    result["watch"] = {
        "warm": base.watch_summary(watch.glimpses, 0, warm),
        "clean": base.watch_summary(watch.glimpses, warm, hold_start),
        "hold": base.watch_summary(watch.glimpses, hold_start, hold_end),
        "after": base.watch_summary(watch.glimpses, hold_end, total),
    }
    for b in result["buckets"]:
        b["watch"] = base.watch_summary(watch.glimpses, b["start"], b["start"] + every)
    result["per_second"] = [
        {**asdict(s), **base.machine_between(watch.glimpses, s.start, s.start + 1)}
        for s in seconds
    ]
    return result


def _apply(conn: psycopg.Connection[Any], template: str, settings: Sequence[str]) -> None:
    """Each `name=value` through `template`, the name quoted as an identifier."""
    for setting in settings:
        name, _, value = setting.partition("=")
        conn.execute(sql.SQL(template).format(sql.Identifier(name), sql.Literal(value)))


def _hold(holder: psycopg.Connection[Any], idle_in_transaction: bool) -> str:
    """Open what the other session holds; what it is, for the log."""
    if idle_in_transaction:
        holder.execute("UPDATE app_rows SET n = n + 1 WHERE id = 1")
        return "a transaction idle after a write (READ COMMITTED)"
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT id FROM jobs LIMIT 1").fetchall()
    return "REPEATABLE READ snapshot"


class _Remedy(threading.Thread):
    """Runs one statement in autocommit and logs how long it took."""

    def __init__(self, dsn: str, sql: str, t0: float, log: Any) -> None:
        super().__init__(daemon=True)
        self.dsn, self.sql, self.t0, self.log = dsn, sql, t0, log
        self.start()

    def run(self) -> None:
        began = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(self.sql)
        self.log(
            f"  -- {time.monotonic() - self.t0:.0f} s: {self.sql!r} took "
            f"{time.monotonic() - began:.1f} s"
        )


HEADER = (
    f"{'t s':>5} {'queued':>7} {'live':>9} {'dead':>9} {'heap MB':>8} {'idx MB':>7} "
    f"{'total MB':>8} {'autovac':>7}"
)


def _live_line(s: base.Sample) -> str:
    return (
        f"{s.t:>5.0f} {s.queued:>7,} {s.n_live_tup:>9,} {s.n_dead_tup:>9,} "
        f"{base.mb(s.table_bytes):>8} {base.mb(s.index_bytes):>7} "
        f"{base.mb(s.total_bytes):>8} {s.autovacuums:>7}"
    )


def summarize(
    sat: float,
    offered: float,
    late: int,
    settings: dict[str, str],
    samples: list[base.Sample],
    rows: list[base.Bucket],
    warm: float,
    hold_start: float,
    hold_end: float,
    every: float,
) -> dict[str, Any]:
    def phase(start: float) -> str:
        end = start + every
        if end <= warm:
            return "warm"
        if end <= hold_start:
            return "clean"
        if start >= hold_end:
            return "after"
        return "hold" if start >= hold_start and end <= hold_end else "edge"

    clean = [b for b in rows if phase(b.start) == "clean"]
    warming = [b for b in rows if phase(b.start) == "warm"][1:]  # its first bucket starts up
    held = [b for b in rows if phase(b.start) == "hold"]
    after = [b for b in rows if phase(b.start) == "after"]
    clean_p99 = statistics.median([b.pickup_p99_ms for b in clean]) if clean else float("nan")
    clean_p50 = statistics.median([b.pickup_p50_ms for b in clean]) if clean else float("nan")
    off_hold = sum(b.offered for b in held)
    done_hold = sum(b.completed for b in held)
    worst = min((b.completed / b.offered for b in held if b.offered), default=float("nan"))
    hold_p99 = max((b.pickup_p99_ms for b in held), default=float("nan"))
    hold_p99_median = statistics.median([b.pickup_p99_ms for b in held]) if held else float("nan")
    # Latency recovered: the first bucket after the release from which on every
    # bucket's p99 is within 1.5x the clean p99.
    latency_back = None
    for i, b in enumerate(after):
        if all(x.pickup_p99_ms <= 1.5 * clean_p99 for x in after[i:-1] or [b]):
            latency_back = b.start - hold_end
            break
    clean_queued = max((s.queued for s in samples if warm < s.t <= hold_start), default=0)
    backlog_back = next(
        (
            s.t - hold_end
            for s in samples
            if s.t > hold_end and s.queued <= max(2 * clean_queued, 1_000)
        ),
        None,
    )
    clean_dead = max((s.n_dead_tup for s in samples if warm < s.t <= hold_start), default=0)
    peak_dead = max((s.n_dead_tup for s in samples), default=0)
    dead_back = next(
        (
            s.t - hold_end
            for s in samples
            if s.t > hold_end and s.n_dead_tup <= max(1.2 * clean_dead, 0.1 * peak_dead)
        ),
        None,
    )
    table = []
    for b in rows:
        s = base.sample_at(samples, b.start + every)
        table.append({"phase": phase(b.start), **asdict(b), **(asdict(s) if s else {})})
    return {
        "settings": settings,
        "saturated_jobs_per_s": sat,
        "offered_jobs_per_s": offered,
        "late_ticks": late,
        "warm_s": warm,
        "warm_pickup_p99_ms": statistics.median([b.pickup_p99_ms for b in warming])
        if warming
        else float("nan"),
        "hold_start_s": hold_start,
        "hold_end_s": hold_end,
        "clean_pickup_p50_ms": clean_p50,
        "clean_pickup_p99_ms": clean_p99,
        "hold_completed_over_offered": done_hold / off_hold if off_hold else float("nan"),
        "hold_worst_bucket_completed_over_offered": worst,
        "hold_pickup_p99_max_ms": hold_p99,
        "hold_pickup_p99_median_ms": hold_p99_median,
        "hold_p99_over_clean_p99": hold_p99 / clean_p99 if clean_p99 else float("nan"),
        "latency_recovered_after_release_s": latency_back,
        "clean_backlog_max": clean_queued,
        "peak_backlog": max((s.queued for s in samples), default=0),
        "backlog_back_after_release_s": backlog_back,
        "clean_dead_tuples_max": clean_dead,
        "peak_dead_tuples": peak_dead,
        "dead_tuples_reclaimed_after_release_s": dead_back,
        "buckets": table,
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"{'t s':>5} {'phase':<5} {'offered/s':>9} {'done/s':>8} {'done/off':>8} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'dead':>9} {'live':>9} {'heap MB':>8} "
        f"{'idx MB':>7} {'autovac':>7} {'arch av':>7} {'queued':>8} {'unstarted':>9} "
        f"{'WAL MB':>7} {'FPIs':>7} {'ckpts':>5} {'heap rd':>7} {'idx rd':>7} {'be wr':>6} "
        f"{'cores':>5} {'steal':>6}"
    ]
    every = (r["buckets"][1]["start"] - r["buckets"][0]["start"]) if len(r["buckets"]) > 1 else 10
    before: dict[str, Any] = {}
    for b in r["buckets"]:
        ratio = b["completed"] / b["offered"] if b["offered"] else float("nan")
        wal, fpi, heap_rd, idx_rd, be_wr = (
            b.get(k, 0) - before.get(k, b.get(k, 0))
            for k in ("wal_bytes", "wal_fpi", "heap_read", "idx_read", "backend_writes")
        )
        cores, steal = base.machine_use(base.sample_ticks(before), base.sample_ticks(b))
        before = b
        lines.append(
            f"{b['start']:>5.0f} {b['phase']:<5} {b['offered'] / every:>9,.0f} "
            f"{b['completed'] / every:>8,.0f} {ratio:>8.2f} {b['pickup_p50_ms']:>8.1f} "
            f"{b['pickup_p99_ms']:>8.1f} {b.get('n_dead_tup', 0):>9,} "
            f"{b.get('n_live_tup', 0):>9,} {base.mb(b.get('table_bytes', 0)):>8} "
            f"{base.mb(b.get('index_bytes', 0)):>7} {b.get('autovacuums', 0):>7} "
            f"{b.get('archive_autovacuums', 0):>7} {b.get('queued', 0):>8,} {b['unstarted']:>9,} "
            f"{base.mb(wal):>7} {fpi:>7,} {b.get('checkpoints', 0):>5} {heap_rd:>7,} "
            f"{idx_rd:>7,} {be_wr:>6,} {cores:>5.2f} {steal:>6.1%}"
        )

    def s(v: Any, unit: str = "") -> str:
        return "never (within the scene)" if v is None else f"{v:,.1f}{unit}"

    lines += [
        f"saturated {r['saturated_jobs_per_s']:,.0f} jobs/s, offered "
        f"{r['offered_jobs_per_s']:,.0f} jobs/s ({r['late_ticks']} late producer ticks)",
        f"during the hold: completed / offered = {r['hold_completed_over_offered']:.3f} "
        f"(worst 10 s: {r['hold_worst_bucket_completed_over_offered']:.3f})",
        f"pickup p99: warm-up {r.get('warm_pickup_p99_ms', float('nan')):.1f} ms (not in the "
        f"baseline), clean {r['clean_pickup_p99_ms']:.1f} ms (p50 "
        f"{r['clean_pickup_p50_ms']:.1f}), during the hold max "
        f"{r['hold_pickup_p99_max_ms']:.1f} ms (median of buckets "
        f"{r['hold_pickup_p99_median_ms']:.1f}): {r['hold_p99_over_clean_p99']:.2f}x clean",
        f"dead tuples: clean max {r['clean_dead_tuples_max']:,}, peak "
        f"{r['peak_dead_tuples']:,}; reclaimed "
        f"{s(r['dead_tuples_reclaimed_after_release_s'], ' s')} after the release",
        f"backlog: clean max {r['clean_backlog_max']:,}, peak {r['peak_backlog']:,}; back "
        f"under max(2x clean, 1,000) {s(r['backlog_back_after_release_s'], ' s')} after the "
        "release",
        f"pickup p99 back within 1.5x clean "
        f"{s(r['latency_recovered_after_release_s'], ' s')} after the release",
        *_span_lines(r),
    ]
    return "\n".join(lines + _watch_lines(r))


def _span_lines(r: dict[str, Any]) -> list[str]:
    """Each phase's pickups as one set, against the clean minute's."""
    spans = r.get("spans")
    if not spans:
        return []
    clean = spans["clean"]["p99_ms"]
    parts = [
        f"{name} {x['p99_ms']:.1f} ms ({x['p99_ms'] / clean:.2f}x; p50 {x['p50_ms']:.1f}, "
        f"{x['jobs']:,} jobs)"
        for name, x in spans.items()
    ]
    return [
        "pickup p99 over each phase's jobs as one set (settled: from "
        f"{r['settled_after_release_s']:.0f} s after the release to the end): " + ", ".join(parts)
    ]


def _watch_lines(r: dict[str, Any]) -> list[str]:
    """Where the worker's time went per phase, and the slowest seconds."""
    lines = []
    for phase, w in r.get("watch", {}).items():
        waits = ", ".join(f"{k} {v:.0%}" for k, v in list(w["waits"].items())[:4])
        lines.append(
            f"{phase}: worker process {w['worker_cpu_cores']:.2f} cores; its active "
            f"sessions: {waits or 'none seen'}"
        )
        lines.append("  " + _server_line(w.get("server_cores", {}), _done_per_s(r, phase)))
    lines += _slow_seconds(r)
    lines += _late_buckets(r)
    worst = sorted(r.get("per_second", []), key=lambda x: -x["pickup_p99_ms"])[:5]
    if worst:
        lines.append(
            "slowest seconds (t: pickup p99, jobs created / finished / archived): "
            + "; ".join(
                f"{x['start']:.0f} s: {x['pickup_p99_ms']:,.0f} ms, "
                f"{x['offered']:,} / {x['completed']:,} / {x['archived']:,}"
                for x in sorted(worst, key=lambda x: x["start"])
            )
        )
    return lines


def _late_buckets(r: dict[str, Any]) -> list[str]:
    """What ran in each bucket after the release whose p99 is over the
    recovery bound (1.5x clean): which VACUUMs, in which phase, and the
    busiest server roles."""
    bound = 1.5 * r["clean_pickup_p99_ms"]
    lines = []
    for before, b in pairwise(r["buckets"]):
        w = b.get("watch")
        if b["phase"] != "after" or b["pickup_p99_ms"] <= bound or not w:
            continue
        vacuums = ", ".join(f"{k} {v:.0%}" for k, v in w["vacuums"].items()) or "no VACUUM"
        roles = ", ".join(f"{k} {v:.2f}" for k, v in list(w["server_cores"].items())[:4])
        cores, steal = base.machine_use(base.sample_ticks(before), base.sample_ticks(b))
        lines.append(
            f"over the bound at {b['start']:.0f} s ({b['pickup_p99_ms']:.1f} ms > {bound:.1f}):"
            f" {vacuums}; server cores: {roles}; machine {cores:.2f} cores busy, steal {steal:.1%}"
        )
    return lines


def _done_per_s(r: dict[str, Any], phase: str) -> float:
    """Jobs completed a second in a phase's buckets ("warm" includes its first)."""
    inside = [b for b in r["buckets"] if b["phase"] == phase]
    every = (r["buckets"][1]["start"] - r["buckets"][0]["start"]) if len(r["buckets"]) > 1 else 10
    return sum(b["completed"] for b in inside) / (every * len(inside)) if inside else 0.0


def _server_line(cores: dict[str, float], done_per_s: float) -> str:
    """The server's cores in a phase, the busiest roles, and CPU per job."""
    total = sum(cores.values())
    per_job = f", {1e6 * total / done_per_s:.0f} us per job completed" if done_per_s else ""
    roles = ", ".join(f"{k} {v:.2f}" for k, v in list(cores.items())[:7])
    return f"server {total:.2f} cores{per_job}: {roles or 'none seen'}"


def _slow_seconds(r: dict[str, Any]) -> list[str]:
    """Did the slow seconds (pickup p99 over twice the clean bucket p99) have
    the machine to themselves? Its busy cores and the hypervisor's steal in
    them, against all seconds'."""
    per = [x for x in r.get("per_second", []) if not math.isnan(x.get("steal", math.nan))]
    if not per or math.isnan(r["clean_pickup_p99_ms"]):
        return []
    slow = [x for x in per if x["pickup_p99_ms"] > 2 * r["clean_pickup_p99_ms"]]

    def machine(xs: list[dict[str, Any]]) -> str:
        if not xs:
            return "-"
        cores = statistics.median(x["machine_cores"] for x in xs)
        stolen = sum(1 for x in xs if x["steal"] > 0.01)
        return f"median {cores:.2f} cores busy, {stolen} with steal over 1%"

    return [
        f"slow seconds (p99 over 2x clean): {len(slow)} of {len(per)}; "
        f"in them: {machine(slow)}; in all seconds: {machine(per)}"
    ]
