"""How reports and logs write numbers: durations, transaction ages, sizes and
timestamps, short in the text and rounded or ISO 8601 in the data (the
doctor's findings, the worker's index rebuilds)."""

from __future__ import annotations

from datetime import datetime, timedelta


def rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def setting_ms(duration: timedelta) -> str:
    """A duration as a PostgreSQL time setting takes it (`'200ms'`), at least 1 ms:
    0 would mean "no limit" to `lock_timeout`."""
    return f"{max(1, round(duration.total_seconds() * 1000))}ms"


def xids(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def secs(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}".replace(".0 ", " ")
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def ago(value: datetime | None, now: datetime) -> str:
    return "never" if value is None else f"{secs((now - value).total_seconds())} ago"


def byte_size(size: int | None) -> str:
    units = ("B", "kB", "MB", "GB", "TB")
    value, step = float(size or 0), 0
    while value >= 1024 and step < len(units) - 1:
        value, step = value / 1024, step + 1
    digits = 1 if step and value < 10 else 0
    return f"{value:.{digits}f} {units[step]}"


def period(span: timedelta) -> str:
    return "day" if span == timedelta(days=1) else secs(span.total_seconds())
