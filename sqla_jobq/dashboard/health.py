"""`/healthz`: 200 while the database answers, 503 while it does not.

Plain text and one query (`SELECT 1`), cheap enough for a load balancer to
call every few seconds; it does not touch the queue table.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ..errors import describe_connection_error
from .context import Dashboard
from .errors import DATABASE_ERRORS


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    async def healthz(request: Request) -> Response:
        try:
            await run_in_threadpool(dashboard.store.ping)
        except DATABASE_ERRORS as exc:
            return PlainTextResponse(f"{describe_connection_error(exc)}\n", status_code=503)
        return PlainTextResponse("ok\n")

    return [Route("/healthz", healthz, methods=["GET"], name="healthz")]
