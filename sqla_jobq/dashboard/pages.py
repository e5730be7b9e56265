"""The pages a GET shows: overview (with each queue's pause state and limit),
job list, job detail.

They only read. Each hands its blocking store call to a worker thread and
renders the result; database errors travel up to the app's error handler,
which answers 503 with a page that says so.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from .chart import throughput_chart
from .context import Dashboard
from .filters import LIST_STATUSES, Cursor, JobFilter


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    store = dashboard.store

    async def overview(request: Request) -> Response:
        view = await run_in_threadpool(store.overview)
        return dashboard.page(
            request,
            "overview.html",
            queues=view.queues,
            settings=view.settings,
            chart=throughput_chart(view.minutes),
        )

    async def jobs(request: Request) -> Response:
        flt = JobFilter.from_params(request.query_params)
        cursor = Cursor.from_params(request.query_params)
        page = await run_in_threadpool(store.page, flt, cursor)
        limit = None if cursor.limit == Cursor().limit else cursor.limit
        return dashboard.page(
            request,
            "jobs.html",
            filter=flt,
            statuses=LIST_STATUSES,
            page=page,
            limit=limit,
        )

    async def job(request: Request) -> Response:
        job_id: int = request.path_params["job_id"]
        row = await run_in_threadpool(store.job, job_id) if job_id < 2**63 else None
        if row is None:
            raise HTTPException(404, f"no job {job_id} in {store.table.fullname}")
        return dashboard.page(request, "job.html", job=row)

    return [
        Route("/", overview, methods=["GET"], name="overview"),
        Route("/jobs", jobs, methods=["GET"], name="jobs"),
        Route("/jobs/{job_id:int}", job, methods=["GET"], name="job"),
    ]
