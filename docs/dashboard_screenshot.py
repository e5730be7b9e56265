"""Regenerate docs/dashboard.png: the overview of a queue with an hour of history,
one queue paused (its backlog growing) and one held to a concurrency limit.

    .venv/bin/python docs/dashboard_screenshot.py [DATABASE_URL]

Works on a scratch queue table, dropped afterwards, in DATABASE_URL (default:
the local server on 127.0.0.1:5432), and drives Debian's Chromium
(/usr/bin/chromium) with Playwright, as tests/db/test_dashboard_browser.py does.
"""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path

import psycopg
import uvicorn
from playwright.sync_api import sync_playwright
from sqlalchemy import MetaData

from sqla_jobq import dashboard
from sqla_jobq.dashboard.server import bind, dashboard_engine
from sqla_jobq.db import conninfo, sqlalchemy_url
from sqla_jobq.migrations.steps import LATEST, down_statements, up_statements
from sqla_jobq.schema import Names, jobs_table

OUT = Path(__file__).with_name("dashboard.png")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

# An hour of history, then the present: ready (aged), scheduled, running, failed;
# mail paused 12 minutes ago with jobs piling up, media limited to 4 at once.
SEED = """
INSERT INTO {t} (queue, task, payload, status, attempts, run_at, started_at, finished_at)
SELECT q.queue, q.task, '{{}}', 'done', 1, f - interval '2 seconds', f - interval '1 second', f
FROM (VALUES ('default', 'send_welcome_email', 9), ('mail', 'send_receipt', 5),
             ('media', 'resize_image', 3)) AS q(queue, task, rate),
     generate_series(1, 3600, 7) AS s(i),
     LATERAL (SELECT now() - make_interval(secs => s.i) AS f) AS at
WHERE (s.i / 60 + q.rate) % 11 < q.rate + 4 * sin(s.i / 600.0);
INSERT INTO {t} (queue, task, payload, status, attempts, last_error, finished_at)
SELECT 'mail', 'send_receipt', '{{"order_id": 1}}', 'failed', 5, 'SMTPServerDisconnected: 451',
       now() - make_interval(mins => m)
FROM generate_series(3, 57, 9) AS m;
INSERT INTO {t} (queue, task, payload, run_at)
SELECT 'default', 'send_welcome_email', '{{}}', now() - make_interval(secs => s)
FROM generate_series(1, 41) AS s;
INSERT INTO {t} (queue, task, payload, run_at)
SELECT 'reports', 'nightly_report', '{{}}', now() + make_interval(hours => h)
FROM generate_series(1, 6) AS h;
INSERT INTO {t} (queue, task, payload, status, attempts, started_at, locked_until)
SELECT 'media', 'resize_image', '{{}}', 'running', 1, now(), now() + interval '5 minutes'
FROM generate_series(1, 4);
INSERT INTO {t} (queue, task, payload, run_at)
SELECT 'mail', 'send_receipt', '{{"order_id": 2}}', now() - make_interval(secs => s * 40)
FROM generate_series(1, 17) AS s;
INSERT INTO {q} (name, paused, updated_at) VALUES ('mail', true, now() - interval '12 minutes');
INSERT INTO {q} (name, concurrency_limit) VALUES ('media', 4);
"""


def main(url: str) -> None:
    names = Names(f"jobs_screenshot_{uuid.uuid4().hex[:6]}", None)
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        for sql in up_statements(names, 0, LATEST):
            conn.execute(sql.encode())
        conn.execute(SEED.format(t=names.qualified, q=names.queues_qualified).encode())
    engine = dashboard_engine(sqlalchemy_url(url))
    sock = bind("127.0.0.1", 0)
    app = dashboard.app(engine, jobs_table(MetaData(), names.table))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1120, "height": 640})
            page.goto(f"http://127.0.0.1:{sock.getsockname()[1]}/")
            page.screenshot(path=str(OUT), full_page=True)
            browser.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.dispose()
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            for sql in down_statements(names, LATEST, 0):
                conn.execute(sql.encode())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/postgres")
