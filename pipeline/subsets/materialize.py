"""Every subset of a filter run as its own shard set: one ``reshard`` per subset ``.npy``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipeline.common.storage import Storage
from pipeline.subsets.reshard import ReshardResult, reshard


def reshard_subsets(
    store: Storage,
    shards: str | Sequence[str],
    subsets: Mapping[str, str],
    outputs: Mapping[str, str],
    samples_per_shard: int,
    workers: int = 1,
) -> dict[str, ReshardResult]:
    """Materialise each subset ``.npy`` (``subsets[label]``) from ``shards`` into ``outputs[label]``.
    Overwrites earlier output; a damaged input shard keeps the samples before the damage and is listed in
    the result (``corrupt_inputs``) instead of stopping every subset."""
    return {
        label: reshard(
            shards,
            path,
            outputs[label],
            samples_per_shard=samples_per_shard,
            store=store,
            workers=workers,
            overwrite=True,
            skip_corrupt=True,
        )
        for label, path in subsets.items()
    }
