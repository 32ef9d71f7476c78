"""``python -m jobs.filter``: see ``jobs/filter/cli.py``."""
