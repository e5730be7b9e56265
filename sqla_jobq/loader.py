"""`MODULE:ATTR` to a Registry, for the command line (internal): `jobq worker`,
`jobq enqueue --app` and `jobq cron` name the app's Registry this way."""

from __future__ import annotations

import importlib
import os
import sys

from . import periodic
from .errors import UsageError
from .registry import Registry


def load_registry(spec: str) -> Registry:
    """Import `MODULE:ATTR` and return the Registry it names."""
    # Like uvicorn and celery: `jobq worker app.tasks:registry` run from the
    # project directory finds `app` without installing it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:ATTR naming a Registry, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import module {module_name!r}: {exc}") from None
    except periodic.InvalidSchedule as exc:
        raise UsageError(f"cannot load {spec}: {exc}") from None
    found = getattr(module, attr, None)
    if not isinstance(found, Registry):
        what = "nothing" if found is None else type(found).__name__
        raise UsageError(f"{spec} is {what}, not a sqla_jobq Registry")
    return found
