"""`python -m bench`: see bench/suite/runner.py."""

import sys

from .suite.runner import main

sys.exit(main())
