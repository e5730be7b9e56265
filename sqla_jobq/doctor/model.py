"""What the doctor measures against and what it hands around: the thresholds
(each with the reason for its value), the `Facts` that `collect` reads, the
`Finding`s that the judges make of them and the `Report` that holds those.

Plain values only, no SQL and no I/O, so every other part of the doctor can
depend on this one and on nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

# --- thresholds --------------------------------------------------------------
# A session idle in transaction this long is doing something slow (an HTTP
# call, a whole job) with a transaction open: it pins a server connection (and
# a pooler slot) and keeps its locks, and VACUUM can remove nothing newer than
# its snapshot or xid. Matches a sensible idle_in_transaction_session_timeout.
IDLE_IN_TRANSACTION_SECONDS = 60.0
# Idle in transaction for any time while this many transactions went by: at
# least that many row versions VACUUM must keep. A healthy pause between two
# statements of a transaction lasts milliseconds and lets few go by.
HORIZON_XID_AGE = 1_000
# No queue statement needs a transaction anywhere near the default 5-minute
# lease; reports and migrations that do belong off-peak or on a replica.
LONG_TRANSACTION_SECONDS = 300.0
# A two-phase commit is resolved by its transaction manager within moments;
# one prepared a minute ago is probably orphaned, and it holds its xid forever.
PREPARED_XACT_SECONDS = 60.0
# An active slot's consumer (a standby with hot_standby_feedback, a logical
# subscriber) lags a little; this far behind it is stuck. An inactive slot is
# flagged from HORIZON_XID_AGE: nothing will ever advance it.
SLOT_XID_AGE = 1_000_000
# Autovacuum's own trigger is 50 rows + 20% of the table: past both a ratio of
# 20% dead and an absolute 10,000 (so a tiny table's noise is ignored), dead
# rows are winning the race and every claim scans more of them.
DEAD_RATIO = 0.20
DEAD_TUPLES = 10_000
# A table this large with fewer live rows than pages is what a held snapshot
# or a worked-off backlog leaves; below it a rewrite gains nothing worth its lock.
SPARSE_TABLE_BYTES = 16 * 1024 * 1024
# The WAL rate is measured over the current checkpoint interval; one younger
# than this says too little (a single bulk enqueue would read as a rate).
CHECKPOINT_WINDOW_SECONDS = 10.0
# A ready job waiting five minutes means no worker serves its queue, or too few.
OLDEST_READY_SECONDS = 300.0
# Reapers run every few seconds; a job still `running` a minute past its lease
# means no reaper is running at all (and no worker, since workers reap).
EXPIRED_LEASE_GRACE_SECONDS = 60.0
# A running job that has used 80% of its lease is about to be reaped and run
# twice unless its handler extends the lease.
LEASE_USED_RATIO = 0.80
# How far back "recently failed" and "recently outlived its lease" look.
RECENT = timedelta(days=1)

CHECKS = (
    "schema_version",
    "visibility",
    "xmin_horizon",
    "idle_in_transaction",
    "long_transaction",
    "prepared_transaction",
    "replication_slot",
    "checkpoints",
    "writeback",
    "dead_tuples",
    "autovacuum",
    "statistics",
    "table_size",
    "index",
    "ready_backlog",
    "expired_leases",
    "lease_nearly_used",
    "lease_expired_recently",
    "failed_recently",
    "paused_queue",
    "concurrency_limit",
)

Level = Literal["ok", "warn"]
Row = dict[str, Any]


@dataclass(frozen=True)
class Thresholds:
    """The limits above, overridable (e.g. by a test that cannot wait a minute)."""

    idle_in_transaction_seconds: float = IDLE_IN_TRANSACTION_SECONDS
    horizon_xid_age: int = HORIZON_XID_AGE
    long_transaction_seconds: float = LONG_TRANSACTION_SECONDS
    prepared_xact_seconds: float = PREPARED_XACT_SECONDS
    slot_xid_age: int = SLOT_XID_AGE
    dead_ratio: float = DEAD_RATIO
    dead_tuples: int = DEAD_TUPLES
    sparse_table_bytes: int = SPARSE_TABLE_BYTES
    checkpoint_window_seconds: float = CHECKPOINT_WINDOW_SECONDS
    oldest_ready_seconds: float = OLDEST_READY_SECONDS
    expired_lease_grace_seconds: float = EXPIRED_LEASE_GRACE_SECONDS
    lease_used_ratio: float = LEASE_USED_RATIO
    recent: timedelta = RECENT


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was measured and, if it is bad, what to do."""

    check: str
    level: Level
    subject: str
    summary: str
    advice: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


def ok(check: str, subject: str, summary: str, data: Mapping[str, Any] | None = None) -> Finding:
    return Finding(check, "ok", subject, summary, "", dict(data or {}))


def warn(
    check: str, subject: str, summary: str, advice: str, data: Mapping[str, Any] | None = None
) -> Finding:
    return Finding(check, "warn", subject, summary, advice, dict(data or {}))


@dataclass(frozen=True)
class Facts:
    """Everything `collect` read, as plain values, for `judge` to weigh."""

    database: str
    server_version: str
    checked_at: datetime
    schema_version: int
    hidden_sessions: int
    sessions: list[Row]
    prepared: list[Row]
    slots: list[Row]
    table: Row
    # The server settings autovacuum goes by, each with this table's own value
    # where it has one (`autovacuum.SERVER_SETTINGS`).
    autovacuum: list[Row]
    archive: Row | None
    indexes: list[Row]
    queues: list[Row]
    # The current checkpoint interval (`checkpoints`), or {"unreadable": why}.
    checkpoints: Row
    # backend_flush_after as this session sees it, and where from (`writeback`).
    writeback: Row
    settings: list[Row] = field(default_factory=list)  # paused or limited queues


@dataclass(frozen=True)
class Report:
    database: str
    server_version: str
    table: str
    checked_at: datetime
    findings: tuple[Finding, ...]

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level == "warn")

    @property
    def healthy(self) -> bool:
        return not self.warnings

    @property
    def exit_status(self) -> int:
        """0 healthy, 1 something needs attention (2, user errors, is the CLI's)."""
        return 0 if self.healthy else 1

    def as_dict(self) -> dict[str, Any]:
        """The documented JSON shape (see the docstring of `sqla_jobq.doctor`)."""
        return {
            "format": 1,
            "table": self.table,
            "database": self.database,
            "server_version": self.server_version,
            "checked_at": self.checked_at.isoformat(),
            "healthy": self.healthy,
            "exit_status": self.exit_status,
            "findings": [
                {
                    "check": f.check,
                    "level": f.level,
                    "subject": f.subject,
                    "summary": f.summary,
                    "advice": f.advice,
                    "data": dict(f.data),
                }
                for f in self.findings
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)
