"""Log output: lines written in batches, and records that carry several lines.

A worker at INFO writes one line per finished job. Written one at a time,
each line is a `write` system call and a wake-up of whatever reads the pipe
(a terminal, journald, a container runtime), and at thousands of jobs a second
that costs more than the jobs. Here the lines of INFO and below are kept for
at most `interval` seconds and written together; a WARNING or worse writes
everything pending at once, so a problem is never held back behind a timer.
The lines, their order and their format are what `logging.basicConfig` would
give; only the moment they reach the stream differs, by at most `interval`.

A record with a `lines` attribute (see `LINES`) stands for several events of
one moment, such as the jobs a worker finished in one turn of its loop: one
record instead of one each is most of what makes that logging cheap. Its
message is those lines joined, so any handler shows them all; the formatter
here writes each as a line of its own, with the usual prefix.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The attribute (set through `extra=`) holding a record's separate lines.
LINES = "lines"
_MARK = "\x00message\x00"
INTERVAL = 0.1
MAX_PENDING = 1000


class BatchedStreamHandler(logging.StreamHandler[TextIO]):
    """A StreamHandler whose quiet lines wait up to `interval` for company.

    The write happens outside the handler's lock: a logging call waits for
    the lock (every `Handler.handle` takes it), and a pipe whose reader has
    fallen behind can hold a write for milliseconds, which would stall the
    worker's event loop mid-job. Batches leave the lock in order through the
    outbox, and one writer at a time empties it."""

    def __init__(
        self, stream: TextIO, interval: float = INTERVAL, max_pending: int = MAX_PENDING
    ) -> None:
        super().__init__(stream)
        self.interval = interval
        self.max_pending = max_pending
        self.pending: list[str] = []
        self.timer: threading.Timer | None = None
        # Lock order: the handler's lock, then `writing`, then `posting`.
        self.outbox: list[str] = []
        self.posting = threading.Lock()
        self.writing = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.pending.append(self.format(record))
        except Exception:
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING or len(self.pending) >= self.max_pending:
            self.flush()
        elif self.timer is None:
            self.timer = threading.Timer(self.interval, self.flush)
            self.timer.daemon = True
            self.timer.start()

    def flush(self) -> None:
        self.acquire()
        try:
            self._post_pending()
        finally:
            self.release()
        with self.writing:
            with self.posting:
                text = "".join(self.outbox)
                self.outbox.clear()
            if text:
                self._write(text)

    def _post_pending(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.pending:
            with self.posting:
                self.outbox.append("\n".join(self.pending) + "\n")
            self.pending.clear()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception:
            self.handleError(logging.makeLogRecord({"msg": text}))

    def close(self) -> None:
        self.flush()
        super().close()


class LinesFormatter(logging.Formatter):
    """`logging.Formatter` that writes a record's `LINES` each with the
    prefix, and formats the date part of `asctime` once per second rather than
    once per line (the same text, a fifth of the cost)."""

    def __init__(self, fmt: str = FORMAT) -> None:
        super().__init__(fmt)
        self.second = -1
        self.stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        lines: list[str] | None = getattr(record, LINES, None)
        if not lines or record.exc_info or record.stack_info:
            return super().format(record)
        # The format around the message, found once per record: the lines
        # are what `Formatter.format` would give each, without a record each.
        record.message = _MARK
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        head, _, tail = self.formatMessage(record).partition(_MARK)
        record.message = record.getMessage()
        return "\n".join(head + line + tail for line in lines)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self.second:
            self.stamp = time.strftime(self.default_time_format, self.converter(record.created))
            self.second = second
        return f"{self.stamp},{int(record.msecs):03d}"


def configure(level: int, stream: TextIO | None = None) -> None:
    """What the CLI does instead of `logging.basicConfig`: the root logger at
    `level`, writing batched lines to stderr. Like basicConfig, it leaves a
    root logger that already has handlers alone."""
    root = logging.getLogger()
    root.setLevel(level)
    if root.handlers:
        return
    handler = BatchedStreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(LinesFormatter())
    root.addHandler(handler)
