"""Copies of Hugging Face hub dataset repos (DataComp's pool metadata, the evaluation sets) in a local
folder or on S3: listed at one commit, fetched resumably, each file checked against the hub's hash."""
