"""Where the repository is, for children that import `bench` from it."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
