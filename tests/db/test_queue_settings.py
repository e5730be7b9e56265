"""Pausing queues and concurrency limits, enforced by the claim statement,
against real PostgreSQL with real concurrent connections.

The race test checks in pg_locks that the second claimer really waits for
the queue's lock before the first one commits, so its outcome is
deterministic rather than a matter of timing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, Table
from sqlalchemy.exc import DBAPIError

from sqla_jobq import client, statements
from sqla_jobq import queue_statements as qs
from sqla_jobq.db import conninfo
from sqla_jobq.migrations.steps import up_statements
from sqla_jobq.schema import Names, canonical_channel, names_of
from sqla_jobq.statements import InvalidJob
from tests.support.queues import drop_queue_table

Raw = psycopg.Connection[Any]


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql("SET lock_timeout = '10s'")
        yield conn


def setting(engine: Engine, stmt: Any) -> Any:
    with engine.begin() as conn:
        return conn.execute(stmt).one()


def fill(engine: Engine, table: Table, queue: str, n: int, priority: int = 0) -> list[int]:
    with engine.begin() as conn:
        return [
            client.enqueue(conn, table, "t", {"i": i}, queue=queue, priority=priority)
            for i in range(n)
        ]


def claim(conn: Connection, table: Table, queue: Any = "default", limit: int = 10) -> list[Any]:
    return list(conn.execute(statements.claim(table, queue=queue, limit=limit)).all())


def complete(conn: Connection, table: Table, rows: list[Any]) -> None:
    for row in rows:
        assert conn.execute(statements.complete(table, row.id, row.attempts)).rowcount == 1


# --------------------------------------------------------------------------- pausing


def test_a_paused_queue_hands_out_nothing_to_any_connection_until_resumed(
    engine: Engine, table: Table
) -> None:
    ids = fill(engine, table, "default", 3)
    paused = setting(engine, qs.pause(table, "default"))
    assert (paused.name, paused.paused, paused.concurrency_limit) == ("default", True, None)
    with autocommit(engine) as a, autocommit(engine) as b:
        assert claim(a, table) == [] and claim(b, table) == []
        setting(engine, qs.resume(table, "default"))
        assert sorted(r.id for r in claim(b, table)) == ids


def test_a_claim_of_several_queues_skips_the_paused_one_and_takes_the_rest(
    engine: Engine, table: Table
) -> None:
    fill(engine, table, "mail", 3)
    sms = fill(engine, table, "sms", 2)
    setting(engine, qs.pause(table, "mail"))
    with autocommit(engine) as conn:
        assert sorted(r.id for r in claim(conn, table, ["mail", "sms"])) == sms
        assert claim(conn, table, ["mail", "sms"]) == []


# --------------------------------------------------------------------------- limits


def test_a_limit_caps_each_claim_at_the_free_slots_and_removing_it_lifts_the_cap(
    engine: Engine, table: Table
) -> None:
    fill(engine, table, "default", 6)
    limited = setting(engine, qs.set_concurrency_limit(table, "default", 2))
    assert (limited.paused, limited.concurrency_limit) == (False, 2)
    with autocommit(engine) as a, autocommit(engine) as b:
        first = claim(a, table)
        assert len(first) == 2 and claim(b, table) == []
        complete(a, table, first[:1])
        assert len(claim(b, table)) == 1
        assert claim(a, table) == []
        setting(engine, qs.set_concurrency_limit(table, "default", None))
        assert len(claim(a, table)) == 3


def test_a_limited_claim_and_the_settings_list_count_running_jobs_without_reading_the_history(
    engine: Engine, table: Table
) -> None:
    """The limit's count of running jobs goes through the running index. When
    that index's predicate gained `locked_until IS NOT NULL` (schema step 6)
    the count, `status = 'running'` alone, could no longer use it and read
    the whole table, history included, on every claim of a limited queue
    while holding the queue's lock: two `-c 8` workers under a limit of 64
    drained at 0.23x of the same workers unlimited. The settings list shows
    the same count beside the limit."""
    name = table.name
    with autocommit(engine) as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload, status, finished_at) '
            "SELECT '{}', 'done', now() FROM generate_series(1, 20000)"
        )
    fill(engine, table, "default", 20)
    setting(engine, qs.set_concurrency_limit(table, "default", 64))
    with autocommit(engine) as conn:
        conn.exec_driver_sql(f'ANALYZE "{name}"')
        assert len(claim(conn, table)) == 10
    with engine.begin() as conn:
        assert len(claim(conn, table)) == 10
        (listed,) = conn.execute(qs.settings(table)).all()
        assert listed.running == 20
        scans = conn.exec_driver_sql(
            "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = %(t)s::regclass",
            {"t": f'"{name}"'},
        ).scalar_one()
    assert scans == 0


def test_a_limit_lowered_below_the_running_jobs_stops_claims_until_enough_finish(
    engine: Engine, table: Table
) -> None:
    fill(engine, table, "default", 5)
    with autocommit(engine) as conn:
        running = claim(conn, table, limit=3)
        setting(engine, qs.set_concurrency_limit(table, "default", 1))
        assert claim(conn, table) == []
        complete(conn, table, running[:2])
        assert claim(conn, table) == []
        complete(conn, table, running[2:])
        assert len(claim(conn, table)) == 1


def test_a_claim_of_several_queues_holds_each_queue_to_its_own_limit_in_priority_order(
    engine: Engine, table: Table
) -> None:
    mail = fill(engine, table, "mail", 3, priority=5)
    sms = fill(engine, table, "sms", 3, priority=1)
    setting(engine, qs.set_concurrency_limit(table, "mail", 1))
    setting(engine, qs.set_concurrency_limit(table, "sms", 2))
    default = fill(engine, table, "default", 2, priority=3)
    with autocommit(engine) as conn:
        # The best two: mail's first (its one slot), then default's (unlimited).
        first = claim(conn, table, ["sms", "mail", "default", "mail"], limit=2)
        assert sorted(r.id for r in first) == sorted([mail[0], default[0]])
        rest = claim(conn, table, ["sms", "mail", "default"], limit=10)
        assert sorted(r.id for r in rest) == sorted([default[1], *sms[:2]])
        assert claim(conn, table, ["sms", "mail", "default"]) == []


def test_a_claimer_waiting_for_the_queue_lock_counts_the_claim_it_waited_for(
    engine: Engine, table: Table, raw: Raw
) -> None:
    """The READ COMMITTED trap: the waiting claim's statement snapshot was
    taken before the first claim committed, and would still see its job as
    queued. Counted there, the second claim would take 2 of 2 slots again."""
    fill(engine, table, "default", 5)
    setting(engine, qs.set_concurrency_limit(table, "default", 2))
    with engine.connect() as first, autocommit(engine) as second, ThreadPoolExecutor(1) as pool:
        second_pid = second.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        assert len(claim(first, table, limit=1)) == 1  # its transaction stays open
        waiting = pool.submit(claim, second, table)
        wait_for_advisory_lock(raw, second_pid)
        first.commit()
        assert len(waiting.result(timeout=30)) == 1
    with autocommit(engine) as conn:
        assert claim(conn, table) == []


def wait_for_advisory_lock(raw: Raw, pid: int) -> None:
    deadline = time.monotonic() + 10
    while not raw.execute(
        "SELECT 1 FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted", [pid]
    ).fetchone():
        assert time.monotonic() < deadline, "the second claim never waited for the queue lock"
        time.sleep(0.01)


def test_claimers_of_different_queues_do_not_wait_for_each_other(
    engine: Engine, table: Table
) -> None:
    fill(engine, table, "mail", 1)
    sms = fill(engine, table, "sms", 1)
    for queue in ("mail", "sms"):
        setting(engine, qs.set_concurrency_limit(table, queue, 1))
    with engine.connect() as first, autocommit(engine) as second:
        second.exec_driver_sql("SET lock_timeout = '100ms'")
        assert len(claim(first, table, "mail")) == 1  # holds mail's lock, open
        assert [r.id for r in claim(second, table, "sms")] == sms
        first.rollback()


def test_a_claim_of_several_limited_queues_locks_them_in_key_order_not_list_order(
    engine: Engine, table: Table, raw: Raw
) -> None:
    """Listed low key first, a claim waiting for the high-key queue's lock must
    not hold the low-key one: claims listing them in either order then take
    the locks in the same order, and cannot deadlock."""

    def key(queue: str) -> Any:
        return raw.execute("SELECT hashtext(%s)", [queue]).fetchone()

    low, high = sorted(("mail", "sms"), key=key)
    for queue in (low, high):
        fill(engine, table, queue, 1)
        setting(engine, qs.set_concurrency_limit(table, queue, 1))
    with (
        engine.connect() as holder,
        autocommit(engine) as waiter,
        autocommit(engine) as other,
        ThreadPoolExecutor(1) as pool,
    ):
        waiter_pid = waiter.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        other.exec_driver_sql("SET lock_timeout = '200ms'")
        assert len(claim(holder, table, low)) == 1  # holds low's lock, open
        waiting = pool.submit(claim, waiter, table, [high, low])
        wait_for_advisory_lock(raw, waiter_pid)
        assert len(claim(other, table, high)) == 1  # high is not held meanwhile
        holder.commit()
        assert waiting.result(timeout=30) == []  # both queues full now


def test_a_limited_queue_refuses_a_claim_outside_read_committed(
    engine: Engine, table: Table
) -> None:
    fill(engine, table, "default", 1)
    setting(engine, qs.set_concurrency_limit(table, "default", 1))
    with engine.connect() as conn:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(DBAPIError, match="claim it under READ COMMITTED"):
            claim(conn, table)
        conn.rollback()


# --------------------------------------------------------------------------- settings


def test_settings_lists_paused_and_limited_queues_with_their_running_and_new_jobs(
    engine: Engine, table: Table
) -> None:
    fill(engine, table, "mail", 2)
    setting(engine, qs.set_concurrency_limit(table, "mail", 3))
    setting(engine, qs.pause(table, "sms"))
    setting(engine, qs.resume(table, "other"))  # no setting left: not listed
    with autocommit(engine) as conn:
        claim(conn, table, "mail", limit=1)
        fill(engine, table, "sms", 2)
        rows = [tuple(r) for r in conn.execute(qs.settings(table))]
    assert [(q, p, n, running, new) for q, p, n, _, running, new in rows] == [
        ("mail", False, 3, 1, 0),
        ("sms", True, None, 0, 2),
    ]


def test_resuming_or_changing_a_limit_wakes_listeners_and_pausing_does_not(
    engine: Engine, table: Table, database_url: str
) -> None:
    channel = canonical_channel("public", names_of(table).table)
    with psycopg.connect(conninfo(database_url), autocommit=True) as listener:
        listener.execute(f'LISTEN "{channel}"')
        setting(engine, qs.pause(table, "mail"))
        setting(engine, qs.resume(table, "mail"))
        setting(engine, qs.set_concurrency_limit(table, "sms", 4))
        heard = [n.payload for n in listener.notifies(timeout=2, stop_after=2)]
    assert heard == ["mail", "sms"]


def test_bad_settings_are_refused_before_reaching_the_database(table: Table) -> None:
    cases = {
        "": "the queue name must not be empty",
        "a\x00b": "NUL character",
    }
    for name, message in cases.items():
        with pytest.raises(InvalidJob, match=message):
            qs.pause(table, name)
    for limit, message in ((-1, "between 1 and"), (2**31, "between 1 and"), (True, "whole")):
        with pytest.raises(InvalidJob, match=message):
            qs.set_concurrency_limit(table, "mail", limit)  # type: ignore[arg-type]


def test_a_limit_of_0_removes_it(engine: Engine, table: Table) -> None:
    setting(engine, qs.set_concurrency_limit(table, "mail", 2))
    assert setting(engine, qs.set_concurrency_limit(table, "mail", 0)).concurrency_limit is None
    with engine.connect() as conn:
        assert conn.execute(qs.settings(table)).all() == []


def test_upgrading_to_version_5_lets_every_reader_of_the_jobs_table_read_the_settings(
    database_url: str, raw: Raw
) -> None:
    """Claims read the settings: a least-privilege worker role granted SELECT on
    the jobs table before the upgrade must not be locked out by it."""
    names = Names(f"jobs_{uuid.uuid4().hex[:10]}", None)
    role = f"jobq_reader_{uuid.uuid4().hex[:8]}"
    for sql in up_statements(names, 0, 4):
        raw.execute(sql.encode())
    raw.execute(f"CREATE ROLE {role}")
    try:
        raw.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {names.qualified} TO {role}")
        for sql in up_statements(names, 4, 5):
            raw.execute(sql.encode())
        granted = raw.execute(
            "SELECT has_table_privilege(%s, %s, 'SELECT'), has_table_privilege(%s, %s, 'UPDATE')",
            [role, names.queues_qualified, role, names.queues_qualified],
        ).fetchone()
        assert granted == (True, False)
    finally:
        drop_queue_table(database_url, names)
        raw.execute(f"DROP ROLE {role}")
