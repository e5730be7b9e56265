"""sqla_jobq schema version 6: autovacuum settings for the jobs table, and a
running index only the reaper uses.

Why: every job leaves two dead row versions in the jobs table (the claim and
the completion both change `status`, which the partial indexes' predicates
name, so neither update can be HOT). With PostgreSQL's defaults autovacuum
waits until dead tuples are a fifth of the table (one that, unpruned, holds
every finished job) and then vacuums it throttled, while every claim steps
over them. The table now carries its own settings (`QUEUE_TABLE_SETTINGS` in
`sqla_jobq.schema`): vacuum and analyze at 5,000 dead or changed tuples
whatever the table's size (scale factor 0), and no cost delay, so autovacuum
takes it at each visit (`autovacuum_naptime` apart) and finishes quickly.
Setting them takes a SHARE UPDATE EXCLUSIVE lock only: workers keep claiming
meanwhile. Downgrading resets these five settings and no others.

The running index is rebuilt with `locked_until IS NOT NULL` added to its
predicate (`RUNNING_WHERE` in `sqla_jobq.schema`), so that only the reaper,
which bounds `locked_until`, can use it: the fenced statements (complete,
fail, extend) then find their rows by primary key, where before the generic
plan of a prepared batch completion could walk this whole index, and while a
snapshot was held that index kept an entry for every job run since (measured:
completions of 50 ms each). It holds running jobs only, so rebuilding it is a
moment's work, under a lock that blocks writes to the table for that moment.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0006"
down_revision = "sqla_jobq_0005"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=5, target=6):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=6, target=5):
        op.execute(sql)
