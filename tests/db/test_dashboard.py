"""The dashboard over HTTP (httpx on the ASGI app), on a real queue table.

Every route, every action with and without its CSRF token, read-only and
token modes, escaping of what the database holds, Prometheus output, and a
database that is unreachable or drops the dashboard's connections.
"""

from __future__ import annotations

import html
import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb
from sqlalchemy import Engine, Table
from starlette.applications import Starlette
from starlette.routing import Mount

from sqla_jobq import dashboard, statements
from sqla_jobq.dashboard import queries, store
from sqla_jobq.dashboard.filters import Cursor, JobFilter
from sqla_jobq.dashboard.server import APPLICATION_NAME, dashboard_engine
from sqla_jobq.db import sqlalchemy_url
from sqla_jobq.statements import FINISHED_STATUSES

pytestmark = pytest.mark.anyio

Raw = psycopg.Connection[Any]
Add = Callable[..., int]
JOBQ = str(Path(sys.executable).with_name("jobq"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def pooled(database_url: str) -> Any:
    """The engine `jobq dashboard` builds: a pool with pre-ping."""
    eng = dashboard_engine(sqlalchemy_url(database_url))
    yield eng
    eng.dispose()


@pytest.fixture
def add(raw: Raw, table: Table) -> Add:
    """Insert one job with the given columns; returns its id."""

    def insert(payload: Any = None, **columns: Any) -> int:
        columns["payload"] = Jsonb({} if payload is None else payload)
        names = ", ".join(columns)
        values = ", ".join(f"%({name})s" for name in columns)
        row = raw.execute(
            f'INSERT INTO "{table.name}" ({names}) VALUES ({values}) RETURNING id', columns
        ).fetchone()
        assert row is not None
        return int(row[0])

    return insert


def ago(**delta: float) -> datetime:
    return datetime.now(UTC) - timedelta(**delta)


@asynccontextmanager
async def client(app: Any, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", headers=headers
    ) as http:
        yield http


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match, "the page has no CSRF field"
    return match[1]


def job_ids(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<a href="[^"]*/jobs/(\d+)">', page)]


def href(page: str, rel: str) -> str | None:
    match = re.search(rf'<a rel="{rel}" href="([^"]+)"', page)
    return html.unescape(match[1]) if match else None


def status_of(raw: Raw, table: Table, job_id: int) -> str:
    row = raw.execute(f'SELECT status FROM "{table.name}" WHERE id = %s', (job_id,)).fetchone()
    assert row is not None
    return str(row[0])


async def test_overview_counts_each_queue_by_state_and_links_to_the_list(
    engine: Engine, table: Table, add: Add
) -> None:
    add(queue="mail", run_at=ago(seconds=90))
    add(queue="mail")
    add(queue="mail", run_at=ago(minutes=-10))
    add(queue="mail", status="running", attempts=1, locked_until=ago(minutes=-5))
    add(queue="mail", status="failed", attempts=5, finished_at=ago(minutes=3))
    add(queue="media", status="done", attempts=1, finished_at=ago(minutes=2))
    add(queue="media", status="done", attempts=1, finished_at=ago(hours=2))

    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get("/")).text

    def cell(queue: str, status: str) -> int:
        match = re.search(rf'queue={queue}&amp;status={status}">([\d,]+)</a>', page)
        assert match, f"no {status} cell for {queue}"
        return int(match[1])

    assert [cell("mail", s) for s in ("ready", "scheduled", "running", "failed", "done")] == [
        2, 1, 1, 1, 0,
    ]
    assert [cell("media", s) for s in ("ready", "scheduled", "running", "failed", "done")] == [
        0, 0, 0, 0, 1,
    ]
    assert re.search(r"<td class=\"num\">1m 3\ds</td>", page), "oldest ready age of mail"


async def test_overview_chart_has_a_bar_per_minute_of_the_last_hour(
    engine: Engine, table: Table, add: Add
) -> None:
    for minutes in (1.5, 1.5, 30):
        add(status="done", attempts=1, finished_at=ago(minutes=minutes))
    add(status="failed", attempts=5, finished_at=ago(minutes=1.5))
    add(status="done", attempts=1, finished_at=ago(minutes=90))

    with engine.connect() as conn:
        minutes = [tuple(r) for r in conn.execute(queries.throughput(table))]
    assert len(minutes) == 60
    assert sum(r[1] for r in minutes) == 3 and sum(r[2] for r in minutes) == 1
    assert max(r[1] + r[2] for r in minutes) == 3

    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get("/")).text
    assert page.count("<title>") == 1 + 60
    assert ": 2 done, 1 failed</title>" in page
    assert "done 3" in page and "failed 1" in page


