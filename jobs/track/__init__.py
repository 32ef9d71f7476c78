"""``python -m jobs.track``: see ``jobs/track/cli.py``."""
