"""A host app's own Alembic project, run the way its developers run it.

Each test is a scratch app made by `alembic init`, with an `orders` model and
our `include_object`, working in a PostgreSQL schema of its own in the test
database (its `search_path`), so its tables and `alembic_version` are its own.
Every `alembic` and `jobq` command is a real subprocess. Path 1: one revision
per queue upgrade in the app's linear chain (`jobq alembic-revision`). Path 2:
the shipped `sqla_jobq` branch beside a branch of the app's own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

import sqla_jobq
from sqla_jobq.db import parse_url
from sqla_jobq.migrations.steps import LATEST
from sqla_jobq.schema import parse_version_comment

PACKAGE_VERSIONS = Path(sqla_jobq.__file__).resolve().parent / "migrations" / "versions"
# The package's own steps are named NNNN_*.py; Alembic names a revision it
# generates after a 12-hex-digit id.
PACKAGE_STEP = re.compile(r"^\d{4}_")

MODELS = """
    from sqlalchemy import Column, Integer, MetaData, Table, Text

    metadata = MetaData()
    orders = Table(
        "orders",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("item", Text, nullable=False),
    )
"""

ENV = """
    import os

    from alembic import context
    from sqlalchemy import create_engine, pool

    from models import metadata
    from sqla_jobq.migrations import include_object

    engine = create_engine(os.environ["APP_DATABASE_URL"], poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection, target_metadata=metadata, include_object=include_object
        )
        with context.begin_transaction():
            context.run_migrations()
