"""`python -m bench`: see bench/runner.py."""

import sys

from .runner import main

sys.exit(main())
