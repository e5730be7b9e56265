"""Prometheus metrics of a real worker, scraped over HTTP from `/metrics`.

In-process workers (tests/support/inprocess.py) run done, failed and retried jobs
with a `PrometheusObserver`; `jobq worker --metrics-port` is scraped as a
subprocess, and refuses a port in use or a missing extra with one line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, MetaData, Table

from sqla_jobq import Registry, client, jobs_table
from sqla_jobq.metrics import PrometheusObserver, serve
from tests.support.inprocess import burst, running
from tests.support.processes import JOBQ
from tests.support.waiting import wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Served = Callable[[PrometheusObserver], int]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
def served() -> Iterator[Served]:
    """Serve an observer's metrics on a free port (stopped after the test)."""
    servers: list[WSGIServer] = []

    def start(observer: PrometheusObserver) -> int:
        port = free_port()
        servers.append(serve(observer, port))
        return port

    yield start
    for server in servers:
        server.shutdown()


@pytest.fixture
def registry(table: Table) -> Registry:
    registry = Registry(table)

    @registry.task(name="ok")
    def ok() -> None:
        pass

    @registry.task(name="boom", max_attempts=1)
    def boom() -> None:
        raise RuntimeError("for good")

    @registry.task(name="flaky", max_attempts=3)
    def flaky() -> None:
        raise RuntimeError("for now")

    @registry.task(name="late", queue="mail")
    def late() -> None:
        pass

    return registry


def test_a_scrape_counts_done_failed_and_retried_jobs_with_durations_and_pickup_delays(
    registry: Registry, database_url: str, engine: Engine, served: Served
) -> None:
    tasks = registry.tasks
    with engine.begin() as conn:
        for _ in range(3):
            tasks["ok"].enqueue(conn)
        tasks["boom"].enqueue(conn)
        tasks["flaky"].enqueue(conn)
        tasks["late"].enqueue(conn, run_at=datetime.now(UTC) - timedelta(minutes=2))
    observer = PrometheusObserver()
    assert burst(registry, database_url, observers=[observer]) == 0

    samples = scrape(served(observer))
    finished = "jobq_jobs_finished_total"
    assert value(samples, finished, queue="default", task="ok", outcome="done") == 3
    assert value(samples, finished, queue="default", task="boom", outcome="failed") == 1
    assert value(samples, finished, queue="default", task="flaky", outcome="retry") == 1
    assert value(samples, finished, queue="mail", task="late", outcome="done") == 1
    # Every outcome of a task seen is a series from the start, at zero.
    assert value(samples, finished, queue="default", task="ok", outcome="lost") == 0
    duration = "jobq_job_duration_seconds_count"
    assert value(samples, duration, queue="default", task="ok") == 3
    assert value(samples, duration, queue="default", task="flaky") == 1
    # Measured from run_at: the late job waited two minutes before it was claimed.
    assert value(samples, "jobq_pickup_delay_seconds_count", queue="mail") == 1
    assert value(samples, "jobq_pickup_delay_seconds_bucket", queue="mail", le="60.0") == 0
    assert (value(samples, "jobq_pickup_delay_seconds_sum", queue="mail") or 0) >= 120
    assert value(samples, "jobq_pickup_delay_seconds_count", queue="default") == 5
    assert value(samples, "jobq_jobs_running", queue="default") == 0


def test_jobs_running_counts_the_handlers_running_at_the_scrape(
    table: Table, database_url: str, engine: Engine, served: Served
) -> None:
    registry, release = Registry(table), threading.Event()

    @registry.task(name="hold")
    def hold() -> None:
        release.wait(30)

    with engine.begin() as conn:
        hold.enqueue(conn)
        hold.enqueue(conn)
    observer = PrometheusObserver()
    port = served(observer)
    done = {"queue": "default", "task": "hold", "outcome": "done"}

    def running_now(count: int) -> Samples | None:
        samples = scrape(port)
        return samples if value(samples, "jobq_jobs_running", queue="default") == count else None

    try:
        with running(registry, database_url, observers=[observer], concurrency=4):
            samples = wait_until(lambda: running_now(2), 30, "two handlers running")
            assert value(samples, "jobq_jobs_finished_total", **done) == 0
            release.set()
            wait_until(lambda: running_now(0), 30, "the handlers to end")
    finally:
        release.set()
    assert value(scrape(port), "jobq_jobs_finished_total", **done) == 2


TASKS = textwrap.dedent(
    """
    import os
    from sqlalchemy import MetaData
    from sqla_jobq import Registry, jobs_table

    registry = Registry(jobs_table(MetaData(), os.environ["JOBQ_TEST_TABLE"]))

    @registry.task(name="noop")
    def noop() -> None:
        pass
    """
)


@pytest.fixture
def app_dir(tmp_path: Path, database_url: str, table: Table) -> Iterator[dict[str, str]]:
    (tmp_path / "metrics_tasks.py").write_text(TASKS)
    yield dict(
        os.environ,
        JOBQ_TEST_TABLE=table.name,
        JOBQ_DATABASE_URL=database_url,
        PYTHONPATH=str(tmp_path),
    )


def test_jobq_worker_serves_metrics_on_the_port_of_jobq_metrics_port(
    app_dir: dict[str, str], engine: Engine, table: Table
) -> None:
    with engine.begin() as conn:
        client.enqueue(conn, jobs_table(MetaData(), table.name), "noop", {})
    port = free_port()
    env = dict(app_dir, JOBQ_METRICS_PORT=str(port))
    proc = subprocess.Popen(
        [JOBQ, "worker", "metrics_tasks:registry", "--log-level", "WARNING"], env=env
    )
    try:
        def done() -> bool:
            try:
                samples = scrape(port)
            except OSError:
                return False  # not listening yet
            labels = {"queue": "default", "task": "noop", "outcome": "done"}
            return value(samples, "jobq_jobs_finished_total", **labels) == 1

        wait_until(done, 60, "the worker's /metrics to count the job")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_worker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JOBQ, "worker", "metrics_tasks:registry", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_jobq_worker_refuses_a_metrics_port_in_use_with_one_line(
    app_dir: dict[str, str],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_worker(app_dir, "--metrics-port", str(port))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"jobq: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use"
    ]


def test_jobq_worker_without_the_metrics_extra_says_which_to_install(
    app_dir: dict[str, str],
) -> None:
    hide = "import sys; sys.modules['prometheus_client'] = None; "
    main = "from sqla_jobq.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hide + main, "worker", "metrics_tasks:registry",
         "--metrics-port", "9", "--burst"],
        env=app_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jobq: error: --metrics-port needs the metrics extra: pip install 'sqla_jobq[metrics]'"
    ]
