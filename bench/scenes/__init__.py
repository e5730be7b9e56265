"""Scenes: sqla_jobq under conditions a production queue meets, each on a throwaway cluster.

    python -m bench.scenes held-snapshot   # about 8 minutes
    python -m bench.scenes bloat-at-peak   # about 3.5 minutes
    python -m bench.scenes many-workers    # about 3 minutes
    python -m bench.scenes claim-probe     # about 1 minute: why a held snapshot slows claims
    python -m bench.scenes held-snapshot --minutes 0.1   # smoke run, under a minute
    python -m bench.scenes held-snapshot --offered 2020  # a fixed load, not half the saturated rate

Each scene bounds its own time and stops by itself, prints a table, and writes
its samples to bench/results/scene-<name>.json.
"""
