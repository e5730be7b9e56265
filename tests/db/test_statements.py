"""The statements against real PostgreSQL, one connection at a time.

Backoff, fencing, reaping, unique keys, the attempts invariant, hostile
strings and the plans the claim gets. Concurrency lives in test_concurrency.py.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, Table, func, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import OperationalError

from sqla_jobq import client, statements
from sqla_jobq.db import LOCK_TIMEOUT as WORKER_LOCK_TIMEOUT
from sqla_jobq.statements import InvalidJob, NewJob

SHORT_LEASE = timedelta(milliseconds=50)


@contextmanager
def autocommit(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


def job(conn: Connection, table: Table, job_id: int) -> Any:
    return conn.execute(select(table).where(table.c.id == job_id)).one()


def claim_one(conn: Connection, table: Table, **options: Any) -> Any:
    rows = conn.execute(statements.claim(table, limit=1, **options)).all()
    assert len(rows) == 1, rows
    return rows[0]


def make_ready(conn: Connection, table: Table, job_id: int) -> None:
    """Bring a backed-off job's run_at back to now (attempts untouched)."""
    conn.execute(update(table).where(table.c.id == job_id).values(run_at=func.now()))


def count(conn: Connection, table: Table) -> int:
    return conn.execute(select(func.count()).select_from(table)).scalar_one()


# --- backoff -----------------------------------------------------------------


def fail_and_measure(engine: Engine, table: Table, job_id: int, attempts: int, error: str) -> Any:
    """Run `fail` and read `run_at - now()` in the same transaction (same now())."""
    with engine.begin() as conn:
        row = conn.execute(statements.fail(table, job_id, attempts, error)).one()
        delay = conn.execute(
            select(func.extract("epoch", table.c.run_at - func.now())).where(table.c.id == job_id)
        ).scalar_one()
    return row, float(delay)


def test_fail_backs_off_20_40_80_160_seconds_then_fails_at_max_attempts(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        for attempts, seconds in enumerate([20, 40, 80, 160], start=1):
            claimed = claim_one(conn, table)
            assert (claimed.id, claimed.attempts) == (job_id, attempts)
            row, delay = fail_and_measure(engine, table, job_id, attempts, f"boom {attempts}")
            assert (row.status, row.attempts) == ("queued", attempts)
            assert delay == pytest.approx(seconds, abs=0.5)
            assert job(conn, table, job_id).last_error == f"boom {attempts}"
            assert conn.execute(statements.claim(table)).all() == []  # backing off
            make_ready(conn, table, job_id)

        claimed = claim_one(conn, table)
        assert claimed.attempts == 5
        run_at_before = job(conn, table, job_id).run_at
        row, _ = fail_and_measure(engine, table, job_id, 5, "boom 5")
        final = job(conn, table, job_id)
        assert (row.status, final.status, final.attempts) == ("failed", "failed", 5)
        assert final.last_error == "boom 5"
        assert final.run_at == run_at_before  # a failed job is not rescheduled
        assert final.finished_at is not None and final.locked_until is None
        assert conn.execute(statements.claim(table)).all() == []


def test_backoff_is_capped_at_one_hour_when_max_attempts_is_raised(
    engine: Engine, table: Table
) -> None:
    expected = [20, 40, 80, 160, 320, 640, 1280, 2560, 3600, 3600]
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {}, max_attempts=12)
        for attempts, seconds in enumerate(expected, start=1):
            assert claim_one(conn, table).attempts == attempts
            row, delay = fail_and_measure(engine, table, job_id, attempts, "again")
            assert row.status == "queued"
            assert delay == pytest.approx(seconds, abs=0.5), attempts
            make_ready(conn, table, job_id)


def test_backoff_of_a_huge_attempt_count_stays_one_hour_without_overflow(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {}, max_attempts=100_000)
        # Simulating: a job that has already run 5,000 times (claimed by hand).
        conn.execute(
            update(table)
            .where(table.c.id == job_id)
            .values(status="running", attempts=5000, locked_until=func.now())
        )
    _, delay = fail_and_measure(engine, table, job_id, 5000, "still failing")
    assert delay == pytest.approx(3600, abs=0.5)


