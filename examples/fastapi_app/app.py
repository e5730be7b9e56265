"""A FastAPI shop: an order and its receipt job commit together, a worker runs
in the app's lifespan, the dashboard is mounted under /jobs.

    jobq migrate --database-url postgresql+psycopg://localhost/shop   # the queue's table
    DATABASE_URL=postgresql+psycopg://localhost/shop \
        uvicorn --factory examples.fastapi_app.app:from_env

(`orders` is created at start-up; a real app migrates it with Alembic.)

The worker here is an asyncio task of the web process: one process to deploy,
fine for a small shop. It shares the process's CPU and event loop with the
requests, and stops when the app does; for more traffic run workers as
processes of their own, ``jobq worker examples.fastapi_app.tasks:registry``,
and create the app with ``run_worker=False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy import create_engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from sqla_jobq import JobCancelled, JobFailed, wait_for_async
from sqla_jobq.statements import job_outcome
from sqla_jobq.worker import Worker, WorkerOptions

from .models import jobs, metadata, orders
from .tasks import registry, send_receipt

# How long `GET /orders/{id}?wait=1` waits for the receipt.
WAIT_SECONDS = 10.0


class NewOrder(BaseModel):
    reference: str
    email: str
    total_cents: int


def create_app(database_url: str, *, run_worker: bool = True) -> FastAPI:
    """The app on `database_url` (postgresql+psycopg://...), with its worker unless told not."""
    engine = create_async_engine(database_url)
    # The dashboard reads through a sync engine, in a thread pool.
    dashboard_engine = create_engine(database_url, pool_pre_ping=True)
    worker = None
    if run_worker:
        worker = Worker(registry, WorkerOptions(database_url=database_url, concurrency=4))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all, tables=[orders])
        running = None if worker is None else asyncio.create_task(worker.run(handle_signals=False))
        try:
            yield
        finally:
            if worker is not None and running is not None:
                worker.stop()  # it finishes or hands back what it holds, then returns
                await running
            await engine.dispose()
            dashboard_engine.dispose()

    app = FastAPI(lifespan=lifespan)
    _routes(app, engine)
    with contextlib.suppress(ImportError):  # without the `dashboard` extra, no dashboard
        from sqla_jobq import dashboard

        app.mount("/jobs", dashboard.app(dashboard_engine, jobs))
    return app


def _routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post("/orders", status_code=201)
    async def create_order(order: NewOrder) -> dict[str, int]:
        """The order and its receipt job in one transaction: both or neither."""
        try:
            async with engine.begin() as conn:
                job_id = await send_receipt.enqueue(conn, **order.model_dump())
                inserted = orders.insert().values(**order.model_dump(), receipt_job_id=job_id)
                order_id = (await conn.execute(inserted.returning(orders.c.id))).scalar_one()
        except IntegrityError:  # rolled back: the receipt job is gone with the order
            raise HTTPException(409, f"order {order.reference!r} exists already") from None
        return {"id": order_id, "receipt_job_id": job_id}

    @app.get("/orders/{order_id}")
    async def get_order(order_id: int, wait: bool = False) -> dict[str, Any]:
        """The order and its receipt job; with `?wait=1`, once the job has ended
        (or `WAIT_SECONDS` have passed)."""
        order = await _order(engine, order_id)
        if wait:
            with contextlib.suppress(JobFailed, JobCancelled, TimeoutError, LookupError):
                job_id = order["receipt_job_id"]
                await wait_for_async(engine, job_id, timeout=WAIT_SECONDS, table=jobs)
            order = await _order(engine, order_id)
        return order


async def _order(engine: AsyncEngine, order_id: int) -> dict[str, Any]:
    """The order and its receipt job's outcome, which `job_outcome` finds in the
    jobs table or, once a worker has moved it there, in the archive (a pruned
    job reads as None)."""
    async with engine.connect() as conn:
        found = (await conn.execute(select(orders).where(orders.c.id == order_id))).mappings()
        order = found.first()
        if order is None:
            raise HTTPException(404, f"no order {order_id}")
        outcome = (await conn.execute(job_outcome(jobs, order["receipt_job_id"]))).first()
    status, result, error = outcome if outcome is not None else (None, None, None)
    return {**order, "receipt": {"status": status, "result": result, "error": error}}


def from_env() -> FastAPI:
    """The app on `DATABASE_URL`, for ``uvicorn --factory``."""
    return create_app(os.environ["DATABASE_URL"])
