"""``python -m jobs.filter``: see ``jobs/filter/cli.py``."""

from jobs.filter.cli import main

__all__ = ["main"]
