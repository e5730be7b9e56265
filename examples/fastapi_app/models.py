"""The shop's tables: its orders, and the queue's table beside them in the same metadata."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Identity, Integer, MetaData, Table, Text

from sqla_jobq import jobs_table

metadata = MetaData()
jobs = jobs_table(metadata)
orders = Table(
    "orders",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    # The client's own key for the order: a second POST of it is refused.
    Column("reference", Text, nullable=False, unique=True),
    Column("email", Text, nullable=False),
    Column("total_cents", Integer, nullable=False),
    Column("receipt_job_id", BigInteger, nullable=False),
)
