"""`jobq doctor` against real PostgreSQL: the article's VACUUM trap, reproduced.

A claim left open in a transaction, idle, while another worker processes
2,000 jobs: VACUUM reports the old row versions "dead but not yet removable",
the doctor names the idle session's pid and exits 1; once it commits, VACUUM
removes them and the finding is gone.

The server may be shared with other test runs, so assertions are about the
sessions and the table this test made, not about the absence of everything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, MetaData, Table, create_engine, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import InternalError
from sqlalchemy.pool import NullPool

from sqla_jobq import client, statements
from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.doctor import (
    CHECKS,
    Finding,
    Report,
    Thresholds,
    diagnose,
    read_only,
    render_text,
)
from sqla_jobq.schema import QUEUE_TABLE_SETTINGS, Names, jobs_table, names_of
from sqla_jobq.statements import NewJob
from tests.support.cluster import FAST_SETTINGS, Cluster, server_installed, throwaway_cluster
from tests.support.queues import create_queue_table
from tests.support.upkeep import snapshot_held
from tests.support.waiting import wait_until

TABLE_CHECKS = {
    "schema_version",
    "dead_tuples",
    "statistics",
    "table_size",
    "index",
    "ready_backlog",
    "expired_leases",
    "lease_nearly_used",
    "lease_expired_recently",
    "failed_recently",
}
VACUUM_TUPLES = re.compile(
    r"tuples: (\d+) removed, (\d+) remain, (\d+) are dead but not yet removable"
)


@dataclass(frozen=True)
class Vacuumed:
    removed: int
    remain: int
    not_yet_removable: int


# --- helpers -----------------------------------------------------------------


def enqueue(engine: Engine, table: Table, n: int, **options: Any) -> list[int]:
    rows = [NewJob("noop", {"n": i}, **options) for i in range(n)]
    with engine.begin() as conn:
        return client.enqueue_many(conn, table, rows)


def autocommit(engine: Engine) -> Connection:
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def process(engine: Engine, table: Table, n: int) -> int:
    """A well-behaved worker: claim 10, complete each, every statement its own commit."""
    done = 0
    with autocommit(engine) as conn:
        while done < n:
            claimed = conn.execute(statements.claim(table, limit=min(10, n - done))).all()
            if not claimed:
                break
            for job in claimed:
                assert conn.execute(statements.complete(table, job.id, job.attempts)).rowcount == 1
            done += len(claimed)
    return done


def vacuum_verbose(database_url: str, table: Table) -> Vacuumed:
    """Run VACUUM (VERBOSE) and read its INFO report for this table (not its TOAST)."""
    notices: list[str] = []
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute(f'VACUUM (VERBOSE) "{table.name}"'.encode())
    mine = [m for m in notices if m.startswith("finished vacuuming") and f'.{table.name}"' in m]
    assert len(mine) == 1, notices
    match = VACUUM_TUPLES.search(mine[0])
    assert match, mine[0]
    return Vacuumed(*(int(g) for g in match.groups()))


def run_jobq(*args: str) -> subprocess.CompletedProcess[str]:
    """The `jobq` entry point in a fresh interpreter, as a user would run it."""
    code = "import sys; from sqla_jobq.cli import main; sys.argv[0] = 'jobq'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def doctor_json(database_url: str, table: Table) -> tuple[int, dict[str, Any]]:
    done = run_jobq("doctor", "--json", "--database-url", database_url, "--table", table.name)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def about_pid(findings: Iterable[Finding], check: str, pid: int) -> list[Finding]:
    return [f for f in findings if f.check == check and f.data.get("pid") == pid]


def of_check(report: Report, check: str) -> list[Finding]:
    return [f for f in report.findings if f.check == check]


@pytest.fixture
def quiet(table: Table, raw: psycopg.Connection[tuple[object, ...]]) -> Table:
    """The test table with autovacuum off, so only our VACUUM removes anything."""
    raw.execute(f'ALTER TABLE "{table.name}" SET (autovacuum_enabled = false)'.encode())
    return table


@pytest.fixture
def stuck_engine(database_url: str) -> Iterator[Engine]:
    """Connections that show up as `stuck-claimer` in pg_stat_activity."""
    eng = create_engine(
        sqlalchemy_url(database_url),
        poolclass=NullPool,
        connect_args={"application_name": "stuck-claimer"},
    )
    yield eng
    eng.dispose()


# --- the article's case ----------------------------------------------------------


def test_idle_claim_blocks_vacuum_and_doctor_names_its_pid_until_it_commits(
    engine: Engine, stuck_engine: Engine, quiet: Table, database_url: str
) -> None:
    table = quiet
    enqueue(engine, table, 2_001)
    with stuck_engine.connect() as stuck:
        tx = stuck.begin()
        assert len(stuck.execute(statements.claim(table, limit=1)).all()) == 1
        pid = stuck.execute(text("SELECT pg_backend_pid()")).scalar_one()
        # the claim is done; the transaction stays open, idle, holding its xid

        assert process(engine, table, 2_000) == 2_000

        held = vacuum_verbose(database_url, table)
        assert held.not_yet_removable >= 2_000
        assert held.removed == 0

        report = diagnose(engine, table)
        idle = about_pid(report.findings, "idle_in_transaction", pid)
        assert [f.level for f in idle] == ["warn"]
        assert idle[0].subject == f"pid {pid} (stuck-claimer)"
        assert idle[0].data["has_xid"] is True
        assert idle[0].data["xid_age"] >= 2_000
        assert f"pg_terminate_backend({pid})" in idle[0].advice
        assert report.exit_status == 1
        assert f"pid {pid} (stuck-claimer)" in render_text(report)

        status, shown = doctor_json(database_url, table)
        assert status == 1
        assert shown["healthy"] is False and shown["exit_status"] == 1
        named = [
            f for f in shown["findings"]
            if f["check"] == "idle_in_transaction" and f["data"].get("pid") == pid
        ]
        assert len(named) == 1 and named[0]["level"] == "warn"

        tx.commit()

    freed = vacuum_verbose(database_url, table)
    assert freed.removed >= 2_000
    assert freed.not_yet_removable == 0
    after = diagnose(engine, table)
    assert about_pid(after.findings, "idle_in_transaction", pid) == []
    _, shown = doctor_json(database_url, table)
    assert not [f for f in shown["findings"] if f["data"].get("pid") == pid]


def test_read_only_repeatable_read_snapshot_holds_the_horizon_too(
    engine: Engine, stuck_engine: Engine, table: Table
) -> None:
    with stuck_engine.connect() as stuck:
        stuck.execution_options(isolation_level="REPEATABLE READ")
        tx = stuck.begin()
        stuck.execute(text("SELECT count(*) FROM pg_class")).scalar_one()
        pid = stuck.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with autocommit(engine) as burner:
            for _ in range(1_100):
                burner.execute(text("SELECT txid_current()"))
        report = diagnose(engine, table)
        tx.rollback()
    idle = about_pid(report.findings, "idle_in_transaction", pid)
    assert len(idle) == 1
    assert idle[0].data["has_snapshot"] is True and idle[0].data["has_xid"] is False
    assert idle[0].data["xmin_age"] >= 1_000


def test_doctor_flags_a_transaction_open_past_the_long_transaction_limit(
    engine: Engine, stuck_engine: Engine, table: Table
) -> None:
    with stuck_engine.connect() as stuck, stuck.begin():
        pid = stuck.execute(text("SELECT pg_backend_pid()")).scalar_one()
        time.sleep(0.6)
        report = diagnose(engine, table, Thresholds(long_transaction_seconds=0.5))
        strict_idle = diagnose(engine, table, Thresholds(idle_in_transaction_seconds=0.5))
    long = about_pid(report.findings, "long_transaction", pid)
    assert len(long) == 1 and long[0].level == "warn"
    assert f"pg_cancel_backend({pid})" in long[0].advice
    # holding no xid and no snapshot, 0.6 s idle is not yet an idle-in-transaction problem
    assert about_pid(report.findings, "idle_in_transaction", pid) == []
    assert len(about_pid(strict_idle.findings, "idle_in_transaction", pid)) == 1


def test_doctor_transaction_is_read_only_takes_no_xid_and_is_bounded(
    engine: Engine, table: Table
) -> None:
    with read_only(engine) as conn:
        settings = conn.execute(
            text(
                "SELECT current_setting('transaction_read_only'), "
                "current_setting('statement_timeout'), current_setting('lock_timeout'), "
                "current_setting('application_name'), txid_current_if_assigned()"
            )
        ).one()
        assert tuple(settings) == ("on", "10s", "1s", "jobq doctor", None)
        with pytest.raises(InternalError, match="read-only transaction"):
            conn.execute(statements.enqueue(table, "noop", {}))


def test_doctor_never_reports_its_own_session_and_leaves_none_behind(
    engine: Engine, table: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    report = diagnose(engine, table, Thresholds(long_transaction_seconds=0.0))
    names = {f.data.get("application_name") for f in of_check(report, "long_transaction")}
    assert "jobq doctor" not in names
    left = raw.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'jobq doctor'"
    ).fetchone()
    assert left == (0,)


# --- the queue ---------------------------------------------------------------------


def test_doctor_flags_expired_and_nearly_used_leases_then_jobs_that_outlived_them(
    engine: Engine, table: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    expired, nearly, fresh = enqueue(engine, table, 3, queue="leases")
    with autocommit(engine) as conn:
        assert len(conn.execute(statements.claim(table, queue="leases", limit=3)).all()) == 3
    t = f'"{table.name}"'
    raw.execute(
        f"UPDATE {t} SET started_at = now() - interval '15 minutes', "
        f"locked_until = now() - interval '10 minutes' WHERE id = {expired}".encode()
    )
    raw.execute(
        f"UPDATE {t} SET started_at = now() - interval '9 minutes', "
        f"locked_until = now() + interval '1 minute' WHERE id = {nearly}".encode()
    )

    report = diagnose(engine, table)
    (lost,) = of_check(report, "expired_leases")
    assert (lost.level, lost.subject, lost.data["ids"]) == ("warn", "queue leases", [expired])
    assert "jobq reap" in lost.advice
    (close,) = of_check(report, "lease_nearly_used")
    assert (close.level, close.data["ids"]) == ("warn", [nearly])
    assert fresh not in close.data["ids"]
    assert report.exit_status == 1

    with autocommit(engine) as conn:
        reaped = conn.execute(statements.reap(table)).all()
    assert [r.id for r in reaped] == [expired]
    after = diagnose(engine, table)
    assert [f.level for f in of_check(after, "expired_leases")] == ["ok"]
    (outlived,) = of_check(after, "lease_expired_recently")
    assert (outlived.level, outlived.data["ids"]) == ("warn", [expired])


def test_doctor_counts_jobs_failed_for_good_but_not_cancelled_ones(
    engine: Engine, table: Table
) -> None:
    failing, cancelled = enqueue(engine, table, 2, queue="mail", max_attempts=1)
    with autocommit(engine) as conn:
        conn.execute(statements.cancel(table, cancelled))
        (job,) = conn.execute(statements.claim(table, queue="mail")).all()
        conn.execute(statements.fail(table, job.id, job.attempts, "SMTP 550"))
    (failed,) = of_check(diagnose(engine, table), "failed_recently")
    assert (failed.level, failed.subject, failed.data["ids"]) == ("warn", "queue mail", [failing])
    assert f"WHERE id IN ({failing})" in failed.advice


def test_doctor_flags_a_queue_whose_oldest_ready_job_waits_too_long(
    engine: Engine, table: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    (old,) = enqueue(engine, table, 1, queue="starved")
    enqueue(engine, table, 1, queue="fed")
    enqueue(engine, table, 1, queue="later", delay=timedelta(hours=1))
    raw.execute(
        f"UPDATE \"{table.name}\" SET run_at = now() - interval '10 minutes' "
        f"WHERE id = {old}".encode()
    )
    backlog = {f.subject: f for f in of_check(diagnose(engine, table), "ready_backlog")}
    assert backlog["queue starved"].level == "warn"
    assert backlog["queue starved"].data["ready"] == 1
    assert backlog["queue starved"].data["oldest_ready_seconds"] >= 600
    assert backlog["queue fed"].level == "ok"
    assert backlog["queue later"].level == "ok"
    assert backlog["queue later"].data["ready"] == 0


# --- the indexes ---------------------------------------------------------------------


def test_doctor_flags_a_missing_ready_index_and_its_advice_recreates_it(
    engine: Engine, table: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    ready = names_of(table).ready_index
    raw.execute(f'DROP INDEX "{ready}"'.encode())
    report = diagnose(engine, table)
    (missing,) = [f for f in of_check(report, "index") if f.level == "warn"]
    assert missing.subject == f"index {ready}"
    assert missing.data == {"name": ready, "exists": False, "valid": False}
    assert report.exit_status == 1

    ddl = missing.advice.removeprefix("recreate it: ")
    assert ddl.startswith("CREATE INDEX CONCURRENTLY")
    raw.execute(ddl.encode())
    assert all(f.level == "ok" for f in of_check(diagnose(engine, table), "index"))


def test_doctor_flags_an_index_left_invalid_by_a_failed_concurrent_build(
    engine: Engine, table: Table, database_url: str, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    claim_index = names_of(table).claim_index
    raw.execute(f'DROP INDEX "{claim_index}"'.encode())
    # A writer with an open transaction makes CREATE INDEX CONCURRENTLY wait
    # after it has registered the index; the lock timeout then leaves it INVALID.
    with psycopg.connect(conninfo(database_url)) as writer:
        writer.execute(f'INSERT INTO "{table.name}" (payload) VALUES (\'{{}}\')'.encode())
        raw.execute(b"SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            raw.execute(
                f'CREATE INDEX CONCURRENTLY "{claim_index}" ON "{table.name}" '
                "(queue, priority DESC, run_at, id) WHERE status = 'queued'".encode()
            )
        raw.execute(b"RESET lock_timeout")
        writer.rollback()
    report = diagnose(engine, table)
    (invalid,) = [f for f in of_check(report, "index") if f.level == "warn"]
    assert invalid.subject == f"index {claim_index}"
    assert invalid.data == {"name": claim_index, "exists": True, "valid": False}
    assert invalid.advice == f'rebuild it: REINDEX INDEX CONCURRENTLY "{claim_index}"'

    raw.execute(invalid.advice.removeprefix("rebuild it: ").encode())
    assert all(f.level == "ok" for f in of_check(diagnose(engine, table), "index"))


def test_doctor_flags_the_invalid_copy_a_reindex_concurrently_left_and_its_advice_drops_it(
    engine: Engine, table: Table, database_url: str, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    claim_index = names_of(table).claim_index
    # A snapshot older than the rebuild makes it wait after it has built its
    # copy; the lock timeout then leaves that copy INVALID beside the index.
    with snapshot_held(database_url):
        raw.execute(b"SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            raw.execute(f'REINDEX INDEX CONCURRENTLY "{claim_index}"'.encode())
        raw.execute(b"RESET lock_timeout")
    report = diagnose(engine, table)
    (left,) = [f for f in of_check(report, "index") if f.level == "warn"]
    assert left.subject == f"index {claim_index}_ccnew"
    assert "every enqueue, claim and completion still writes to it" in left.summary
    assert left.advice == f'drop it: DROP INDEX CONCURRENTLY "{claim_index}_ccnew"'

    raw.execute(left.advice.removeprefix("drop it: ").encode())
    assert all(f.level == "ok" for f in of_check(diagnose(engine, table), "index"))


def test_doctor_flags_a_never_analyzed_table_until_it_is_analyzed(
    engine: Engine, table: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Without statistics a claim may sort every queued job instead of walking the
    claim index; on a server with autovacuum off nothing ever analyzes the table."""
    enqueue(engine, table, 1500)
    deadline = time.monotonic() + 10
    while True:  # the statistics collector reports the new rows asynchronously
        (finding,) = of_check(diagnose(engine, table), "statistics")
        if finding.level == "warn" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert finding.level == "warn"
    assert finding.advice == f'ANALYZE "{table.name}"'

    raw.execute(finding.advice.encode())
    deadline = time.monotonic() + 10
    while True:
        (finding,) = of_check(diagnose(engine, table), "statistics")
        if finding.level == "ok" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert finding.level == "ok"
    assert finding.data["analyzed"] is True


