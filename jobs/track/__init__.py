"""``python -m jobs.track``: see ``jobs/track/cli.py``."""

from jobs.track.cli import main

__all__ = ["main"]
