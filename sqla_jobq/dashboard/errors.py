"""Errors as pages: a database that went away is a 503 page that says so,
never a traceback; bad input is one line on a 400 page.

Nothing is kept from a failed request: the engine drops a connection that
died, so the next request after the database is back simply works.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..errors import describe_connection_error
from .context import Dashboard
from .filters import BadRequest
from .store import Refused

DATABASE_ERRORS: tuple[type[Exception], ...] = (DBAPIError, PoolTimeout, psycopg.Error)

_TITLES = {400: "Bad request", 403: "Forbidden", 404: "Not found", 405: "Method not allowed"}


def handlers(dashboard: Dashboard) -> Mapping[Any, Any]:
    async def database_error(request: Request, exc: Exception) -> Response:
        return dashboard.page(
            request,
            "error.html",
            503,
            title="Database unavailable",
            message=describe_connection_error(exc),
            hint="The dashboard reconnects by itself once the database answers: reload then.",
        )

    async def bad_request(request: Request, exc: Exception) -> Response:
        return dashboard.page(
            request, "error.html", 400, title=_TITLES[400], message=str(exc), hint=""
        )

    async def refused(request: Request, exc: Exception) -> Response:
        return dashboard.page(
            request, "error.html", 409, title="Refused", message=str(exc), hint=""
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        response = dashboard.page(
            request,
            "error.html",
            exc.status_code,
            title=_TITLES.get(exc.status_code, "Refused"),
            message=exc.detail,
            hint="",
        )
        response.headers.update(exc.headers or {})
        return response

    database: dict[Any, Any] = dict.fromkeys(DATABASE_ERRORS, database_error)
    return {**database, BadRequest: bad_request, Refused: refused, HTTPException: http_error}
