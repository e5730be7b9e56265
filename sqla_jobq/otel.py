"""OpenTelemetry spans for the jobs a worker runs (extra `otel`).

`OtelObserver` runs each attempt's handler inside a CONSUMER span named after
the task. The job's row carries the trace context it was enqueued in
(`traceparent`, see `sqla_jobq.traceparent`): the first attempt's span is a
child of the enqueuing span, so a request and the job it enqueued are one
trace; a retry starts a trace of its own, linked to the enqueuing span, so a
job retried for a day does not stretch its request's trace over that day.
A job enqueued outside any span starts a new trace. Spans the handler opens
are children of the attempt's span.

An exception leaving the handler (a `CancelledError` on timeout included) is
recorded on the span, whose status becomes ERROR.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .job import Job
from .observe import Observer

__all__ = ["MESSAGING_SYSTEM", "OtelObserver"]

MESSAGING_SYSTEM = "sqla_jobq"
_PROPAGATOR = TraceContextTextMapPropagator()


def _enqueued_in(traceparent: str | None) -> trace.SpanContext | None:
    """The span a job was enqueued in, from its stored traceparent."""
    if not traceparent:
        return None
    carried = _PROPAGATOR.extract({"traceparent": traceparent})
    span = trace.get_current_span(carried).get_span_context()
    return span if span.is_valid else None


class OtelObserver(Observer):
    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer("sqla_jobq", tracer_provider=tracer_provider)

    @contextlib.contextmanager
    def handler_context(self, job: Job, row: dict[str, Any]) -> Iterator[None]:
        enqueued = _enqueued_in(row.get("traceparent"))
        parent = Context()  # never the worker's own context: the job decides
        links: Sequence[Link] = ()
        if enqueued is not None and job.attempts <= 1:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(enqueued), parent)
        elif enqueued is not None:
            links = (Link(enqueued, {"jobq.link": "enqueued"}),)
        with self.tracer.start_as_current_span(
            job.task or f"process {job.queue}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=_attributes(job),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield
            except BaseException as exc:  # CancelledError (timeouts) is an error here too
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise


def _attributes(job: Job) -> dict[str, str | int]:
    """Messaging semantic conventions, plus the job's id and attempt."""
    attributes: dict[str, str | int] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.destination.name": job.queue,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": str(job.id),
        "jobq.job.id": job.id,
        "jobq.attempt": job.attempts,
    }
    if job.task is not None:
        attributes["jobq.task"] = job.task
    return attributes
