"""Tests that need no database: pure functions, parsing, compiled SQL."""
