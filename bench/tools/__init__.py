"""Standalone tools, each run alone: `python -m bench.tools.profile`, `.breakdown`, `.soak`."""
