"""sqla_jobq schema version 5: scheduling, control and observability.

Why: a promise that holds only in one worker's memory is not a promise, so the
controls live in the database. A cancelled job gets its own status
(`cancelled`, never retried), set by the cancel itself so that the fence
refuses whatever a still-running handler tries to record; a row trigger
announces it to the worker running it. The queue settings table
`jobs_queues` (paused, concurrency limit) is read inside the claim statement.
`result` holds a task's return value, `traceparent` the trace that enqueued the
job, and `awaited` marks jobs someone waits on, whose end a row trigger
announces (every other completion passes that trigger on its WHEN alone). The
worker registry `jobs_workers` is kept by the heartbeats workers send anyway.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0005"
down_revision = "sqla_jobq_0004"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=4, target=5):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=5, target=4):
        op.execute(sql)
