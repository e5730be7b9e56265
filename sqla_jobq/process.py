"""Process-wide settings `jobq worker` makes for the process it owns (internal).

Both settings are process-wide, so only the command applies them: an app
that runs a `Worker` inside its own process keeps Python's defaults unless it
chooses otherwise.
"""

from __future__ import annotations

import gc
import sys

# How long a thread may hold the GIL while another waits for it (Python's
# default: 5 ms). A handler thread woken while the event loop is busy gets
# the GIL only when the loop waits on a socket or this interval runs out; the
# faster the database answers, the less the loop waits, and short handlers sat
# idle for up to 5 ms at a time. When the fenced completions got 0.7 ms
# faster, `--burst -c 8` drained no-op jobs 0.82x as fast at 5 ms (16
# interleaved rounds), and 1.05x as fast as before at 1 ms (16 rounds; at
# 20 ms, 0.71x). Async handlers, which never wait for the GIL, drained at
# 1.02x without it.
SWITCH_INTERVAL = 0.001


def hand_the_gil_over_sooner() -> None:
    """Set the process's GIL switch interval to SWITCH_INTERVAL."""
    sys.setswitchinterval(SWITCH_INTERVAL)


def freeze_what_startup_made() -> None:
    """Move every object alive now (the app's modules, SQLAlchemy's, ours:
    kept for the process's life) out of reach of the cyclic garbage collector.

    A busy worker makes objects that outlive a young collection (claimed
    rows, attempts waiting for their completion batch), so Python runs a full
    collection about every 11,000 jobs, and a full collection scans every
    tracked object in the process with the GIL held: the event loop, the
    listener and every handler thread stop meanwhile. With the 80,000 objects
    a worker starts with, each stopped the process for 41 ms (median of 9 in
    a drain of 100,000 jobs here); with them frozen, 0.3 ms. The cost: cyclic
    garbage made of objects alive at this moment is never collected. What is
    garbage already is collected first; what startup builds is meant to live
    as long as the process.
    """
    gc.collect()
    gc.freeze()