def test_fail_strips_nul_from_the_error_instead_of_refusing_to_record_it(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        claimed = claim_one(conn, table)
        row = conn.execute(statements.fail(table, job_id, claimed.attempts, "bad\x00byte")).one()
        assert row.status == "queued"
        assert job(conn, table, job_id).last_error == "badbyte"


# --- fencing and reaping -------------------------------------------------------


def test_stale_worker_cannot_complete_fail_or_extend_reclaimed_job(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        stale = claim_one(conn, table, lease=SHORT_LEASE)
        assert stale.attempts == 1
        time.sleep(0.1)
        assert [tuple(r) for r in conn.execute(statements.reap(table))] == [(job_id, "queued", 1)]
        owner = claim_one(conn, table)
        assert (owner.id, owner.attempts) == (job_id, 2)

        assert conn.execute(statements.complete(table, job_id, 1)).rowcount == 0
        assert conn.execute(statements.fail(table, job_id, 1, "late")).first() is None
        assert conn.execute(statements.extend_lease(table, job_id, 1)).rowcount == 0
        assert conn.execute(statements.release(table, job_id, 1)).rowcount == 0
        assert conn.execute(statements.complete_many(table, [(job_id, 1)])).all() == []
        leases = statements.extend_leases(table, [(job_id, 1)], timedelta(minutes=5))
        assert conn.execute(leases).all() == []

        row = job(conn, table, job_id)
        assert (row.status, row.attempts, row.last_error) == ("running", 2, "lease expired")
        assert row.locked_until == owner.locked_until  # the stale extend changed nothing

        assert conn.execute(statements.complete(table, job_id, 2)).rowcount == 1
        row = job(conn, table, job_id)
        assert (row.status, row.attempts, row.locked_until) == ("done", 2, None)


OUTCOMES = {
    "complete_many": lambda t, key, wait: statements.complete_many(t, [key], lock_timeout=wait),
    "complete_to_archive": lambda t, key, wait: statements.complete_to_archive(
        t, [key], lock_timeout=wait
    ),
    "fail": lambda t, key, wait: statements.fail(t, *key, "boom", lock_timeout=wait),
}


@pytest.mark.parametrize("form", sorted(OUTCOMES))
def test_an_outcome_gives_up_on_a_held_row_after_its_own_lock_timeout_whatever_the_session_says(
    engine: Engine, table: Table, form: str
) -> None:
    """Behind a transaction-mode pooler the worker's session setting is gone
    (PgBouncer drops the startup options): here `lock_timeout` is 0, wait
    for ever. The statement's own 200 ms still ends the wait on a row
    another session holds, with the error the finisher goes round (not the
    10 s statement timeout that guards this test), and leaves the session's
    setting as it was."""
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        claimed = claim_one(conn, table)
    key = (job_id, claimed.attempts)
    stmt = OUTCOMES[form](table, key, WORKER_LOCK_TIMEOUT)
    with engine.connect() as holder, autocommit(engine) as conn:
        holder.execute(select(table.c.id).where(table.c.id == job_id).with_for_update())
        conn.exec_driver_sql("SET lock_timeout = 0")
        conn.exec_driver_sql("SET statement_timeout = '10s'")
        with pytest.raises(OperationalError) as refused:
            conn.execute(stmt).all()
        assert isinstance(refused.value.orig, psycopg.errors.LockNotAvailable)
        assert conn.exec_driver_sql("SHOW lock_timeout").scalar_one() == "0"
        holder.rollback()
        assert len(conn.execute(stmt).all()) == 1  # the row free again, the outcome recorded


def test_an_outcomes_lock_timeout_is_a_one_time_filter_evaluated_before_any_row(
    engine: Engine, table: Table
) -> None:
    """What `waiting_at_most` adds, as SQL and as plan: a condition without
    columns, which PostgreSQL evaluates once, before it reads a row; without
    a `lock_timeout` the statement is as it was."""
    stmt = statements.fail(table, 1, 1, "boom", lock_timeout=WORKER_LOCK_TIMEOUT)
    compiled = stmt.compile(dialect=postgresql.psycopg.dialect())
    assert "AND (SELECT set_config('lock_timeout', %(lock_timeout)s::VARCHAR, true)" in str(
        compiled
    )
    assert compiled.params["lock_timeout"] == "200ms"
    assert "set_config" not in str(statements.fail(table, 1, 1, "boom").compile())
    with engine.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN (COSTS OFF) {compiled}", compiled.params)
        assert "One-Time Filter: ($0 IS NOT NULL)" in "\n".join(plan.scalars())
        conn.rollback()


@pytest.mark.parametrize("stale_first", [True, False])
@pytest.mark.parametrize("skip_locked", [False, True])
def test_batch_holding_two_attempts_of_one_job_finishes_only_the_newest_with_its_result(
    engine: Engine, table: Table, stale_first: bool, skip_locked: bool
) -> None:
    """A worker whose lease ran out can claim the job again and hold both
    attempts' outcomes in one batch. Each row looks its pair up at its id's
    first position in the batch, so the newest attempt must be found there
    whatever order the batch came in, and the result stored must be its own."""
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        claim_one(conn, table, lease=SHORT_LEASE)
        time.sleep(0.1)
        conn.execute(statements.reap(table))
        claim_one(conn, table)
        pairs = [(job_id, 1), (job_id, 2)]
        results = ['"stale"', '"live"']
        if not stale_first:
            pairs, results = pairs[::-1], results[::-1]
        fates = conn.execute(statements.fates(table, pairs)).all()
        assert [tuple(r) for r in fates] == [(job_id, 2, "running")]
        done = statements.complete_many(table, pairs, results, skip_locked=skip_locked)
        assert [tuple(r) for r in conn.execute(done)] == [(job_id, 2)]
        row = job(conn, table, job_id)
        assert (row.status, row.attempts, row.result) == ("done", 2, "live")


def test_new_owner_can_fail_and_extend_its_reclaimed_job(engine: Engine, table: Table) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        claim_one(conn, table, lease=SHORT_LEASE)
        time.sleep(0.1)
        conn.execute(statements.reap(table))
        claim_one(conn, table, lease=SHORT_LEASE)
        extend = statements.extend_lease(table, job_id, 2, timedelta(minutes=10))
        assert conn.execute(extend).rowcount == 1
        time.sleep(0.1)
        assert conn.execute(statements.reap(table)).all() == []  # lease was extended
        ids = conn.execute(statements.extend_leases(table, [(job_id, 2)], timedelta(minutes=1)))
        assert ids.scalars().all() == [job_id]
        assert conn.execute(statements.fail(table, job_id, 2, "boom")).one().status == "queued"


def test_reaper_leaves_live_leases_alone(engine: Engine, table: Table) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        claim_one(conn, table, lease=timedelta(minutes=5))
        assert conn.execute(statements.reap(table)).all() == []
        assert job(conn, table, job_id).status == "running"


def test_reap_fails_a_job_at_max_attempts_with_lease_expired(engine: Engine, table: Table) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {}, max_attempts=1)
        claim_one(conn, table, lease=SHORT_LEASE)
        time.sleep(0.1)
        assert [tuple(r) for r in conn.execute(statements.reap(table))] == [(job_id, "failed", 1)]
        row = job(conn, table, job_id)
        assert (row.status, row.last_error, row.locked_until) == ("failed", "lease expired", None)
        assert row.finished_at is not None
        assert conn.execute(statements.claim(table)).all() == []


def test_reap_keeps_an_earlier_error_message(engine: Engine, table: Table) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {}, max_attempts=3)
        claim_one(conn, table)
        conn.execute(statements.fail(table, job_id, 1, "SMTP 451"))
        make_ready(conn, table, job_id)
        claim_one(conn, table)
        # Set the lease in the past instead of sleeping.
        conn.execute(
            update(table)
            .where(table.c.id == job_id)
            .values(locked_until=func.now() - timedelta(seconds=1))
        )
        assert [tuple(r) for r in conn.execute(statements.reap(table))] == [(job_id, "queued", 2)]
        assert job(conn, table, job_id).last_error == "SMTP 451"


