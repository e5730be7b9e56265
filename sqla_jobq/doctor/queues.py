"""Judge the queues in the table: a backlog no worker takes, leases that
expired with nothing to reap them or are nearly used up, and jobs that
recently outlived their lease or failed for good, each with example ids."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..schema import Names
from ..units import period, rounded, secs
from .model import Finding, Row, Thresholds, ok, warn


@dataclass(frozen=True)
class _QueueCheck:
    """A per-queue count that is a warning when not zero. Texts are formatted
    with count, ids, grace, recent, ratio and table."""

    check: str
    summary: str
    advice: str
    ok: str


_QUEUE_CHECKS = (
    _QueueCheck(
        "expired_leases",
        "{count:,} running job(s) whose lease expired over {grace} ago (ids {ids})",
        "nothing reaps them: run `jobq reap`, and check that workers (they reap) are running",
        "no lease expired over {grace} ago",
    ),
    _QueueCheck(
        "lease_nearly_used",
        "{count:,} running job(s) past {ratio:.0%} of their lease (ids {ids})",
        "give these tasks a longer lease or extend it while they run (extend_lease), "
        "or they are reaped and run twice",
        "no running job past {ratio:.0%} of its lease",
    ),
    _QueueCheck(
        "lease_expired_recently",
        "{count:,} job(s) outlived their lease in the last {recent} "
        "(last_error 'lease expired', ids {ids})",
        "a lease shorter than the task, or a worker crashing mid-job: compare the task's "
        "run time with its lease, and read the worker logs",
        "no job outlived its lease in the last {recent}",
    ),
    _QueueCheck(
        "failed_recently",
        "{count:,} job(s) failed for good in the last {recent} (ids {ids})",
        "read why: SELECT id, task, last_error FROM {table} WHERE id IN ({ids}); "
        "once fixed, `jobq retry ID`",
        "no job failed for good in the last {recent}",
    ),
)


def queue_findings(
    queues: Sequence[Row], names: Names, t: Thresholds, paused: Collection[str] = ()
) -> list[Finding]:
    backlog = [_backlog_finding(q, t, q["queue"] in paused) for q in queues] or [
        ok("ready_backlog", "queues", "the table holds no jobs")
    ]
    words = {
        "grace": secs(t.expired_lease_grace_seconds),
        "recent": period(t.recent),
        "ratio": t.lease_used_ratio,
        "table": names.qualified,
    }
    counted: list[Finding] = []
    for spec in _QUEUE_CHECKS:
        found = [_counted_finding(spec, q, words) for q in queues if q[spec.check]]
        counted += found or [ok(spec.check, "queues", spec.ok.format(**words))]
    return [*backlog, *counted]


def _counted_finding(spec: _QueueCheck, q: Row, words: Mapping[str, Any]) -> Finding:
    ids = [int(i) for i in q[f"{spec.check}_ids"] or []]
    filled = {**words, "count": q[spec.check], "ids": ", ".join(map(str, ids))}
    return warn(
        spec.check,
        f"queue {q['queue']}",
        spec.summary.format(**filled),
        spec.advice.format(**filled),
        {"queue": q["queue"], "count": q[spec.check], "ids": ids},
    )


def _backlog_finding(q: Row, t: Thresholds, paused: bool) -> Finding:
    oldest = q["oldest_ready_seconds"]
    waiting = "none waiting" if oldest is None else f"oldest waiting {secs(oldest)}"
    summary = f"ready {q['ready']:,}, {waiting}; running {q['running']:,}"
    data = {
        "queue": q["queue"],
        "ready": q["ready"],
        "oldest_ready_seconds": rounded(oldest),
        "running": q["running"],
    }
    subject = f"queue {q['queue']}"
    if paused:  # the paused_queue check says whether that backlog grows
        return ok("ready_backlog", subject, f"{summary} (paused)", data)
    if oldest is not None and oldest >= t.oldest_ready_seconds:
        advice = f"no worker takes queue {q['queue']!r}, or too few: start (more) workers for it"
        return warn("ready_backlog", subject, summary, advice, data)
    return ok("ready_backlog", subject, summary, data)
