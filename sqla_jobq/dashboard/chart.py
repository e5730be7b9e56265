"""The overview's chart as geometry: stacked bars of jobs done and failed per
minute, laid out here and drawn by the template as inline SVG.

Server-rendered on purpose: no JavaScript library to download or pin, nothing
to break under a mount prefix, and the page reads the same without scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .store import Minute

WIDTH = 720
HEIGHT = 180
LEFT = 40  # room for the y-axis label
BOTTOM = 20  # room for the time labels
TOP = 8
GAP = 1.0


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    done_y: float
    done_height: float
    failed_y: float
    failed_height: float
    title: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    left: int
    top: int
    baseline: int
    peak: int
    bars: Sequence[Bar]
    labels: Sequence[tuple[float, str, str]]  # x, text, SVG text-anchor
    done: int
    failed: int


def throughput_chart(minutes: Sequence[Minute]) -> Chart:
    """Bars scaled to the busiest minute; a time label every 15 minutes and
    one on the last, right-aligned so it stays inside the picture."""
    baseline = HEIGHT - BOTTOM
    span = baseline - TOP
    peak = max((m.done + m.failed for m in minutes), default=0) or 1
    step = (WIDTH - LEFT) / max(len(minutes), 1)
    bars: list[Bar] = []
    labels: list[tuple[float, str, str]] = []
    for i, m in enumerate(minutes):
        x = LEFT + i * step
        done_h = span * m.done / peak
        failed_h = span * m.failed / peak
        at = f"{m.at:%H:%M}"
        bars.append(
            Bar(
                x=round(x, 2),
                width=round(max(step - GAP, 1.0), 2),
                done_y=round(baseline - done_h, 2),
                done_height=round(done_h, 2),
                failed_y=round(baseline - done_h - failed_h, 2),
                failed_height=round(failed_h, 2),
                title=f"{at}: {m.done} done, {m.failed} failed",
            )
        )
        if i == len(minutes) - 1:
            labels.append((WIDTH, at, "end"))
        elif i % 15 == 0:
            labels.append((round(x, 2), at, "start"))
    return Chart(
        width=WIDTH,
        height=HEIGHT,
        left=LEFT,
        top=TOP,
        baseline=baseline,
        peak=peak,
        bars=bars,
        labels=labels,
        done=sum(m.done for m in minutes),
        failed=sum(m.failed for m in minutes),
    )
