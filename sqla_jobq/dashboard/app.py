"""Builds one dashboard: its routes, middleware and error pages, closed over
one `Dashboard` context (so a host app may mount several, one per table).

Routes are grouped by what they do, each group from its own module: pages
(read), actions (write; absent when read-only), health and metrics (probes),
login (only with a token). A view that needs schema the queue may not have
yet (live workers) arrives as another group, not as a branch inside these;
on such a table the overview leaves out its pause and limit columns.
"""

from __future__ import annotations

from sqlalchemy import Engine, Table
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from . import actions, auth, csrf, errors, health, metrics, pages, workers
from .context import Dashboard
from .render import environment
from .store import Store


def create_app(
    engine: Engine, table: Table, *, read_only: bool = False, auth_token: str | None = None
) -> Starlette:
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token must not be empty (pass None for no token)")
    dashboard = Dashboard(Store(engine, table), environment(), read_only, auth_token)
    routes: list[BaseRoute] = [
        *pages.routes(dashboard),
        *workers.routes(dashboard),
        *health.routes(dashboard),
        *metrics.routes(dashboard),
        Mount("/static", StaticFiles(packages=[("sqla_jobq.dashboard", "static")]), name="static"),
    ]
    middleware = [Middleware(csrf.CsrfCookie)]
    if not read_only:
        routes += actions.routes(dashboard)
    if auth_token is not None:
        routes += auth.routes(dashboard)
        middleware.append(Middleware(auth.TokenAuth, token=auth_token))
    return Starlette(
        routes=routes, middleware=middleware, exception_handlers=dict(errors.handlers(dashboard))
    )
