"""3: pickup latency of an idle worker, against a raw LISTEN/NOTIFY round trip.

One idle `jobq worker` (not burst, LISTEN active, poll interval 60 s so only
a notification can wake it) runs the `stamp` task, whose handler writes
time.time() as its first act. The producer commits one job at a time with a
gap between them and records time.time() just before COMMIT and just after it
returns. In the same round, job by job in turn with the worker's (so both
are measured over the same seconds), the baseline: a psycopg connection
LISTENing in a thread, recording when the notification arrives. Both sides'
jobs are committed the same way (`_producer`: a psycopg connection running
INSERT; COMMIT, whose trigger sends the NOTIFY and whose COMMIT waits for the
WAL flush), so the producer's own code costs them alike: through
SQLAlchemy, the worker's side started its COMMIT about 15 us later. A
second baseline, the floor for any worker that must claim a job before
running it: the same listener then runs the worker's claim statement and
records when it returns. The raw side commits into its own queue table
(`jobs_floor`, same schema and trigger), so its transactions are exactly the
worker's side's. The floor claims in two ways, every other round: through
psycopg's `Connection.execute`, as a hand-written loop would, and on libpq
directly with its parameters dumped ahead, as the worker's idle claim does
(`sqla_jobq.direct`), the stricter floor: what is left between it and the
worker is the worker's own cost. Not every other job: a claim's Python runs
cold after an idle gap, and at twice the worker's gap psycopg's execute took
0.17 ms longer.

Two figures per side:

* from COMMIT sent: includes the producer's commit (WAL flush), which is most
  of the raw round trip; this is the like-for-like comparison.
* from COMMIT returned: what the producer's code would observe. The raw
  notification often arrives before the producer's COMMIT returns, so the
  baseline here is close to zero and a ratio against it means little; the
  absolute figure is reported.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from .. import common
from ..common import Bench

FLOOR_TABLE = "jobs_floor"


def _wait_for_listener(bench: Bench, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with bench.connect() as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query ILIKE 'LISTEN%%'"
            ).fetchone()
            if row and row[0] > 0:
                return
            time.sleep(0.05)
    raise RuntimeError("the worker did not start LISTENing")


STOP = -999_999  # the sequence number that ends the listener


@contextmanager
def raw_floor(
    bench: Bench, *, on_libpq: bool = False
) -> Iterator[tuple[Callable[[int], tuple[float, float]], dict[int, float], dict[int, float]]]:
    """Raw LISTEN/NOTIFY, and the floor: the same plus one claim round trip
    (the least any worker that must claim before it runs a job can do): a
    call committing one job (the times just before COMMIT and just after it
    returned), and when each job's notification arrived and its claim returned.

    The producer commits an enqueue's INSERT into `jobs_floor` (our schema: its
    trigger sends the NOTIFY); the listener records when the notification
    arrives, claims with the worker's own claim statement (prepared, autocommit)
    and records when the claim returns: through psycopg's `Connection.execute`,
    or `on_libpq` as the worker's idle claim does (`sqla_jobq.direct`).
    """
    received: dict[int, float] = {}
    claimed: dict[int, float] = {}
    listening = threading.Event()
    with bench.connect() as listener, _floor_claims(bench, on_libpq=on_libpq) as claim_now:

        def listen() -> None:
            listener.execute(f'LISTEN "public.{FLOOR_TABLE}"')
            listening.set()
            for _ in listener.notifies():
                woke = time.time()
                payloads = claim_now()
                now = time.time()
                seqs = [int(payload["seq"]) for payload in payloads]
                for seq in seqs:
                    received[seq], claimed[seq] = woke, now
                if STOP in seqs:
                    return

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        listening.wait(10)
        with _producer(bench, FLOOR_TABLE) as one:
            try:
                yield one, received, claimed
            finally:
                one(STOP)
                thread.join(10)


@contextmanager
def _floor_claims(bench: Bench, *, on_libpq: bool) -> Iterator[Callable[[], list[Any]]]:
    """The floor's claim of up to 8 jobs with the worker's statement, warmed
    up: a call returning their payloads. Through psycopg's `execute`
    (prepared, autocommit), or `on_libpq` as the worker's idle claim runs."""
    from datetime import timedelta

    from sqlalchemy import MetaData

    from sqla_jobq.direct import DirectConnection, Numbered
    from sqla_jobq.driver import Compiled
    from sqla_jobq.schema import jobs_table
    from sqla_jobq.statements import claim

    stmt = claim(jobs_table(MetaData(), FLOOR_TABLE), queue="default", lease=timedelta(minutes=5))
    close: Callable[[], None]
    if on_libpq:
        direct = DirectConnection(bench.url, prepared=True)
        bound = Numbered.of(stmt).bind(limit=8)

        def claim_now() -> list[Any]:
            return [json.loads(row["payload"]) for row in direct.run(bound)]

        close = direct.close
    else:
        claimer = psycopg.connect(bench.dsn, autocommit=True, prepare_threshold=0)
        compiled = Compiled.of(stmt)
        params = compiled.params(limit=8)

        def claim_now() -> list[Any]:
            return [row[3] for row in claimer.execute(compiled.sql, params).fetchall()]

        close = claimer.close
    try:
        for _ in range(3):
            claim_now()
        yield claim_now
    finally:
        close()


@contextmanager
def _producer(bench: Bench, table: str) -> Iterator[Callable[[int], tuple[float, float]]]:
    """A call committing one `stamp` job into `table` in a transaction of its
    own: the times just before COMMIT and just after it returned."""
    insert = f"INSERT INTO {table} (task, payload) VALUES ('stamp', %s::jsonb)"
    with psycopg.connect(bench.dsn) as sender:

        def one(seq: int) -> tuple[float, float]:
            sender.execute(insert, (json.dumps({"seq": seq}),))
            before = time.time()
            sender.commit()
            return before, time.time()

        yield one


