"""Judge whether the WAL a busy queue writes makes the server checkpoint early.

Why a queue's doctor looks at checkpoints: every job writes WAL (its insert,
its claim, its completion and archive row), so a busy queue is often what
fills `max_wal_size`. Once WAL reaches `max_wal_size / (1 +
checkpoint_completion_target)` before `checkpoint_timeout` has passed, the
checkpoints come from WAL volume: closer together, and after each one the
first change to every page writes a full-page image, which is more WAL
again. PostgreSQL's own advice ("WAL Configuration") is a `max_wal_size`
large enough that checkpoints come from the timeout.

The rate is the WAL written since the last checkpoint's redo point over the
time since that checkpoint started: the current interval, what the server
is doing now. The cumulative counts (`pg_stat_bgwriter` up to 16,
`pg_stat_checkpointer` from 17) are shown but not judged: they also count
CHECKPOINT commands, DROP DATABASE and base backups, and a burst long past.
"""

from __future__ import annotations

import math
from typing import Any

from ..units import byte_size, secs
from .model import Facts, Finding, Row, Thresholds, ok, warn

GB = 1024**3


def checkpoint_finding(facts: Facts, t: Thresholds) -> Finding:
    row = facts.checkpoints
    if row.get("unreadable"):
        return ok("checkpoints", "server", f"not measured: {row['unreadable']}", dict(row))
    trigger = int(row["max_wal_size_bytes"] / (1 + float(row["completion_target"])))
    data: dict[str, Any] = {**row, "trigger_bytes": trigger}
    seconds = float(row["seconds"])
    if seconds < t.checkpoint_window_seconds:
        summary = f"last checkpoint {secs(seconds)} ago: too soon to measure the WAL rate"
        return ok("checkpoints", "server", summary + _counts(row), data)
    return _by_rate(row, trigger, data)


def _by_rate(row: Row, trigger: int, data: dict[str, Any]) -> Finding:
    """When the next checkpoint comes at the current rate, against the timeout."""
    seconds, timeout = float(row["seconds"]), float(row["checkpoint_timeout_seconds"])
    rate = int(row["wal_bytes"]) / seconds
    every = trigger / rate if rate else math.inf
    data.update(wal_bytes_per_second=round(rate), every_seconds=_finite(every))
    summary = (
        f"{byte_size(round(rate))}/s of WAL over the last {secs(seconds)}; "
        f"max_wal_size {byte_size(row['max_wal_size_bytes'])} starts a checkpoint "
        f"every {byte_size(trigger)} of it"
    )
    if every >= timeout:
        return ok("checkpoints", "server", f"{summary}: by checkpoint_timeout{_counts(row)}", data)
    wanted = _wanted(rate, timeout, float(row["completion_target"]))
    data["suggested_max_wal_size_bytes"] = wanted
    return warn(
        "checkpoints",
        "server",
        f"{summary}, so about every {secs(every)}, before checkpoint_timeout "
        f"({secs(timeout)}){_counts(row)}",
        "each checkpoint makes the next change to every page write a whole page of WAL: "
        f"ALTER SYSTEM SET max_wal_size = '{wanted // GB}GB'; SELECT pg_reload_conf(); "
        "(pg_wal may grow to about that size on disk)",
        data,
    )


def _counts(row: Row) -> str:
    if row.get("requested") is None:
        return ""
    return f" (since statistics reset: {row['requested']:,} requested, {row['timed']:,} timed)"


def _wanted(rate: float, timeout: float, completion_target: float) -> int:
    """The `max_wal_size` at which this rate checkpoints by timeout, rounded up
    to a whole GB: about what `pg_wal` then keeps on disk, so no more than that."""
    needed = rate * timeout * (1 + completion_target)
    return max(1, math.ceil(needed / GB)) * GB


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else round(value, 1)
