"""The W3C `traceparent` of the current span, stored with each job enqueued.

This is the only piece of tracing the core install runs: at enqueue, if the
`opentelemetry-api` package is importable and a valid span is current, its
context goes into the job's `traceparent` column (the same INSERT, so enqueue
stays one round trip), and the worker's `sqla_jobq.otel.OtelObserver` parents
or links the job's span to it. Without the package, or with no span, it is
None and the column stays NULL.
"""

from __future__ import annotations

try:
    from opentelemetry import trace
except ImportError:  # the `otel` extra is not installed: nothing to propagate
    trace = None  # type: ignore[assignment]

__all__ = ["current"]


def current() -> str | None:
    """The current span's traceparent, or None (no OpenTelemetry, no valid span)."""
    if trace is None:
        return None
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return None
    return f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"
