"""The observers `jobq worker` runs with, from its options: a Prometheus
endpoint (`--metrics-port`, extra `metrics`) and OpenTelemetry spans (extra
`otel`). A missing extra or an address already in use is a UsageError, one
line, before the worker claims anything (internal).

Tracing is on when asked for (`--otel`), off when refused (`--no-otel`), and
otherwise on exactly when the app configured a tracer provider by the time
its registry was imported (as `opentelemetry-instrument` or the app's own
set-up does): a worker of an app that does not trace pays nothing for it.
"""

from __future__ import annotations

import logging

from .errors import UsageError
from .observe import Observer

log = logging.getLogger("sqla_jobq.worker")


def worker_observers(
    metrics_port: int | None, metrics_host: str, otel: bool | None
) -> list[Observer]:
    """The observers asked for; starts the metrics server when one is."""
    observers: list[Observer] = []
    if metrics_port is not None:
        observers.append(_metrics(metrics_port, metrics_host))
    if _tracing(otel):
        from .otel import OtelObserver

        observers.append(OtelObserver())
        log.info("OpenTelemetry: one CONSUMER span per attempt")
    return observers


def _metrics(port: int, host: str) -> Observer:
    if not 0 < port < 65536:
        raise UsageError(f"--metrics-port must be between 1 and 65535, got {port}")
    try:
        from .metrics import PrometheusObserver, serve
    except ModuleNotFoundError as exc:
        if exc.name != "prometheus_client":
            raise
        raise UsageError(
            "--metrics-port needs the metrics extra: pip install 'sqla_jobq[metrics]'"
        ) from None
    observer = PrometheusObserver()
    try:
        serve(observer, port, host)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"cannot serve metrics on {host}:{port}: {reason}") from None
    log.info("metrics at http://%s:%d/metrics", host, port)
    return observer


def _tracing(otel: bool | None) -> bool:
    if otel is False:
        return False
    try:
        from opentelemetry import trace
    except ModuleNotFoundError:
        if otel:
            raise UsageError("--otel needs the otel extra: pip install 'sqla_jobq[otel]'") from None
        return False
    return bool(otel) or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