async def test_job_list_filters_by_queue_task_status_and_error_text(
    engine: Engine, table: Table, add: Add
) -> None:
    a = add(queue="a", task="send", status="failed", attempts=5, last_error="SMTP 451 busy")
    b = add(queue="a", task="send", status="failed", attempts=5, last_error="100% refused")
    c = add(queue="b", task="send", status="failed", attempts=5, last_error="SMTP 550")
    d = add(queue="a", task="resize")
    e = add(queue="a", task="resize", run_at=ago(minutes=-5))

    async with client(dashboard.app(engine, table)) as http:

        async def ids(**params: str) -> list[int]:
            response = await http.get("/jobs", params=params)
            assert response.status_code == 200
            return job_ids(response.text)

        assert await ids() == [e, d, c, b, a]
        assert await ids(queue="a") == [e, d, b, a]
        assert await ids(task="send", queue="a") == [b, a]
        assert await ids(status="failed") == [c, b, a]
        assert await ids(status="ready") == [d]
        assert await ids(status="scheduled") == [e]
        assert await ids(error="smtp") == [c, a]
        assert await ids(error="100%") == [b]
        assert await ids(error="0%") == [b]
        assert await ids(queue="nope") == []
        bad = await http.get("/jobs", params={"status": "lost"})
    assert bad.status_code == 400
    assert "unknown status &#39;lost&#39;" in bad.text


async def test_job_list_pages_by_keyset_newest_first_both_ways(
    engine: Engine, table: Table, add: Add
) -> None:
    ids = [add(queue="q") for _ in range(7)]
    add(queue="other")

    async with client(dashboard.app(engine, table)) as http:
        first = (await http.get("/jobs", params={"queue": "q", "limit": "3"})).text
        assert job_ids(first) == ids[6:3:-1] and href(first, "prev") is None
        older = href(first, "next")
        assert older is not None
        second = (await http.get(older)).text
        assert job_ids(second) == ids[3:0:-1]
        last = (await http.get(href(second, "next") or "")).text
        assert job_ids(last) == ids[:1] and href(last, "next") is None
        back = (await http.get(href(second, "prev") or "")).text
        assert job_ids(back) == ids[6:3:-1] and href(back, "prev") is None
        assert "queue=q" in (href(back, "next") or "")


def test_job_list_walks_the_primary_key_backwards_without_sorting(
    engine: Engine, table: Table, raw: Raw
) -> None:
    raw.execute(
        f'INSERT INTO "{table.name}" (payload, queue, task, status, finished_at, last_error) '
        "SELECT '{}', 'q' || (i % 3), 't' || (i % 7), "
        "CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'done' END, now(), "
        "CASE WHEN i % 10 = 0 THEN 'boom ' || i END FROM generate_series(1, 20000) i"
    )
    raw.execute(f'ANALYZE "{table.name}"')
    for flt in (JobFilter(), JobFilter(queue="q1", status="failed"), JobFilter(error="boom")):
        compiled = queries.job_page(table, flt, Cursor(before=15000)).compile(
            dialect=engine.dialect
        )
        with engine.connect() as conn:
            plan = conn.exec_driver_sql(
                "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.params
            ).scalar_one()
        text = json.dumps(plan)
        assert '"Node Type": "Limit"' in text
        # The list reads the (here empty) archive too; what is asserted of the
        # jobs table is asserted of its side of the plan. A populated archive's
        # side: the next test.
        assert_walks_backwards(plan[0]["Plan"], table.name, f"{table.name}_pkey")


