"""What every benchmark shares, by concern: the scratch database and its jobs
(`database`), worker subprocesses and /proc readers (`processes`), the
statistics and the results file (`stats`). Imported as `common.<name>`.

Nothing here is a test: these are measuring scripts. Every figure is taken
against a baseline measured in the same run, rounds interleaved, because the
machine is shared and absolute numbers drift.
"""

from .database import (
    FINISHED_COLUMNS,
    SERVER_URL,
    Bench,
    Outcome,
    Sizes,
    create_table,
    drop_table,
    fill,
    insert_ready,
    outcome,
    own_backend_pid,
    require_all_done,
    scratch_database,
    with_archive,
)
from .paths import REPO
from .processes import (
    CLK_TCK,
    PAGE,
    BackendCPU,
    Finished,
    backends_of,
    child_env,
    jobq_command,
    proc_cpu,
    proc_status,
    run_children,
    worker_command,
)
from .stats import dump_json, median, per_round, percentile, ratio, rotated

__all__ = [
    "CLK_TCK",
    "FINISHED_COLUMNS",
    "PAGE",
    "REPO",
    "SERVER_URL",
    "BackendCPU",
    "Bench",
    "Finished",
    "Outcome",
    "Sizes",
    "backends_of",
    "child_env",
    "create_table",
    "drop_table",
    "dump_json",
    "fill",
    "insert_ready",
    "jobq_command",
    "median",
    "outcome",
    "own_backend_pid",
    "per_round",
    "percentile",
    "proc_cpu",
    "proc_status",
    "ratio",
    "require_all_done",
    "rotated",
    "run_children",
    "scratch_database",
    "with_archive",
    "worker_command",
]