# --- the attempts invariant -----------------------------------------------------


def test_retry_of_failed_job_raises_max_attempts_and_keeps_attempts(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {}, max_attempts=1)
        claim_one(conn, table)
        assert conn.execute(statements.fail(table, job_id, 1, "boom")).one().status == "failed"
        assert conn.execute(statements.retry(table, job_id)).one() == (job_id, 1, 2)
        row = job(conn, table, job_id)
        assert (row.status, row.attempts, row.max_attempts) == ("queued", 1, 2)
        assert row.finished_at is None and row.last_error == "boom"
        assert claim_one(conn, table).attempts == 2
        # retry touches failed jobs only
        assert conn.execute(statements.retry(table, job_id)).first() is None
        conn.execute(statements.complete(table, job_id, 2))
        assert conn.execute(statements.retry(table, job_id)).first() is None
        assert job(conn, table, job_id).status == "done"


def test_release_requeues_without_lowering_attempts(engine: Engine, table: Table) -> None:
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {})
        claim_one(conn, table)
        assert conn.execute(statements.release(table, job_id, 1)).rowcount == 1
        row = job(conn, table, job_id)
        assert (row.status, row.attempts, row.locked_until) == ("queued", 1, None)
        assert claim_one(conn, table).attempts == 2


def test_cancel_takes_queued_and_running_jobs_and_fences_out_their_owner(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        queued = client.enqueue(conn, table, "t", {}, priority=1)
        running = client.enqueue(conn, table, "t", {})
        assert [tuple(r) for r in conn.execute(statements.cancel(table, queued))] == [
            (queued, "queued")
        ]
        row = job(conn, table, queued)
        assert (row.status, row.attempts) == ("cancelled", 0)
        assert row.finished_at is not None and row.cancel_requested_at is not None

        assert claim_one(conn, table).id == running
        assert [tuple(r) for r in conn.execute(statements.cancel(table, running))] == [
            (running, "running")
        ]
        # The owner's handler finishing anyway changes nothing: the fence refuses it.
        assert conn.execute(statements.complete(table, running, 1)).rowcount == 0
        assert conn.execute(statements.fail(table, running, 1, "late")).first() is None
        fates = conn.execute(statements.fates(table, [(running, 1)])).all()
        assert [tuple(f) for f in fates] == [(running, 1, "cancelled")]
        assert conn.execute(statements.cancel(table, running)).first() is None
        assert conn.execute(statements.cancel(table, queued)).first() is None
        assert job(conn, table, running).status == "cancelled"


OPERATIONS = (
    "claim",
    "claim_short",
    "complete",
    "fail",
    "release",
    "reap",
    "retry",
    "cancel",
    "extend",
    "stale_complete",
    "make_ready",
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)
@given(ops=st.lists(st.sampled_from(OPERATIONS), min_size=1, max_size=12))
def test_attempts_never_decreases_under_any_sequence_of_operations(
    engine: Engine, table: Table, ops: list[str]
) -> None:
    with autocommit(engine) as conn:
        queue = f"q{time.monotonic_ns()}"
        job_id = client.enqueue(conn, table, "t", {}, queue=queue, max_attempts=3)
        seen = 0
        for op in ops:
            attempts = job(conn, table, job_id).attempts
            if op in ("claim", "claim_short"):
                lease = SHORT_LEASE if op == "claim_short" else timedelta(minutes=5)
                conn.execute(statements.claim(table, queue=queue, lease=lease))
            elif op == "complete":
                conn.execute(statements.complete(table, job_id, attempts))
            elif op == "stale_complete":
                # a token from an earlier claim never matches once re-claimed
                assert conn.execute(statements.complete(table, job_id, attempts - 1)).rowcount == 0
            elif op == "fail":
                conn.execute(statements.fail(table, job_id, attempts, "x"))
            elif op == "release":
                conn.execute(statements.release(table, job_id, attempts))
            elif op == "reap":
                conn.execute(
                    update(table)
                    .where(table.c.id == job_id, table.c.status == "running")
                    .values(locked_until=func.now() - timedelta(seconds=1))
                )
                conn.execute(statements.reap(table))
            elif op == "retry":
                conn.execute(statements.retry(table, job_id))
            elif op == "cancel":
                conn.execute(statements.cancel(table, job_id))
            elif op == "extend":
                conn.execute(statements.extend_lease(table, job_id, attempts))
            elif op == "make_ready":
                make_ready(conn, table, job_id)
            row = job(conn, table, job_id)
            assert row.attempts >= seen, (op, row.attempts, seen)
            seen = row.attempts
            assert (row.status == "running") == (row.locked_until is not None)


# --- unique keys ------------------------------------------------------------------


def test_duplicate_unique_key_of_queued_or_running_job_returns_existing_id(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        first = client.enqueue(conn, table, "t", {"n": 1}, unique_key="k")
        assert client.enqueue(conn, table, "t", {"n": 2}, unique_key="k") == first
        assert count(conn, table) == 1
        claim_one(conn, table)
        assert client.enqueue(conn, table, "t", {"n": 3}, unique_key="k") == first
        assert count(conn, table) == 1
        assert job(conn, table, first).payload == {"n": 1}


def test_unique_key_is_free_again_once_the_job_is_done_or_failed(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        first = client.enqueue(conn, table, "t", {}, unique_key="k", max_attempts=1)
        claim_one(conn, table)
        conn.execute(statements.complete(table, first, 1))
        second = client.enqueue(conn, table, "t", {}, unique_key="k", max_attempts=1)
        assert second != first
        claim_one(conn, table)
        conn.execute(statements.fail(table, second, 1, "boom"))
        third = client.enqueue(conn, table, "t", {}, unique_key="k")
        assert third not in (first, second)
        assert client.enqueue(conn, table, "t", {}, unique_key="k") == third
        assert count(conn, table) == 3


def test_enqueue_many_returns_ids_in_input_order_with_duplicate_keys(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        existing = client.enqueue(conn, table, "t", {"i": "existing"}, unique_key="old")
        keys = [None, "a", "old", None, "a", "b", None, "old", "b", None]
        rows = [NewJob("t", {"i": i}, unique_key=k) for i, k in enumerate(keys)]
        ids = client.enqueue_many(conn, table, rows)
        assert len(ids) == len(keys)
        assert ids[2] == ids[7] == existing
        assert ids[1] == ids[4] and ids[5] == ids[8]
        new_positions = [0, 1, 3, 5, 6, 9]  # first occurrence of each new job
        new_ids = [ids[i] for i in new_positions]
        assert len(set(new_ids)) == len(new_ids) and existing not in new_ids
        assert new_ids == sorted(new_ids)  # inserted in input order
        for i in new_positions:  # each id is the row that was asked for at i
            row = job(conn, table, ids[i])
            assert (row.payload, row.unique_key) == ({"i": i}, keys[i])
        assert count(conn, table) == 1 + len(new_positions)


def test_enqueue_many_of_plain_rows_maps_ids_to_rows_in_order(engine: Engine, table: Table) -> None:
    with autocommit(engine) as conn:
        rows = [NewJob("t", {"i": i}, priority=i % 3) for i in range(7000)]  # two pages
        ids = client.enqueue_many(conn, table, rows)
        assert ids == sorted(ids) and len(set(ids)) == 7000
        got = dict(conn.execute(select(table.c.id, table.c.payload["i"].as_integer())).all())
        assert [got[i] for i in ids] == list(range(7000))


# --- prune, next_run_at, stats ---------------------------------------------------------


def test_prune_deletes_only_finished_jobs_older_than_the_cutoff_in_batches(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        ids = client.enqueue_many(conn, table, [NewJob("t", {}) for _ in range(6)])
        claimed = conn.execute(statements.claim(table, limit=4)).all()
        done = [(r.id, r.attempts) for r in claimed[:3]]
        conn.execute(statements.complete_many(table, done))
        conn.execute(statements.fail(table, claimed[3].id, 1, "x"))
        conn.execute(statements.cancel(table, ids[5]))
        # now: 3 done, 1 cancelled (failed), 2 queued (one of them failed once)
        kept = statements.prune(table, older_than=timedelta(hours=1))
        assert conn.execute(kept).rowcount == 0
        assert conn.execute(statements.prune(table, older_than=timedelta(0), limit=2)).rowcount == 2
        assert conn.execute(statements.prune(table, older_than=timedelta(0), limit=2)).rowcount == 2
        assert conn.execute(statements.prune(table, older_than=timedelta(0), limit=2)).rowcount == 0
        left = conn.execute(select(table.c.status).order_by(table.c.id)).scalars().all()
        assert sorted(left) == ["queued", "queued"]  # the failed-once job is queued again
    with pytest.raises(InvalidJob):
        statements.prune(table, older_than=timedelta(0), statuses=["queued"])


def test_next_run_at_reports_the_earliest_queued_job_even_if_delayed(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        assert conn.execute(statements.next_run_at(table)).first()[0] is None
        later = datetime.now(UTC) + timedelta(hours=2)
        client.enqueue(conn, table, "t", {}, run_at=later)
        client.enqueue(conn, table, "t", {}, delay=timedelta(hours=3))
        client.enqueue(conn, table, "t", {}, queue="other")
        assert conn.execute(statements.next_run_at(table)).first()[0] == later
        both = statements.next_run_at(table, queue=["default", "other"])
        assert conn.execute(both).first()[0] < later


def test_stats_counts_per_queue_and_status_with_expired_leases(
    engine: Engine, table: Table
) -> None:
    with autocommit(engine) as conn:
        client.enqueue_many(conn, table, [NewJob("t", {}) for _ in range(3)])
        client.enqueue(conn, table, "t", {}, queue="mail")
        claim_one(conn, table, lease=SHORT_LEASE)
        time.sleep(0.1)
        got = {(r.queue, r.status): r for r in conn.execute(statements.stats(table))}
        assert {k: r.count for k, r in got.items()} == {
            ("default", "queued"): 2,
            ("default", "running"): 1,
            ("mail", "queued"): 1,
        }
        assert got[("default", "running")].expired_leases == 1
        assert got[("default", "queued")].oldest_ready_age >= 0


# --- hostile strings ------------------------------------------------------------------

HOSTILE = [
    "it's",
    'say "hi"',
    "a;b",
    "'; DROP TABLE jobs; --",
    '"; DROP TABLE jobs; --',
    "🦄 ünïcödé ✓ 漢字",
    "%(queue)s %s $1 :id ?",
    "back\\slash \\x00 \\u0000",
    "new\nline\ttab\r",
    "x" * 1000,
]


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v[:20]))
def test_hostile_strings_round_trip_verbatim_through_enqueue_and_claim(
    engine: Engine, table: Table, value: str
) -> None:
    payload = {"s": value, value: [value], "n": 1}
    with autocommit(engine) as conn:
        one = client.enqueue(conn, table, value, payload, queue=value, unique_key=value)
        assert client.enqueue(conn, table, value, payload, queue=value, unique_key=value) == one
        many = client.enqueue_many(
            conn, table, [NewJob(value, payload, queue=value, unique_key=value + "2")]
        )
        rows = conn.execute(statements.claim(table, queue=value)).all()
        assert sorted(r.id for r in rows) == sorted([one, *many])
        for r in rows:
            assert (r.task, r.queue, r.payload) == (value, value, payload)
        keys = conn.execute(select(table.c.unique_key).order_by(table.c.id)).scalars().all()
        assert keys == [value, value + "2"]
        assert conn.execute(statements.claim(table, queue=[value, "x"])).all() == []
        assert conn.execute(statements.fail(table, one, 1, value)).one().status == "queued"
        assert job(conn, table, one).last_error == value
        assert conn.execute(select(func.count()).select_from(table)).scalar() == 2


def test_10kb_task_names_and_payload_strings_round_trip_verbatim(
    engine: Engine, table: Table
) -> None:
    rng = random.Random(7)
    for big in ("x" * 10_240, "".join(rng.choice("ab;'\"-🦄漢 ") for _ in range(10_240))):
        payload = {"s": big, big: [big]}
        with autocommit(engine) as conn:
            job_id = client.enqueue(conn, table, big, payload)
            (many,) = client.enqueue_many(conn, table, [NewJob(big, payload)])
            rows = conn.execute(statements.claim(table)).all()
            assert sorted(r.id for r in rows) == [job_id, many]
            assert all((r.task, r.payload) == (big, payload) for r in rows)


def test_queue_names_and_unique_keys_are_capped_at_1024_bytes(engine: Engine, table: Table) -> None:
    """Queue names are NOTIFY payloads (< 8000 bytes) and both are btree index
    keys (about 2.7 kB): a longer one is refused up front, not by the database."""
    rng = random.Random(11)
    at_limit = "".join(rng.choice("abcdefghij'\";- ") for _ in range(statements.MAX_KEY_BYTES))
    with autocommit(engine) as conn:
        job_id = client.enqueue(conn, table, "t", {}, queue=at_limit, unique_key=at_limit)
        row = claim_one(conn, table, queue=at_limit)
        assert (row.id, row.queue) == (job_id, at_limit)
        assert job(conn, table, job_id).unique_key == at_limit
        for options in ({"queue": at_limit + "x"}, {"unique_key": "🦄" * 257}):
            with pytest.raises(InvalidJob, match="1024 bytes"):
                client.enqueue(conn, table, "t", {}, **options)
            with pytest.raises(InvalidJob, match="1024 bytes"):
                client.enqueue_many(conn, table, [NewJob("t", {}, **options)])
        assert count(conn, table) == 1


@pytest.mark.parametrize(
    "options",
    [
        {"task": "bad\x00task"},
        {"queue": "bad\x00queue"},
        {"payload": {"s": "bad\x00value"}},
        {"payload": {"bad\x00key": 1}},
        {"unique_key": "bad\x00key"},
    ],
    ids=["task", "queue", "payload-value", "payload-key", "unique_key"],
)
def test_nul_is_refused_before_anything_is_written(
    engine: Engine, table: Table, options: dict[str, Any]
) -> None:
    task = options.pop("task", "t")
    payload = options.pop("payload", {})
    with autocommit(engine) as conn:
        with pytest.raises(InvalidJob, match="NUL"):
            client.enqueue(conn, table, task, payload, **options)
        with pytest.raises(InvalidJob, match="NUL"):
            client.enqueue_many(conn, table, [NewJob(task, payload, **options)])
        assert count(conn, table) == 0
    if "queue" in options:
        with pytest.raises(InvalidJob, match="NUL"):
            statements.claim(table, queue=options["queue"])


# Any text but NUL and lone surrogates (which UTF-8 cannot encode), short
# enough to stay under the 1024-byte cap on queue names and unique keys.
_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=200
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)
@given(queue=_TEXT, task=_TEXT, key=_TEXT, value=_TEXT)
def test_any_text_without_nul_round_trips(
    engine: Engine, table: Table, queue: str, task: str, key: str, value: str
) -> None:
    payload = {key: value, "list": [value, key]}
    with autocommit(engine) as conn:
        conn.execute(table.delete())
        job_id = client.enqueue(conn, table, task, payload, queue=queue, unique_key=key)
        row = claim_one(conn, table, queue=queue)
        assert (row.id, row.task, row.queue, row.payload) == (job_id, task, queue, payload)
        assert job(conn, table, job_id).unique_key == key


# --- plans --------------------------------------------------------------------------


@pytest.fixture
def history(engine: Engine, table: Table) -> Table:
    """50,000 done jobs and 300 queued ones, analysed."""
    with autocommit(engine) as conn:
        name = table.name
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload, status, finished_at, created_at) '
            "SELECT jsonb_build_object('i', g), 'done', now(), now() - interval '1 day' "
            "FROM generate_series(1, 50000) AS g"
        )
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload, queue) '
            "SELECT jsonb_build_object('i', g), "
            "CASE WHEN g %% 3 = 0 THEN 'mail' ELSE 'default' END "
            "FROM generate_series(1, 300) AS g"
        )
        conn.exec_driver_sql(f'ANALYZE "{name}"')
    return table


