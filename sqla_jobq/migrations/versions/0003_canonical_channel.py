"""sqla_jobq schema version 3: one canonical NOTIFY channel, and put-backs announced.

Why: the INSERT trigger sent on the table name as the migration spelled it,
so a table migrated as `public.jobs` and used as `jobs` notified a channel no
worker listened on, and every job waited for the fallback poll. The trigger
function now names the channel from the table that fired (`schema.table`,
resolved by the server), and `check_schema` gives workers the same string.
Jobs put back to `queued` by an UPDATE (release, the reaper, `retry`, a failure
to be retried) were heard of only at the next poll; a row trigger now
announces them, its WHEN keeping claims, completions and lease extensions off
plpgsql.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0003"
down_revision = "sqla_jobq_0002"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=2, target=3):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=3, target=2):
        op.execute(sql)
