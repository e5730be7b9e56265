"""What `jobq stats` shows about workers: every registered worker, the stale
ones (silent for longer than they promised, see `sqla_jobq.presence`) flagged,
since a worker that died without leaving still has its row (internal)."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection

from . import presence


def collect(conn: Connection, table: Table) -> list[dict[str, Any]]:
    """Every registered worker, live ones first, read in the caller's transaction."""
    return [dict(r._mapping) for r in conn.execute(presence.listing(table))]


def to_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": r["id"],
            "host": r["host"],
            "pid": r["pid"],
            "queues": r["queues"],
            "concurrency": r["concurrency"],
            "started_at": r["started_at"].isoformat(),
            "heartbeat_at": r["heartbeat_at"].isoformat(),
            "heartbeat_age": round(float(r["heartbeat_age"]), 3),
            "beat_interval": r["beat_interval"].total_seconds(),
            "jobs_done": r["jobs_done"],
            "stale": r["stale"],
        }
        for r in rows
    ]


def render_text(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no workers registered"
    lines = [
        f"{'worker':<32} {'queues':<20} {'conc':>4} {'started (UTC)':<19} "
        f"{'last beat (s)':>13} {'jobs done':>10}  state"
    ]
    for r in rows:
        state = "STALE (no heartbeat: dead or cut off?)" if r["stale"] else "live"
        started = r["started_at"].astimezone(UTC)
        lines.append(
            f"{r['id']:<32} {','.join(r['queues']):<20} {r['concurrency']:>4} "
            f"{started:%Y-%m-%d %H:%M:%S} {float(r['heartbeat_age']):>13.1f} "
            f"{r['jobs_done']:>10}  {state}"
        )
    return "\n".join(lines)