def cte_plan(conn: Connection, sql: str, params: Any = None) -> dict[str, Any]:
    """The plan of the claim's locking CTE, from EXPLAIN (FORMAT JSON)."""
    plan = conn.exec_driver_sql(f"EXPLAIN (COSTS OFF, FORMAT JSON) {sql}", params).scalar_one()
    root = plan[0]["Plan"]
    ctes = [p for p in root.get("Plans", []) if p.get("Subplan Name", "").startswith("CTE ")]
    assert len(ctes) == 1, root
    return ctes[0]


def assert_limit_lockrows_index_scan(node: dict[str, Any], index: str) -> None:
    assert node["Node Type"] == "Limit", node
    (lock,) = node["Plans"]
    assert lock["Node Type"] == "LockRows", lock
    (scan,) = lock["Plans"]
    assert scan["Node Type"] == "Index Scan", scan
    assert scan["Index Name"] == index


def dollar_params(sql: str) -> tuple[str, list[str]]:
    """Rewrite pyformat placeholders as $1.. for PREPARE; returns the names in order."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, sql), order


def test_claim_walks_the_claim_index_past_finished_history(engine: Engine, history: Table) -> None:
    compiled = statements.claim(history, limit=10).compile(dialect=postgresql.psycopg.dialect())
    with engine.connect() as conn:
        node = cte_plan(conn, str(compiled), compiled.params)
        assert_limit_lockrows_index_scan(node, f"{history.name}_claim_idx")
        rows = conn.execute(statements.claim(history, limit=10)).all()
        assert len(rows) == 10 and {r.queue for r in rows} == {"default"}
        conn.rollback()


def test_the_articles_classic_claim_uses_the_ready_index(engine: Engine, history: Table) -> None:
    name = history.name
    classic = f"""
        WITH next AS (
          SELECT id FROM "{name}"
          WHERE queue = 'default' AND status = 'queued' AND run_at <= now()
          ORDER BY run_at
          LIMIT 1
          FOR UPDATE
        )
        UPDATE "{name}" j
        SET status = 'running', attempts = j.attempts + 1
        FROM next
        WHERE j.id = next.id
        RETURNING j.id"""
    with engine.connect() as conn:
        assert_limit_lockrows_index_scan(cte_plan(conn, classic), f"{name}_ready_idx")
        skip_locked = classic.replace("FOR UPDATE", "FOR UPDATE SKIP LOCKED")
        assert_limit_lockrows_index_scan(cte_plan(conn, skip_locked), f"{name}_ready_idx")


def test_generic_plan_of_prepared_claim_still_uses_the_partial_index(
    engine: Engine, history: Table
) -> None:
    """Status literals are inline for this: a parameter could not prove the
    partial index's predicate, and a generic plan would scan the whole table."""
    compiled = statements.claim(history, limit=10).compile(dialect=postgresql.psycopg.dialect())
    sql, order = dollar_params(str(compiled))
    assert "'queued'" in sql and "'running'" in sql
    literals = {"queue": "'default'", "limit": "10", "lease": "interval '5 minutes'"}
    args = ", ".join(literals.get(n, "1") for n in order)
    status_param = sql.replace("status = 'queued'", f"status = ${len(order) + 1}")
    assert status_param != sql
    with engine.connect() as conn:
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE jobq_claim AS {sql}")
        node = cte_plan(conn, f"EXECUTE jobq_claim({args})")
        assert_limit_lockrows_index_scan(node, f"{history.name}_claim_idx")
        assert "$1" in str(node)  # it is the generic plan: the queue is still a parameter

        # The contrast: the same claim with the status as a parameter cannot.
        conn.exec_driver_sql(f"PREPARE jobq_claim_param AS {status_param}")
        plan = (
            conn.exec_driver_sql(f"EXPLAIN (COSTS OFF) EXECUTE jobq_claim_param({args}, 'queued')")
            .scalars()
            .all()
        )
        assert not any("_claim_idx" in line or "_ready_idx" in line for line in plan), plan
        conn.rollback()


