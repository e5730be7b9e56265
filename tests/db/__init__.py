"""Tests against a real PostgreSQL (the session database of tests/conftest.py)."""
