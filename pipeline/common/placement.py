"""Placement by node labels: keep Ray Data stages on CPU ("data") nodes and Train workers on GPU ("train") nodes.

Ray 2.60 expresses this with *label selectors* (``ray start --labels prolip-role=data``; the cluster
configs in ``cluster/`` label their node types the same way):

- Ray Data: ``ExecutionOptions.label_selector`` on a dataset's ``DataContext`` is added to every task and
  actor the dataset launches — reads, maps, actor pools and the hash-shuffle aggregators of ``groupby``.
  A derived dataset copies its parent's context, so scoping the source dataset scopes the whole plan.
- Ray Train: ``ScalingConfig(label_selector=...)`` places the workers; the training ingest runs under
  ``ray.train.DataConfig(execution_options=...)``, which *replaces* the dataset's execution options, so
  the selector has to travel there as well (``pipeline.ingest.dataset.train_dataset_config``).

Only plain values here (no Ray import): the Ray objects are built in pipeline/ingest/dataset.py and
training/train/trainer.py.

An empty selector adds no constraint, so nothing changes on a laptop or a cluster without labels.
Placement by label needs autoscaler v2 to scale up the right node type (v1 ignores labels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LABEL_KEY = "prolip-role"  # the label the cluster configs put on their node types
DATA_ROLE = "data"  # CPU nodes: downloads, ingest, decode
TRAIN_ROLE = "train"  # GPU nodes: Train workers


def scope_dataset(ds: Any, selector: Mapping[str, str] | None) -> Any:
    """Constrain every task and actor of ``ds`` (and of datasets derived from it later) to nodes whose
    labels match ``selector``; returns ``ds``. No-op for an empty selector."""
    if selector:
        ds.context.execution_options.label_selector = {str(k): str(v) for k, v in selector.items()}
    return ds


def worker_label_selector(selector: Mapping[str, str] | None) -> dict[str, str] | None:
    """``ScalingConfig(label_selector=...)`` value: None (no constraint) for an empty selector."""
    return {str(k): str(v) for k, v in selector.items()} if selector else None
