"""What every route of one dashboard shares: its store, its templates, and
the options it was built with. Routes close over one instance of it, so two
dashboards (two queue tables) can live in one host app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from .store import Store


@dataclass(frozen=True)
class Dashboard:
    store: Store
    env: jinja2.Environment
    read_only: bool
    auth_token: str | None

    def page(
        self, request: Request, template: str, status_code: int = 200, **values: Any
    ) -> HTMLResponse:
        """A rendered page; templates get the request, the CSRF token and the options."""
        html = self.env.get_template(template).render(
            request=request,
            csrf_token=request.state.csrf_token,
            actions=not self.read_only,
            login=self.auth_token is not None,
            table=self.store.table.fullname,
            **values,
        )
        return HTMLResponse(html, status_code)
