"""sqla_jobq schema version 9: a partial index on the done jobs still in the
jobs table, `(id) WHERE status = 'done'`.

Why: each worker's archiver sweeps up, every 30 s, the done jobs its
completions did not move to the archive (jobs someone waited on, completed in
place so their end is announced; jobs an app completed with its own
statements). With no index to find them it read the whole table each time:
the failed jobs kept for inspection and, after a long transaction elsewhere
had held back VACUUM, hundreds of MB of dead space. That read is a TID range
scan, which PostgreSQL runs through shared buffers without the small ring a
sequential scan gets, so each sweep pushed out the pages every claim and
completion needs: after a held snapshot, `bench.scenes held-snapshot` saw a
pickup p99 spike every 30 s (up to 452 ms against 43 ms clean), in the
buckets where the sweep read 43,000 to 46,000 heap pages. Through this index
a sweep reads what it moves.

Cost: a done job completed in place (`archive_after` above 0, or an awaited
job) adds one entry to this index; archiving at completion, the default,
adds none. No update that was HOT becomes non-HOT: `id` never changes, and
`status` is in the other partial indexes' predicates already.

The build reads the whole table under a SHARE lock: reads go on, enqueues,
claims and completions wait for it (step 7's build, of a wider index, took
about 0.1 s per million rows on a 2-core VM). Prune or archive a long
history first to keep that short. Downgrading drops the index.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0009"
down_revision = "sqla_jobq_0008"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=8, target=9):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=9, target=8):
        op.execute(sql)
