"""The report for people: one line per finding, the advice under each WARN.
(For machines, `Report.as_dict` / `Report.to_json` give the JSON shape.)"""

from __future__ import annotations

from .model import Report


def render_text(report: Report) -> str:
    """The human report: one line per finding, the advice under each WARN."""
    lines = [
        f"jobq doctor: table {report.table} in database {report.database} "
        f"(PostgreSQL {report.server_version}) at {report.checked_at:%Y-%m-%d %H:%M:%S %Z}",
        "",
        f"{'STATUS':<6}  {'CHECK':<22}  {'SUBJECT':<26}  DETAIL",
    ]
    for f in report.findings:
        lines.append(f"{f.level.upper():<6}  {f.check:<22}  {f.subject:<26}  {f.summary}")
        if f.advice:
            lines.append(f"{'':<8}-> {f.advice}")
    count = len(report.warnings)
    lines += [
        "",
        "healthy: nothing needs attention"
        if report.healthy
        else f"{count} finding(s) need attention (exit status 1)",
    ]
    return "\n".join(lines)