def assert_walks_backwards(root: dict[str, Any], relation: str, index: str) -> None:
    """`relation` is read by one backward scan of `index`, with no Sort above it."""

    def scans(node: dict[str, Any], above: tuple[str, ...]) -> list[tuple[dict[str, Any], bool]]:
        found = [(node, "Sort" in above)] if node.get("Relation Name") == relation else []
        for child in node.get("Plans", []):
            found += scans(child, (*above, node["Node Type"]))
        return found

    found = scans(root, ())
    text = json.dumps(root)
    assert len(found) == 1, text
    node, sorted_above = found[0]
    assert node["Node Type"] in ("Index Scan", "Index Only Scan"), text
    assert (node["Index Name"], node["Scan Direction"]) == (index, "Backward"), text
    assert not sorted_above, text


async def test_job_detail_shows_payload_attempts_times_and_lease(
    engine: Engine, table: Table, add: Add
) -> None:
    job = add(
        payload={"user": 7, "address": "a@example.org"},
        task="send",
        status="running",
        attempts=2,
        max_attempts=4,
        started_at=ago(seconds=30),
        locked_until=ago(seconds=-95),
        last_error="SMTP 451",
    )
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get(f"/jobs/{job}")).text
        missing = await http.get(f"/jobs/{job + 1000}")
        huge = await http.get(f"/jobs/{2**64}")
    assert f"Job {job}" in page and "2 of 4" in page
    assert '{\n  "user": 7,\n  "address": "a@example.org"\n}' in html.unescape(page)
    assert re.search(r"\(1m 3\ds left\)", page)
    assert "SMTP 451" in page
    assert missing.status_code == 404 and f"no job {job + 1000}" in missing.text
    assert huge.status_code == 404


def archive(engine: Engine, table: Table, *statuses: str) -> int:
    """Move finished jobs to the archive now, as a worker does after `archive_after`."""
    stmt = statements.archive(
        table, older_than=timedelta(0), statuses=list(statuses or FINISHED_STATUSES)
    )
    with engine.begin() as conn:
        return conn.execute(stmt).rowcount


async def test_dashboard_shows_an_archived_job(engine: Engine, table: Table, add: Add) -> None:
    """A done job leaves the jobs table after `archive_after`: its page, the
    list, the overview's last hour and the chart must still show it."""
    job = add(
        payload={"order": 7},
        task="receipt",
        status="done",
        attempts=1,
        started_at=ago(minutes=2, seconds=1),
        finished_at=ago(minutes=2),
        result=Jsonb({"sent": 3}),
    )
    queued = add(task="receipt")
    assert archive(engine, table) == 1
    async with client(dashboard.app(engine, table)) as http:
        page = await http.get(f"/jobs/{job}")
        listing = (await http.get("/jobs")).text
        done = (await http.get("/jobs", params={"status": "done", "task": "receipt"})).text
        ready = (await http.get("/jobs", params={"status": "ready"})).text
        overview = (await http.get("/")).text
    assert page.status_code == 200
    assert f"Job {job}" in page.text and "1 of 5" in page.text
    assert re.search(r'<dt>archived</dt><dd id="archived">', page.text)
    assert '"sent": 3' in html.unescape(page.text) and '"order": 7' in html.unescape(page.text)
    assert "<button" not in page.text  # history: nothing to retry or cancel
    assert job_ids(listing) == [queued, job] and job_ids(done) == [job]
    assert job_ids(ready) == [queued]
    assert re.search(rf'/jobs/{job}">{job}</a>.*?archived', listing, re.S)
    assert re.search(r'status=done">1</a>', overview), "done in the last hour"
    assert "done 1" in overview  # the chart


