"""OpenTelemetry: the trace context stored at enqueue, and the worker's spans.

Spans go to the SDK's in-memory exporter through a provider of the test's
own (never the global one); the worker is a real in-process `Worker` with an
`OtelObserver` on that provider, on a real queue table.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Engine, Table, select, update

from sqla_jobq import Registry, client, statements
from sqla_jobq.instrument import worker_observers
from sqla_jobq.otel import OtelObserver
from sqla_jobq.statements import InvalidJob, NewJob
from tests.support.inprocess import burst


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def traceparent_of(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def stored(engine: Engine, table: Table) -> list[str | None]:
    with engine.connect() as conn:
        return list(conn.execute(select(table.c.traceparent).order_by(table.c.id)).scalars())


# --------------------------------------------------------------------------- enqueue


def test_enqueue_in_a_span_stores_its_traceparent_and_outside_stores_null(
    provider: TracerProvider, engine: Engine, table: Table
) -> None:
    request_span = provider.get_tracer("test").start_as_current_span("request")
    with request_span as request, engine.begin() as conn:
        client.enqueue(conn, table, "t", {})
    with engine.begin() as conn:
        client.enqueue(conn, table, "t", {})
    assert stored(engine, table) == [traceparent_of(request), None]


@pytest.mark.parametrize("count", [3, 1000], ids=["array insert", "copy"])
def test_enqueue_many_stores_the_traceparent_on_every_row(
    provider: TracerProvider, engine: Engine, table: Table, count: int
) -> None:
    request_span = provider.get_tracer("test").start_as_current_span("request")
    with request_span as request, engine.begin() as conn:
        client.enqueue_many(conn, table, [NewJob("t", {"n": n}) for n in range(count)])
    assert set(stored(engine, table)) == {traceparent_of(request)}


def test_async_enqueue_stores_the_traceparent(
    provider: TracerProvider, engine: Engine, table: Table, database_url: str
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from sqla_jobq.db import sqlalchemy_url

    async def main() -> str:
        async_engine = create_async_engine(sqlalchemy_url(database_url))
        try:
            with provider.get_tracer("test").start_as_current_span("request") as request:
                async with async_engine.begin() as conn:
                    await client.enqueue_async(conn, table, "t", {})
            return traceparent_of(request)
        finally:
            await async_engine.dispose()

    expected = asyncio.run(main())
    assert stored(engine, table) == [expected]


def test_a_traceparent_that_is_not_w3c_is_refused_before_any_sql(table: Table) -> None:
    with pytest.raises(InvalidJob, match="traceparent"):
        statements.enqueue(table, "t", {}, traceparent="00-abc-def-01")
    with pytest.raises(InvalidJob, match="traceparent"):
        statements.enqueue_many(table, [NewJob("t")], traceparent="nonsense")


# --------------------------------------------------------------------------- worker spans


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_first_attempt_runs_in_a_consumer_span_child_of_the_enqueuing_span(
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    engine: Engine,
    table: Table,
    database_url: str,
    kind: str,
) -> None:
    registry, inner = Registry(table), provider.get_tracer("handler")

    if kind == "sync":

        @registry.task(name="work", queue="mail")
        def work() -> None:
            inner.start_span("inside").end()

    else:

        @registry.task(name="work", queue="mail")
        async def work() -> None:
            inner.start_span("inside").end()

    request_span = provider.get_tracer("test").start_as_current_span("request")
    with request_span as request, engine.begin() as conn:
        job_id = registry.tasks["work"].enqueue(conn)
    assert burst(registry, database_url, observers=[OtelObserver(provider)]) == 0

    [job] = spans_named(exporter, "work")
    parent = request.get_span_context()
    assert job.kind is SpanKind.CONSUMER
    assert job.context is not None and job.parent is not None
    assert job.context.trace_id == parent.trace_id
    assert job.parent.span_id == parent.span_id
    assert dict(job.attributes or {}) == {
        "messaging.system": "sqla_jobq",
        "messaging.destination.name": "mail",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": str(job_id),
        "jobq.job.id": job_id,
        "jobq.attempt": 1,
        "jobq.task": "work",
    }
    assert job.status.status_code is StatusCode.UNSET
    # The handler's own spans are children of the attempt's span.
    [child] = spans_named(exporter, "inside")
    assert child.parent is not None and child.parent.span_id == job.context.span_id


def test_a_retry_gets_a_trace_of_its_own_linked_to_the_enqueuing_span(
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    engine: Engine,
    table: Table,
    database_url: str,
) -> None:
    registry, calls = Registry(table), []

    @registry.task(name="flaky", max_attempts=3)
    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient")

    request_span = provider.get_tracer("test").start_as_current_span("request")
    with request_span as request, engine.begin() as conn:
        job_id = flaky.enqueue(conn)
    observers = [OtelObserver(provider)]
    assert burst(registry, database_url, observers=observers) == 0
    with engine.begin() as conn:  # the retry is due now, not after its backoff
        conn.execute(update(table).where(table.c.id == job_id).values(run_at=table.c.created_at))
    assert burst(registry, database_url, observers=observers) == 0

    first, second = sorted(spans_named(exporter, "flaky"), key=lambda s: s.start_time or 0)
    origin = request.get_span_context()
    assert first.parent is not None and first.parent.span_id == origin.span_id
    assert first.status.status_code is StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert (first.events[0].attributes or {})["exception.message"] == "transient"

    assert second.parent is None
    assert second.context is not None and second.context.trace_id != origin.trace_id
    assert [link.context.span_id for link in second.links] == [origin.span_id]
    assert (second.attributes or {})["jobq.attempt"] == 2
    assert second.status.status_code is StatusCode.UNSET


def test_a_job_enqueued_outside_any_span_starts_a_trace_of_its_own(
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    engine: Engine,
    table: Table,
    database_url: str,
) -> None:
    registry = Registry(table)

    @registry.task(name="plain")
    def plain() -> None:
        pass

    with engine.begin() as conn:
        plain.enqueue(conn)
    assert burst(registry, database_url, observers=[OtelObserver(provider)]) == 0
    [span] = spans_named(exporter, "plain")
    assert span.parent is None and not span.links


# --------------------------------------------------------------------------- jobq worker


def test_otel_flags_choose_the_observer() -> None:
    assert worker_observers(None, "127.0.0.1", False) == []
    assert [type(o) for o in worker_observers(None, "127.0.0.1", True)] == [OtelObserver]


TASKS = textwrap.dedent(
    """
    import os
    from sqlalchemy import MetaData
    from sqla_jobq import Registry, jobs_table

    if os.environ.get("CONFIGURE_TRACING"):
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())

    registry = Registry(jobs_table(MetaData(), os.environ["JOBQ_TEST_TABLE"]))
    """
)


def run_worker(
    tmp_path: Path, database_url: str, table: Table, *args: str, prelude: str = "", **env: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "otel_tasks.py").write_text(TASKS)
    environ: dict[str, Any] = dict(
        os.environ,
        JOBQ_TEST_TABLE=table.name,
        JOBQ_DATABASE_URL=database_url,
        PYTHONPATH=str(tmp_path),
        **env,
    )
    main = prelude + "from sqla_jobq.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", main, "worker", "otel_tasks:registry", "--burst", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("configured", [True, False])
def test_jobq_worker_traces_by_default_exactly_when_the_app_configured_a_tracer_provider(
    tmp_path: Path, database_url: str, table: Table, configured: bool
) -> None:
    env = {"CONFIGURE_TRACING": "1"} if configured else {}
    done = run_worker(tmp_path, database_url, table, **env)
    assert done.returncode == 0, done.stderr
    assert ("OpenTelemetry: one CONSUMER span per attempt" in done.stderr) is configured


def test_jobq_worker_otel_without_the_extra_says_which_to_install(
    tmp_path: Path, database_url: str, table: Table
) -> None:
    hide = "import sys; sys.modules['opentelemetry'] = None; "
    done = run_worker(tmp_path, database_url, table, "--otel", prelude=hide)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jobq: error: --otel needs the otel extra: pip install 'sqla_jobq[otel]'"
    ]
