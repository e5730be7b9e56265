"""The statistics every figure is reported with, and the JSON results file."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def per_round(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """The median of the per-round ratios, ours over the baseline of the same round."""
    return median([ratio(a, b) for a, b in zip(ours, baseline, strict=True)])


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The contenders in the order round `round_index` runs them: each round
    starts with the next one, so none always runs first (or last)."""
    k = round_index % len(names)
    return [*names[k:], *names[:k]]


def dump_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