def test_reaper_uses_the_running_index(engine: Engine, history: Table) -> None:
    reap = statements.reap(history).compile(dialect=postgresql.psycopg.dialect())
    with engine.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN (COSTS OFF) {reap}", reap.params).scalars().all()
        assert any(f"{history.name}_running_idx" in line for line in plan), plan
        conn.rollback()


def under_the_lock(node: dict[str, Any]) -> dict[str, Any]:
    """What the claim's CTE (Limit, then LockRows) locks rows from."""
    assert node["Node Type"] == "Limit", node
    (lock,) = node["Plans"]
    assert lock["Node Type"] == "LockRows", lock
    (child,) = lock["Plans"]
    return child


def starts_at_the_position(node: dict[str, Any]) -> str:
    """The index scan right under the claim's LockRows, bounded by the
    position: `(run_at, id) >` as its Index Cond, on either index (both end in
    `run_at, id` since schema version 7), so nothing sorts and the scan stops
    at the LIMIT."""
    scan = under_the_lock(node)
    assert scan["Node Type"] == "Index Scan", scan
    assert "ROW(run_at, id) >" in str(scan["Index Cond"]), scan
    return str(scan["Index Name"])


def generic_claim_after_plan(conn: Connection, sql: str, literals: dict[str, str]) -> Any:
    """The positional claim's CTE in the generic plan a prepared statement
    gets (as the worker's is), for a position given as SQL literals."""
    numbered, order = dollar_params(sql)
    values = {"queue": "'default'", "lease": "interval '5 minutes'", "after_priority": "0"}
    values.update(literals)
    conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
    conn.exec_driver_sql(f"PREPARE jobq_claim_after AS {numbered}")
    args = ", ".join(values.get(n, "1") for n in order)
    return cte_plan(conn, f"EXECUTE jobq_claim_after({args})")


