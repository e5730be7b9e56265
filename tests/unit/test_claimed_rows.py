"""What the worker builds from a claimed row, by its fast paths, is exactly
what the plain ones would build: the same `Job`, the same payload, the same
refusals."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

import pytest

from sqla_jobq.execute import Refused, decode_payload
from sqla_jobq.job import CancelSignal, Job

ROW = {
    "id": 7,
    "task": "send",
    "queue": "mail",
    "payload": '{"to": "a@example.com"}',
    "attempts": 2,
    "max_attempts": 5,
    "scheduled_for": datetime(2026, 1, 1, tzinfo=UTC),
}


def test_job_from_row_is_the_job_init_would_build() -> None:
    signal = CancelSignal()
    built = Job.from_row(ROW, payload={"to": "a@example.com"}, cancel_event=signal)
    expected = Job(
        id=7,
        task="send",
        queue="mail",
        payload={"to": "a@example.com"},
        attempts=2,
        max_attempts=5,
        scheduled_for=ROW["scheduled_for"],
        cancel_event=signal,
    )
    assert built == expected
    assert vars(built) == vars(expected)
    assert set(vars(built)) == {f.name for f in dataclasses.fields(Job)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.id = 8  # type: ignore[misc]


def test_job_from_row_without_optional_columns() -> None:
    row = {k: v for k, v in ROW.items() if k != "scheduled_for"}
    job = Job.from_row(row)
    assert job.scheduled_for is None
    assert job.payload == ROW["payload"]
    assert not job.cancel_requested


@pytest.mark.parametrize(
    "raw",
    [
        '{"n": 1}',
        '{"a": [1, 2.5, null, true], "b": {"c": "\\u00e9\\n"}}',
        ' {"n": 1}',
        '{"n": 1} ',
        '{"n": NaN}',
        b'{"n": 2}',
        '{"a": "\\ud800"}',
    ],
)
def test_payload_decodes_as_json_loads_does(raw: str | bytes) -> None:
    assert decode_payload(raw) == json.loads(raw)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ('{"n": 1}x', "cannot decode the payload: Extra data"),
        ("", "cannot decode the payload: Expecting value"),
        ('{"n": ', "cannot decode the payload: Expecting value"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"text"', "expected a JSON object, got str"),
    ],
)
def test_undecodable_payload_is_refused_with_the_reason(raw: str, why: str) -> None:
    with pytest.raises(Refused, match=f"^InvalidPayload: {why}"):
        decode_payload(raw)
