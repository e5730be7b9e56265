"""Database URLs and connections: one place that turns what a user typed into
a SQLAlchemy URL or a psycopg conninfo, and connection failures into one line.
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

_SCHEMES = {"postgres", "postgresql", "postgresql+psycopg"}


class BadDatabaseURL(ValueError):
    """The URL is not a PostgreSQL URL this package can use."""


def parse_url(url: str) -> URL:
    """A `postgresql+psycopg` URL from any of the spellings users type."""
    try:
        parsed = make_url(url.strip())
    except ArgumentError:
        raise BadDatabaseURL(
            f"not a database URL: {url!r} (expected postgresql://user@host:port/dbname)"
        ) from None
    if parsed.drivername not in _SCHEMES:
        raise BadDatabaseURL(
            f"unsupported database URL scheme {parsed.drivername!r}: sqla_jobq needs "
            "PostgreSQL (postgresql:// or postgresql+psycopg://)"
        )
    return parsed.set(drivername="postgresql+psycopg")


def sqlalchemy_url(url: str) -> str:
    return parse_url(url).render_as_string(hide_password=False)


def conninfo(url: str) -> str:
    """The same URL as a libpq conninfo string for a raw psycopg connection."""
    return parse_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
