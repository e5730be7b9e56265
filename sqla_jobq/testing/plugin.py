"""The pytest plugin, registered as `sqla_jobq` in the `pytest11` entry points:
installing sqla_jobq makes these fixtures available to any test suite. It
defines fixtures only, no hooks, so it does nothing until a test asks for one.

``jobq_registry``
    Your app's `Registry`. Define this fixture in your conftest.py.
``jobq_connection``
    The connection (or `Session`) the helpers work on. By default a
    `Connection` on ``jobq_engine`` (define that fixture) inside an outer
    transaction rolled back after the test; override it to hand in your own
    suite's transactional connection or session instead.
``jobq``
    A `Harness` on those two: ``jobq.drain(now=...)``, ``jobq.enqueued()``,
    ``jobq.assert_enqueued(task, **payload)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.orm import Session

    from ..registry import Registry
    from .harness import Harness


def _undefined(name: str, what: str) -> NoReturn:
    pytest.fail(f"sqla_jobq.testing: define a `{name}` fixture returning {what}", pytrace=False)


@pytest.fixture
def jobq_registry() -> Registry:
    _undefined("jobq_registry", "your app's Registry")


@pytest.fixture
def jobq_engine() -> Engine:
    _undefined("jobq_engine", "an Engine on your test database (or override jobq_connection)")


@pytest.fixture
def jobq_connection(jobq_engine: Engine) -> Iterator[Connection]:
    with jobq_engine.connect() as conn:
        outer = conn.begin()
        try:
            yield conn
        finally:
            outer.rollback()


@pytest.fixture
def jobq(jobq_registry: Registry, jobq_connection: Connection | Session) -> Harness:
    # The registry first: set up before the connection, it is torn down after
    # it, so whatever it stands on (a test's queue table) outlives the
    # transaction that holds locks on it.
    from .harness import Harness

    return Harness(jobq_connection, jobq_registry)
