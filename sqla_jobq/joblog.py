"""The worker's one line per finished job, at INFO (internal).

Users expect a line per job; at thousands of jobs a second, a log record per
job (its LogRecord, its formatting, its handler's lock and write) costs the
worker a fifth of its throughput. Jobs settle in batches anyway (a claim
brings dozens, a fenced completion records dozens), so the lines of the jobs
settled in one turn of the event loop go out as one record carrying them all
(see `logs.LINES`): the same lines, a record per batch. A turn that settles
one job logs exactly the record it always did.
"""

from __future__ import annotations

import asyncio
import logging

from .attempt import Attempt
from .logs import LINES

log = logging.getLogger("sqla_jobq.worker")


class JobLog:
    """Collects finished-job lines and logs them together at the end of the turn."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, attempt: Attempt, seconds: float, outcome: str) -> None:
        if not log.isEnabledFor(logging.INFO):
            return  # before any formatting: at WARNING a job costs this check alone
        if not self.lines:
            asyncio.get_running_loop().call_soon(self.flush)
        described = attempt.describe()
        self.lines.append(f"{described} duration={seconds * 1000:.1f}ms outcome={outcome}")

    def flush(self) -> None:
        lines, self.lines = self.lines, []
        if len(lines) == 1:
            log.info("%s", lines[0])
        elif lines:
            log.info("%s", "\n".join(lines), extra={LINES: lines})
