"""What `jobq cron` shows: each periodic task's schedule, its last and next
fire times, and whether its last fire was enqueued (and how that job fared) (internal).

The next fire time is computed as a worker's tick would compute it from the
same schedules row, so an overdue fire (no worker running) shows as due.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Connection

from . import periodic, schedule_statements
from .registry import Registry


@dataclass(frozen=True)
class ScheduleState:
    schedule: periodic.Schedule
    queue: str
    # False until a worker has seen the schedule (and created its row).
    started: bool
    # The last fire time enqueued; None before the first fire.
    last_fire: datetime | None
    next_fire: datetime
    overdue: bool
    last_job_id: int | None
    last_job_status: str | None
    archived: bool

    @property
    def last_job(self) -> str:
        """The last fire's job in a few words."""
        if not self.started:
            return "no worker has run this schedule yet"
        if self.last_job_id is None:
            return "no fire yet"
        if self.last_job_status is None:
            return f"job {self.last_job_id}, no longer in the table (pruned)"
        archived = " (archived)" if self.archived else ""
        return f"job {self.last_job_id} {self.last_job_status}{archived}"


def collect(conn: Connection, registry: Registry, now: datetime) -> list[ScheduleState]:
    """Every schedule of `registry`, read in the caller's transaction."""
    names = sorted(registry.schedules)
    rows = {r.name: r for r in conn.execute(schedule_statements.report(registry.table, names))}
    return [_state(registry, name, rows.get(name), now) for name in names]


def _state(registry: Registry, name: str, row: Any, now: datetime) -> ScheduleState:
    schedule = registry.schedules[name]
    # A schedules row without a job is a start mark (see schedule_statements.load).
    fired = row is not None and row.last_job_id is not None
    plan = periodic.plan(schedule, now if row is None else row.last_fire, now)
    return ScheduleState(
        schedule=schedule,
        queue=registry.tasks[name].queue,
        started=row is not None,
        last_fire=row.last_fire if fired else None,
        next_fire=plan.due[0] if plan.due else plan.next,
        overdue=bool(plan.due),
        last_job_id=row.last_job_id if fired else None,
        last_job_status=row.status if fired else None,
        archived=bool(row.archived) if fired else False,
    )


def to_json(states: list[ScheduleState]) -> list[dict[str, Any]]:
    return [
        {
            "name": s.schedule.name,
            "task": s.schedule.name,
            "queue": s.queue,
            "cron": s.schedule.cron,
            "every": None if s.schedule.every is None else s.schedule.every.total_seconds(),
            "timezone": s.schedule.timezone or "UTC",
            "catch_up": None
            if s.schedule.catch_up is None
            else s.schedule.catch_up.total_seconds(),
            "last_fire": _iso(s.last_fire),
            "next_fire": _iso(s.next_fire),
            "overdue": s.overdue,
            "enqueued": s.last_job_id is not None,
            "last_job_id": s.last_job_id,
            "last_job_status": s.last_job_status,
            "archived": s.archived,
        }
        for s in states
    ]


def render_text(states: list[ScheduleState]) -> str:
    header = ("task", "schedule", "timezone", "last fire (UTC)", "next fire (UTC)", "last job")
    rows = [
        (
            s.schedule.name,
            s.schedule.spec,
            s.schedule.timezone or "UTC",
            _short(s.last_fire),
            _short(s.next_fire) + (" (due)" if s.overdue else ""),
            s.last_job,
        )
        for s in states
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(r, widths, strict=False)), r[-1]])
        for r in [header, *rows]
    )


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()


def _short(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
