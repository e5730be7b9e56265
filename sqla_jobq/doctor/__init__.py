"""`jobq doctor`: a read-only health report on one queue table and on what
keeps VACUUM from cleaning it.

Why it exists: a queue table is all updates and deletes (claim, complete,
retry, prune), so it is the first table to bloat when VACUUM is held back, and
what holds VACUUM back is invisible from the queue itself: one session left
`idle in transaction` after a claim, a forgotten prepared transaction or an
abandoned replication slot keeps every row version newer than its xmin
("dead but not yet removable") in every table of the database. This report
names the culprit (its pid), then looks at the table (dead tuples, vacuum
history, sizes, indexes) and at the queue (backlog, leases, failures), and
says for each finding what to do, in one line.

It must never become the problem it reports: everything runs in ONE short
READ ONLY transaction (no xid, no row lock), under a statement and a lock
timeout, and the connection is handed back at once. The work is split in
three steps so each stays small: `collect` (SQL to plain rows), `judge` (rows
to findings, no I/O) and `render_text` / `Report.as_dict` (output).

The modules: `model` (thresholds, `Finding`, `Facts`, `Report`), `collect`,
`judge` (with `horizon`, `checkpoints`, `writeback`, `table`, `autovacuum` and
`queues`, one per subject), `units` (how numbers read) and `render`.

JSON shape (``jobq doctor --json``), stable, ``format`` 1::

    {"format": 1, "table": "jobs", "database": "app",
     "server_version": "15.4", "checked_at": "2025-01-01T12:00:00+00:00",
     "healthy": false, "exit_status": 1,
     "findings": [{"check": "idle_in_transaction", "level": "warn",
                   "subject": "pid 4242 (billing)", "summary": "...",
                   "advice": "...", "data": {...}}, ...]}

``table`` is NAME or SCHEMA.NAME, unquoted; ``level`` is ``"ok"`` or
``"warn"``; ``advice`` is empty for ``ok``; ``check`` is one of `CHECKS`;
``data`` holds the measured numbers of that check.
"""

from __future__ import annotations

from sqlalchemy import Engine, Table

from ..schema import names_of

# Aliased so that `sqla_jobq.doctor.collect` and `.judge` stay the modules.
from .collect import collect as _collect
from .collect import read_only
from .judge import judge as _judge
from .model import CHECKS, Finding, Report, Thresholds
from .render import render_text

__all__ = ["CHECKS", "Finding", "Report", "Thresholds", "diagnose", "read_only", "render_text"]


def diagnose(engine: Engine, table: Table, thresholds: Thresholds | None = None) -> Report:
    """Collect in one short read-only transaction, then judge outside it."""
    names = names_of(table)
    limits = thresholds or Thresholds()
    with read_only(engine) as conn:
        facts = _collect(conn, names, limits)
    return Report(
        database=facts.database,
        server_version=facts.server_version,
        table=names.table if names.schema is None else f"{names.schema}.{names.table}",
        checked_at=facts.checked_at,
        findings=tuple(_judge(facts, names, limits)),
    )
