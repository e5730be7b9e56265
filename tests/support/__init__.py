"""Helpers shared by the test suite (and bench/soak.py), one copy each.

* `waiting`: `wait_until`, the polling helper;
* `queues`: create and drop a migrated queue table;
* `inprocess`: a real `Worker` on a thread of the test process;
* `processes`: the `jobq` script, `jobq worker faultapp:registry` processes and fleets;
* `faultqueue`: the fault suite's queue with its side table and audit trail;
* `cluster`: a throwaway PostgreSQL 15 cluster (initdb/pg_ctl as the postgres user);
* `pgbouncer`: a PgBouncer in transaction mode;
* `workerapp`, `faultapp`: the task apps `jobq worker` subprocesses import, run
  with this directory (`APP_DIR`) as their working directory.
"""

from __future__ import annotations

from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
"""Where `workerapp.py` and `faultapp.py` live: the cwd of `jobq worker workerapp:registry`."""
