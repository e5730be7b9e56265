"""What a worker imports to start: Alembic is for migrating, not for working.

Importing Alembic costs a sixth of `jobq worker`'s start-up, paid again by
every worker process, every CLI call, and every burst worker a scheduler
starts; the runtime schema check reads the version from the table's comment
and needs none of it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["sqla_jobq", "sqla_jobq.worker", "sqla_jobq.cli"])
def test_the_runtime_never_imports_alembic(module: str) -> None:
    probe = (
        f"import sys, {module}, sqla_jobq.errors, sqla_jobq.migrations.check; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('alembic', 'mako')))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert found == "[]"


def test_a_host_revision_still_finds_alembic_op_through_the_helpers() -> None:
    probe = (
        "import sqla_jobq.migrations as m, sys; "
        "assert 'alembic' not in sys.modules; "
        "assert m._op().__name__ == 'alembic.op'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
