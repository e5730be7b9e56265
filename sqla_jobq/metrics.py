"""Prometheus metrics of one worker process (extra `metrics`).

`PrometheusObserver` counts what this worker does, on a `CollectorRegistry`
of its own (nothing leaks into, or collides with, an app's default registry):

* `jobq_jobs_finished_total{queue,task,outcome}`: outcome is done, retry,
  failed, cancelled or lost;
* `jobq_job_duration_seconds{queue,task}`: handler time, a histogram;
* `jobq_pickup_delay_seconds{queue}`: from the job's `run_at` to its start;
* `jobq_jobs_running{queue}`: handlers running now.

The hooks run on the worker's event loop for every job, at tens of thousands
of jobs a second, so they only add to plain numbers in series bound once per
(queue, task): no label lookup, no lock, no metric object per call (a
prometheus_client child costs a lock per increment, about four times these
hooks). A collector turns the numbers into metric families when `/metrics`
is scraped, from the server's thread. Queue-level gauges read from the table
(one target for a whole fleet) are the dashboard's `/metrics`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .observe import Observer

__all__ = ["OUTCOMES", "PrometheusObserver", "serve"]

OUTCOMES = ("done", "retry", "failed", "cancelled", "lost")
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
PICKUP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class _Histogram:
    """Observations per bucket (not cumulative: one add per observation)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: the first bound >= value
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts per `le` label, as Prometheus exposes them."""
        labels = [*(str(float(b)) for b in self.bounds), "+Inf"]
        return list(zip(labels, accumulate(list(self.counts)), strict=True))


class _TaskSeries:
    """The numbers of one (queue, task)."""

    __slots__ = ("duration", "finished")

    def __init__(self) -> None:
        self.finished = dict.fromkeys(OUTCOMES, 0)
        self.duration = _Histogram(DURATION_BUCKETS)


class PrometheusObserver(Observer):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self._tasks: dict[tuple[str, str | None], _TaskSeries] = {}
        self._pickups: dict[str, _Histogram] = {}
        self._running: dict[str, int] = {}
        self.registry.register(_Collector(self))

    def started(self, queue: str, task: str | None, pickup_delay: float | None) -> None:
        if (queue, task) not in self._tasks:  # its series exist, at zero, from its first start
            self._tasks[(queue, task)] = _TaskSeries()
        if pickup_delay is None:
            return
        pickup = self._pickups.get(queue)
        if pickup is None:
            pickup = self._pickups[queue] = _Histogram(PICKUP_BUCKETS)
        # The two clocks (the server's run_at, ours now) may disagree a little.
        pickup.observe(pickup_delay if pickup_delay > 0.0 else 0.0)

    def settled(self, queue: str, task: str | None, kind: str, duration: float) -> None:
        series = self._tasks.get((queue, task))
        if series is None:
            series = self._tasks[(queue, task)] = _TaskSeries()
        finished = series.finished
        finished[kind] = finished.get(kind, 0) + 1
        series.duration.observe(duration)

    def running(self, counts: dict[str, int]) -> None:
        # Kept, not copied: read at scrape time, so a worker may as well pass
        # one live mapping it keeps up to date.
        self._running = counts


class _Collector:
    """The observer's numbers as metric families, read at scrape time.

    The hooks run on another thread: every dict is copied (one C-level step
    under the GIL) before it is walked, so a series born during a scrape
    waits for the next one.
    """

    def __init__(self, observer: PrometheusObserver) -> None:
        self.observer = observer

    def describe(self) -> Iterable[Metric]:
        return []  # no fixed series: the registry must not pre-collect at register()

    def collect(self) -> Iterable[Metric]:
        o = self.observer
        finished = CounterMetricFamily(
            "jobq_jobs_finished",
            "Attempts finished by this worker, by outcome (done, retry, failed, cancelled, lost).",
            labels=["queue", "task", "outcome"],
        )
        duration = HistogramMetricFamily(
            "jobq_job_duration_seconds",
            "Time from a handler's start to its end.",
            labels=["queue", "task"],
        )
        for (queue, task), series in list(o._tasks.items()):
            for outcome, count in list(series.finished.items()):
                finished.add_metric([queue, task or "", outcome], count)
            hist = series.duration
            duration.add_metric([queue, task or ""], hist.buckets(), hist.total)
        pickup = HistogramMetricFamily(
            "jobq_pickup_delay_seconds",
            "Time from a job's run_at to its handler's start.",
            labels=["queue"],
        )
        for queue, hist in list(o._pickups.items()):
            pickup.add_metric([queue], hist.buckets(), hist.total)
        running = GaugeMetricFamily("jobq_jobs_running", "Handlers running now.", labels=["queue"])
        for queue, count in list(o._running.items()):
            running.add_metric([queue], count)
        return [finished, duration, pickup, running]


def serve(observer: PrometheusObserver, port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve the observer's metrics on `http://host:port/metrics` from a
    daemon thread, until the server's `shutdown()`; OSError when the address
    cannot be bound."""
    server, _ = start_http_server(port, addr=host, registry=observer.registry)
    return server