def test_claim_after_a_position_starts_its_index_scan_there(
    engine: Engine, history: Table
) -> None:
    """The positional claim (see claim_cursor) is an index range from the
    position on, in the custom plan and in the generic plan a prepared
    statement gets, so it never steps over the entries before it."""
    stmt = statements.claim(history, limit=10, after=True)
    compiled = stmt.compile(dialect=postgresql.psycopg.dialect())
    position = {"after_priority": 0, "after_run_at": "-infinity", "after_id": 150}
    with engine.connect() as conn:
        node = cte_plan(conn, str(compiled), {**compiled.params, **position})
        starts_at_the_position(node)
        literals = {"limit": "10", "after_run_at": "'-infinity'", "after_id": "150"}
        starts_at_the_position(generic_claim_after_plan(conn, str(compiled), literals))
        conn.rollback()


def test_fenced_statements_find_their_rows_by_primary_key_in_generic_plans(
    engine: Engine, history: Table
) -> None:
    """Completion, failure, heartbeats and hand-backs name their rows by id.
    Their generic plans (the worker prepares them) must look those ids up in
    the primary key, never walk the running index: while a snapshot is held,
    that index keeps an entry for every job run since (schema step 6 gave it
    a predicate only the reaper implies)."""
    name = history.name
    with autocommit(engine) as conn:
        conn.exec_driver_sql(
            f"UPDATE \"{name}\" SET status = 'running', attempts = 1, "
            "locked_until = now() + interval '5 minutes' "
            f"WHERE id IN (SELECT id FROM \"{name}\" WHERE status = 'queued' LIMIT 50)"
        )
        conn.exec_driver_sql(f'ANALYZE "{name}"')
    pairs = [(1, 1), (2, 1)]
    wait = WORKER_LOCK_TIMEOUT
    fenced = {
        "complete_many": statements.complete_many(history, pairs, lock_timeout=wait),
        "complete_many with results": statements.complete_many(
            history, pairs, [None, None], lock_timeout=wait
        ),
        "complete_to_archive": statements.complete_to_archive(
            history, pairs, [None, None], lock_timeout=wait
        ),
        "extend_leases": statements.extend_leases(history, pairs, timedelta(minutes=5)),
        "release_many": statements.release_many(history, pairs, refund=True),
        "fail": statements.fail(history, 1, 1, "boom", lock_timeout=wait),
    }
    with engine.connect() as conn:
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        for n, (what, stmt) in enumerate(fenced.items()):
            compiled = stmt.compile(dialect=postgresql.psycopg.dialect())
            sql, order = dollar_params(str(compiled))
            values = {**compiled.params}
            args = ", ".join(_literal(values.get(key)) for key in order)
            conn.exec_driver_sql(f"PREPARE fenced_{n} AS {sql}")
            plan = "\n".join(
                conn.exec_driver_sql(f"EXPLAIN (COSTS OFF) EXECUTE fenced_{n}({args})").scalars()
            )
            assert f"{name}_running_idx" not in plan, (what, plan)
            assert f"{name}_pkey" in plan, (what, plan)
            assert "Nested Loop" not in plan and "Function Scan" not in plan, (what, plan)
        conn.rollback()


