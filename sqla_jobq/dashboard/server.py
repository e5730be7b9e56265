"""`jobq dashboard`: the app on its own engine, served by uvicorn.

The socket is bound here, before uvicorn starts, so a port already taken or a
host that does not resolve is one line from the CLI rather than a log record
and an exit from inside the server.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

import uvicorn
from sqlalchemy import Engine, Table, create_engine

from ..errors import UsageError
from ..migrations.check import check_schema
from .app import create_app

APPLICATION_NAME = "jobq dashboard"


def dashboard_engine(url: str) -> Engine:
    """A small pool that checks a connection before lending it (one cheap
    round trip), so a database restart costs no request an error page."""
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=4,
        max_overflow=4,
        pool_timeout=10,
        connect_args={"application_name": APPLICATION_NAME, "connect_timeout": 5},
    )


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"cannot listen on {host}:{port}: {reason}") from None


def _loopback(sock: socket.socket) -> bool:
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def serve(
    url: str,
    table: Table,
    *,
    host: str,
    port: int,
    read_only: bool,
    auth_token: str | None,
    announce: Callable[[str], object],
) -> None:
    """Check the schema, bind, then serve until interrupted."""
    if auth_token is not None and not auth_token:
        raise UsageError("--auth-token must not be empty")
    engine = dashboard_engine(url)
    try:
        with engine.connect() as conn:
            check_schema(conn, table)
        sock = bind(host, port)
        app = create_app(engine, table, read_only=read_only, auth_token=auth_token)
        shown = f"[{host}]" if ":" in host else host
        mode = ", read-only" if read_only else ""
        announce(f"jobq dashboard on http://{shown}:{port}/ (table {table.fullname}{mode})")
        if auth_token is None and not read_only and not _loopback(sock):
            announce("warning: anyone who reaches this address can change jobs: pass --auth-token")
        config = uvicorn.Config(app, log_level="warning", proxy_headers=False)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.dispose()
