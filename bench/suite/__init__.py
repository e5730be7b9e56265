"""The benchmark suite: `python -m bench` runs every figure here (see runner.py)."""
