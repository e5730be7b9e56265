"""The worker's driver reports exactly which attempts a fenced batch matched:
all of them by the row count alone, and the ones that missed (a stale
attempt, a row another session holds) by reading the returned rows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Engine, Table

from sqla_jobq.db import conninfo
from sqla_jobq.driver import Driver, Fates, Key, lifecycle_statements
from tests.support.rows import Raw, enqueue, job_row

LEASE = timedelta(minutes=5)


def _enqueue(engine: Engine, table: Table, count: int) -> None:
    for n in range(count):
        enqueue(engine, table, "t", {"n": n})


async def _claimed(driver: Driver, count: int) -> list[tuple[int, int]]:
    rows = await driver.claim(count)
    return sorted((r["id"], r["attempts"]) for r in rows)


@asynccontextmanager
async def _driver(database_url: str, table: Table) -> AsyncIterator[Driver]:
    driver = Driver(database_url, lifecycle_statements(table, ["default"], LEASE), True)
    try:
        yield driver
    finally:
        await driver.close()


def _complete_while_held(
    database_url: str,
    table: Table,
    count: int,
    held: int,
    results: Sequence[str | None] | None = None,
) -> tuple[list[tuple[int, int]], set[Any]]:
    """Claim `count` jobs and complete them, skipping locked rows, while
    another session holds the row of the `held`-th: the keys, and what matched."""

    async def scenario() -> tuple[list[tuple[int, int]], set[Any]]:
        async with _driver(database_url, table) as driver:
            keys = await _claimed(driver, count)
            with psycopg.connect(conninfo(database_url)) as holder:
                lock = f'SELECT 1 FROM "{table.name}" WHERE id = %s FOR UPDATE'
                holder.execute(lock, [keys[held][0]])
                done = await driver.complete_many(keys, results, skip_locked=True)
            return keys, done

    return asyncio.run(scenario())


def test_batch_with_a_stale_attempt_matches_only_the_live_ones(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    _enqueue(engine, table, 3)

    async def scenario() -> tuple[set[Any], set[Any], set[Any]]:
        async with _driver(database_url, table) as driver:
            (a, b, c) = await _claimed(driver, 3)
            stale = (c[0], c[1] + 1)
            extended = await driver.extend_leases([a, b, c], LEASE)
            done = await driver.complete_many([a, stale], ['{"r": 1}', None])
            handed = await driver.hand_back([b, c, a], refund=False)
            return extended, done, handed

    extended, done, handed = asyncio.run(scenario())
    assert len(extended) == 3
    (a, b, c) = sorted(extended)
    assert done == {a}
    assert handed == {b, c}
    rows = {key: job_row(raw, table, key[0]) for key in (a, b, c)}
    assert {k: r["status"] for k, r in rows.items()} == {a: "done", b: "queued", c: "queued"}
    assert rows[a]["result"] == {"r": 1}


def test_batch_holding_two_attempts_of_one_job_matches_only_the_newest(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    """The driver sends a batch in the order the statements look pairs up in:
    the stale attempt, sent first, must neither hide the live one nor lend
    it its result."""
    _enqueue(engine, table, 1)

    async def scenario() -> tuple[Key, Key, Fates, set[Key]]:
        async with _driver(database_url, table) as driver:
            [stale] = await _claimed(driver, 1)
            raw.execute(f'UPDATE "{table.name}" SET status = \'queued\' WHERE id = %s', [stale[0]])
            [live] = await _claimed(driver, 1)
            fates = await driver.fates([stale, live])
            done = await driver.complete_many([stale, live], ['"stale"', '"live"'])
            return stale, live, fates, done

    stale, live, fates, done = asyncio.run(scenario())
    assert live == (stale[0], stale[1] + 1)
    assert fates.busy == {live}
    assert done == {live}
    row = job_row(raw, table, live[0])
    assert (row["status"], row["result"]) == ("done", "live")


def test_batch_skipping_a_row_another_session_holds_matches_the_rest(
    database_url: str, engine: Engine, table: Table
) -> None:
    _enqueue(engine, table, 2)
    keys, done = _complete_while_held(database_url, table, 2, held=0)
    assert done == {keys[1]}


def test_batch_skipping_a_locked_row_stores_each_result_on_its_own_job(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    """Results travel beside the ids they belong to: the locked row keeps
    none and stays running, the other gets its own, not its neighbour's."""
    _enqueue(engine, table, 3)
    results = ['{"r": 0}', '{"r": 1}', None]
    keys, done = _complete_while_held(database_url, table, 3, held=1, results=results)
    assert done == {keys[0], keys[2]}
    rows = [job_row(raw, table, key[0]) for key in keys]
    assert [(r["status"], r["result"]) for r in rows] == [
        ("done", {"r": 0}),
        ("running", None),
        ("done", None),
    ]


def test_results_with_quotes_backslashes_and_braces_are_stored_as_given(
    database_url: str, engine: Engine, table: Table, raw: Raw
) -> None:
    """Results go to the server as one array literal (see `_text_array`): no
    text may read as NULL, end its element early or split the array."""
    tricky: list[Any] = [
        {"q": 'say "hi"', "path": "C:\\dir\\", "set": "{a,b}"},
        "NULL",
        "",
        {"emoji": "\u00e9\u2603", "nested": [1, {"x": None}]},
        None,
    ]
    _enqueue(engine, table, len(tricky))

    async def scenario() -> list[tuple[int, int]]:
        async with _driver(database_url, table) as driver:
            keys = await _claimed(driver, len(tricky))
            results = [None if r is None else json.dumps(r) for r in tricky]
            assert await driver.complete_many(keys, results) == set(keys)
            return keys

    keys = asyncio.run(scenario())
    assert [job_row(raw, table, key[0])["result"] for key in keys] == tricky
