"""The dashboard's `/workers` page (httpx on the ASGI app), on a real queue
table whose worker registry is written with `sqla_jobq.presence`."""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta
from typing import Any

import httpx
import psycopg
from sqlalchemy import Engine, Table

from sqla_jobq import dashboard
from sqla_jobq.db import conninfo
from sqla_jobq.presence import Presence, WorkerInfo

Raw = psycopg.Connection[Any]


def register(database_url: str, table: Table, name: str, queues: tuple[str, ...]) -> str:
    info = WorkerInfo(
        id=f"host-a:{name}",
        host="host-a",
        pid=1,
        queues=queues,
        concurrency=3,
        beat_interval=timedelta(seconds=15),
    )

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(
            conninfo(database_url), autocommit=True
        ) as conn:
            assert await Presence(table, info).register(conn)

    asyncio.run(main())
    return info.id


def get(engine: Engine, table: Table, path: str) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=dashboard.app(engine, table))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            return await http.get(path)

    return asyncio.run(main())


def rows(page: str) -> list[str]:
    body = re.search(r'<table class="grid" id="workers">(.*?)</table>', page, re.S)
    assert body, "no workers table"
    return re.findall(r"<tr[^>]*>\s*<td>.*?</tr>", body[1], re.S)


def test_workers_page_lists_live_workers_first_and_flags_stale_ones(
    database_url: str, raw: Raw, engine: Engine, table: Table
) -> None:
    live = register(database_url, table, "live", ("default", "<b>mail</b>"))
    dead = register(database_url, table, "dead", ("default",))
    raw.execute(
        f"UPDATE \"{table.name}_workers\" SET heartbeat_at = now() - interval '1 hour' "
        "WHERE id = %s",
        (dead,),
    )
    response = get(engine, table, "/workers")
    assert response.status_code == 200
    page = response.text
    assert "1 live, " in page and "1 stale</span>" in page
    first, second = rows(page)
    assert live in first and '<span class="status done">live</span>' in first
    assert dead in second and '<span class="status failed">stale</span>' in second
    assert "1h 0m ago" in second
    # Queue names come from the database: escaped, and linked to their jobs.
    assert "&lt;b&gt;mail&lt;/b&gt;" in first and "<b>mail</b>" not in page


def test_every_page_links_to_the_workers_page(engine: Engine, table: Table) -> None:
    assert '<a href="/workers">Workers</a>' in get(engine, table, "/").text


def test_workers_page_without_any_worker_says_so(engine: Engine, table: Table) -> None:
    assert "No worker is registered" in get(engine, table, "/workers").text


def test_workers_page_on_a_table_without_the_registry_asks_for_the_migration(
    raw: Raw, engine: Engine, table: Table
) -> None:
    raw.execute(f'DROP TABLE "{table.name}_workers"')
    try:
        response = get(engine, table, "/workers")
        overview = get(engine, table, "/")
    finally:
        raw.execute(f'CREATE TABLE "{table.name}_workers" (id text PRIMARY KEY)')
    assert response.status_code == 200
    assert "run <code>jobq migrate</code>" in response.text
    assert overview.status_code == 200
