"""The dashboard in a real browser: Debian's Chromium driven by Playwright.

The app is served by uvicorn on a free port in a thread, as `jobq dashboard`
serves it. Playwright is pointed at /usr/bin/chromium (`apt-get install
chromium`); it never downloads a browser of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import uvicorn
from psycopg.types.json import Jsonb
from sqlalchemy import Engine, Table

from sqla_jobq import Registry, client, dashboard
from sqla_jobq.dashboard.server import bind
from tests.support.inprocess import Side, running
from tests.support.rows import job_row
from tests.support.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is absent: apt-get install chromium (Playwright never downloads one)",
)

Raw = psycopg.Connection[Any]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    yield context.new_page()
    context.close()


@pytest.fixture
def served(engine: Engine, table: Table) -> Iterator[str]:
    """The dashboard on a free 127.0.0.1 port; the socket listens before the
    thread starts, so the browser may connect at once."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(dashboard.app(engine, table), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def add(raw: Raw, table: Table, payload: Any = None, **columns: Any) -> int:
    columns["payload"] = Jsonb({} if payload is None else payload)
    names = ", ".join(columns)
    values = ", ".join(f"%({name})s" for name in columns)
    row = raw.execute(
        f'INSERT INTO "{table.name}" ({names}) VALUES ({values}) RETURNING id', columns
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_overview_lists_each_queue_and_draws_the_chart(
    page: Any, served: str, raw: Raw, table: Table
) -> None:
    from playwright.sync_api import expect

    add(raw, table, queue="mail")
    add(raw, table, queue="media", status="done", attempts=1, finished_at="now")
    page.goto(f"{served}/")
    expect(page.locator("#queues")).to_contain_text("mail")
    expect(page.locator("#queues")).to_contain_text("media")
    expect(page.locator("figure.chart svg rect.done")).to_have_count(1)


def test_filter_the_list_open_a_failed_job_and_retry_it(
    page: Any, served: str, raw: Raw, table: Table
) -> None:
    from playwright.sync_api import expect

    add(raw, table, queue="mail", task="send")
    failed = add(
        raw, table, queue="mail", task="send", status="failed", attempts=5, last_error="SMTP 451"
    )
    add(raw, table, queue="media", task="resize", status="failed", attempts=5)
    page.goto(f"{served}/jobs")
    expect(page.locator("#jobs tbody tr")).to_have_count(3)
    page.fill("input[name=queue]", "mail")
    page.select_option("select[name=status]", "failed")
    page.click("#filters button[type=submit]")
    expect(page.locator("#jobs tbody tr")).to_have_count(1)
    assert "status=failed" in page.url and "queue=mail" in page.url
    page.click(f"#jobs a:text-is('{failed}')")
    expect(page.locator("#status")).to_have_text("failed")
    expect(page.locator("#last-error")).to_have_text("SMTP 451")
    page.click("button:text-is('Retry')")
    expect(page.locator("#status")).to_have_text("queued")
    assert page.url.endswith(f"/jobs/{failed}")
    expect(page.locator("button:text-is('Cancel')")).to_be_visible()


def test_script_in_a_payload_or_error_shows_as_text_and_never_runs(
    page: Any, served: str, raw: Raw, table: Table
) -> None:
    from playwright.sync_api import expect

    script = "<script>window.pwned = 1</script>"
    image = '<img src=x onerror="window.pwned = 2">'
    job = add(raw, table, {"note": script}, task=image, status="failed", last_error=image)
    page.goto(f"{served}/jobs/{job}")
    expect(page.locator("#last-error")).to_have_text(image)
    expect(page.locator("#payload")).to_contain_text(script)
    page.goto(f"{served}/jobs")
    expect(page.locator("#jobs")).to_contain_text(image)
    assert page.evaluate("window.pwned") is None


def status_of(raw: Raw, table: Table, job_id: int) -> str:
    """Where a job stands, in the jobs table or (done, by default) the archive."""
    return str(job_row(raw, table, job_id, "status")["status"])


def test_pausing_a_queue_in_the_overview_stops_a_real_worker_until_it_is_resumed(
    page: Any, served: str, raw: Raw, engine: Engine, table: Table, database_url: str
) -> None:
    from playwright.sync_api import expect

    side = Side(database_url, f"{table.name}_side")
    registry = Registry(table)

    @registry.task(name="work")
    def work() -> None:
        side.record("ran")

    def enqueue(queue: str) -> int:
        with engine.begin() as conn:
            return client.enqueue(conn, table, "work", {}, queue=queue)

    def ran(job_id: int) -> bool:
        return bool(side.events(job_id)) and status_of(raw, table, job_id) == "done"

    try:
        with running(registry, database_url, queues=["mail", "other"], poll_interval=1):
            first = enqueue("mail")
            wait_until(lambda: ran(first), 30, "the worker to run the first mail job")

            page.goto(f"{served}/")
            mail = page.locator('#queues tr[data-queue="mail"]')
            expect(mail).to_contain_text("active")
            mail.locator("button:text-is('Pause')").click()
            expect(mail).to_contain_text("paused")
            expect(mail.locator("button:text-is('Resume')")).to_be_visible()

            held = [enqueue("mail"), enqueue("mail")]
            # A job of another queue, enqueued after them, runs: the worker is
            # claiming, and the paused queue's older jobs are not handed out.
            later = enqueue("other")
            wait_until(lambda: ran(later), 30, "the worker to run the other queue's job")
            assert [status_of(raw, table, i) for i in held] == ["queued", "queued"]
            assert not any(side.events(i) for i in held)

            page.reload()
            expect(mail.locator("td.num").first).to_have_text("2")  # ready
            page.click("header nav a:text-is('Workers')")
            workers = page.locator("#workers tbody tr")
            expect(workers).to_have_count(1)
            expect(workers).to_contain_text("live")
            expect(workers).to_contain_text("mail, other")

            page.click("header nav a:text-is('Overview')")
            mail.locator("button:text-is('Resume')").click()
            expect(mail).to_contain_text("active")
            wait_until(lambda: all(ran(i) for i in held), 30, "the resumed queue's jobs to run")
            page.reload()
            expect(mail.locator("td.num").first).to_have_text("0")
            expect(mail.locator("td.num").nth(4)).to_have_text("3")  # done, last hour
    finally:
        raw.execute(f'DROP TABLE IF EXISTS "{side.name}"')
