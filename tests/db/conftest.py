"""Fixtures of the tests that run real workers in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Table

from tests.support.inprocess import Side


@pytest.fixture
def side(database_url: str, table: Table, raw: psycopg.Connection[Any]) -> Iterator[Side]:
    """The side table handlers record their executions in (tests/support/inprocess.py)."""
    found = Side(database_url, f"{table.name}_side")
    yield found
    raw.execute(f'DROP TABLE IF EXISTS "{found.name}"')
