"""The CLI's batched log handler and the multi-line records the worker logs."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from sqla_jobq.job import CancelSignal
from sqla_jobq.logs import LINES, BatchedStreamHandler, LinesFormatter


def logger_on(stream: io.StringIO, interval: float) -> tuple[logging.Logger, BatchedStreamHandler]:
    """A logger of its own at INFO, writing to `stream` through the batched handler."""
    handler = BatchedStreamHandler(stream, interval=interval)
    handler.setFormatter(LinesFormatter())
    logger = logging.getLogger(f"test_logs.{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return logger, handler


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO, BatchedStreamHandler]]:
    stream = io.StringIO()
    logger, handler = logger_on(stream, interval=0.2)
    yield logger, stream, handler
    logger.removeHandler(handler)
    handler.close()


def test_info_lines_wait_for_the_interval_then_arrive_together_in_order(
    logged: tuple[logging.Logger, io.StringIO, BatchedStreamHandler],
) -> None:
    logger, stream, _ = logged
    for n in range(3):
        logger.info("line %d", n)
    assert stream.getvalue() == ""
    deadline = time.monotonic() + 5
    while not stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = stream.getvalue().splitlines()
    assert [line.rsplit(": ", 1)[1] for line in lines] == ["line 0", "line 1", "line 2"]


def test_a_warning_writes_everything_pending_at_once(
    logged: tuple[logging.Logger, io.StringIO, BatchedStreamHandler],
) -> None:
    logger, stream, _ = logged
    logger.info("before")
    logger.warning("trouble")
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 3)[2:] for line in lines] == [
        ["INFO", f"{logger.name}: before"],
        ["WARNING", f"{logger.name}: trouble"],
    ]


def test_close_writes_what_is_pending(
    logged: tuple[logging.Logger, io.StringIO, BatchedStreamHandler],
) -> None:
    logger, stream, handler = logged
    logger.info("last words")
    handler.close()
    assert stream.getvalue().endswith(f"INFO {logger.name}: last words\n")


def test_a_record_with_lines_is_written_one_prefixed_line_each(
    logged: tuple[logging.Logger, io.StringIO, BatchedStreamHandler],
) -> None:
    logger, stream, handler = logged
    lines = ["job 1 outcome=done", "job 2 outcome=done"]
    logger.info("%s", "\n".join(lines), extra={LINES: lines})
    handler.flush()
    written = stream.getvalue().splitlines()
    assert len(written) == 2
    first, second = (line.split(" ", 2) for line in written)
    assert first[0] == second[0]  # the same date, the same prefix
    assert [line.split(": ", 1)[1] for line in written] == lines
    assert all(f" INFO {logger.name}: job " in line for line in written)


def test_any_other_formatter_shows_every_line_of_such_a_record() -> None:
    lines = ["job 1 outcome=done", "job 2 outcome=done"]
    record = logging.makeLogRecord({"msg": "%s", "args": ("\n".join(lines),), LINES: lines})
    assert logging.Formatter("%(message)s").format(record) == "\n".join(lines)


def test_a_record_with_lines_keeps_what_the_format_puts_after_the_message() -> None:
    lines = ["job 1 outcome=done", "job 2 outcome=done"]
    record = logging.makeLogRecord(
        {"msg": "%s", "args": ("\n".join(lines),), "levelname": "INFO", LINES: lines}
    )
    formatter = LinesFormatter("[%(levelname)s] %(message)s (end)")
    assert formatter.format(record).splitlines() == [f"[INFO] {line} (end)" for line in lines]
    assert record.message == "\n".join(lines)


class StuckStream(io.StringIO):
    """A stream whose writes wait until released, like a pipe nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.release.wait(10)
        return super().write(text)


def test_a_logging_call_does_not_wait_for_a_write_in_progress() -> None:
    stream = StuckStream()
    logger, handler = logger_on(stream, interval=0.01)
    try:
        logger.info("first")
        assert stream.entered.wait(5)  # the timer's flush is inside write()
        second = threading.Thread(target=logger.info, args=("second",))
        second.start()
        second.join(5)
        assert not second.is_alive()
    finally:
        stream.release.set()
        logger.removeHandler(handler)
        handler.close()
    assert [line.rsplit(": ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "first",
        "second",
    ]


def test_cancel_signal_wakes_a_waiter_set_before_or_after_it_waits() -> None:
    early = CancelSignal()
    early.set()
    assert early.is_set() and early.wait(0)
    late = CancelSignal()
    assert not late.is_set() and not late.wait(0.01)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(late.wait(5)))
    waiter.start()
    time.sleep(0.05)
    late.set()
    waiter.join(5)
    assert woke == [True]