async def test_an_archived_failed_job_is_refused_retry_as_history(
    engine: Engine, table: Table, add: Add
) -> None:
    """`jobq prune --archive` may archive failed jobs: they are shown, not retried."""
    failed = add(status="failed", attempts=5, last_error="boom", finished_at=ago(days=8))
    add(queue="other")  # the overview's pause button carries a CSRF token
    assert archive(engine, table, "failed") == 1
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get(f"/jobs/{failed}")).text
        token = csrf_of((await http.get("/")).text)
        retried = await http.post(f"/actions/jobs/{failed}/retry", data={"csrf_token": token})
    assert "boom" in page and "Retry</button>" not in page
    assert retried.status_code == 409 and "archived" in retried.text


def test_job_list_over_both_tables_walks_each_primary_key_backwards_without_sorting(
    engine: Engine, table: Table, raw: Raw
) -> None:
    """The list reads the jobs table and the archive: each side walks its
    primary key backwards and stops after a page (a Merge Append under the
    Limit), so a long archive costs a page view what a short one does. Done
    jobs alone: the jobs table's side walks the done index, also by id."""
    raw.execute(
        f'INSERT INTO "{table.name}" (payload, queue, task, status, finished_at, last_error) '
        "SELECT '{}', 'q' || (i % 3), 't' || (i % 7), "
        "CASE WHEN i % 10 = 0 THEN 'failed' ELSE 'done' END, now() - interval '1 hour', "
        "CASE WHEN i % 10 = 0 THEN 'boom ' || i END FROM generate_series(1, 40000) i"
    )
    archive(engine, table, "done")
    raw.execute(f'ANALYZE "{table.name}", "{table.name}_archive"')
    pkey = f"{table.name}_pkey"
    cases = [
        (JobFilter(), pkey),
        (JobFilter(queue="q1", status="done"), f"{table.name}_done_idx"),
        (JobFilter(error="boom"), pkey),
    ]
    for flt, jobs_index in cases:
        compiled = queries.job_page(table, flt, Cursor(before=30000)).compile(
            dialect=engine.dialect
        )
        with engine.connect() as conn:
            plan = conn.exec_driver_sql(
                "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.params
            ).scalar_one()
        text = json.dumps(plan)
        assert '"Node Type": "Limit"' in text and "Merge Append" in text, text
        assert_walks_backwards(plan[0]["Plan"], table.name, jobs_index)
        archived = f"{table.name}_archive"
        assert_walks_backwards(plan[0]["Plan"], archived, f"{archived}_pkey")
        assert "Seq Scan" not in text and '"Sort"' not in text, text


async def test_script_in_payload_task_or_error_renders_as_text(
    engine: Engine, table: Table, add: Add
) -> None:
    attack = "<script>alert(1)</script>"
    job = add(
        payload={"x": attack}, task=attack, queue=attack, status="failed", last_error=attack
    )
    async with client(dashboard.app(engine, table)) as http:
        pages = [(await http.get(path)).text for path in ("/", "/jobs", f"/jobs/{job}")]
    for page in pages:
        assert "<script>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


async def test_retry_and_cancel_change_the_job_and_return_to_it(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    failed = add(status="failed", attempts=5, max_attempts=5, last_error="boom")
    queued = add()
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get(f"/jobs/{failed}")).text
        assert "Retry</button>" in page and "Cancel</button>" not in page
        token = csrf_of(page)
        retried = await http.post(f"/actions/jobs/{failed}/retry", data={"csrf_token": token})
        cancelled = await http.post(f"/actions/jobs/{queued}/cancel", data={"csrf_token": token})
        again = await http.post(f"/actions/jobs/{failed}/retry", data={"csrf_token": token})
        absent = await http.post("/actions/jobs/999999/retry", data={"csrf_token": token})
        assert "Cancel</button>" in (await http.get(f"/jobs/{failed}")).text
    assert retried.status_code == 303 and retried.headers["location"] == f"/jobs/{failed}"
    assert cancelled.status_code == 303
    assert status_of(raw, table, failed) == "queued"
    assert status_of(raw, table, queued) == "cancelled"
    assert again.status_code == 409 and f"job {failed} is queued" in again.text
    assert absent.status_code == 404


