"""The dashboard's schema-5 views over HTTP (httpx on the ASGI app), on a real
queue table: pausing and resuming queues from the overview, the job detail's
result, cancel request, scheduled time and traceparent, and the cancelled
status in the job list."""

from __future__ import annotations

import html
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb
from sqlalchemy import Engine, Table

from sqla_jobq import dashboard, queue_statements

pytestmark = pytest.mark.anyio

Raw = psycopg.Connection[Any]
Add = Callable[..., int]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def add(raw: Raw, table: Table) -> Add:
    def insert(payload: Any = None, **columns: Any) -> int:
        columns["payload"] = Jsonb({} if payload is None else payload)
        if "result" in columns:
            columns["result"] = Jsonb(columns["result"])
        names = ", ".join(columns)
        values = ", ".join(f"%({name})s" for name in columns)
        row = raw.execute(
            f'INSERT INTO "{table.name}" ({names}) VALUES ({values}) RETURNING id', columns
        ).fetchone()
        assert row is not None
        return int(row[0])

    return insert


@asynccontextmanager
async def client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match, "the page has no CSRF field"
    return match[1]


def paused(raw: Raw, table: Table) -> dict[str, bool]:
    rows = raw.execute(f'SELECT name, paused FROM "{table.name}_queues" ORDER BY name').fetchall()
    return {str(name): bool(flag) for name, flag in rows}


def queue_row(page: str, queue: str) -> str:
    match = re.search(rf'<tr data-queue="{re.escape(html.escape(queue))}".*?</tr>', page, re.S)
    assert match, f"no overview row for {queue}"
    return match[0]


def action_of(row: str) -> str:
    match = re.search(r'<form method="post" action="([^"]+)"', row)
    assert match, "the row offers no action"
    return html.unescape(match[1])


async def test_pause_and_resume_buttons_change_the_queue_settings_and_the_overview(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    add(queue="mail")
    add(queue="media")
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get("/")).text
        mail = queue_row(page, "mail")
        assert '<span class="status active">active</span>' in mail and "Pause</button>" in mail
        token = csrf_of(page)
        response = await http.post(action_of(mail), data={"csrf_token": token})
        assert response.status_code == 303 and response.headers["location"] == "/"
        assert paused(raw, table) == {"mail": True}
        page = (await http.get("/")).text
        mail = queue_row(page, "mail")
        assert '<span class="status paused">paused</span>' in mail and "Resume</button>" in mail
        assert "Pause</button>" in queue_row(page, "media")
        resumed = await http.post(action_of(mail), data={"csrf_token": token})
        assert resumed.status_code == 303
        assert paused(raw, table) == {"mail": False}
        assert "Pause</button>" in queue_row((await http.get("/")).text, "mail")


async def test_overview_shows_each_queues_limit_and_keeps_a_paused_queue_without_jobs(
    engine: Engine, table: Table, add: Add
) -> None:
    add(queue="mail")
    with engine.begin() as conn:
        conn.execute(queue_statements.set_concurrency_limit(table, "mail", 3))
        conn.execute(queue_statements.pause(table, "empty"))
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get("/")).text
    assert '<td class="num limit">3</td>' in queue_row(page, "mail")
    empty = queue_row(page, "empty")
    assert "paused</span>" in empty and "Resume</button>" in empty
    assert empty.count(">0</a>") == 5  # ready, scheduled, running, failed, done


async def test_a_queue_name_with_slashes_and_reserved_characters_is_paused_whole(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    name = "a/b c?d#e%f&<evil>"
    add(queue=name)
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get("/")).text
        row = queue_row(page, name)
        target = action_of(row)
        assert target == "/actions/queues/a%2Fb%20c%3Fd%23e%25f%26%3Cevil%3E/pause"
        response = await http.post(target, data={"csrf_token": csrf_of(page)})
    assert response.status_code == 303
    assert paused(raw, table) == {name: True}
    assert "<evil>" not in page


