"""`python -m bench.peers`: sqla_jobq against procrastinate and pgqueuer, in one run.

The orchestrator is `bench/peers/run.py` (it runs in this checkout's
environment); `pgqueuer_app.py` and `procrastinate_app.py` run inside each
peer's own virtualenv and import nothing from sqla_jobq. This file imports
nothing, so a peer's interpreter can load its app from here.
"""
