"""Judge the queues' settings: a paused queue whose backlog grows (jobs keep
arriving that no worker may take), and each concurrency limit against the
jobs running now."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from ..units import ago, iso
from .model import Finding, Row, ok, warn


def settings_findings(settings: Sequence[Row], now: datetime) -> list[Finding]:
    paused = [_paused_finding(s, now) for s in settings if s["paused"]]
    limits = [_limit_finding(s) for s in settings if s["concurrency_limit"] is not None]
    return [
        *(paused or [ok("paused_queue", "queues", "no queue is paused")]),
        *(limits or [ok("concurrency_limit", "queues", "no queue has a concurrency limit")]),
    ]


def _paused_finding(s: Row, now: datetime) -> Finding:
    queue, arrived = s["queue"], s["queued_since_change"]
    subject = f"queue {queue}"
    since = f"paused (set {ago(s['updated_at'], now)})"
    data = {"queue": queue, "since": iso(s["updated_at"]), "queued_since": arrived}
    if not arrived:
        return ok("paused_queue", subject, f"{since}; no job enqueued since", data)
    return warn(
        "paused_queue",
        subject,
        f"{since}; {arrived:,} job(s) enqueued since, waiting for `jobq resume`",
        f"its backlog grows while paused: `jobq resume {queue}` once it may run, "
        "or stop enqueueing into it",
        data,
    )


def _limit_finding(s: Row) -> Finding:
    limit, running = s["concurrency_limit"], s["running"]
    data = {"queue": s["queue"], "concurrency_limit": limit, "running": running}
    summary = f"at most {limit:,} running at once across all workers; {running:,} running now"
    return ok("concurrency_limit", f"queue {s['queue']}", summary, data)