async def test_pause_and_resume_without_the_csrf_token_are_refused_and_change_nothing(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    add(queue="mail")
    with engine.begin() as conn:
        conn.execute(queue_statements.pause(table, "held"))
    async with client(dashboard.app(engine, table)) as http:
        await http.get("/")
        missing = await http.post("/actions/queues/mail/pause")
        wrong = await http.post("/actions/queues/held/resume", data={"csrf_token": "x" * 43})
        get = await http.get("/actions/queues/mail/pause")
    async with client(dashboard.app(engine, table)) as stranger:
        no_cookie = await stranger.post(
            "/actions/queues/mail/pause", data={"csrf_token": http.cookies["jobq_csrf"]}
        )
    assert [r.status_code for r in (missing, wrong, no_cookie)] == [403] * 3
    assert "CSRF token" in missing.text
    assert get.status_code == 405
    assert paused(raw, table) == {"held": True}


async def test_pausing_a_queue_name_the_queue_refuses_answers_409(
    engine: Engine, table: Table, raw: Raw
) -> None:
    async with client(dashboard.app(engine, table)) as http:
        await http.get("/")
        token = http.cookies["jobq_csrf"]
        long = await http.post(f"/actions/queues/{'q' * 5000}/pause", data={"csrf_token": token})
    assert long.status_code == 409
    assert paused(raw, table) == {}


async def test_read_only_shows_pause_state_but_no_buttons_and_has_no_queue_actions(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    add(queue="mail")
    with engine.begin() as conn:
        conn.execute(queue_statements.pause(table, "mail"))
    async with client(dashboard.app(engine, table, read_only=True)) as http:
        page = (await http.get("/")).text
        token = http.cookies["jobq_csrf"]
        resume = await http.post("/actions/queues/mail/resume", data={"csrf_token": token})
        pause = await http.post("/actions/queues/other/pause", data={"csrf_token": token})
    assert "paused</span>" in queue_row(page, "mail")
    assert "<button" not in page and "/actions/" not in page
    assert resume.status_code in (404, 405) and pause.status_code in (404, 405)
    assert paused(raw, table) == {"mail": True}


async def test_overview_of_a_table_without_queue_settings_leaves_pausing_out(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    add(queue="mail")
    raw.execute(f'ALTER TABLE "{table.name}_queues" RENAME TO "{table.name}_queues_away"')
    try:
        async with client(dashboard.app(engine, table)) as http:
            response = await http.get("/")
    finally:
        raw.execute(f'ALTER TABLE "{table.name}_queues_away" RENAME TO "{table.name}_queues"')
    assert response.status_code == 200
    assert 'data-queue="mail"' in response.text
    assert "Pause</button>" not in response.text and "<th>state</th>" not in response.text


async def test_job_detail_shows_result_cancel_request_schedule_and_traceparent(
    engine: Engine, table: Table, add: Add
) -> None:
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    fired = datetime(2024, 5, 1, 6, 0, tzinfo=UTC)
    done = add(
        status="done",
        attempts=1,
        finished_at=fired,
        result={"sent": 3, "to": ["a@example.org"]},
        scheduled_for=fired,
        traceparent=trace,
    )
    cancelled = add(status="cancelled", cancel_requested_at=fired, finished_at=fired)
    plain = add(status="done", attempts=1)
    async with client(dashboard.app(engine, table)) as http:
        done_page = (await http.get(f"/jobs/{done}")).text
        cancelled_page = (await http.get(f"/jobs/{cancelled}")).text
        plain_page = (await http.get(f"/jobs/{plain}")).text
    result = re.search(r'<pre id="result">(.*?)</pre>', done_page, re.S)
    assert result, "no result shown"
    shown = html.unescape(result[1])
    assert json.loads(shown) == {"sent": 3, "to": ["a@example.org"]}
    assert '\n  "sent": 3' in shown and '\n    "a@example.org"\n' in shown  # indented
    assert re.search(r'id="scheduled-for">2024-05-01 \d\d:00:00', done_page)
    assert f'<code id="traceparent">{trace}</code>' in done_page
    assert "cancel-requested" not in done_page
    assert re.search(r'id="cancel-requested">2024-05-01 \d\d:00:00', cancelled_page)
    assert "Retry</button>" in cancelled_page
    for absent in ("scheduled-for", "traceparent", "cancel-requested", '<pre id="result">'):
        assert absent not in plain_page
    assert "the task returned nothing" in plain_page


async def test_script_in_a_result_renders_as_text(
    engine: Engine, table: Table, add: Add
) -> None:
    attack = "<script>alert(1)</script>"
    job = add(status="done", attempts=1, result={"html": attack, attack: [attack]})
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get(f"/jobs/{job}")).text
    assert "<script>" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 3


async def test_job_list_filters_cancelled_jobs_and_offers_the_status(
    engine: Engine, table: Table, add: Add
) -> None:
    gone = add(status="cancelled", finished_at=datetime.now(UTC))
    add()
    add(status="failed", attempts=5)
    async with client(dashboard.app(engine, table)) as http:
        listing = await http.get("/jobs", params={"status": "cancelled"})
        empty = await http.get("/jobs", params={"status": "cancelled", "queue": "other"})
    assert listing.status_code == 200
    assert re.findall(r'<a href="/jobs/(\d+)">', listing.text) == [str(gone)]
    assert '<option value="cancelled" selected>cancelled</option>' in listing.text
    assert '<span class="status cancelled">cancelled</span>' in listing.text
    assert "No job matches this filter" in empty.text


async def test_cancel_is_offered_for_a_running_job_and_cancels_it(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    job = add(status="running", attempts=1, started_at=datetime.now(UTC))
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get(f"/jobs/{job}")).text
        assert "Cancel</button>" in page
        form = {"csrf_token": csrf_of(page)}
        response = await http.post(f"/actions/jobs/{job}/cancel", data=form)
        again = await http.post(f"/actions/jobs/{job}/cancel", data=form)
        after = (await http.get(f"/jobs/{job}")).text
    assert response.status_code == 303
    assert again.status_code == 409 and "only a queued or running job can" in again.text
    assert '<span class="status cancelled" id="status">cancelled</span>' in after
    assert 'id="cancel-requested"' in after
