"""pgqueuer's side of `python -m bench.peers`: runs in pgqueuer's own virtualenv.

Imports only pgqueuer, asyncpg and the standard library (never sqla_jobq).

* `pgq run pgqueuer_app:factory [--mode drain]`: the worker, pgqueuer's
  defaults (one QueueManager on one asyncpg connection, batch size 10, no
  concurrency cap, log level INFO).
* `python pgqueuer_app.py bulk N`: enqueue N `echo` jobs (payload `{"n": i}`)
  in one `Queries.enqueue` call; prints the seconds from the call to its return
  (one statement, so its own transaction).
* `python pgqueuer_app.py fill N`: the same with N `noop` jobs, untimed.
* `python pgqueuer_app.py serve`: the pickup producer. For each seq read from
  stdin: open a transaction, enqueue one `stamp` job through `Queries.enqueue`,
  take time.time() just before COMMIT and just after it returns; writes
  "seq before after" to stdout.

The database comes from `BENCH_DSN`; the `stamp` handler appends
"seq time" to the file `BENCH_STAMPS` as its first act.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from pgqueuer import AsyncpgDriver, Queries, QueueManager
from pgqueuer.models import Job

DSN = os.environ.get("BENCH_DSN", "")


@asynccontextmanager
async def factory() -> AsyncIterator[QueueManager]:
    conn = await asyncpg.connect(DSN)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("noop")
    async def noop(job: Job) -> None:
        pass

    @qm.entrypoint("echo")
    async def echo(job: Job) -> None:
        pass

    @qm.entrypoint("stamp")
    async def stamp(job: Job) -> None:
        now = time.time()
        seq = json.loads(job.payload or b"{}")["seq"]
        with open(os.environ["BENCH_STAMPS"], "a") as f:
            f.write(f"{seq} {now:.6f}\n")

    try:
        yield qm
    finally:
        await conn.close()


async def _bulk(n: int, task: str) -> float:
    conn = await asyncpg.connect(DSN)
    try:
        queries = Queries(AsyncpgDriver(conn))
        started = time.perf_counter()
        if task == "echo":
            payloads: list[bytes | None] = [json.dumps({"n": i}).encode() for i in range(n)]
        else:
            payloads = [None] * n
        ids = await queries.enqueue([task] * n, payloads, [0] * n)
        elapsed = time.perf_counter() - started
    finally:
        await conn.close()
    if len(ids) != n:
        raise RuntimeError(f"enqueue returned {len(ids)} ids for {n} jobs")
    return elapsed


async def _serve() -> None:
    """One job per line of stdin (its seq); one line back: seq, before COMMIT, after."""
    conn = await asyncpg.connect(DSN)
    try:
        queries = Queries(AsyncpgDriver(conn))
        while line := sys.stdin.readline():  # blocking: nothing else runs here
            seq = int(line)
            tr = conn.transaction()
            await tr.start()
            await queries.enqueue("stamp", json.dumps({"seq": seq}).encode())
            before = time.time()
            await tr.commit()
            sys.stdout.write(f"{seq} {before:.6f} {time.time():.6f}\n")
            sys.stdout.flush()
    finally:
        await conn.close()


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "bulk":
        print(json.dumps({"seconds": asyncio.run(_bulk(int(argv[1]), "echo"))}))
    elif cmd == "fill":
        asyncio.run(_bulk(int(argv[1]), "noop"))
    elif cmd == "serve":
        asyncio.run(_serve())
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