async def test_actions_without_the_csrf_token_are_refused_with_403(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    failed = add(status="failed", attempts=5)
    async with client(dashboard.app(engine, table)) as http:
        await http.get("/")
        missing = await http.post(f"/actions/jobs/{failed}/retry")
        wrong = await http.post(f"/actions/jobs/{failed}/retry", data={"csrf_token": "x" * 43})
        bulk = await http.post("/actions/bulk-retry", data={"upto": str(failed)})
        get = await http.get(f"/actions/jobs/{failed}/retry")
    async with client(dashboard.app(engine, table)) as stranger:
        no_cookie = await stranger.post(
            f"/actions/jobs/{failed}/retry", data={"csrf_token": http.cookies["jobq_csrf"]}
        )
    assert [r.status_code for r in (missing, wrong, bulk, no_cookie)] == [403] * 4
    assert "CSRF token" in missing.text
    assert get.status_code == 405
    assert status_of(raw, table, failed) == "failed"


async def test_bulk_retry_shows_the_count_then_retries_only_those_jobs(
    engine: Engine, table: Table, add: Add, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "RETRY_BATCH", 2)
    matching = [add(queue="a", status="failed", attempts=5, last_error="boom") for _ in range(5)]
    others = [
        add(queue="b", status="failed", attempts=5, last_error="boom"),
        add(queue="a", status="failed", attempts=5, last_error="other"),
        add(queue="a", status="done", attempts=1, last_error="boom"),
    ]
    async with client(dashboard.app(engine, table)) as http:
        listing = (await http.get("/jobs", params={"queue": "a", "status": "failed"})).text
        confirm_link = re.search(r'href="([^"]*/bulk-retry\?[^"]*)"', listing)
        assert confirm_link
        confirm = (await http.get(html.unescape(confirm_link[1]) + "&error=boom")).text
        assert re.search(r"<strong>5</strong> failed jobs match", confirm)
        late = add(queue="a", status="failed", attempts=5, last_error="boom")
        form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm))
        done = await http.post("/actions/bulk-retry", data=form)
        nothing = (await http.get("/bulk-retry", params={"queue": "zzz"})).text
    assert done.status_code == 200 and "<strong>5</strong> failed jobs sent back" in done.text
    assert [status_of(raw, table, i) for i in matching] == ["queued"] * 5
    assert [status_of(raw, table, i) for i in [*others, late]] == [
        "failed", "failed", "done", "failed",
    ]
    assert "No failed job matches" in nothing


async def test_retry_skips_failed_jobs_whose_unique_key_an_active_job_holds(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    add(unique_key="k1")
    held = add(status="failed", attempts=5, unique_key="k1")
    twins = [add(status="failed", attempts=5, unique_key="k2") for _ in range(2)]
    free = add(status="failed", attempts=5)
    async with client(dashboard.app(engine, table)) as http:
        page = (await http.get(f"/jobs/{held}")).text
        single = await http.post(f"/actions/jobs/{held}/retry", data={"csrf_token": csrf_of(page)})
        confirm = (await http.get("/bulk-retry")).text
        form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm))
        done = await http.post("/actions/bulk-retry", data=form)
    assert single.status_code == 409 and "unique key belongs to a job" in single.text
    assert "<strong>2</strong> failed jobs sent back" in done.text
    assert '<p id="left">2 of those counted' in done.text
    assert status_of(raw, table, held) == "failed" and status_of(raw, table, free) == "queued"
    assert sorted(status_of(raw, table, i) for i in twins) == ["failed", "queued"]


