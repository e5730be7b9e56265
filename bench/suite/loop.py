"""A minimal hand-written psycopg worker loop: the Python ceiling.

`python -m bench.suite.loop CONNINFO THREADS BATCH` drains the queue with THREADS
threads, each on its own autocommit connection with server-side prepared
statements: claim BATCH (the worker's own compiled claim statement), then
complete the claimed jobs in one fenced statement (the worker's own
`complete_many`), until a claim comes back empty. No handler, no logging, no
asyncio: two round trips per batch and as little Python as possible.
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta
from typing import Any

import psycopg

from sqla_jobq import jobs
from sqla_jobq.driver import Compiled
from sqla_jobq.statements import claim, complete_many


def drain(dsn: str, batch: int, claim_sql: Compiled, complete_sql: Compiled) -> None:
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        claim_params = claim_sql.params(limit=batch)
        while True:
            rows = conn.execute(claim_sql.sql, claim_params).fetchall()
            if not rows:
                return
            ids = [r[0] for r in rows]
            attempts = [r[4] for r in rows]
            done: list[Any] = conn.execute(
                complete_sql.sql, complete_sql.params(ids=ids, attempts=attempts)
            ).fetchall()
            if len(done) != len(rows):
                raise RuntimeError(f"completed {len(done)} of {len(rows)} claimed jobs")


def main(argv: list[str]) -> int:
    dsn, threads, batch = argv[0], int(argv[1]), int(argv[2])
    claim_sql = Compiled.of(claim(jobs, queue="default", lease=timedelta(minutes=5)))
    complete_sql = Compiled.of(complete_many(jobs, []))
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            drain(dsn, batch, claim_sql, complete_sql)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=guarded) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for exc in errors:
        print(f"bench.suite.loop: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
