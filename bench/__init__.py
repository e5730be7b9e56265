"""Benchmarks of sqla_jobq against the local PostgreSQL: `python -m bench`.

Scripts, not tests. Each figure is the median of several rounds, rounds
interleaved, and every figure is reported against a baseline measured in the
same run (the machine is shared; absolute numbers drift, ratios much less).
"""
