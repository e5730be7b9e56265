"""A small FastAPI shop whose orders get their receipts from sqla_jobq (see app.py)."""
