"""`--auth-token`: every request shows the token, or is turned away.

Two ways to show it: ``Authorization: Bearer TOKEN`` (scrapers, scripts), or a
session cookie set by the login form (browsers). The cookie holds an HMAC of
the token, not the token, so a cookie that leaks does not reveal what to type
into another dashboard's login form. Every comparison is constant-time.
Only the login form and the stylesheet are open without it.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlencode

from starlette.requests import HTTPConnection, Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .context import Dashboard
from .csrf import cookie_header, same, verified_form
from .render import path_for

SESSION_COOKIE = "jobq_session"
SESSION_SECONDS = 7 * 86400


def session_value(token: str) -> str:
    return hmac.new(token.encode(), b"sqla_jobq dashboard session", hashlib.sha256).hexdigest()


def _route_path(scope: Scope) -> str:
    """The path inside the dashboard, without its mount prefix."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class TokenAuth:
    """ASGI middleware: admit requests that show the token, refuse the rest."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token
        self.session = session_value(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._admitted(scope):
            await self.app(scope, receive, send)
            return
        await _refusal(Request(scope))(scope, receive, send)

    def _admitted(self, scope: Scope) -> bool:
        path = _route_path(scope)
        if path == "/login" or path.startswith("/static/"):
            return True
        conn = HTTPConnection(scope)
        scheme, _, given = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and same(given.strip(), self.token):
            return True
        return same(conn.cookies.get(SESSION_COOKIE, ""), self.session)


def _refusal(request: Request) -> Response:
    """Browsers asking for a page go to the login form; anything else gets 401."""
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        target = f"{path_for(request, 'login')}?{urlencode({'next': here})}"
        return RedirectResponse(target, status_code=303)
    return PlainTextResponse(
        "authentication required: send Authorization: Bearer TOKEN",
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _next_page(request: Request, wanted: str | None) -> str:
    """Where to go after logging in: a path under the dashboard, never another site."""
    root = request.scope.get("root_path", "")
    if wanted and wanted.startswith(f"{root}/") and not _elsewhere(wanted):
        return wanted
    return path_for(request, "overview")


def _elsewhere(path: str) -> bool:
    """`//host` and `/\\host` are other sites to a browser."""
    return path.startswith("//") or "\\" in path


def routes(dashboard: Dashboard) -> list[BaseRoute]:
    token = dashboard.auth_token or ""

    async def login_form(request: Request) -> Response:
        return dashboard.page(request, "login.html", next=request.query_params.get("next", ""))

    async def login(request: Request) -> Response:
        form = await verified_form(request)
        given, wanted = form.get("token"), form.get("next")
        if not (isinstance(given, str) and same(given, token)):
            return dashboard.page(
                request, "login.html", 401, next=wanted or "", error="wrong token"
            )
        target = _next_page(request, wanted if isinstance(wanted, str) else None)
        response = RedirectResponse(target, status_code=303)
        cookie = cookie_header(
            SESSION_COOKIE, session_value(token), request.scope, max_age=SESSION_SECONDS
        )
        response.headers.append("set-cookie", cookie)
        return response

    async def logout(request: Request) -> Response:
        await verified_form(request)
        response = RedirectResponse(path_for(request, "login"), status_code=303)
        response.headers.append(
            "set-cookie", cookie_header(SESSION_COOKIE, "", request.scope, max_age=0)
        )
        return response

    return [
        Route("/login", login_form, methods=["GET"], name="login"),
        Route("/login", login, methods=["POST"], name="login_submit"),
        Route("/logout", logout, methods=["POST"], name="logout"),
    ]
