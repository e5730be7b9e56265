"""Crash-consistency scenarios: real `jobq worker` processes under faults."""
