"""procrastinate's side of `python -m bench.peers`: runs in procrastinate's own virtualenv.

Imports only procrastinate, psycopg and the standard library (never sqla_jobq).

* `procrastinate --app=procrastinate_app.app worker [--one-shot]`: the worker,
  procrastinate's defaults (concurrency 1, LISTEN/NOTIFY on).
* `python procrastinate_app.py bulk N`: N `echo` jobs (`{"n": i}`) in one
  `batch_defer_async` call; prints the seconds from the call to its return.
* `python procrastinate_app.py fill N`: the same with N `noop` jobs, untimed.
* `python procrastinate_app.py serve`: the pickup producer: for each seq read
  from stdin, `stamp.configure(connection=conn).defer_async(seq=...)` inside a
  transaction on our own connection, time.time() just before COMMIT and just
  after it returns; writes "seq before after" to stdout.

The database comes from `BENCH_DSN`; the `stamp` handler appends "seq time"
to the file `BENCH_STAMPS` as its first act.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import procrastinate
import psycopg

DSN = os.environ.get("BENCH_DSN", "")

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))


@app.task(name="noop")
async def noop() -> None:
    pass


@app.task(name="echo")
async def echo(n: int) -> None:
    pass


@app.task(name="stamp")
async def stamp(seq: int) -> None:
    now = time.time()
    with open(os.environ["BENCH_STAMPS"], "a") as f:
        f.write(f"{seq} {now:.6f}\n")


async def _bulk(n: int, task: str) -> float:
    async with app.open_async():
        started = time.perf_counter()
        if task == "echo":
            ids = await echo.batch_defer_async(*({"n": i} for i in range(n)))
        else:
            ids = await noop.batch_defer_async(*({} for _ in range(n)))
        elapsed = time.perf_counter() - started
    if len(ids) != n:
        raise RuntimeError(f"batch_defer_async returned {len(ids)} ids for {n} jobs")
    return elapsed


async def _serve() -> None:
    """One job per line of stdin (its seq); one line back: seq, before COMMIT, after."""
    async with app.open_async(), await psycopg.AsyncConnection.connect(DSN) as conn:
        while line := sys.stdin.readline():  # blocking: nothing else runs here
            seq = int(line)
            await stamp.configure(connection=conn).defer_async(seq=seq)
            before = time.time()
            await conn.commit()
            sys.stdout.write(f"{seq} {before:.6f} {time.time():.6f}\n")
            sys.stdout.flush()


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
