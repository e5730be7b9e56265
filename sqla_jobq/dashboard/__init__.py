"""`jobq dashboard`: the queue in a browser, as an ASGI app (the `dashboard` extra).

Mount it in a Starlette or FastAPI host::

    from sqla_jobq import dashboard
    host.mount("/jobs", dashboard.app(engine, jobs))

`engine` is a sync SQLAlchemy Engine on the queue's database (reads and
actions run in a thread pool); give it ``pool_pre_ping=True`` so connections
the database dropped are replaced before a page notices. ``read_only=True``
removes every action; ``auth_token`` makes every request show the token.
"""

from __future__ import annotations

from .app import create_app as app

__all__ = ["app"]
