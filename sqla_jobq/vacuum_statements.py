"""Pure builders for keeping the queue table vacuumed: its dead tuples, what
holds them, and VACUUM.

Workers use them (see `vacuuming`); they are public so an app that runs its
own upkeep can issue the same statements.
"""

from __future__ import annotations

from sqlalchemy import Table, TextClause, text

from .schema import names_of

__all__ = ["dead_tuples", "vacuum"]

# A `pg_stat_activity a` row of another client session of this database that
# has held a snapshot or a transaction id for over `:old_after` seconds: what
# keeps VACUUM from removing every dead tuple younger than it. Standby
# feedback, replication slots and prepared transactions hold VACUUM back too
# and are not in it.
OLD_TRANSACTION = """a.datname = current_database()
    AND a.pid <> pg_backend_pid()
    AND a.backend_type = 'client backend'
    AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    AND a.xact_start < statement_timestamp() - make_interval(secs => :old_after)"""


def dead_tuples(table: Table, old_after: float) -> TextClause:
    """The table's dead tuples as the statistics system counts them, and the
    oldest snapshot holding dead tuples back: one row `dead`, `held_by`, or
    none before the table has statistics.

    The count is cheap to read (shared memory, no access to the table) and at
    most about a second behind. With `track_counts` off it stays empty, so
    nothing is vacuumed on a guess (`jobq doctor` warns about that setting).

    `held_by` is the xmin (or xid) of the oldest transaction open for over
    `old_after` seconds in another session, NULL when there is none. While it
    stays the same, no dead tuple a VACUUM left behind has become removable:
    a second VACUUM would read the whole heap again for nothing.
    """
    return text(
        f"""SELECT s.n_dead_tup AS dead,
  (SELECT x::text
     FROM pg_stat_activity a,
          LATERAL (VALUES (a.backend_xmin), (a.backend_xid)) AS held(x)
    WHERE x IS NOT NULL AND {OLD_TRANSACTION}
    ORDER BY age(x) DESC
    LIMIT 1) AS held_by
FROM pg_stat_user_tables s
WHERE s.relid = to_regclass(:qualified)"""
    ).bindparams(qualified=names_of(table).qualified, old_after=old_after)


def vacuum(table: Table) -> TextClause:
    """`VACUUM (SKIP_LOCKED, PARALLEL 0)` of the table: it cannot run in a
    transaction, so run it in autocommit. SKIP_LOCKED makes it return at once,
    with a warning notice, when another VACUUM (a worker's, or autovacuum's)
    holds the table: several workers never queue up to vacuum it one after
    another.

    PARALLEL 0: a parallel VACUUM puts its list of dead tuples in shared
    memory sized by the heap and zero-fills it first. A heap a held snapshot
    grew stays that size, so each of the VACUUMs that follow every few
    seconds filled tens of megabytes (97 ms a VACUUM of a 210 MB heap with
    20,000 dead tuples here, 16 ms without; 20 against 9 ms on a small one),
    and its workers take the cores the claims run on."""
    return text(f"VACUUM (SKIP_LOCKED, PARALLEL 0) {names_of(table).qualified}")
