"""The shop's tasks. No FastAPI here: `jobq worker examples.fastapi_app.tasks:registry`
and the tests import this module alone."""

from __future__ import annotations

from sqla_jobq import Registry

from .models import jobs

registry = Registry(jobs)


class Outbox:
    """Stands in for a mail service: keeps what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    async def send(self, to: str, text: str) -> None:
        self.sent.append((to, text))


outbox = Outbox()


@registry.task(name="send_receipt", queue="receipts", max_attempts=5)
async def send_receipt(reference: str, email: str, total_cents: int) -> dict[str, str]:
    """Mail the receipt; what it returns is stored with the job (`GET /orders/{id}` shows it)."""
    text = f"Order {reference}: {total_cents / 100:.2f} EUR. Thank you!"
    await outbox.send(email, text)
    return {"to": email, "text": text}