# --- autovacuum ----------------------------------------------------------------------------


def server_setting(raw: psycopg.Connection[tuple[object, ...]], name: str) -> object:
    row = raw.execute("SELECT current_setting(%s)", [name]).fetchone()
    assert row is not None
    return row[0]


def test_doctor_warns_when_autovacuum_is_off_server_wide_and_names_alter_system(
    database_url: str, table: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    if server_setting(raw, "autovacuum") != "off":
        pytest.skip("needs a server with autovacuum off, as the shared test server has")
    status, shown = doctor_json(database_url, table)
    (finding,) = [f for f in shown["findings"] if f["check"] == "autovacuum"]
    assert status == 1 and finding["level"] == "warn"
    assert "autovacuum = off" in finding["summary"]
    assert "grows without bound unless pruned and vacuumed by hand" in finding["advice"]
    assert "ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf();" in finding["advice"]
    assert finding["data"]["autovacuum"] is False and finding["data"]["track_counts"] is True
    # The table's own settings are reported even while they cannot take effect.
    assert finding["data"]["settings"]["autovacuum_vacuum_threshold"] == {
        "value": "5000",
        "source": "table",
    }


def test_doctor_warns_of_a_table_with_autovacuum_disabled_and_its_reset_clears_that(
    engine: Engine, quiet: Table, raw: psycopg.Connection[tuple[object, ...]]
) -> None:
    (finding,) = of_check(diagnose(engine, quiet), "autovacuum")
    assert finding.level == "warn"
    assert "table option autovacuum_enabled = false" in finding.summary
    reset = f'ALTER TABLE "{quiet.name}" RESET (autovacuum_enabled)'
    assert reset in finding.advice
    assert finding.data["table_autovacuum_enabled"] == "false"

    raw.execute(reset.encode())
    (after,) = of_check(diagnose(engine, quiet), "autovacuum")
    assert "autovacuum_enabled" not in after.summary
    assert after.data["table_autovacuum_enabled"] is None


@pytest.fixture(scope="module")
def autovacuum_server() -> Iterator[Cluster]:
    """A cluster of these tests' own with autovacuum on (the shared server has it
    off on purpose, and must not be changed); removed afterwards."""
    if not server_installed():
        pytest.skip("PostgreSQL 15 server binaries are not installed")
    with throwaway_cluster() as node:
        with psycopg.connect(conninfo(node.url), autocommit=True) as conn:
            assert conn.execute("SHOW autovacuum").fetchone() == ("on",)
        yield node


@pytest.fixture
def on_server(autovacuum_server: Cluster) -> Iterator[tuple[str, Table]]:
    """A migrated queue table in a database of its own on that cluster: (URL, table)."""
    name = f"jobq_doc_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(conninfo(autovacuum_server.url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"'.encode())
    url = autovacuum_server.url.rsplit("/", 1)[0] + f"/{name}"
    names = Names("jobs", None)
    create_queue_table(url, names)
    yield url, jobs_table(MetaData(), names.table)
    with psycopg.connect(conninfo(autovacuum_server.url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)'.encode())


def test_with_autovacuum_on_doctor_reports_the_step_6_settings_as_the_tables_own(
    on_server: tuple[str, Table],
) -> None:
    url, table = on_server
    status, shown = doctor_json(url, table)
    (finding,) = [f for f in shown["findings"] if f["check"] == "autovacuum"]
    assert finding["level"] == "ok", finding
    assert finding["data"]["settings"] == {
        name: {"value": value, "source": "table"} for name, value in QUEUE_TABLE_SETTINGS.items()
    }
    assert finding["data"]["autovacuum_naptime"] == "1min"
    assert finding["data"]["changed"] == {}
    assert "autovacuum_vacuum_scale_factor = 0 (table)" in finding["summary"]
    assert "autovacuum_naptime = 1min (server)" in finding["summary"]
    assert "changed" not in finding["summary"]
    assert not [f for f in shown["findings"] if f["level"] == "warn"], shown
    assert status == 0


def test_settings_changed_by_hand_are_noted_in_the_summary_not_warned_about(
    on_server: tuple[str, Table],
) -> None:
    url, table = on_server
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(b"ALTER TABLE jobs SET (autovacuum_vacuum_threshold = 1000)")
        conn.execute(b"ALTER TABLE jobs RESET (autovacuum_vacuum_cost_delay)")
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        (finding,) = of_check(diagnose(engine, table), "autovacuum")
    finally:
        engine.dispose()
    assert finding.level == "ok"
    assert finding.data["changed"] == {
        "autovacuum_vacuum_threshold": {"value": "1000", "schema": "5000"},
        "autovacuum_vacuum_cost_delay": {"value": "2ms", "schema": "0"},
    }
    assert finding.data["settings"]["autovacuum_vacuum_cost_delay"] == {
        "value": "2ms",
        "source": "server",
    }
    assert "autovacuum_vacuum_threshold (was 5000)" in finding.summary


def test_track_counts_off_for_the_database_warns_and_names_the_database_reset(
    on_server: tuple[str, Table],
) -> None:
    """track_counts is a superuser setting a database may carry: its sessions
    then count nothing, so autovacuum never learns of their dead tuples."""
    url, table = on_server
    database = url.rsplit("/", 1)[1]
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{database}" SET track_counts = off'.encode())
    status, shown = doctor_json(url, table)
    (finding,) = [f for f in shown["findings"] if f["check"] == "autovacuum"]
    assert status == 1 and finding["level"] == "warn"
    assert finding["summary"] == (
        "autovacuum cannot clean this table: track_counts = off (source: database)"
    )
    reset = f'ALTER DATABASE "{database}" RESET track_counts'
    assert finding["advice"].endswith(f"fix: {reset}")
    assert "needs pg_stat counts too" in finding["advice"]
    (dead,) = [f for f in shown["findings"] if f["check"] == "dead_tuples"]
    assert dead["summary"].endswith("autovacuum is OFF (track_counts is off)")

    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(reset.encode())
    status, shown = doctor_json(url, table)
    (finding,) = [f for f in shown["findings"] if f["check"] == "autovacuum"]
    assert finding["level"] == "ok" and status == 0


# --- healthy, and the CLI's contract ------------------------------------------------------


def test_healthy_table_has_only_ok_findings_and_exit_status_follows_the_warnings(
    engine: Engine, table: Table, database_url: str
) -> None:
    enqueue(engine, table, 5)
    process(engine, table, 3)
    report = diagnose(engine, table)
    mine = [f for f in report.findings if f.check in TABLE_CHECKS]
    assert {f.check for f in mine} == TABLE_CHECKS
    assert [f for f in mine if f.level != "ok"] == []
    assert all(f.advice == "" for f in mine)
    assert report.exit_status == (0 if not report.warnings else 1)

    done = run_jobq("doctor", "--database-url", database_url, "--table", table.name)
    assert done.returncode in (0, 1), done.stderr
    lines = done.stdout.splitlines()
    assert lines[2].split() == ["STATUS", "CHECK", "SUBJECT", "DETAIL"]
    assert any(line.startswith("OK      ready_backlog           queue default") for line in lines)
    others = [ln for ln in lines if ln.startswith("WARN")]
    assert done.returncode == (1 if others else 0)
    assert not any(table.name in ln for ln in others)


def test_json_report_has_the_documented_shape(database_url: str, table: Table) -> None:
    _, shown = doctor_json(database_url, table)
    assert set(shown) == {
        "format", "table", "database", "server_version", "checked_at",
        "healthy", "exit_status", "findings",
    }
    assert shown["format"] == 1 and shown["table"] == table.name
    for finding in shown["findings"]:
        assert set(finding) == {"check", "level", "subject", "summary", "advice", "data"}
        assert finding["level"] in ("ok", "warn")
        assert (finding["advice"] != "") == (finding["level"] == "warn")


def test_doctor_cli_user_errors_exit_2_with_one_line(database_url: str) -> None:
    missing = run_jobq("doctor", "--database-url", database_url, "--table", "no_such_jobs")
    bad_url = run_jobq("doctor", "--database-url", "mysql://localhost/db")
    for done in (missing, bad_url):
        assert done.returncode == 2
        assert done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1
        assert done.stderr.startswith("jobq: error: ")
    assert "jobq migrate" in missing.stderr


# --- a table a hold left: mostly empty, larger than shared_buffers --------------------------

SMALL_BUFFERS = (*FAST_SETTINGS, "shared_buffers=1MB")


@pytest.fixture(scope="module")
def small_buffers_server() -> Iterator[Cluster]:
    """A cluster with 1 MB of shared_buffers, so a table of a few MB outgrows them."""
    if not server_installed():
        pytest.skip("PostgreSQL 15 server binaries are not installed")
    with throwaway_cluster(SMALL_BUFFERS) as node:
        yield node


def test_doctor_warns_of_a_mostly_empty_table_outgrowing_shared_buffers_until_rewritten(
    small_buffers_server: Cluster,
) -> None:
    """What a held snapshot leaves: VACUUM frees the space but keeps the pages
    (one live row every 5,000 jobs keeps it from truncating the end), so the
    table stays large; the doctor's advice, a rewrite, gives them back."""
    url = small_buffers_server.url
    names = Names("jobs", None)
    create_queue_table(url, names)
    table = jobs_table(MetaData(), names.table)
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(
            b"INSERT INTO jobs (task, payload) "
            b"SELECT 'noop', jsonb_build_object('n', g) FROM generate_series(1, 150000) g"
        )
        conn.execute(b"DELETE FROM jobs WHERE id % 5000 <> 0")
        conn.execute(b"SELECT pg_stat_force_next_flush()")  # counted before VACUUM's own
        conn.execute(b"VACUUM (ANALYZE) jobs")
    status, shown = doctor_json(url, table)
    (size,) = [f for f in shown["findings"] if f["check"] == "table_size"]
    assert status == 1 and size["level"] == "warn", size
    assert size["data"]["shared_buffers_bytes"] == 1024 * 1024
    assert size["data"]["table_bytes"] >= 16 * 1024 * 1024
    assert size["data"]["live_rows_per_page"] < 0.05
    assert re.search(r"mostly empty \(30 live rows in [\d,]+ pages\)", size["summary"])
    assert "larger than shared_buffers (1.0 MB)" in size["summary"]
    rewrite = "SET lock_timeout = '5s'; VACUUM (FULL, VERBOSE) \"jobs\""
    assert rewrite in size["advice"]

    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        for statement in rewrite.split("; "):
            conn.execute(statement.encode())
        assert conn.execute(b"SELECT count(*) FROM jobs").fetchone() == (30,)
    _, shown = doctor_json(url, table)
    (size,) = [f for f in shown["findings"] if f["check"] == "table_size"]
    assert size["level"] == "ok", size
    assert size["data"]["table_bytes"] < 64 * 1024
    # The 150,000-row load writes WAL fast enough to be the server's one warning.
    assert {f["check"] for f in shown["findings"] if f["level"] == "warn"} <= {"checkpoints"}


# --- writeback: what the release of a held horizon costs at the next checkpoint -------------


def writeback(engine: Engine, table: Table) -> tuple[Finding, list[Finding]]:
    """The writeback finding, and the horizon warnings beside it, with an
    idle-in-transaction limit a test can pass in a moment."""
    report = diagnose(engine, table, Thresholds(idle_in_transaction_seconds=0.2))
    (found,) = of_check(report, "writeback")
    return found, of_check(report, "idle_in_transaction")


def test_writeback_left_to_the_checkpoint_is_a_warning_only_while_a_horizon_is_held(
    database_url: str, table: Table
) -> None:
    engine = create_engine(
        sqlalchemy_url(database_url),
        poolclass=NullPool,
        connect_args={"options": "-c backend_flush_after=0"},
    )
    try:
        calm, _ = writeback(engine, table)
        with snapshot_held(database_url):
            time.sleep(0.3)
            held, idle = writeback(engine, table)
    finally:
        engine.dispose()
    assert calm.level == "ok"
    assert calm.summary.endswith("matters once a long-held horizon moves on")
    assert [f.level for f in idle] == ["warn"]
    assert held.level == "warn"
    assert "that can stall every commit" in held.summary
    database = make_url(database_url).database
    assert f"ALTER DATABASE \"{database}\" SET backend_flush_after = '256kB'" in held.advice
    assert held.data["bytes"] == 0 and held.data["source"] == "client"
    assert held.data["shared_with_autovacuum"] is False


def test_backend_flush_after_set_for_the_database_satisfies_the_writeback_check(
    on_server: tuple[str, Table],
) -> None:
    """ALTER DATABASE needs no superuser, and reaches the database's autovacuum
    workers as well as its new sessions: the doctor accepts it while a horizon
    is held."""
    url, table = on_server
    database = url.rsplit("/", 1)[1]
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE \"{database}\" SET backend_flush_after = '256kB'".encode())
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        with snapshot_held(url):
            time.sleep(0.3)
            found, idle = writeback(engine, table)
    finally:
        engine.dispose()
    assert [f.level for f in idle] == ["warn"]
    assert found.level == "ok"
    assert found.data["bytes"] == 256 * 1024 and found.data["source"] == "database"
    assert found.data["shared_with_autovacuum"] is True
    assert found.summary == "backend_flush_after 256 kB (from the database)"


# --- a server whose WAL starts checkpoints before checkpoint_timeout -----------------------

ADVICE = re.compile(r"ALTER SYSTEM SET max_wal_size = '(\d+)GB'; SELECT pg_reload_conf\(\);")


@pytest.fixture(scope="module")
def small_wal_server() -> Iterator[Cluster]:
    """A cluster whose 32 MB of max_wal_size starts a checkpoint every 16.8 MB of
    WAL, set as a user would (a `-c` option would outrank the doctor's advice)."""
    if not server_installed():
        pytest.skip("PostgreSQL 15 server binaries are not installed")
    with throwaway_cluster() as node:
        create_queue_table(node.url, Names("jobs", None))
        with psycopg.connect(conninfo(node.url), autocommit=True) as conn:
            conn.execute(b"ALTER SYSTEM SET min_wal_size = '32MB'")
            conn.execute(b"ALTER SYSTEM SET max_wal_size = '32MB'")
            conn.execute(b"SELECT pg_reload_conf()")
        wait_for_setting(node.url, "max_wal_size", "32MB")
        yield node


def wait_for_setting(url: str, name: str, value: str) -> None:
    """A reload reaches new sessions once the postmaster has read the file."""

    def shown() -> bool:
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            return conn.execute(f"SHOW {name}".encode()).fetchone() == (value,)

    wait_until(shown, 10, f"{name} = {value} after the reload")


def write_wal(url: str, jobs: int) -> int:
    """Enqueue `jobs` jobs right after a checkpoint; the WAL bytes that wrote."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(b"CHECKPOINT")
        start = conn.execute(b"SELECT pg_current_wal_lsn()").fetchone()
        conn.execute(
            b"INSERT INTO jobs (task, payload) "
            b"SELECT 'noop', jsonb_build_object('n', g) FROM generate_series(1, %d) g" % jobs
        )
        row = conn.execute(b"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", start).fetchone()
    assert row is not None
    return int(row[0])


def checkpoint_finding(url: str, window: float = 1.0) -> Finding:
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        quick = Thresholds(checkpoint_window_seconds=window)
        report = diagnose(engine, jobs_table(MetaData(), "jobs"), quick)
    finally:
        engine.dispose()
    (found,) = of_check(report, "checkpoints")
    return found


def test_doctor_warns_when_wal_starts_checkpoints_before_the_timeout_until_max_wal_size_grows(
    small_wal_server: Cluster,
) -> None:
    """A busy queue's WAL fills max_wal_size long before checkpoint_timeout: the
    doctor measures the rate over the current checkpoint interval, says how
    often checkpoints come at it, and its advice makes them come by the timeout."""
    url = small_wal_server.url
    written = write_wal(url, 10_000)
    assert 1024 * 1024 < written < 16 * 1024 * 1024
    time.sleep(1.0)
    found = checkpoint_finding(url)
    assert found.level == "warn", found
    assert found.data["trigger_bytes"] == int(32 * 1024 * 1024 / 1.9)
    assert found.data["wal_bytes"] >= written
    assert found.data["every_seconds"] < found.data["checkpoint_timeout_seconds"] == 300
    assert "starts a checkpoint every 17 MB of it, so about every" in found.summary
    advice = ADVICE.search(found.advice)
    assert advice, found.advice
    assert int(advice[1]) * 1024**3 == found.data["suggested_max_wal_size_bytes"]

    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        for statement in advice[0].split("; "):
            conn.execute(statement.encode())
    wait_for_setting(url, "max_wal_size", f"{advice[1]}GB")
    found = checkpoint_finding(url)
    assert found.data["max_wal_size_bytes"] == int(advice[1]) * 1024**3
    assert found.level == "ok", found
    assert "by checkpoint_timeout" in found.summary


def test_doctor_says_why_it_cannot_measure_checkpoints_for_a_role_kept_from_them(
    small_wal_server: Cluster,
) -> None:
    """Managed servers may revoke pg_control_checkpoint(): the doctor checks
    the privilege first, so its one transaction survives and every other check runs."""
    url = small_wal_server.url
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(b"REVOKE EXECUTE ON FUNCTION pg_control_checkpoint() FROM PUBLIC")
        conn.execute(b"CREATE ROLE watcher LOGIN IN ROLE pg_read_all_stats")
        conn.execute(b"GRANT SELECT ON ALL TABLES IN SCHEMA public TO watcher")
    watcher = url.replace("postgres@", "watcher@")
    _, shown = doctor_json(watcher, jobs_table(MetaData(), "jobs"))
    (found,) = [f for f in shown["findings"] if f["check"] == "checkpoints"]
    assert found["level"] == "ok"
    assert found["summary"] == "not measured: this role may not call pg_control_checkpoint()"
    assert {f["check"] for f in shown["findings"]} == set(CHECKS) - {"visibility"}, shown