async def test_read_only_shows_no_buttons_and_has_no_action_routes(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    failed = add(status="failed", attempts=5)
    queued = add()
    async with client(dashboard.app(engine, table, read_only=True)) as http:
        pages = [(await http.get(p)).text for p in (f"/jobs/{failed}", f"/jobs/{queued}")]
        listing = (await http.get("/jobs", params={"status": "failed"})).text
        token = csrf_of((await http.get("/")).text) if "csrf_token" in pages[0] else "none"
        post = await http.post(f"/actions/jobs/{failed}/retry", data={"csrf_token": token})
        bulk = await http.post("/actions/bulk-retry", data={"csrf_token": token})
        confirm = await http.get("/bulk-retry")
    assert all("<button" not in p for p in pages) and "bulk-retry" not in listing
    assert "read-only" in pages[0]
    assert post.status_code in (404, 405) and bulk.status_code in (404, 405)
    assert confirm.status_code == 404
    assert status_of(raw, table, failed) == "failed"


async def test_auth_token_admits_bearer_or_login_cookie_and_nothing_else(
    engine: Engine, table: Table
) -> None:
    app = dashboard.app(engine, table, auth_token="s3cret")
    async with client(app) as http:
        bare = await http.get("/metrics")
        browser = await http.get("/jobs?queue=a", headers={"accept": "text/html"})
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert browser.status_code == 303
        login_page = await http.get(browser.headers["location"])
        assert login_page.status_code == 200 and 'type="password"' in login_page.text
        token = csrf_of(login_page.text)
        wrong = await http.post(
            "/login", data={"csrf_token": token, "token": "guess", "next": "/jobs?queue=a"}
        )
        assert wrong.status_code == 401 and "wrong token" in wrong.text
        assert (await http.get("/")).status_code == 401
        right = await http.post(
            "/login", data={"csrf_token": token, "token": "s3cret", "next": "/jobs?queue=a"}
        )
        assert right.status_code == 303 and right.headers["location"] == "/jobs?queue=a"
        assert "jobq_session" in right.headers["set-cookie"]
        assert "s3cret" not in right.headers["set-cookie"]
        assert (await http.get("/")).status_code == 200
        offsite = await http.post(
            "/login", data={"csrf_token": token, "token": "s3cret", "next": "//evil.example"}
        )
        assert offsite.headers["location"] == "/"
        await http.post("/logout", data={"csrf_token": token})
        assert (await http.get("/healthz")).status_code == 401
    async with client(app, authorization="Bearer s3cret") as scraper:
        assert (await scraper.get("/metrics")).status_code == 200
    async with client(app, authorization="Bearer s3cre") as wrong_bearer:
        assert (await wrong_bearer.get("/metrics")).status_code == 401


async def test_metrics_reports_jobs_per_queue_and_status_and_oldest_ready_age(
    engine: Engine, table: Table, add: Add
) -> None:
    add(queue="mail", run_at=ago(seconds=100))
    add(queue="mail", status="failed", attempts=5)
    add(queue="mail", status="failed", attempts=5)
    add(queue="media", status="done", attempts=1)
    async with client(dashboard.app(engine, table)) as http:
        response = await http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=")
    lines = response.text.splitlines()
    assert "# TYPE jobq_queue_jobs gauge" in lines
    for expected in (
        'jobq_queue_jobs{queue="mail",status="queued"} 1.0',
        'jobq_queue_jobs{queue="mail",status="failed"} 2.0',
        'jobq_queue_jobs{queue="mail",status="done"} 0.0',
        'jobq_queue_jobs{queue="media",status="done"} 1.0',
        'jobq_queue_oldest_ready_seconds{queue="media"} 0.0',
    ):
        assert expected in lines
    mail = 'jobq_queue_oldest_ready_seconds{queue="mail"}'
    age = next(line for line in lines if line.startswith(mail))
    assert 100 <= float(age.split()[-1]) < 200


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_unreachable_database_gives_503_pages_not_tracebacks(table: Table) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/postgres"
    eng = dashboard_engine(url)
    try:
        async with client(dashboard.app(eng, table)) as http:
            health = await http.get("/healthz")
            page = await http.get("/jobs")
            metrics = await http.get("/metrics")
    finally:
        eng.dispose()
    assert health.status_code == 503 and health.text.startswith("cannot connect to the database")
    assert page.status_code == 503 and "Database unavailable" in page.text
    assert "Traceback" not in page.text
    assert metrics.status_code == 503


async def test_dashboard_recovers_when_its_connections_are_terminated(
    pooled: Engine, table: Table, add: Add, raw: Raw
) -> None:
    add()
    async with client(dashboard.app(pooled, table)) as http:
        assert (await http.get("/")).status_code == 200
        assert (await http.get("/healthz")).status_code == 200
        killed = raw.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()",
            (APPLICATION_NAME,),
        ).fetchone()
        assert killed is not None and killed[0] >= 1
        assert (await http.get("/")).status_code == 200
        assert (await http.get("/healthz")).text == "ok\n"


