"""The test suite: unit/ (no database), db/ (real PostgreSQL), faults/ (crashes,
restarts, poolers), support/ (shared helpers, imported explicitly)."""
