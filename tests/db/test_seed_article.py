"""Every statement of the article the queue is built from (shared/seed) runs
unchanged on a table at the latest schema version, in the article's order,
with the outcomes the article shows."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from sqla_jobq.db import conninfo
from sqla_jobq.migrations.steps import LATEST, up_statements
from sqla_jobq.schema import Names

CLAIM_ONE = """UPDATE jobs
SET status = 'running', attempts = attempts + 1
WHERE id = (
  SELECT id FROM jobs
  WHERE status = 'queued'
  ORDER BY run_at
  LIMIT 1
)
RETURNING id, attempts"""

CLAIM_FOR_UPDATE = """WITH next AS (
  SELECT id FROM jobs
  WHERE queue = 'default' AND status = 'queued' AND run_at <= now()
  ORDER BY run_at
  LIMIT 1
  FOR UPDATE
)
UPDATE jobs j
SET status = 'running', attempts = j.attempts + 1
FROM next
WHERE j.id = next.id
RETURNING j.id"""

CLAIM_SKIP_LOCKED = """WITH next AS (
  SELECT id FROM jobs
  WHERE queue = 'default' AND status = 'queued' AND run_at <= now()
  ORDER BY run_at
  LIMIT 10
  FOR UPDATE SKIP LOCKED
)
UPDATE jobs j
SET status       = 'running',
    attempts     = j.attempts + 1,
    locked_until = now() + interval '5 minutes'
FROM next
WHERE j.id = next.id
RETURNING j.id, j.payload, j.attempts"""

COMPLETE = """UPDATE jobs
SET status = 'done', locked_until = NULL
WHERE id = 1 AND status = 'running' AND attempts = 1"""

FAIL = """UPDATE jobs
SET status       = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'queued' END,
    run_at       = now() + least(interval '1 hour', interval '10 seconds' * 2 ^ attempts),
    locked_until = NULL,
    last_error   = 'SMTP 451: try again later'
WHERE id = 2 AND status = 'running' AND attempts = 1
RETURNING id, status, attempts, run_at - now() AS retry_in"""

REAP = """UPDATE jobs
SET status       = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'queued' END,
    locked_until = NULL,
    last_error   = coalesce(last_error, 'lease expired')
WHERE status = 'running' AND locked_until < now()
RETURNING id, status, attempts"""

EXTEND = """UPDATE jobs
SET locked_until = now() + interval '5 minutes'
WHERE id = $1 AND status = 'running' AND attempts = $2"""

PRUNE = """DELETE FROM jobs
WHERE id IN (
  SELECT id FROM jobs
  WHERE status = 'done' AND created_at < now() - interval '7 days'
  LIMIT 10000
)"""


@pytest.fixture
def article(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A session whose `jobs` is a fresh queue table at the latest version."""
    schema = f"seed_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"'.encode())
        for sql in up_statements(Names("jobs", schema), 0, LATEST):
            conn.execute(sql.encode())
        conn.execute(f'SET search_path = "{schema}"'.encode())
        yield conn
        conn.execute("RESET search_path")
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE'.encode())


def test_every_statement_of_the_article_runs_unchanged_on_the_latest_schema(
    article: psycopg.Connection[Any],
) -> None:
    run = article.execute
    run(
        "INSERT INTO jobs (payload) "
        "SELECT jsonb_build_object('email_id', g) FROM generate_series(1, 10) AS g"
    )
    assert run(CLAIM_ONE).fetchall() == [(1, 1)]
    assert run(CLAIM_FOR_UPDATE).fetchall() == [(2,)]
    claimed = run(CLAIM_SKIP_LOCKED).fetchall()
    assert [(r[0], r[2]) for r in claimed] == [(i, 1) for i in range(3, 11)]
    assert run(COMPLETE).rowcount == 1
    (failed,) = run(FAIL).fetchall()
    assert failed[:3] == (2, "queued", 1) and 19 < failed[3].total_seconds() <= 20
    run("UPDATE jobs SET locked_until = now() - interval '1 second' WHERE id = 3")
    assert run(REAP).fetchall() == [(3, "queued", 1)]
    assert run(EXTEND.replace("$1", "%s").replace("$2", "%s"), (4, 1)).rowcount == 1
    assert run(EXTEND.replace("$1", "%s").replace("$2", "%s"), (3, 1)).rowcount == 0
    assert run(PRUNE).rowcount == 0  # nothing is seven days old
    run("LISTEN jobs")
