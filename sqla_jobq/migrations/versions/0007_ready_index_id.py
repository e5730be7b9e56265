"""sqla_jobq schema version 7: the ready index ends in `id`, and a limited
queue's count of running jobs uses the running index.

Why: a worker claiming past a position (see `sqla_jobq.claim_cursor`) orders
by `(run_at, id)` within one priority. The claim index serves that as one
range. But after autovacuum analysed the table while few jobs were queued,
PostgreSQL 15 chose the ready index `(queue, run_at)` instead, which cannot
give `id` order: a Sort under the claim's LockRows, which cannot stop at the
LIMIT, so every claim read and sorted the whole backlog past the position
(measured: 63 to 98 ms a claim, and a worker offered 15,000 jobs/s behind a
held snapshot fell to 2% of it). With `id` as its last column the ready index
serves the same order as a range, so either index stops at the LIMIT. The
article's hand-written claims (`ORDER BY run_at`) use it as before.

The new index is built beside the old one and renamed into place. The build
reads the whole table (finished jobs too) under a SHARE lock: reads go on,
enqueues, claims and completions wait for it (measured: about 0.1 s per
million rows, 128 MB, on a 2-core VM). Prune or archive a long history
first to keep that short.

`<table>_claim_slots` is replaced: it counts a limited queue's running jobs
with `status = 'running' AND locked_until IS NOT NULL`, the running index's
predicate since version 6, where `status = 'running'` alone could not use
that index and read the whole table, history included, on every claim of a
limited queue while holding that queue's lock (measured: two `-c 8` workers
under a limit of 64 at 0.23x of the same workers unlimited; 0.92x after).
Every claim that consults the limit (`statements.claim`) sets
`locked_until`; a hand-written claim that does not never consulted it.
"""

from alembic import op

from sqla_jobq.migrations.steps import down_statements, up_statements
from sqla_jobq.schema import Names

revision = "sqla_jobq_0007"
down_revision = "sqla_jobq_0006"
branch_labels = None
depends_on = None

NAMES = Names("jobs", None)


def upgrade() -> None:
    for sql in up_statements(NAMES, current=6, target=7):
        op.execute(sql)


def downgrade() -> None:
    for sql in down_statements(NAMES, current=7, target=6):
        op.execute(sql)
