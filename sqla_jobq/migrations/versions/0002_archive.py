"""sqla_jobq schema version 2: the archive table.

Why: a queue table is all updates and deletes, so it is the first to bloat;
finished jobs do not belong in it. `jobq prune --archive` moves them, in one
statement per batch, to `jobs_archive` (the same columns, ids kept, plus
`archived_at`), so the hot table stays small and the history is kept where
nothing claims, reaps or NOTIFYs. No trigger, and only the `archived_at` index
the archive needs to be pruned in turn.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0002"
down_revision = "sqla_jobq_0001"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=1, target=2):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=2, target=1):
        op.execute(sql)
