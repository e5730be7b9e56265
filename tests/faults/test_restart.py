"""PostgreSQL itself goes away mid-run: a throwaway cluster is restarted under the workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sqla_jobq.schema import Names
from tests.support.cluster import Cluster
from tests.support.faultqueue import FaultQueue
from tests.support.processes import Workers
from tests.support.waiting import wait_until

pytestmark = pytest.mark.faults


@pytest.fixture
def cluster_queue(cluster: Cluster) -> Iterator[FaultQueue]:
    queue = FaultQueue(cluster.url, Names("jobs_restart", None))
    queue.create()
    yield queue


def test_workers_ride_out_postgres_restarts(
    cluster: Cluster, cluster_queue: FaultQueue, workers: Workers
) -> None:
    """3,000 jobs, 2 workers on a cluster of the test's own. PostgreSQL is stopped
    and started twice mid-run: once `-m fast` (sessions terminated, clean
    shutdown), once `-m immediate` (a crash: WAL recovery on start). The same two
    worker processes reconnect by themselves and finish the run: all done, every
    handler ran, every transition legal and fenced."""
    fq = cluster_queue
    ids = fq.enqueue_work(3000, sleep=0.003)
    procs = [
        workers.start(fq, "--concurrency", "4", "--reap-interval", "0.5", lease=2.0)
        for _ in range(2)
    ]
    for threshold, mode in ((800, "fast"), (1800, "immediate")):
        wait_until(lambda t=threshold: fq.done_count() >= t, 90, f"{threshold} jobs done")
        cluster.stop(mode)
        assert all(p.alive() for p in procs)
        cluster.start()
    wait_until(lambda: fq.done_count() >= len(ids), 180, "all jobs done after the restarts")
    assert all(p.alive() for p in procs), "workers must ride out restarts, not exit"
    fq.check_all_done(ids)
    fq.check_audit()
    logs = "".join(p.output() for p in procs)
    assert "retrying" in logs or "reconnecting" in logs
