"""``python -m jobs.export_checkpoint``: one of our checkpoints out to open_clip or the released ProLIP layout."""
