"""``python -m jobs.fetch``: see ``jobs/fetch/cli.py``."""