def _literal(value: Any) -> str:
    """A bound value as SQL text for EXECUTE (the test's own simple values)."""
    if isinstance(value, list):
        inner = ",".join("NULL" if v is None else str(v) for v in value)
        return f"'{{{inner}}}'"
    if isinstance(value, timedelta):
        return f"interval '{int(value.total_seconds())} seconds'"
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(value)


def fenced_batches(table: Table, pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """Every fenced batch statement a worker runs, for these pairs."""
    wait = WORKER_LOCK_TIMEOUT
    return {
        "complete_many": statements.complete_many(table, pairs, lock_timeout=wait),
        "complete_many with results": statements.complete_many(
            table, pairs, [None] * len(pairs), lock_timeout=wait
        ),
        "complete_many skipping locked": statements.complete_many(table, pairs, skip_locked=True),
        "complete_to_archive": statements.complete_to_archive(table, pairs, lock_timeout=wait),
        "complete_to_archive skipping locked": statements.complete_to_archive(
            table, pairs, skip_locked=True
        ),
        "extend_leases": statements.extend_leases(table, pairs, timedelta(minutes=5)),
        "release_many": statements.release_many(table, pairs, refund=True),
        "fates": statements.fates(table, pairs),
    }


def custom_plans(engine: Engine, stmts: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Each statement's plan for its own values: unprepared, as a worker
    behind PgBouncer runs it, or as a prepared one is after an ANALYZE."""
    with engine.connect() as conn:
        for what, stmt in stmts.items():
            compiled = stmt.compile(dialect=postgresql.psycopg.dialect())
            plan = conn.exec_driver_sql(f"EXPLAIN (COSTS OFF) {compiled}", compiled.params)
            yield what, "\n".join(plan.scalars())
        conn.rollback()


def test_fenced_batches_find_their_rows_by_primary_key_when_statistics_saw_no_running_job(
    engine: Engine, table: Table
) -> None:
    """Behind PgBouncer the worker runs unprepared: every batch is planned
    with the table's statistics of the moment. Autovacuum's ANALYZE often runs
    while no job is running (a full queue, an idle one), and then estimates
    one running row: the planner scanned the whole table for every batch and
    joined each row against the batch (25 to 60 ms a completion on 20,000
    rows). The ids must go to the primary key whatever the statistics say, and
    no join to the batch's pairs may be left for the planner to rescan per
    row (see `statements._owned`)."""
    name = table.name
    with autocommit(engine) as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload) SELECT \'{{}}\' FROM generate_series(1, 20000)'
        )
        conn.exec_driver_sql(f'ANALYZE "{name}"')
        running = conn.exec_driver_sql(
            f"UPDATE \"{name}\" SET status = 'running', attempts = 1, "
            "locked_until = now() + interval '5 minutes' "
            f"WHERE id IN (SELECT id FROM \"{name}\" LIMIT 200) RETURNING id"
        ).scalars().all()
    pairs = [(job_id, 1) for job_id in running]
    for what, plan in custom_plans(engine, fenced_batches(table, pairs)):
        assert "Seq Scan" not in plan, (what, plan)
        assert f"{name}_pkey" in plan, (what, plan)
        assert "Nested Loop" not in plan and "Function Scan" not in plan, (what, plan)


def test_fenced_batches_find_their_rows_by_primary_key_after_an_analyze_during_a_hold(
    engine: Engine, table: Table
) -> None:
    """While a snapshot is held, ANALYZE (autovacuum's, every minute on a busy
    queue) counts only the live rows, while every row version the hold keeps
    stays in the heap and the primary key: the planner then prices each id's
    lookup at dozens of pages. For a batch of ids given as a literal array
    (a custom plan, as every plan is after such an ANALYZE invalidated the
    prepared ones) it chose a Seq Scan of the whole bloated heap: in the
    held-snapshot scene every completion did, the finisher's session took a
    whole core, and completions fell to 28% of the offered load for 50 s.
    However many ids a batch holds, the planner must see too few to make
    that scan look cheaper."""
    name = table.name
    batch = 1000
    with autocommit(engine) as conn, engine.connect() as holder:
        holder.execution_options(isolation_level="REPEATABLE READ")
        holder.exec_driver_sql(f'SELECT count(*) FROM "{name}"').scalar_one()
        for _ in range(10):  # 100,000 jobs run and gone: three versions each, all kept
            conn.exec_driver_sql(
                f'INSERT INTO "{name}" (payload) SELECT \'{{}}\' FROM generate_series(1, 10000)'
            )
            conn.exec_driver_sql(
                f"UPDATE \"{name}\" SET status = 'running', attempts = 1, "
                "locked_until = now() + interval '5 minutes' WHERE status = 'queued'"
            )
            conn.exec_driver_sql(f'DELETE FROM "{name}"')
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload) SELECT \'{{}}\' FROM generate_series(1, {batch})'
        )
        running = conn.exec_driver_sql(
            f"UPDATE \"{name}\" SET status = 'running', attempts = 1, "
            "locked_until = now() + interval '5 minutes' RETURNING id"
        ).scalars().all()
        conn.exec_driver_sql(f'ANALYZE "{name}"')
        holder.rollback()
    pairs = [(job_id, 1) for job_id in running]
    for what, plan in custom_plans(engine, fenced_batches(table, pairs)):
        assert "Seq Scan" not in plan, (what, plan)
        assert f"{name}_pkey" in plan, (what, plan)


def test_claim_after_a_position_never_sorts_the_backlog_when_statistics_saw_a_short_queue(
    engine: Engine, table: Table
) -> None:
    """Autovacuum analyses a queue table while its queue is short, so the
    planner expects few queued rows. With 200,000 jobs queued past the
    position, PostgreSQL 15 then gives the positional claim the ready index.
    On `(queue, run_at)` (schema versions 1 to 6) that meant a Sort under its
    LockRows: a sort that cannot stop at the LIMIT, so every claim read and
    sorted the whole backlog past the position (20 to 70 ms a claim with
    60,000 jobs queued; behind a held snapshot a worker offered 15,000 jobs/s
    fell to 2% of it). Version 7's `(queue, run_at, id)` serves the order as a
    range. PostgreSQL 16 keeps the claim index here."""
    name = table.name
    with autocommit(engine) as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload, status, finished_at, run_at) '
            "SELECT '{}', 'done', now(), now() - interval '1 hour' + g * interval '1 ms' "
            "FROM generate_series(1, 100000) AS g"
        )
        conn.exec_driver_sql(
            f"INSERT INTO \"{name}\" (payload, run_at) "
            "SELECT '{}', now() - interval '10 minutes' FROM generate_series(1, 500)"
        )
        conn.exec_driver_sql(f'ANALYZE "{name}"')
        conn.exec_driver_sql(
            f'INSERT INTO "{name}" (payload, run_at) '
            "SELECT '{}', now() - interval '1 minute' + (g / 4000) * interval '1 s' "
            "FROM generate_series(1, 200000) AS g"
        )
        first = conn.exec_driver_sql(
            f"SELECT run_at, id FROM \"{name}\" WHERE run_at > now() - interval '2 minutes' "
            "ORDER BY run_at, id LIMIT 1"
        ).one()
    stmt = statements.claim(table, limit=64, after=True)
    compiled = stmt.compile(dialect=postgresql.psycopg.dialect())
    position = {"after_priority": 0, "after_run_at": first.run_at, "after_id": first.id}
    literals = {
        "limit": "64",
        "after_run_at": f"'{first.run_at.isoformat()}'",
        "after_id": str(first.id),
    }
    with engine.connect() as conn:
        plans = [
            cte_plan(conn, str(compiled), {**compiled.params, **position}),
            generic_claim_after_plan(conn, str(compiled), literals),
        ]
        conn.rollback()
    for plan in plans:
        starts_at_the_position(plan)
