"""The Jinja2 environment of the dashboard: templates shipped in the package,
autoescaping everything, and the few helpers the templates need.

Autoescape is on for every template, with no `|safe` anywhere: payloads, task
names and error texts come from the database, and a `<script>` in any of them
must show as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from starlette.requests import Request

NOTHING = "\u2013"  # an en dash where a value is missing


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("sqla_jobq.dashboard", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals["link"] = link
    env.filters.update(age=age, when=when, pretty=pretty, number=number, segment=segment)
    return env


@jinja2.pass_context
def link(
    context: jinja2.runtime.Context,
    name: str,
    query: Mapping[str, Any] | None = None,
    **path_params: Any,
) -> str:
    """`path_for` in templates, with the non-empty `query` parameters."""
    path = path_for(context["request"], name, **path_params)
    params = {k: v for k, v in (query or {}).items() if v is not None and v != ""}
    return f"{path}?{urlencode(params)}" if params else path


def path_for(request: Request, name: str, **path_params: Any) -> str:
    """The path (no scheme or host) of one of the dashboard's routes, under
    its mount prefix.

    Not `request.url_for`: in a host app, that resolves names with the host's
    router, which knows the dashboard's routes only by prefixed names. The
    dashboard's own app (``scope["app"]``) knows them, and ``root_path`` is
    where it is mounted.
    """
    own = request.app.url_path_for(name, **path_params)
    return f"{request.scope.get('root_path', '')}{own}"


def age(seconds: float | None) -> str:
    """A duration the way people read one: 45s, 3m 12s, 2h 5m, 3d 4h."""
    if seconds is None:
        return NOTHING
    whole = max(int(seconds), 0)
    if whole >= 86400:
        return f"{whole // 86400}d {whole % 86400 // 3600}h"
    if whole >= 3600:
        return f"{whole // 3600}h {whole % 3600 // 60}m"
    if whole >= 60:
        return f"{whole // 60}m {whole % 60}s"
    return f"{whole}s"


def when(moment: datetime | None) -> str:
    return NOTHING if moment is None else f"{moment:%Y-%m-%d %H:%M:%S %Z}".rstrip()


def number(count: int) -> str:
    return f"{count:,}"


def pretty(payload: Any) -> str:
    return json.dumps(payload, indent=2, ensure_ascii=False)


def segment(name: str) -> str:
    """A name (a queue's) as one path segment: every reserved character,
    `/` included, percent-encoded. The server decodes it before routing and
    the route takes the rest of the path, so the name arrives as it was."""
    return quote(name, safe="")
