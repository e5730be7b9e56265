"""Pure builders for rebuilding the queue table's indexes once they are mostly
empty: which are, the rebuild, and the clean-up of a rebuild that failed.

A B-tree never gives pages back. A snapshot held while jobs come and go, or a
large backlog worked off, leaves the queue table's indexes hundreds of
megabytes for a few thousand entries, and every VACUUM of the table (every few
seconds on a busy queue) reads each index in full. `REINDEX INDEX
CONCURRENTLY` builds a compact copy without blocking claims, enqueues or
completions. Workers use these (see `reindexing`); they are public so an app
that runs its own upkeep can issue the same statements.
"""

from __future__ import annotations

from sqlalchemy import Table, TextClause, text

from .schema import names_of
from .vacuum_statements import OLD_TRANSACTION

__all__ = [
    "LEFTOVER_SUFFIX",
    "drop_index",
    "index_bytes",
    "leftover_indexes",
    "reindex",
    "sparse_indexes",
]

# How PostgreSQL names the copies a REINDEX CONCURRENTLY makes (a POSIX regex).
LEFTOVER_SUFFIX = "_cc(new|old)[0-9]*$"

# No other client session of this database has held a snapshot or a
# transaction id for `:old_after` seconds. A concurrent build or drop waits
# for every older transaction (autovacuum's are exempt): while one of those
# runs, it would only wait out its lock timeout and leave a `_ccnew` copy.
_NO_OLD_TRANSACTION = f"""
  AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                  WHERE {OLD_TRANSACTION})
"""


def sparse_indexes(
    table: Table, min_bytes: int, max_entries_per_page: float, old_after: float
) -> TextClause:
    """The table's valid indexes of at least `min_bytes` holding fewer than
    `max_entries_per_page` entries per page: rows `qualified`, `bytes`,
    `entries`, and the table's own `heap_bytes`, which a rebuild reads twice.

    Entries and pages both come from `pg_class`, as the last VACUUM or ANALYZE
    of the table left them, so they describe one moment (set against the
    index's current size, the entries would make one that grew since look
    sparse). Every index of the table counts, a host app's own too. A
    freshly built B-tree holds 150 to 400 entries per page here.

    None while a transaction older than `old_after` seconds runs in the
    database: VACUUM counts the dead entries a held snapshot keeps, but an
    ANALYZE (autovacuum's, every minute on a busy queue) counts only the
    live rows an index covers, so during a hold the indexes look sparse, and
    the rebuild would wait for that snapshot. None while another session
    builds an index of the table (another worker's rebuild); never an
    exclusion constraint's, which PostgreSQL cannot rebuild concurrently (a
    host app may add one).
    """
    return text(
        """
SELECT format('%I.%I', n.nspname, c.relname) AS qualified,
       pg_relation_size(c.oid) AS bytes, c.reltuples::bigint AS entries,
       pg_relation_size(i.indrelid) AS heap_bytes
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.indrelid = to_regclass(:qualified)
  AND i.indisvalid
  AND NOT i.indisexclusion
  AND c.relpages::bigint * current_setting('block_size')::bigint >= :min_bytes
  AND c.reltuples >= 0
  AND c.reltuples < c.relpages * :max_entries_per_page
  AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.relid = i.indrelid)
"""
        + _NO_OLD_TRANSACTION
        + """
ORDER BY pg_relation_size(c.oid) DESC
"""
    ).bindparams(
        qualified=names_of(table).qualified,
        min_bytes=min_bytes,
        max_entries_per_page=max_entries_per_page,
        old_after=old_after,
    )


def leftover_indexes(table: Table, old_after: float) -> TextClause:
    """Invalid indexes a failed `REINDEX CONCURRENTLY` left on the table (named
    `<index>_ccnew`, `_ccnew1`, ..., or `_ccold` when only the old copy's drop
    failed) and no build is working on now: rows `qualified`.

    Such an index serves no query, yet once it was ready for inserts every
    enqueue, claim and completion keeps updating it. A failed migration's
    invalid index keeps its own name and is left to `jobq doctor`. None
    while a transaction older than `old_after` seconds runs in the database:
    the drop would wait for it too.
    """
    return text(
        """
SELECT format('%I.%I', n.nspname, c.relname) AS qualified
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.indrelid = to_regclass(:qualified)
  AND NOT i.indisvalid
  AND c.relname ~ :suffix
  AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index p
                  WHERE p.index_relid = i.indexrelid OR p.relid = i.indrelid)
"""
        + _NO_OLD_TRANSACTION
    ).bindparams(qualified=names_of(table).qualified, suffix=LEFTOVER_SUFFIX, old_after=old_after)


def reindex(qualified_index: str) -> TextClause:
    """`REINDEX INDEX CONCURRENTLY`: cannot run in a transaction, so run it in
    autocommit. It waits for the transactions that write the table when it
    starts and for snapshots older than its build; a lock timeout bounds
    those waits, and a timeout leaves a `_ccnew` index for `drop_index`."""
    return text(f"REINDEX INDEX CONCURRENTLY {qualified_index}")


def index_bytes(qualified_index: str) -> TextClause:
    """The index's size now, one row `bytes`: what a rebuild left."""
    return text("SELECT pg_relation_size(to_regclass(:index)) AS bytes").bindparams(
        index=qualified_index
    )


def drop_index(qualified_index: str) -> TextClause:
    """`DROP INDEX CONCURRENTLY IF EXISTS`, for a leftover of `leftover_indexes`:
    a plain DROP INDEX would lock the table against every claim meanwhile."""
    return text(f"DROP INDEX CONCURRENTLY IF EXISTS {qualified_index}")