"""


def pinned_revision(revision: str, down: str | None, up: int, down_to: int, **table: str) -> str:
    """A revision written by hand, as the README shows (an app on an older sqla_jobq)."""
    options = "".join(f", {key}={value!r}" for key, value in table.items())
    return f"""
        from sqla_jobq import migrations

        revision = {revision!r}
        down_revision = {down!r}
        branch_labels = None
        depends_on = None


        def upgrade() -> None:
            migrations.upgrade(version={up}{options})


        def downgrade() -> None:
            migrations.downgrade(version={down_to}{options})
    """


def write(path: Path, content: str) -> None:
    path.write_text(textwrap.dedent(content).lstrip())


def beside(script: str) -> str:
    """The console script installed beside this interpreter (`alembic`, `jobq`)."""
    path = Path(sys.executable).with_name(script)
    return str(path) if path.exists() else script


def run(cwd: Path, line: str, url: str = "") -> subprocess.CompletedProcess[str]:
    """Run a command line as typed in a shell in the app's directory."""
    program, *args = shlex.split(line)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBQ_")}
    env["APP_DATABASE_URL"] = url
    return subprocess.run(
        [beside(program), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def succeeds(cwd: Path, line: str, url: str = "") -> str:
    done = run(cwd, line, url)
    assert done.returncode == 0, f"{line}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@dataclass(frozen=True)
class App:
    """The scratch app's directory and the URL its env.py connects with."""

    root: Path
    url: str
    schema: str

    def run(self, line: str) -> str:
        """Run a command that must succeed; its output."""
        return succeeds(self.root, line, self.url)

    def versions(self) -> set[Path]:
        return set((self.root / "migrations" / "versions").glob("*.py"))

    def new_revision(self, line: str) -> str:
        """Run a command that must write one revision to the app's versions folder; its text."""
        before = self.versions()
        self.run(line)
        (added,) = self.versions() - before
        return added.read_text()


def package_revisions() -> set[str]:
    return {p.name for p in PACKAGE_VERSIONS.glob("*.py")}


def assert_nothing_written_into_package(before: set[str]) -> None:
    strangers = {name for name in package_revisions() - before if not PACKAGE_STEP.match(name)}
    assert strangers == set()


def queue_version(raw: psycopg.Connection[Any], app: App) -> int | None:
    """The queue table's schema version in the app's schema (None: no table)."""
    row = raw.execute(
        "SELECT obj_description(to_regclass(%s), 'pg_class')", [f"{app.schema}.jobs"]
    ).fetchone()
    assert row is not None
    return parse_version_comment(row[0])


@pytest.fixture(scope="module")
def initialized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`alembic init migrations`, once: each test copies it."""
    project = tmp_path_factory.mktemp("init")
    succeeds(project, "alembic init migrations")
    return project


@pytest.fixture
def app(
    initialized: Path, tmp_path: Path, database_url: str, raw: psycopg.Connection[Any]
) -> Iterator[App]:
    """The scratch app: its models, an env.py with include_object, a schema of its own."""
    root = tmp_path / "app"
    shutil.copytree(initialized, root)
    write(root / "models.py", MODELS)
    write(root / "migrations" / "env.py", ENV)
    schema = f"app_{uuid.uuid4().hex[:10]}"
    raw.execute(f'CREATE SCHEMA "{schema}"')
    url = parse_url(database_url).update_query_dict({"options": f"-csearch_path={schema}"})
    yield App(root, url.render_as_string(hide_password=False), schema)
    raw.execute(f'DROP SCHEMA "{schema}" CASCADE')


def revision_id(source: str) -> str:
    match = re.search(r"^revision: str = '(\w+)'", source, re.MULTILINE)
    assert match is not None
    return match[1]


def operations(source: str) -> str:
    """The bodies of `upgrade()` and `downgrade()`."""
    return source.split("def upgrade()", 1)[1]


# --- path 1: one revision per queue upgrade, in the app's own chain -----------------


def test_jobq_revision_brings_the_queue_into_a_linear_chain_autogenerate_keeps_off(
    app: App, raw: psycopg.Connection[Any]
) -> None:
    package_before = package_revisions()
    queue = app.new_revision("jobq alembic-revision")
    assert f"migrations.upgrade(version={LATEST})" in operations(queue)
    assert "migrations.downgrade(version=0)" in operations(queue)
    assert "down_revision: Union[str, Sequence[str], None] = None" in queue

    app.run("alembic upgrade head")
    assert queue_version(raw, app) == LATEST
    app.run("alembic downgrade -1")
    assert queue_version(raw, app) is None
    app.run("alembic upgrade head")
    assert queue_version(raw, app) == LATEST

    orders = app.new_revision("alembic revision --autogenerate -m orders")
    assert "op.create_table('orders'" in orders
    assert "jobs" not in orders
    assert f"= '{revision_id(queue)}'" in orders
    app.run("alembic upgrade head")
    unchanged = app.new_revision("alembic revision --autogenerate -m 'nothing new'")
    assert "jobs" not in unchanged
    assert "op." not in operations(unchanged)
    assert f"= '{revision_id(orders)}'" in unchanged
    app.run("alembic upgrade head")
    assert "No new upgrade operations detected" in app.run("alembic check")
    assert_nothing_written_into_package(package_before)


def test_a_later_queue_upgrade_is_one_more_revision_down_to_the_previous_pin(
    app: App, raw: psycopg.Connection[Any]
) -> None:
    """The app pinned version 1 with an older sqla_jobq; a pin of another
    queue table (`mail`) is not the default queue's and is passed over."""
    folder = app.root / "migrations" / "versions"
    write(folder / "app_0001_queue.py", pinned_revision("app_0001", None, 1, 0))
    write(folder / "app_0002_mail.py", pinned_revision("app_0002", "app_0001", 1, 0, name="mail"))
    app.run("alembic upgrade head")
    assert queue_version(raw, app) == 1

    queue = app.new_revision("jobq alembic-revision -m 'queue to the latest schema'")
    assert queue.startswith('"""queue to the latest schema')
    assert "down_revision: Union[str, Sequence[str], None] = 'app_0002'" in queue
    assert f"migrations.upgrade(version={LATEST})" in operations(queue)
    assert "migrations.downgrade(version=1)" in operations(queue)
    again = app.run("jobq alembic-revision")
    assert again.count("\n") == 1
    assert f"already pins sqla_jobq schema version {LATEST}" in again
    assert len(app.versions()) == 3

    app.run("alembic upgrade head")
    assert queue_version(raw, app) == LATEST
    app.run("alembic downgrade -1")
    assert queue_version(raw, app) == 1


# --- path 2: the shipped sqla_jobq branch beside a branch of the app's own ----------


def test_on_the_shipped_branch_the_documented_commands_keep_the_apps_revisions_home(
    app: App, raw: psycopg.Connection[Any]
) -> None:
    ini = app.root / "alembic.ini"
    locations = "version_locations = %(here)s/migrations/versions sqla_jobq:migrations/versions"
    ini.write_text(
        re.sub(
            r"^path_separator = os$",
            f"path_separator = space\n{locations}",
            ini.read_text(),
            flags=re.MULTILINE,
        )
    )
    package_before = package_revisions()
    app.run("alembic upgrade heads")
    assert queue_version(raw, app) == LATEST

    # The README's commands, word for word.
    orders = app.new_revision(
        "alembic revision --autogenerate -m orders"
        " --head base --branch-label app --version-path migrations/versions"
    )
    assert "op.create_table('orders'" in orders
    assert "jobs" not in orders
    assert "branch_labels: Union[str, Sequence[str], None] = ('app',)" in orders
    app.run("alembic upgrade heads")
    unchanged = app.new_revision("alembic revision --autogenerate -m later --head app@head")
    assert "op." not in operations(unchanged)
    assert f"= '{revision_id(orders)}'" in unchanged
    app.run("alembic upgrade heads")
    assert "No new upgrade operations detected" in app.run("alembic check")
    assert_nothing_written_into_package(package_before)


# --- refusals: one line, exit 2, nothing written -------------------------------------


def _no_ini(root: Path) -> str:
    (root / "alembic.ini").unlink()
    return ""


def _branch_ini(root: Path) -> str:
    ini = root / "alembic.ini"
    ini.write_text(
        ini.read_text().replace(
            "[alembic]\n", "[alembic]\nversion_locations = sqla_jobq:migrations/versions\n", 1
        )
    )
    return ""


def _two_heads(root: Path) -> str:
    for revision in ("a_0001", "b_0001"):
        write(
            root / "migrations" / "versions" / f"{revision}.py",
            pinned_revision(revision, None, 1, 0),
        )
    return ""


def _template_without_body(root: Path) -> str:
    write(
        root / "migrations" / "script.py.mako",
        "revision = ${repr(up_revision)}\ndown_revision = ${repr(down_revision)}\n",
    )
    return ""


REFUSALS = {
    "no alembic.ini": (_no_ini, "no alembic.ini in"),
    "the shipped branch in version_locations": (_branch_ini, "--head app@head"),
    "a version path in the package": (
        lambda root: f"--version-path {shlex.quote(str(PACKAGE_VERSIONS))}",
        "inside the installed sqla_jobq package",
    ),
    "a version path alembic does not know": (
        lambda root: "--version-path elsewhere",
        "alembic: Path elsewhere is not represented in current version locations",
    ),
    "two heads": (_two_heads, "2 heads (a_0001, b_0001): merge them first"),
    "a template without a body": (_template_without_body, "nothing written"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_alembic_revision_refuses_with_one_line_and_writes_nothing(
    case: str, initialized: Path, tmp_path: Path
) -> None:
    root = tmp_path / "app"
    shutil.copytree(initialized, root)
    prepare, fragment = REFUSALS[case]
    options = prepare(root)
    before = set(root.rglob("*.py"))
    package_before = package_revisions()

    done = run(root, f"jobq alembic-revision {options}")

    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("jobq: error: ")
    assert fragment in line
    assert set(root.rglob("*.py")) == before
    assert_nothing_written_into_package(package_before)
