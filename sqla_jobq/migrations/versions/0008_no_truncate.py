"""sqla_jobq schema version 8: VACUUM never truncates the jobs table.

Why: when VACUUM finds empty pages at the end of a table it gives them back
to the operating system, and to do so it takes an ACCESS EXCLUSIVE lock on
the table: every claim, enqueue and completion waits while it holds it. A
queue table's tail is empty again and again (its rows live for seconds, and
when completions move jobs to the archive, `--archive-after 0`, hardly any
stay), so autovacuum and the workers' own VACUUM took that lock over and
over; after a long transaction elsewhere had let the table grow, the slowest
seconds of `bench.scenes held-snapshot` were those truncations (the workers'
sessions waiting on `Timeout:VacuumTruncate`, pickup p99 up to 458 ms). With
`vacuum_truncate = off` the empty pages stay allocated and new jobs reuse
them; `VACUUM (TRUNCATE) jobs` by hand gives them back when wanted.

Setting it takes a SHARE UPDATE EXCLUSIVE lock only: workers keep claiming
meanwhile. Downgrading resets this one setting.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0008"
down_revision = "sqla_jobq_0007"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=7, target=8):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=8, target=7):
        op.execute(sql)
