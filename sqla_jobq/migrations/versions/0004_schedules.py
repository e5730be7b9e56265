"""sqla_jobq schema version 4: periodic tasks.

Why: a periodic task must be enqueued once per fire time however many workers
run its schedule, and a unique key on active jobs cannot promise that (once
the fired job finishes, a late worker could insert it again). The schedules
table `jobs_schedules` keeps each schedule's last fire time; a fire is
enqueued only by the statement that moves it forward. `scheduled_for`, on the
jobs table and on the archive (which copies whole rows), is the fire time the
handler is given.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0004"
down_revision = "sqla_jobq_0003"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=3, target=4):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=4, target=3):
        op.execute(sql)
