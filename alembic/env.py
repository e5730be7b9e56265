"""Standalone environment: the queue's revisions live in the installed package."""

from sqla_jobq.migrations.environment import run

run()
