"""sqla_jobq schema version 1: the jobs table.

Why: the queue itself. One row per job; partial indexes on the ready rows (the
classic `(queue, run_at)` and the `claim` order with priority), on the leases
of running jobs (so the reaper never scans history) and on active unique keys;
a statement-level NOTIFY trigger, one notification per queue per INSERT.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0001"
down_revision = None
branch_labels = ("sqla_jobq",)
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=0, target=1):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=1, target=0):
        op.execute(sql)