async def test_mounted_under_a_prefix_every_link_and_redirect_keeps_it(
    engine: Engine, table: Table, add: Add, raw: Raw
) -> None:
    failed = add(status="failed", attempts=5)
    host = Starlette(routes=[Mount("/jobs", app=dashboard.app(engine, table))])
    async with client(host) as http:
        first = await http.get("/jobs/")
        page = first.text
        assert "Path=/jobs;" in first.headers["set-cookie"]
        paths = re.findall(r'(?:href|action)="([^"]+)"', page)
        assert paths and all(p.startswith("/jobs/") for p in paths), paths
        assert "/jobs/static/style.css" in paths
        assert (await http.get("/jobs/static/style.css")).status_code == 200
        detail = (await http.get(f"/jobs/jobs/{failed}")).text
        assert f'action="/jobs/actions/jobs/{failed}/retry"' in detail
        retried = await http.post(
            f"/jobs/actions/jobs/{failed}/retry", data={"csrf_token": csrf_of(detail)}
        )
    assert retried.headers["location"] == f"/jobs/jobs/{failed}"
    assert status_of(raw, table, failed) == "queued"


def jobq_dashboard(database_url: str, *args: str) -> subprocess.Popen[str]:
    env = {"PATH": str(Path(sys.executable).parent), "JOBQ_DATABASE_URL": database_url}
    return subprocess.Popen(
        [JOBQ, "dashboard", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_serves_on_the_port_it_announces(database_url: str, table: Table) -> None:
    port = closed_port()
    proc = jobq_dashboard(database_url, "--table", table.name, "--port", str(port), "--read-only")
    try:
        assert proc.stdout is not None
        announced = proc.stdout.readline()
        assert announced.startswith(f"jobq dashboard on http://127.0.0.1:{port}/ ")
        assert "read-only" in announced
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as reply:
            assert reply.status == 200 and reply.read() == b"ok\n"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--table", "no_such_table"], "does not exist in this database: run `jobq migrate`"),
        (["--table", "TABLE", "--port", "PORT"], "cannot listen on 127.0.0.1:PORT:"),
        (["--table", "TABLE", "--auth-token", ""], "--auth-token must not be empty"),
    ],
)
def test_cli_refuses_bad_start_with_one_line(
    database_url: str, table: Table, args: list[str], message: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        filled = [a.replace("TABLE", table.name).replace("PORT", port) for a in args]
        proc = jobq_dashboard(database_url, *filled)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("jobq: error: ")
    assert message.replace("PORT", port) in err
