"""Pure builders for keeping the queue table vacuumed: its dead tuples, and VACUUM.

Workers use them (see `vacuuming`); they are public so an app that runs its
own upkeep can issue the same statements.
"""

from __future__ import annotations

from sqlalchemy import Table, TextClause, text

from .schema import names_of

__all__ = ["dead_tuples", "vacuum"]


def dead_tuples(table: Table) -> TextClause:
    """The table's dead tuples as the statistics system counts them, and its
    heap as the last VACUUM or ANALYZE left it: one row `dead`, `pages`
    (`pg_class.relpages`), `live` (`reltuples`, -1 before either ran), or
    none before the table has statistics.

    Cheap to read (shared memory and one catalog row, no access to the table)
    and at most about a second behind. With `track_counts` off it stays
    empty, so nothing is vacuumed on a guess (`jobq doctor` warns about that
    setting).
    """
    return text(
        "SELECT s.n_dead_tup AS dead, c.relpages AS pages, c.reltuples AS live "
        "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid "
        "WHERE s.relid = to_regclass(:qualified)"
    ).bindparams(qualified=names_of(table).qualified)


def vacuum(table: Table, *, truncate: bool = False) -> TextClause:
    """`VACUUM (SKIP_LOCKED)` of the table: it cannot run in a transaction, so
    run it in autocommit. SKIP_LOCKED makes it return at once, with a warning
    notice, when another VACUUM (a worker's, or autovacuum's) holds the table:
    several workers never queue up to vacuum it one after another.

    `truncate` gives the empty pages at the heap's end back to the operating
    system, which the jobs table's `vacuum_truncate = off` (schema step 8)
    otherwise forbids: for a heap a long transaction elsewhere let grow (see
    `vacuuming.SPARSE_PAGES`), not for every VACUUM, since truncating takes an
    ACCESS EXCLUSIVE lock, however briefly."""
    options = "SKIP_LOCKED, TRUNCATE" if truncate else "SKIP_LOCKED"
    return text(f"VACUUM ({options}) {names_of(table).qualified}")
