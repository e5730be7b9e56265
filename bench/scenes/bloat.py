"""Bloat at peak: workers draining at full speed while producers keep 4,000 jobs ready.

On a throwaway cluster (autovacuum on, default settings), one `jobq worker -c 8
--log-level WARNING` (not burst; `--worker-arg` adds options, e.g. pruning)
works no-op jobs for 3 minutes while a producer tops the queue back up to
about 4,000 ready jobs every 20 ms (INSERTs of 1,000). Every 10 s: jobs
completed, `n_dead_tup`, live tuples, heap, index and total size of the jobs
table, autovacuum runs, and the archive (`jobs_archive`, where the worker
moves done jobs as they complete, by default, or after `--archive-after`):
its size and the rows moved into it. At the end: the peak of dead tuples, and whether the
jobs table's size levels off (growth over the last third of the run against
the first).

`--minutes` scales the run (0.1 for a smoke run of about 25 s).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from . import base

READY = 4_000


def run(minutes: float, log: Any, worker_args: list[str] | None = None) -> dict[str, Any]:
    seconds = 180 * minutes
    every = base.SAMPLE_SECONDS if minutes >= 0.5 else 5.0
    extra = worker_args or []
    with base.throwaway_cluster() as cluster:
        settings = cluster.settings()
        log(
            f"bloat at peak: {seconds:.0f} s, worker -c 8 {' '.join(extra)} at full speed, "
            f"about {READY:,} jobs kept ready; samples every {every:.0f} s"
        )
        log(
            f"  cluster: PostgreSQL {settings['server_version']}, autovacuum "
            f"{settings['autovacuum']}, naptime {settings['autovacuum_naptime']} s, "
            f"scale factor {settings['autovacuum_vacuum_scale_factor']}"
        )
        producer = base.TopUpProducer(cluster.dsn(), READY)
        producer.start()
        while producer.sent < READY:  # the queue is full before the worker starts
            time.sleep(0.05)
        with base.workers([base.worker_cmd(cluster.url(), 8, *extra)]):
            with cluster.connect() as conn:
                epoch0 = base.server_epoch(conn)
            t0 = time.monotonic()
            sampler = base.Sampler(cluster.dsn(), t0, every)
            log(HEADER)
            sent: list[tuple[float, int]] = [(0.0, producer.sent)]

            def on_sample(s: base.Sample) -> None:
                sent.append((s.t, producer.sent))
                log(_line(s))

            sampler.on_sample = on_sample
            sampler.start()
            try:
                time.sleep(max(0.0, t0 + seconds - time.monotonic()))
            finally:
                producer.stop.set()
                sampler.stop.set()
                producer.join()
                sampler.join()
            total = time.monotonic() - t0
        with cluster.connect() as conn:
            rows = base.buckets(conn, epoch0, total, every)
            row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
            done_total = int(row[0]) if row else 0
            row = conn.execute("SELECT count(*) FROM jobs_archive").fetchone()
            archived_total = int(row[0]) if row else 0
    result = summarize(settings, sampler.samples, rows, every, extra, done_total, dict(sent))
    result["archived_rows_at_end"] = archived_total
    return result


HEADER = (
    f"{'t s':>5} {'queued':>7} {'live':>9} {'dead':>9} {'heap MB':>8} {'idx MB':>7} "
    f"{'total MB':>8} {'autovac':>7} {'archived':>10} {'arch MB':>8}"
)


def _line(s: base.Sample) -> str:
    return (
        f"{s.t:>5.0f} {s.queued:>7,} {s.n_live_tup:>9,} {s.n_dead_tup:>9,} "
        f"{base.mb(s.table_bytes):>8} {base.mb(s.index_bytes):>7} "
        f"{base.mb(s.total_bytes):>8} {s.autovacuums:>7} {s.archived:>10,} "
        f"{base.mb(s.archive_bytes):>8}"
    )


def summarize(
    settings: dict[str, str],
    samples: list[base.Sample],
    rows: list[base.Bucket],
    every: float,
    extra: list[str],
    done_total: int,
    sent: dict[float, int],
) -> dict[str, Any]:
    """`completed` per sample interval comes from the producer: jobs sent minus the
    change in the backlog (pruned rows are gone from the table, so counting
    `finished_at` would miss them; the few running jobs are ignored)."""
    third = max(1, len(samples) // 3)
    first, last = samples[:third], samples[-third:]

    def growth(part: list[base.Sample]) -> float:
        """Total bytes gained per second over a part of the run."""
        if len(part) < 2:
            return float("nan")
        return (part[-1].total_bytes - part[0].total_bytes) / (part[-1].t - part[0].t)

    g_first, g_last = growth(first), growth(last)
    table = []
    # t, sent, queued: at t = 0 the worker is just starting, all sent jobs queued
    before = (0.0, sent.get(0.0, 0), sent.get(0.0, 0))
    for s in samples:
        now_sent = sent.get(s.t, before[1])
        done = (now_sent - s.queued) - (before[1] - before[2])
        table.append(
            {"start": before[0], "completed": done, "seconds": s.t - before[0], **asdict(s)}
        )
        before = (s.t, now_sent, s.queued)
    completed = sum(r["completed"] for r in table)
    seconds = samples[-1].t if samples else float("nan")
    return {
        "settings": settings,
        "worker_args": extra,
        "completed": completed,
        "completed_from_rows": sum(b.completed for b in rows),
        "jobs_per_s": completed / seconds if seconds else float("nan"),
        "done_rows_at_end": done_total,
        "peak_dead_tuples": max((s.n_dead_tup for s in samples), default=0),
        "final": asdict(samples[-1]) if samples else {},
        "growth_first_third_bytes_per_s": g_first,
        "growth_last_third_bytes_per_s": g_last,
        "levels_off": bool(g_last <= 0.2 * g_first) if g_first > 0 else g_last <= 0,
        "buckets": table,
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"{'t s':>5} {'done/s':>8} {'dead':>9} {'live':>9} {'heap MB':>8} {'idx MB':>7} "
        f"{'total MB':>8} {'autovac':>7} {'archived':>10} {'arch MB':>8}"
    ]
    for b in r["buckets"]:
        lines.append(
            f"{b['t']:>5.0f} {b['completed'] / b['seconds']:>8,.0f} {b.get('n_dead_tup', 0):>9,} "
            f"{b.get('n_live_tup', 0):>9,} {base.mb(b.get('table_bytes', 0)):>8} "
            f"{base.mb(b.get('index_bytes', 0)):>7} {base.mb(b.get('total_bytes', 0)):>8} "
            f"{b.get('autovacuums', 0):>7} {b.get('archived', 0):>10,} "
            f"{base.mb(b.get('archive_bytes', 0)):>8}"
        )
    f = r["final"]
    idx = ", ".join(f"{k} {base.mb(v)}" for k, v in f.get("indexes", {}).items())
    lines += [
        f"{r['completed']:,} jobs completed ({r['jobs_per_s']:,.0f} jobs/s); peak n_dead_tup "
        f"{r['peak_dead_tuples']:,}",
        f"at the end: heap {base.mb(f.get('table_bytes', 0))} MB, indexes "
        f"{base.mb(f.get('index_bytes', 0))} MB ({idx}), "
        f"total {base.mb(f.get('total_bytes', 0))} MB; archive "
        f"{base.mb(f.get('archive_bytes', 0))} MB, {r.get('archived_rows_at_end', 0):,} jobs "
        f"(done jobs left in the jobs table: {r.get('done_rows_at_end', 0):,})",
        f"total size growth: first third {r['growth_first_third_bytes_per_s'] / base.MB:.2f} MB/s, "
        f"last third {r['growth_last_third_bytes_per_s'] / base.MB:.2f} MB/s: "
        + ("levels off" if r["levels_off"] else "still growing"),
    ]
    return "\n".join(lines)
