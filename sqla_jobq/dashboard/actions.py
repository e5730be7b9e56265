"""What an operator can change: retry a failed or cancelled job, cancel a
queued or running one, retry every failed job matching a filter, and pause or
resume a queue.

Registered only when the dashboard is not read-only, so in read-only mode
these paths do not exist (404/405) rather than refuse. Every change is a POST
under ``/actions/`` carrying the CSRF token, and runs the package's own
statement builders (`statements.retry`, `statements.cancel`,
`statements.retry_many`, `queue_statements.pause` and `resume`), so the
dashboard changes a job or a queue exactly as ``jobq retry``, ``jobq cancel``
and ``jobq pause`` do.

A queue's name travels percent-encoded in its action's path (see
`render.segment`), so any name (slashes, spaces, ``?``) reaches the route whole.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from .context import Dashboard
from .csrf import verified_form
from .filters import JobFilter, number
from .render import path_for


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    store = dashboard.store

    async def refuse(job_id: int, action: str) -> HTTPException:
        row = await run_in_threadpool(store.job, job_id) if job_id < 2**63 else None
        if row is None:
            return HTTPException(404, f"no job {job_id} in {store.table.fullname}")
        if row.archived_at is not None:
            what = f"archived ({row.status}, kept as history)"
            return HTTPException(409, f"job {job_id} is {what}: it cannot be {action}")
        return HTTPException(409, f"job {job_id} is {row.status}: it cannot be {action}")

    async def retry(request: Request) -> Response:
        await verified_form(request)
        job_id: int = request.path_params["job_id"]
        if job_id >= 2**63 or not await run_in_threadpool(store.retry, job_id):
            raise await refuse(job_id, "retried (only a failed or cancelled job can)")
        return RedirectResponse(path_for(request, "job", job_id=job_id), status_code=303)

    async def cancel(request: Request) -> Response:
        await verified_form(request)
        job_id: int = request.path_params["job_id"]
        if job_id >= 2**63 or not await run_in_threadpool(store.cancel, job_id):
            raise await refuse(job_id, "cancelled (only a queued or running job can)")
        return RedirectResponse(path_for(request, "job", job_id=job_id), status_code=303)

    async def confirm_bulk_retry(request: Request) -> Response:
        flt = JobFilter.from_params(request.query_params).failed()
        count, upto = await run_in_threadpool(store.failed_summary, flt)
        return dashboard.page(request, "confirm.html", filter=flt, count=count, upto=upto)

    async def bulk_retry(request: Request) -> Response:
        form = await verified_form(request)
        fields = {key: value for key, value in form.items() if isinstance(value, str)}
        flt = JobFilter.from_params(fields).failed()
        upto = number("upto", fields.get("upto"))
        expected = number("expected", fields.get("expected"))
        retried = await run_in_threadpool(store.bulk_retry, flt, upto)
        return dashboard.page(
            request, "retried.html", filter=flt, count=retried, left=max(expected - retried, 0)
        )

    async def pause(request: Request) -> Response:
        await verified_form(request)
        await run_in_threadpool(store.pause, request.path_params["queue"])
        return RedirectResponse(path_for(request, "overview"), status_code=303)

    async def resume(request: Request) -> Response:
        await verified_form(request)
        await run_in_threadpool(store.resume, request.path_params["queue"])
        return RedirectResponse(path_for(request, "overview"), status_code=303)

    return [
        Route("/bulk-retry", confirm_bulk_retry, methods=["GET"], name="confirm_bulk_retry"),
        Route("/actions/jobs/{job_id:int}/retry", retry, methods=["POST"], name="retry"),
        Route("/actions/jobs/{job_id:int}/cancel", cancel, methods=["POST"], name="cancel"),
        Route("/actions/bulk-retry", bulk_retry, methods=["POST"], name="bulk_retry"),
        Route("/actions/queues/{queue:path}/pause", pause, methods=["POST"], name="pause"),
        Route("/actions/queues/{queue:path}/resume", resume, methods=["POST"], name="resume"),
    ]
