"""Pure builders for keeping the queue table vacuumed: its dead tuples, and VACUUM.

Workers use them (see `vacuuming`); they are public so an app that runs its
own upkeep can issue the same statements.
"""

from __future__ import annotations

from sqlalchemy import Table, TextClause, text

from .schema import names_of

__all__ = ["dead_tuples", "vacuum"]


def dead_tuples(table: Table) -> TextClause:
    """The table's dead tuples as the statistics system counts them: one row
    `dead`, or none before the table has statistics.

    Cheap to read (shared memory, no access to the table) and at most about a
    second behind. With `track_counts` off it stays empty, so nothing is
    vacuumed on a guess (`jobq doctor` warns about that setting).
    """
    return text(
        "SELECT n_dead_tup AS dead FROM pg_stat_user_tables WHERE relid = to_regclass(:qualified)"
    ).bindparams(qualified=names_of(table).qualified)


def vacuum(table: Table) -> TextClause:
    """`VACUUM (SKIP_LOCKED)` of the table: it cannot run in a transaction, so
    run it in autocommit. SKIP_LOCKED makes it return at once, with a warning
    notice, when another VACUUM (a worker's, or autovacuum's) holds the table:
    several workers never queue up to vacuum it one after another."""
    return text(f"VACUUM (SKIP_LOCKED) {names_of(table).qualified}")
