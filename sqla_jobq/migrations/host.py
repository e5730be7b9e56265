"""`jobq alembic-revision`: the queue's schema as one revision in a host app's own chain.

Why: a host that adds the shipped `sqla_jobq` branch to its version_locations
has two heads, so every `alembic revision` needs `--head`; and while the
queue's branch is its only head, `alembic revision` chains the app's revision
after the queue's and writes it into the installed package, where the next
pip upgrade deletes it. One ordinary revision in the app's linear chain that
calls `migrations.upgrade(version=N)`, N pinned (Oban's way), avoids both; a
later sqla_jobq that needs a newer schema is one more such revision.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError, coerce_resource_to_filename, rev_id

from .pins import pinned_version
from .refused import RevisionRefused
from .steps import LATEST

PACKAGE = Path(__file__).resolve().parents[1]
BRANCH_LOCATION = "sqla_jobq:migrations/versions"


@dataclass(frozen=True)
class HostRevision:
    """The app's revision that pins the queue's schema version.

    `written` is False when the chain already pinned this sqla_jobq's
    version: `path` is then that older revision and `previous == version`.
    """

    path: Path
    version: int
    previous: int
    written: bool


def write_host_revision(
    config_file: str = "alembic.ini", version_path: str | None = None, message: str | None = None
) -> HostRevision:
    """Write the revision bringing the queue from the app's last pin to `LATEST`."""
    with _alembic_errors():
        script = _app_scripts(config_file)
        if version_path is not None:
            _refuse_inside_package(Path(version_path), "--version-path")
        _refuse_several_heads(script)
        pin = _latest_pin(script)
        if pin is not None and pin.version >= LATEST:
            return pin
        previous = 0 if pin is None else pin.version
        path = _generate(script, version_path, message, previous)
    return HostRevision(path, LATEST, previous, written=True)


@contextmanager
def _alembic_errors() -> Iterator[None]:
    """Alembic's own refusals (a bad script_location, a --version-path that is
    not one of the app's version locations) become one line."""
    try:
        yield
    except (CommandError, RevisionError) as exc:
        first = str(exc).strip().splitlines()
        raise RevisionRefused(f"alembic: {first[0] if first else type(exc).__name__}") from None


def _app_scripts(config_file: str) -> ScriptDirectory:
    path = Path(config_file)
    if not path.is_file():
        raise RevisionRefused(
            f"no {config_file} in {Path.cwd()}: run this beside the app's alembic.ini "
            "(or pass --config); `alembic init migrations` creates one"
        )
    config = Config(path, cmd_opts=argparse.Namespace(quiet=True))
    script = ScriptDirectory.from_config(config)
    listed = config.get_main_option("version_locations") or ""
    if BRANCH_LOCATION in listed:
        raise RevisionRefused(
            f"{config_file} lists {BRANCH_LOCATION} in version_locations, so this app "
            "uses the shipped sqla_jobq branch: create your revisions with "
            "`alembic revision --head app@head` (the first one with `--head base "
            "--branch-label app --version-path DIR`) and run `alembic upgrade heads`"
        )
    where = f"a location in {config_file}"
    for location in [script.dir, *script.version_locations]:
        _refuse_inside_package(coerce_resource_to_filename(location), where)
    return script


def _refuse_inside_package(path: Path, what: str) -> None:
    if path.resolve().is_relative_to(PACKAGE):
        raise RevisionRefused(
            f"{what} points inside the installed sqla_jobq package ({PACKAGE}), where "
            "a pip upgrade would delete your revision: use the app's own versions folder"
        )


def _refuse_several_heads(script: ScriptDirectory) -> None:
    heads = script.get_heads()
    if len(heads) > 1:
        raise RevisionRefused(
            f"the app's Alembic chain has {len(heads)} heads ({', '.join(sorted(heads))}): "
            "merge them first (`alembic merge heads -m merge`), then run this again"
        )


def _latest_pin(script: ScriptDirectory) -> HostRevision | None:
    """The newest revision of the chain that pins the queue's version."""
    for revision in script.walk_revisions():
        path = Path(revision.path)
        version = pinned_version(path.read_text(encoding="utf-8"))
        if version is not None:
            return HostRevision(path, version, version, written=False)
    return None


def _generate(
    script: ScriptDirectory, version_path: str | None, message: str | None, previous: int
) -> Path:
    """Render the app's own `script.py.mako`, as `alembic revision` would,
    with the body filled in; refuse a template that drops the body."""
    created = script.generate_revision(
        rev_id(),
        message or f"sqla_jobq schema version {LATEST}",
        head="head",
        version_path=version_path,
        imports="from sqla_jobq import migrations",
        upgrades=(
            "# Pinned: this revision means the same after sqla_jobq is upgraded;\n"
            "    # a newer schema comes as a new revision (`jobq alembic-revision`).\n"
            f"    migrations.upgrade(version={LATEST})"
        ),
        downgrades=(
            "# Back to what the previous such revision pinned (0 drops the queue's tables).\n"
            f"    migrations.downgrade(version={previous})"
        ),
    )
    if created is None:
        raise RevisionRefused("alembic wrote a revision it cannot load back: check file_template")
    path = Path(created.path)
    if pinned_version(path.read_text(encoding="utf-8")) != LATEST:
        path.unlink()
        raise RevisionRefused(
            f"{Path(script.dir, 'script.py.mako')} does not render ${{upgrades}}, "
            "${downgrades} and ${imports} as `alembic init` writes them: nothing written"
        )
    return path
