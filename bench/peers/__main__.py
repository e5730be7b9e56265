"""`python -m bench.peers`: see bench/peers/run.py."""

import sys

from .run import main

sys.exit(main())
