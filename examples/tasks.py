"""Example tasks for `jobq worker examples.tasks:registry`."""

from __future__ import annotations

import asyncio
import logging
import time

from sqla_jobq import Registry, current_job

registry = Registry()
log = logging.getLogger("examples")


@registry.task(name="send_welcome_email")
def send_welcome_email(user_id: int, address: str) -> None:
    """Pretend to talk to an SMTP server."""
    time.sleep(0.05)
    log.info("welcome mail to %s (user %d), attempt %d", address, user_id, current_job().attempts)


@registry.task(name="resize_image", queue="media")
async def resize_image(path: str, width: int = 640) -> None:
    await asyncio.sleep(0.1)
    log.info("resized %s to %dpx", path, width)


@registry.task(name="flaky", max_attempts=3)
def flaky(n: int) -> None:
    """Fails its first attempt, to show retries with backoff."""
    if current_job().attempts < 2:
        raise RuntimeError(f"transient failure for n={n}")
