"""`/metrics`: queue-level gauges read from the database at scrape time.

A custom collector on a registry of this dashboard's own: no global mutable
gauge to keep in step with the table, nothing shared between two dashboards
in one process, and the numbers are as fresh as the scrape. One scrape of the
dashboard covers the whole queue, however many workers there are. The
figures come from `statements.stats`, the query behind ``jobq stats``.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ..errors import describe_connection_error
from ..schema import STATUSES
from .context import Dashboard
from .errors import DATABASE_ERRORS
from .store import Store


def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    return (
        GaugeMetricFamily(
            "jobq_queue_jobs", "Jobs in the queue table, by queue and status.",
            labels=["queue", "status"],
        ),
        GaugeMetricFamily(
            "jobq_queue_oldest_ready_seconds",
            "Age of the oldest job ready to run (0 when none is waiting).",
            labels=["queue"],
        ),
    )


class QueueCollector:
    """Reads `statements.stats` on every scrape; every status of every queue
    seen is reported, zeros included, so a series never just disappears."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> Iterable[Metric]:
        return _families()

    def collect(self) -> Iterable[Metric]:
        jobs, oldest = _families()
        counts: dict[str, dict[str, int]] = {}
        ages: dict[str, float] = {}
        for row in self.store.stats():
            queue, age = row["queue"], row["oldest_ready_age"]
            counts.setdefault(queue, dict.fromkeys(STATUSES, 0))[row["status"]] = row["count"]
            if age is not None:
                ages[queue] = float(age)
        for queue, by_status in counts.items():
            for status, count in by_status.items():
                jobs.add_metric([queue, status], count)
            oldest.add_metric([queue], ages.get(queue, 0.0))
        return [jobs, oldest]


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    registry = CollectorRegistry()
    registry.register(QueueCollector(dashboard.store))

    async def metrics(request: Request) -> Response:
        try:
            body = await run_in_threadpool(generate_latest, registry)
        except DATABASE_ERRORS as exc:
            return PlainTextResponse(f"{describe_connection_error(exc)}\n", status_code=503)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return [Route("/metrics", metrics, methods=["GET"], name="metrics")]