def _paired_round(
    bench: Bench, stamps: Path, first: int, count: int, gap: float, *, on_libpq: bool
) -> dict[str, list[float]]:
    """`count` jobs for the worker and as many for the floor, one of each in
    turn, `gap` apart: both sides are measured over the same seconds, so a
    slower stretch of the machine costs them alike (in rounds of their own,
    one side's stretch could be slower than the other's). The floor's claims
    run `on_libpq` or through psycopg's execute (`libpq_floor_sent` or
    `floor_sent`)."""
    raw_sent: dict[int, tuple[float, float]] = {}
    ours_sent: dict[int, tuple[float, float]] = {}
    floor = raw_floor(bench, on_libpq=on_libpq)
    with floor as (send, heard, claimed), _producer(bench, "jobs") as ours:
        for i in range(count):
            raw_sent[i] = send(i)
            time.sleep(gap)
            ours_sent[first + i] = ours(first + i)
            time.sleep(gap)
    deadline = time.monotonic() + 10
    received: dict[int, float] = {}
    while time.monotonic() < deadline:
        received = _read_stamps(stamps)
        if all(s in received for s in ours_sent):
            break
        time.sleep(0.05)
    raw, raw_ret = _deltas(raw_sent, heard)
    floor_sent, _ = _deltas(raw_sent, claimed)
    ours, ours_ret = _deltas(ours_sent, received)
    return {
        "raw_sent": raw,
        "raw_ret": raw_ret,
        "libpq_floor_sent" if on_libpq else "floor_sent": floor_sent,
        "ours_sent": ours,
        "ours_ret": ours_ret,
    }


def _deltas(
    sent: dict[int, tuple[float, float]], received: dict[int, float]
) -> tuple[list[float], list[float]]:
    missing = set(sent) - set(received)
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(sent)} were never picked up")
    from_sent = [(received[i] - sent[i][0]) * 1000 for i in sent]
    from_returned = [(received[i] - sent[i][1]) * 1000 for i in sent]
    return from_sent, from_returned


def _read_stamps(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            seq, at = line.split()
            out[int(seq)] = float(at)
    return out


def run(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    n, gap = bench.sizes.latency_jobs, bench.sizes.latency_gap
    common.create_table(bench)
    common.create_table(bench, FLOOR_TABLE)
    with tempfile.TemporaryDirectory(prefix="jobq-bench-") as tmpdir:
        stamps = Path(tmpdir) / "stamps"
        cmd = common.worker_command(
            bench, concurrency=8, burst=False, extra=["--poll-interval", "60"]
        )
        worker = subprocess.Popen(
            cmd,
            cwd=common.REPO,
            env=common.child_env(JOBQ_BENCH_STAMPS=str(stamps)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        rounds: list[dict[str, list[float]]] = []
        try:
            _wait_for_listener(bench)
            # Warm up: connections made, statements prepared, code paths run.
            _paired_round(bench, stamps, -20, 20, gap, on_libpq=False)
            for r in range(bench.rounds):
                on_libpq = r % 2 == 0  # the stricter floor first, and in every odd round
                got = _paired_round(bench, stamps, r * n, n, gap, on_libpq=on_libpq)
                floor = "on libpq" if on_libpq else "psycopg execute"
                floor_ms = common.median(got["libpq_floor_sent" if on_libpq else "floor_sent"])
                rounds.append(got)
                log(
                    f"  round {r + 1} pickup p50 {common.median(got['ours_sent']):.2f} ms "
                    f"(raw {common.median(got['raw_sent']):.2f} ms, raw + claim "
                    f"{floor_ms:.2f} ms, {floor}), p99 "
                    f"{common.percentile(got['ours_sent'], 99):.2f} ms "
                    f"(raw {common.percentile(got['raw_sent'], 99):.2f} ms)"
                )
        finally:
            worker.terminate()
            try:
                _, err = worker.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                _, err = worker.communicate()
        if worker.returncode not in (0, -15):
            raise RuntimeError(f"latency worker exited {worker.returncode}: {err[-2000:]}")
    return summarize(rounds)


SIDES = ("raw_sent", "raw_ret", "floor_sent", "libpq_floor_sent", "ours_sent", "ours_ret")


def summarize(rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    def stat(key: str, fn: Callable[[list[float]], float]) -> float:
        values = [fn(r[key]) for r in rounds if key in r]  # a floor is in every other round
        return common.median(values) if values else float("nan")

    def ratio(key: str, fn: Callable[[list[float]], float]) -> float:
        values = [common.ratio(fn(r["ours_sent"]), fn(r[key])) for r in rounds if key in r]
        return common.median(values) if values else float("nan")

    def p50(v: list[float]) -> float:
        return common.median(v)

    def p99(v: list[float]) -> float:
        return common.percentile(v, 99)

    out: dict[str, Any] = {
        key: {"p50_ms": stat(key, p50), "p99_ms": stat(key, p99)}
        for key in SIDES
    }
    out["ratio_p50_from_commit_sent"] = ratio("raw_sent", p50)
    out["ratio_p99_from_commit_sent"] = ratio("raw_sent", p99)
    out["ratio_p50_vs_floor"] = ratio("floor_sent", p50)
    out["ratio_p50_vs_libpq_floor"] = ratio("libpq_floor_sent", p50)
    out["added_p50_ms"] = common.median([p50(r["ours_sent"]) - p50(r["raw_sent"]) for r in rounds])
    out["samples_per_round"] = len(rounds[0]["ours_sent"]) if rounds else 0
    return out
