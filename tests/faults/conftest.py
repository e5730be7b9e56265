"""Fixtures of the fault suite: a queue with its audit trail, worker processes, a
throwaway PostgreSQL cluster and a PgBouncer, each torn down even when a test
fails. The helpers themselves live in tests/support/ (faultqueue, processes,
cluster, pgbouncer); the proof the scenarios check is in `FaultQueue`'s docstring.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sqla_jobq.schema import Names
from tests.support.cluster import Cluster, server_installed, throwaway_cluster
from tests.support.faultqueue import FaultQueue
from tests.support.pgbouncer import Bouncer, installed, running_pgbouncer
from tests.support.processes import Workers


@pytest.fixture
def fq(database_url: str) -> Iterator[FaultQueue]:
    """A fresh queue table, side table and audit trail in the session database."""
    queue = FaultQueue(database_url, Names(f"fx_{uuid.uuid4().hex[:10]}", None))
    queue.create()
    yield queue
    queue.drop()


@pytest.fixture
def workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Workers]:
    """This test's worker processes; all stopped after it, their logs printed if it failed."""
    fleet = Workers(tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(fleet.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """A PostgreSQL 15 cluster of this test's own, on a free port; removed afterwards."""
    if not server_installed():
        pytest.skip("PostgreSQL 15 server binaries are not installed")
    with throwaway_cluster() as node:
        yield node


@pytest.fixture
def pgbouncer(database_url: str) -> Iterator[Bouncer]:
    """PgBouncer (transaction pooling) in front of the session database."""
    if not installed():
        pytest.skip("pgbouncer is not installed")
    with running_pgbouncer(database_url) as bouncer:
        yield bouncer
