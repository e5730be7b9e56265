"""`/workers`: the worker registry (schema step 5), stale workers flagged.

Its own route group, as `app` asks of views that need schema a queue table
may not have yet: on an older table the page says to migrate, and every
other page works as before.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from .context import Dashboard


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    async def workers(request: Request) -> Response:
        rows = await run_in_threadpool(dashboard.store.workers)
        return dashboard.page(request, "workers.html", workers=rows)

    return [Route("/workers", workers, methods=["GET"], name="workers")]
