"""CSRF protection for the dashboard's POST forms: a double-submit cookie.

A dashboard on 127.0.0.1 with no token is exactly what a hostile page in the
operator's browser can POST to. Every response carries a random token in a
SameSite=Strict, HttpOnly cookie; every form repeats it in a hidden field;
an action runs only when the two match. Another site can make the browser
send the cookie (or, with SameSite, not even that) but cannot read it to put
it in the form. It needs no server-side state, so it works across processes
and under any mount prefix.
"""

from __future__ import annotations

import hmac
import secrets

from starlette.datastructures import FormData, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "jobq_csrf"
FIELD = "csrf_token"
_TOKEN_LENGTH = 43  # secrets.token_urlsafe(32)


def cookie_header(name: str, value: str, scope: Scope, max_age: int | None = None) -> str:
    """A Set-Cookie value scoped to the dashboard's own path (its mount prefix)."""
    path = scope.get("root_path") or "/"
    parts = [f"{name}={value}", f"Path={path}", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if scope.get("scheme") == "https":
        parts.append("Secure")
    return "; ".join(parts)


class CsrfCookie:
    """ASGI middleware: makes sure the browser holds a token, and exposes it
    to templates as ``request.state.csrf_token``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = HTTPConnection(scope).cookies.get(COOKIE, "")
        fresh = not _well_formed(held)
        token = secrets.token_urlsafe(32) if fresh else held
        scope.setdefault("state", {})["csrf_token"] = token

        async def send_with_cookie(message: Message) -> None:
            if fresh and message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(
                    "set-cookie", cookie_header(COOKIE, token, scope)
                )
            await send(message)

        await self.app(scope, receive, send_with_cookie)


def _well_formed(token: str) -> bool:
    bare = token.replace("-", "").replace("_", "")
    return len(token) == _TOKEN_LENGTH and bare.isascii() and bare.isalnum()


def same(given: str, expected: str) -> bool:
    """Constant-time equality of two strings (any characters)."""
    return hmac.compare_digest(given.encode(), expected.encode())


async def verified_form(request: Request) -> FormData:
    """The POSTed form, once its token matches the cookie; 403 otherwise."""
    form = await request.form()
    sent = form.get(FIELD)
    held = request.cookies.get(COOKIE, "")
    if not (isinstance(sent, str) and held and same(sent, held)):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and submit again")
    return form
