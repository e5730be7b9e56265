"""A hypothesis state machine over the statements, against real PostgreSQL.

Several simulated workers enqueue, claim, complete, fail, extend, release; the
clock is moved by hand (a lease is expired with ``UPDATE ... SET locked_until =
now() - interval '1 s'``, a backoff elapses by moving ``run_at``); a reaper, a
pruner, retry and cancel run in between. Workers keep every (id, attempts) they
ever claimed, so they keep trying statements on jobs they lost.

After every step the database must equal a plain-Python model, and:

* attempts never decreases for any row, and max_attempts neither;
* status changes are only those the step may make: queued->running (claim),
  running->done/queued/failed (complete, fail, release, reap), failed->queued
  (retry only), queued/running->cancelled (cancel only; the owner of a cancelled
  running job then matches nothing); rows vanish only by prune, and only when
  finished;
* a stale owner's statement matches 0 rows and leaves the row byte-for-byte as it was;
* the rows the claim statement can see are exactly the queued, ready rows of the
  model, and the partial index serves exactly the queued rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Connection, Engine, Table, select, text

from sqla_jobq import statements

QUEUES = ("a", "b")
WORKERS = 2
HOUR = timedelta(hours=1)
LEGAL_BY_RULE: dict[str, set[tuple[str, str]]] = {
    "claim": {("queued", "running")},
    "complete": {("running", "done")},
    "fail": {("running", "queued"), ("running", "failed")},
    "release": {("running", "queued")},
    "reap": {("running", "queued"), ("running", "failed")},
    "retry": {("failed", "queued"), ("cancelled", "queued")},
    "cancel": {("queued", "cancelled"), ("running", "cancelled")},
}


@dataclass(frozen=True)
class Row:
    status: str
    attempts: int
    max_attempts: int
    queue: str
    ready: bool = True  # queued and run_at <= now()
    expired: bool = False  # running and locked_until < now()


class QueueMachine(RuleBasedStateMachine):
    conn: Connection
    table: Table

    def __init__(self) -> None:
        super().__init__()
        self.conn.execute(text(f"TRUNCATE {self.q}"))
        self.model: dict[int, Row] = {}
        self.held: list[list[tuple[int, int]]] = [[] for _ in range(WORKERS)]
        self.before: dict[int, Row] = {}
        self.step = "init"

    @property
    def q(self) -> str:
        return self.table.fullname if self.table.schema else f'"{self.table.name}"'

    # -- helpers ------------------------------------------------------------

    def full_row(self, job_id: int) -> Any:
        return self.conn.execute(select(self.table).where(self.table.c.id == job_id)).first()

    def begin(self, name: str) -> None:
        self.step = name
        self.before = dict(self.model)

    def pick(self, items: list[Any], index: int) -> Any:
        return items[index % len(items)] if items else None

    def owned(self, job_id: int, attempts: int) -> bool:
        row = self.model.get(job_id)
        return row is not None and row.status == "running" and row.attempts == attempts

    def fenced(self, name: str, worker: int, index: int, stmt_for: Any) -> tuple[int, int] | None:
        """Run a fenced statement for one of `worker`'s claims: an even `index` picks
        one it still owns, an odd one a claim it lost (when it has such)."""
        self.begin(name)
        mine = self.held[worker]
        live = [h for h in mine if self.owned(*h)]
        lost = [h for h in mine if not self.owned(*h)]
        held = self.pick((lost if index % 2 else live) or mine, index // 2)
        if held is None:
            return None
        job_id, attempts = held
        expect = self.owned(job_id, attempts)
        before = self.full_row(job_id)
        count = self.conn.execute(stmt_for(job_id, attempts)).rowcount
        assert count == (1 if expect else 0), (name, held, self.model.get(job_id))
        if not expect:
            assert self.full_row(job_id) == before, f"stale {name} changed job {job_id}"
            return None
        return held

    def guarded(
        self, name: str, index: int, status: str | tuple[str, ...], stmt_for: Any
    ) -> tuple[int, Row, Sequence[Any]] | None:
        """Run an admin statement on any job (picked by `index`): it applies only to
        a job in `status` (one, or any of several); on any other it must return no
        rows and leave the row byte-for-byte as it was. Returns (job id, model row
        before, rows) when it applied, None otherwise."""
        self.begin(name)
        job_id = self.pick(sorted(self.model), index)
        if job_id is None:
            return None
        old = self.model[job_id]
        before = self.full_row(job_id)
        rows = self.conn.execute(stmt_for(job_id)).all()
        if old.status not in ((status,) if isinstance(status, str) else status):
            assert rows == [] and self.full_row(job_id) == before
            return None
        return job_id, old, rows

    def some(self, *statuses: str) -> bool:
        return any(r.status in statuses for r in self.model.values())

    # -- rules --------------------------------------------------------------

    @rule(queue=st.sampled_from(QUEUES), max_attempts=st.integers(1, 3))
    def enqueue(self, queue: str, max_attempts: int) -> None:
        self.begin("enqueue")
        stmt = statements.enqueue(self.table, "t", {}, queue=queue, max_attempts=max_attempts)
        job_id = self.conn.execute(stmt).scalar_one()
        self.model[job_id] = Row("queued", 0, max_attempts, queue)

    @precondition(lambda self: self.some("queued"))
    @rule(
        worker=st.integers(0, WORKERS - 1),
        queues=st.sampled_from([("a",), ("b",), ("a", "b")]),
        limit=st.integers(1, 3),
    )
    def claim(self, worker: int, queues: tuple[str, ...], limit: int) -> None:
        self.begin("claim")
        queue: statements.Queues = queues[0] if len(queues) == 1 else list(queues)
        rows = self.conn.execute(
            statements.claim(self.table, queue=queue, limit=limit, lease=HOUR)
        ).all()
        claimable = {
            i
            for i, r in self.model.items()
            if r.status == "queued" and r.ready and r.queue in queues
        }
        assert len(rows) == min(limit, len(claimable))
        for r in rows:
            assert r.id in claimable, f"claimed job {r.id} that was not claimable"
            old = self.model[r.id]
            assert r.attempts == old.attempts + 1
            self.model[r.id] = replace(old, status="running", attempts=r.attempts, expired=False)
            self.held[worker].append((r.id, r.attempts))

    @precondition(lambda self: any(self.held))
    @rule(worker=st.integers(0, WORKERS - 1), index=st.integers(0, 50))
    def complete(self, worker: int, index: int) -> None:
        won = self.fenced(
            "complete", worker, index, lambda i, a: statements.complete(self.table, i, a)
        )
        if won:
            self.model[won[0]] = replace(self.model[won[0]], status="done")

    @precondition(lambda self: any(self.held))
    @rule(worker=st.integers(0, WORKERS - 1), index=st.integers(0, 50))
    def fail(self, worker: int, index: int) -> None:
        won = self.fenced(
            "fail", worker, index, lambda i, a: statements.fail(self.table, i, a, "boom")
        )
        if won:
            row = self.model[won[0]]
            final = row.attempts >= row.max_attempts
            status = "failed" if final else "queued"
            self.model[won[0]] = replace(row, status=status, ready=False)

    @precondition(lambda self: any(self.held))
    @rule(worker=st.integers(0, WORKERS - 1), index=st.integers(0, 50))
    def extend(self, worker: int, index: int) -> None:
        won = self.fenced(
            "extend",
            worker,
            index,
            lambda i, a: statements.extend_lease(self.table, i, a, HOUR),
        )
        if won:
            self.model[won[0]] = replace(self.model[won[0]], expired=False)

    @precondition(lambda self: any(self.held))
    @rule(worker=st.integers(0, WORKERS - 1), index=st.integers(0, 50))
    def release(self, worker: int, index: int) -> None:
        won = self.fenced(
            "release", worker, index, lambda i, a: statements.release(self.table, i, a)
        )
        if won:
            self.model[won[0]] = replace(self.model[won[0]], status="queued", ready=True)

    @precondition(lambda self: self.some("running"))
    @rule(index=st.integers(0, 50))
    def lease_runs_out(self, index: int) -> None:
        """Time passes for one running job: its lease is now in the past."""
        self.begin("expire")
        running = sorted(i for i, r in self.model.items() if r.status == "running")
        job_id = self.pick(running, index)
        if job_id is None:
            return
        self.conn.execute(
            text(f"UPDATE {self.q} SET locked_until = now() - interval '1 s' WHERE id = :id"),
            {"id": job_id},
        )
        self.model[job_id] = replace(self.model[job_id], expired=True)

    @precondition(lambda self: self.some("queued"))
    @rule()
    def backoff_elapses(self) -> None:
        """Time passes for every queued job: all are ready."""
        self.begin("time")
        self.conn.execute(
            text(f"UPDATE {self.q} SET run_at = now() - interval '1 s' WHERE status = 'queued'")
        )
        for i, r in self.model.items():
            if r.status == "queued":
                self.model[i] = replace(r, ready=True)

    @precondition(lambda self: self.some("running"))
    @rule()
    def reap(self) -> None:
        self.begin("reap")
        rows = self.conn.execute(statements.reap(self.table)).all()
        due = {i for i, r in self.model.items() if r.status == "running" and r.expired}
        assert {r.id for r in rows} == due
        for r in rows:
            old = self.model[r.id]
            status = "failed" if old.attempts >= old.max_attempts else "queued"
            assert (r.status, r.attempts) == (status, old.attempts)
            self.model[r.id] = replace(old, status=status, expired=False)

    @precondition(lambda self: self.some("done", "failed", "cancelled"))
    @rule()
    def prune(self) -> None:
        self.begin("prune")
        count = self.conn.execute(statements.prune(self.table, older_than=timedelta(0))).rowcount
        finished = [i for i, r in self.model.items() if r.status in ("done", "failed", "cancelled")]
        assert count == len(finished)
        for i in finished:
            del self.model[i]

    @precondition(lambda self: bool(self.model))
    @rule(index=st.integers(0, 50))
    def retry(self, index: int) -> None:
        applied = self.guarded(
            "retry", index, ("failed", "cancelled"), lambda i: statements.retry(self.table, i)
        )
        if applied is None:
            return
        job_id, old, (row,) = applied
        assert row.attempts == old.attempts and row.max_attempts >= old.attempts + 1
        self.model[job_id] = replace(
            old, status="queued", ready=True, max_attempts=row.max_attempts
        )

    @precondition(lambda self: bool(self.model))
    @rule(index=st.integers(0, 50))
    def cancel(self, index: int) -> None:
        applied = self.guarded(
            "cancel", index, ("queued", "running"), lambda i: statements.cancel(self.table, i)
        )
        if applied is None:
            return
        job_id, old, rows = applied
        assert [tuple(r) for r in rows] == [(job_id, old.status)]
        self.model[job_id] = replace(old, status="cancelled")

    # -- invariants ---------------------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        c = self.table.c
        rows = self.conn.execute(
            select(c.id, c.status, c.attempts, c.max_attempts, c.queue, c.last_error)
        ).all()
        actual = {r.id: (r.status, r.attempts, r.max_attempts, r.queue) for r in rows}
        expected = {
            i: (r.status, r.attempts, r.max_attempts, r.queue) for i, r in self.model.items()
        }
        assert actual == expected, self.step

    @invariant()
    def transitions_are_legal(self) -> None:
        legal = LEGAL_BY_RULE.get(self.step, set())
        for i, old in self.before.items():
            new = self.model.get(i)
            if new is None:
                finished = ("done", "failed", "cancelled")
                assert self.step == "prune" and old.status in finished, (self.step, old)
                continue
            assert new.attempts >= old.attempts, (self.step, i, old, new)
            assert new.max_attempts >= old.max_attempts, (self.step, i, old, new)
            if new.status != old.status:
                assert (old.status, new.status) in legal, (self.step, i, old, new)

    @invariant()
    def claim_sees_exactly_the_queued_ready_rows(self) -> None:
        ready = {i for i, r in self.model.items() if r.status == "queued" and r.ready}
        queued = {i for i, r in self.model.items() if r.status == "queued"}
        with self.conn.engine.connect() as probe:
            with probe.begin() as trx:
                seen = probe.execute(
                    statements.claim(self.table, queue=list(QUEUES), limit=10_000, lease=HOUR)
                ).all()
                trx.rollback()
            assert {r.id for r in seen} == ready
            with probe.begin():
                probe.execute(text("SET LOCAL enable_seqscan = off"))
                by_index = probe.execute(
                    text(f"SELECT id FROM {self.q} WHERE queue IN ('a', 'b') AND status = 'queued'")
                ).scalars()
                assert set(by_index) == queued


@pytest.fixture
def autocommit(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


def test_queue_state_machine(autocommit: Connection, table: Table) -> None:
    machine = type("Machine", (QueueMachine,), {"conn": autocommit, "table": table})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=50,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
