"""Bulk enqueue checks a task, queue, priority and max_attempts once per
distinct combination (or once in all, for a task's many payloads), and still
refuses every bad row, wherever it is."""

from __future__ import annotations

from typing import Any

import pytest

from sqla_jobq.job import InvalidJob, NewJob, encode_payload
from sqla_jobq.statements import copy_payload_rows, copy_rows


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


TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_payload_rows_take_every_field_but_the_payload_from_one_job() -> None:
    job = NewJob("t", queue="q", priority=2, max_attempts=3)
    rows: list[Any] = copy_payload_rows(job, [{"n": 0}, {"n": 1}], TRACE)
    assert rows == [("t", '{"n":0}', "q", 2, 3, TRACE), ("t", '{"n":1}', "q", 2, 3, TRACE)]
    assert copy_payload_rows(NewJob("t", unique_key="k"), [{}]) is None  # needs the INSERT


@pytest.mark.parametrize(
    ("job", "payloads", "trace", "message"),
    [
        (NewJob("t", priority=True), [{}], None, "priority must be a 32-bit integer"),
        (NewJob("t", queue="a\x00b"), [{}], None, "queue contains a NUL"),
        (NewJob("t"), [{}, {"x": float("inf")}], None, "not JSON-serialisable"),
        (NewJob("t"), [{}], "not-a-traceparent", "traceparent must look like"),
    ],
)
def test_payload_rows_refuse_a_bad_job_payload_or_traceparent(
    job: NewJob, payloads: list[Any], trace: str | None, message: str
) -> None:
    with pytest.raises(InvalidJob, match=message):
        copy_payload_rows(job, payloads, trace)


def test_a_circular_or_too_deep_payload_is_refused_not_a_crash() -> None:
    circular: dict[str, Any] = {}
    circular["self"] = circular
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    for payload in (circular, deep):
        with pytest.raises(InvalidJob, match="too deeply, or circular"):
            encode_payload(payload)
    assert encode_payload({"é": [1, 2.5, None, True]}) == '{"\\u00e9":[1,2.5,null,true]}'
