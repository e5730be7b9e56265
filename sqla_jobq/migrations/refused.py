"""The error `jobq alembic-revision` reports (internal).

In a module of its own so the CLI's table of user errors can name it without
importing Alembic, which `host` needs and a worker's start-up does not.
"""

from __future__ import annotations


class RevisionRefused(ValueError):
    """`jobq alembic-revision` cannot write a revision here; the message says why."""
