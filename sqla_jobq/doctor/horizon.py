"""Judge what holds the database's xmin horizon back: sessions idle in (or
long in) a transaction, orphaned prepared transactions and stuck replication
slots.

A queue table is all updates and deletes, so it is the first to bloat when
VACUUM is held back, and what holds VACUUM back is invisible from the queue
itself: every row version newer than the oldest xid or snapshot is "dead but
not yet removable" in every table of the database. These checks name the
culprit (its pid, gid or slot) and how to end it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..units import rounded, secs, xids
from .model import Facts, Finding, Row, Thresholds, ok, warn


def _session_age(s: Row) -> int | None:
    """How many transactions behind this session's xid or snapshot is (None: neither)."""
    ages = [a for a in (s["xid_age"], s["xmin_age"]) if a is not None]
    return max(ages) if ages else None


def _slot_age(s: Row) -> int | None:
    """A slot's `xmin` holds every table back; `catalog_xmin` only the catalogs."""
    return None if s["xmin_age"] is None else int(s["xmin_age"])


def horizon_age(facts: Facts) -> int | None:
    ages = [
        *(_session_age(s) for s in facts.sessions),
        *(p["xid_age"] for p in facts.prepared),
        *(_slot_age(s) for s in facts.slots),
    ]
    known = [int(a) for a in ages if a is not None]
    return max(known) if known else None


def _horizon_holder(facts: Facts, horizon: int) -> str:
    for s in facts.sessions:
        if _session_age(s) == horizon:
            return _session_subject(s)
    for p in facts.prepared:
        if p["xid_age"] == horizon:
            return f"prepared transaction {p['gid']!r}"
    for s in facts.slots:
        if _slot_age(s) == horizon:
            return f"replication slot {s['slot_name']!r}"
    return "unknown"


def horizon_finding(facts: Facts, horizon: int | None) -> Finding:
    if horizon is None:
        return ok(
            "xmin_horizon",
            "database",
            "no other session, prepared transaction or slot holds an xid or snapshot",
            {"horizon_age": None, "holder": None},
        )
    holder = _horizon_holder(facts, horizon)
    return ok(
        "xmin_horizon",
        "database",
        f"oldest xid/snapshot is {horizon:,} transactions behind, held by {holder}",
        {"horizon_age": horizon, "holder": holder},
    )


def _session_subject(s: Row) -> str:
    app = s["application_name"]
    return f"pid {s['pid']} ({app})" if app else f"pid {s['pid']}"


def _holds(s: Row, horizon: int | None) -> str:
    held = [w for w, on in (("an xid", s["has_xid"]), ("a snapshot", s["has_snapshot"])) if on]
    age = _session_age(s)
    if not held or age is None:
        return "holds no xid or snapshot"
    where = "it IS the xmin horizon" if age == horizon else f"the horizon is {horizon:,} behind"
    return f"holds {' and '.join(held)} {age:,} transactions behind; {where}"


def _session_data(s: Row, horizon: int | None) -> dict[str, Any]:
    age = _session_age(s)
    return {
        "pid": s["pid"],
        "usename": s["usename"],
        "application_name": s["application_name"],
        "client_addr": s["client_addr"],
        "backend_type": s["backend_type"],
        "state": s["state"],
        "xact_seconds": rounded(s["xact_seconds"]),
        "state_seconds": rounded(s["state_seconds"]),
        "has_xid": s["has_xid"],
        "has_snapshot": s["has_snapshot"],
        "xid_age": s["xid_age"],
        "xmin_age": s["xmin_age"],
        "holds_horizon": age is not None and age == horizon,
        "horizon_age": horizon,
        "query": s["query"],
    }


def session_findings(sessions: Sequence[Row], horizon: int | None, t: Thresholds) -> list[Finding]:
    """Idle-in-transaction culprits first; otherwise, transactions open too long."""
    found: list[Finding] = []
    for s in sessions:
        idle = str(s["state"] or "").startswith("idle in transaction")
        age = _session_age(s)
        idle_long = idle and (s["state_seconds"] or 0.0) >= t.idle_in_transaction_seconds
        idle_holding = idle and age is not None and age >= t.horizon_xid_age
        if idle_long or idle_holding:
            found.append(_idle_finding(s, horizon))
        elif (s["xact_seconds"] or 0.0) >= t.long_transaction_seconds:
            found.append(_long_finding(s, horizon))
    return found


def _idle_finding(s: Row, horizon: int | None) -> Finding:
    pid = s["pid"]
    return warn(
        "idle_in_transaction",
        _session_subject(s),
        f"{s['state']} for {secs(s['state_seconds'])} (transaction open "
        f"{secs(s['xact_seconds'])}); {_holds(s, horizon)}",
        f"commit or roll back in the app that owns it, or end it: "
        f"SELECT pg_terminate_backend({pid}); set idle_in_transaction_session_timeout",
        _session_data(s, horizon),
    )


def _long_finding(s: Row, horizon: int | None) -> Finding:
    pid = s["pid"]
    return warn(
        "long_transaction",
        _session_subject(s),
        f"transaction open {secs(s['xact_seconds'])}, {s['state'] or 'state unknown'}; "
        f"{_holds(s, horizon)}",
        f"if it should not take this long, cancel it: SELECT pg_cancel_backend({pid}); "
        "run long reports on a replica",
        _session_data(s, horizon),
    )


def prepared_findings(prepared: Sequence[Row], t: Thresholds) -> list[Finding]:
    found: list[Finding] = []
    for p in prepared:
        if (p["seconds"] or 0.0) < t.prepared_xact_seconds:
            continue
        gid = str(p["gid"]).replace("'", "''")
        found.append(
            warn(
                "prepared_transaction",
                f"gid {p['gid']!r}",
                f"prepared {secs(p['seconds'])} ago by {p['owner']}; holds an xid "
                f"{p['xid_age']:,} transactions behind",
                f"ask its transaction manager, then COMMIT PREPARED '{gid}' "
                f"or ROLLBACK PREPARED '{gid}'",
                {
                    "gid": p["gid"],
                    "owner": p["owner"],
                    "seconds": rounded(p["seconds"]),
                    "xid_age": p["xid_age"],
                },
            )
        )
    return found


def slot_findings(slots: Sequence[Row], t: Thresholds) -> list[Finding]:
    found: list[Finding] = []
    for s in slots:
        ages = [a for a in (s["xmin_age"], s["catalog_xmin_age"]) if a is not None]
        worst = max(ages) if ages else 0
        stuck = worst >= t.slot_xid_age or (not s["active"] and worst >= t.horizon_xid_age)
        if not stuck:
            continue
        name = str(s["slot_name"]).replace("'", "''")
        found.append(
            warn(
                "replication_slot",
                f"slot {s['slot_name']}",
                f"{s['slot_type']} slot, {'active' if s['active'] else 'INACTIVE'}; "
                f"xmin {xids(s['xmin_age'])}, catalog_xmin {xids(s['catalog_xmin_age'])} "
                "transactions behind",
                f"if nothing consumes it any more, drop it: "
                f"SELECT pg_drop_replication_slot('{name}'); else fix its standby or subscriber",
                {
                    "slot_name": s["slot_name"],
                    "slot_type": s["slot_type"],
                    "active": s["active"],
                    "active_pid": s["active_pid"],
                    "xmin_age": s["xmin_age"],
                    "catalog_xmin_age": s["catalog_xmin_age"],
                },
            )
        )
    return found
