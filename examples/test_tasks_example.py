"""Testing an app's tasks with sqla_jobq.testing: an example to copy.

The shop's receipt task (examples/fastapi_app/tasks.py) run for real, on the
queue's real SQL, in a transaction rolled back after each test. The plugin
installed with sqla_jobq gives every test suite the `jobq` fixture, a
`Harness` on `jobq_connection` (by default a connection on `jobq_engine`
inside a transaction rolled back after the test) and `jobq_registry`: define
those two, usually in your conftest.py, as below.

Run it against a migrated test database:

    export DATABASE_URL=postgresql+psycopg://localhost/shop_test
    jobq migrate --database-url "$DATABASE_URL"
    python -m pytest examples/test_tasks_example.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, create_engine

from examples.fastapi_app import tasks
from examples.fastapi_app.tasks import Outbox, send_receipt
from sqla_jobq import Registry
from sqla_jobq.testing import Harness


@pytest.fixture(scope="session")
def jobq_engine() -> Iterator[Engine]:
    engine = create_engine(os.environ["DATABASE_URL"])
    yield engine
    engine.dispose()


@pytest.fixture
def jobq_registry() -> Registry:
    return tasks.registry


@pytest.fixture
def outbox(monkeypatch: pytest.MonkeyPatch) -> Outbox:
    """A fresh stand-in for the mail service, for this test only."""
    fresh = Outbox()
    monkeypatch.setattr(tasks, "outbox", fresh)
    return fresh


class DownOnce(Outbox):
    """The mail service, down for its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def send(self, to: str, text: str) -> None:
        if self.down:
            self.down = False
            raise ConnectionError("mail service unavailable")
        await super().send(to, text)


def test_a_receipt_is_mailed_and_its_text_kept_as_the_jobs_result(
    jobq: Harness, outbox: Outbox
) -> None:
    send_receipt.enqueue(jobq.conn, reference="A-1", email="ada@example.com", total_cents=990)
    jobq.assert_enqueued(send_receipt, reference="A-1")

    [ran] = jobq.drain()

    assert ran.outcome == "done"
    assert ran.result == {"to": "ada@example.com", "text": "Order A-1: 9.90 EUR. Thank you!"}
    assert outbox.sent == [("ada@example.com", "Order A-1: 9.90 EUR. Thank you!")]
    assert jobq.enqueued() == []


def test_a_mail_service_outage_is_retried_after_the_backoff(
    jobq: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    down = DownOnce()
    monkeypatch.setattr(tasks, "outbox", down)
    send_receipt.enqueue(jobq.conn, reference="A-2", email="bob@example.com", total_cents=100)

    [first] = jobq.drain()
    assert (first.outcome, first.error) == ("retry", "ConnectionError: mail service unavailable")
    assert jobq.drain() == []  # not due yet: no sleeping, move the clock instead

    [second] = jobq.drain(now=first.retry_at)
    assert (second.outcome, second.attempt) == ("done", 2)
    assert [to for to, _ in down.sent] == ["bob@example.com"]


def test_a_receipt_scheduled_for_later_runs_when_its_time_comes(
    jobq: Harness, outbox: Outbox
) -> None:
    send_receipt.enqueue(
        jobq.conn, reference="A-3", email="cy@example.com", total_cents=1, delay=timedelta(hours=1)
    )

    assert jobq.drain() == []
    [ran] = jobq.drain(now=datetime.now(UTC) + timedelta(hours=2))

    assert ran.outcome == "done"
    assert len(outbox.sent) == 1
