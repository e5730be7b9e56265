"""Bulk enqueue checks a task, queue, priority and max_attempts once per
distinct combination, and still refuses every bad row, wherever it is."""

from __future__ import annotations

from typing import Any

import pytest

from sqla_jobq.job import InvalidJob, NewJob
from sqla_jobq.statements import copy_rows


def many(last: NewJob, count: int = 50) -> list[NewJob]:
    return [*(NewJob("t", {"n": n}, priority=1) for n in range(count)), last]


@pytest.mark.parametrize(
    ("last", "message"),
    [
        (NewJob("t", {}, priority=True), "priority must be a 32-bit integer"),
        (NewJob("t", {}, priority=1, max_attempts=0), "max_attempts must be at least 1"),
        (NewJob("t", {}, queue="a\x00b", priority=1), "queue contains a NUL"),
        (NewJob("t", {}, queue=["default"], priority=1), "queue must be a string"),  # type: ignore[arg-type]
        (NewJob("t", {"x": float("nan")}, priority=1), "not JSON-serialisable"),
    ],
)
def test_a_bad_row_after_many_good_ones_is_refused(last: NewJob, message: str) -> None:
    with pytest.raises(InvalidJob, match=message):
        copy_rows(many(last))


def test_good_rows_are_encoded_in_order_with_their_fields() -> None:
    rows: list[Any] = copy_rows(many(NewJob("u", {"z": 1}, queue="q", max_attempts=2)), None)
    assert [r[1] for r in rows[:2]] == ['{"n":0}', '{"n":1}']
    assert rows[-1] == ("u", '{"z":1}', "q", 0, 2, None)
    assert len(rows) == 51
