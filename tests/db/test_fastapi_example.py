"""examples/fastapi_app end to end: httpx against the app, its lifespan (and
so the worker in it) running, on a database of its own; and the example test
of its tasks, run by pytest as an app's suite would run it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, func, select
from sqlalchemy.pool import NullPool

from examples.fastapi_app.app import create_app
from examples.fastapi_app.models import jobs
from sqla_jobq.db import conninfo, parse_url
from sqla_jobq.migrations.runner import migrate_to_latest
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_TEST = REPO / "examples" / "test_tasks_example.py"
ORDER = {"reference": "A-1001", "email": "ada@example.com", "total_cents": 4250}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def shop_url(server_url: str) -> Iterator[str]:
    """A database of its own (the example's tables have fixed names), migrated."""
    name = f"jobq_shop_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(conninfo(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = parse_url(server_url).set(database=name).render_as_string(hide_password=False)
    migrate_to_latest(url, jobs)
    yield url
    with psycopg.connect(conninfo(server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app between its start-up and its shutdown, as a server runs it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as http:
            yield http


def job_count(url: str) -> int:
    engine = create_engine(url, poolclass=NullPool)
    with engine.connect() as conn:
        count = conn.execute(select(func.count()).select_from(jobs)).scalar_one()
    engine.dispose()
    return int(count)


async def test_an_order_gets_its_receipt_from_the_lifespan_worker_and_shows_its_result(
    shop_url: str,
) -> None:
    async with serving(create_app(shop_url)) as http:
        created = await http.post("/orders", json=ORDER)
        assert created.status_code == 201
        shown = (await http.get(f"/orders/{created.json()['id']}", params={"wait": 1})).json()
    assert shown["reference"] == "A-1001"
    assert shown["receipt"] == {
        "status": "done",
        "result": {"to": "ada@example.com", "text": "Order A-1001: 42.50 EUR. Thank you!"},
        "error": None,
    }


async def test_an_order_shows_its_receipt_after_the_worker_moved_the_job_to_the_archive(
    shop_url: str,
) -> None:
    """Nobody waits, so the worker's completion moves the job to the archive
    (archiving at completion, the default): the order still shows its receipt."""
    async with serving(create_app(shop_url)) as http:
        created = await http.post("/orders", json=ORDER)
        job_id = created.json()["receipt_job_id"]
        await wait_until_async(lambda: archived(shop_url, job_id), 30, "the receipt job archived")
        shown = (await http.get(f"/orders/{created.json()['id']}")).json()
    assert shown["receipt"]["status"] == "done"
    assert shown["receipt"]["result"]["to"] == "ada@example.com"


def archived(url: str, job_id: int) -> bool:
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute("SELECT 1 FROM jobs_archive WHERE id = %s", (job_id,)).fetchone()
    return row is not None


async def test_a_refused_order_rolls_back_its_receipt_job_with_it(shop_url: str) -> None:
    async with serving(create_app(shop_url, run_worker=False)) as http:
        assert (await http.post("/orders", json=ORDER)).status_code == 201
        again = await http.post("/orders", json={**ORDER, "email": "someone@example.com"})
        assert again.status_code == 409
        assert (await http.get("/orders/999")).status_code == 404
    assert job_count(shop_url) == 1


async def test_the_dashboard_answers_under_jobs(shop_url: str) -> None:
    async with serving(create_app(shop_url, run_worker=False)) as http:
        await http.post("/orders", json=ORDER)
        page = await http.get("/jobs/")
    assert page.status_code == 200
    assert "receipts" in page.text


def test_the_example_task_tests_pass_in_a_pytest_run_of_their_own(shop_url: str) -> None:
    """examples/test_tasks_example.py, run as an app's suite runs it: the
    plugin found through its entry point, a migrated database in DATABASE_URL."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE_TEST)],
        cwd=REPO,
        env={**os.environ, "DATABASE_URL": shop_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout
