"""Starting points: a track from shards that exist already and from a scorer trained elsewhere.

- ``start_shards``: a folder of webdataset shards — DataComp's ``download_upstream.py`` output
  (img2dataset's ``{:08d}.tar`` with ``.json`` members holding the uid) or our build's — used in place of the
  build. ``no_filter`` lists every uid the shards hold; the score subsets come from scoring them. The
  metadata filters (basic, the CLIP-score baselines) need the build and are refused with it.
- ``start_scorer``: ``openclip:MODEL:LOCATION`` or ``prolip:LOCATION`` (imported once, training/imports/) or
  one of our checkpoint directories, used in place of training the scorer. Its tokenizer is the track's.

Both record their origin in ``track_state.json`` under the step they replace, so a resumed run skips them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.common import storage

Log = Callable[[str], None]


def _uids(batch: pa.Table) -> pa.Table:
    from pipeline.ingest.subset_reader import row_uid

    keys, metas = batch.column("key").to_pylist(), batch.column("json").to_pylist()
    uids = [row_uid(k, m) for k, m in zip(keys, metas, strict=True)]
    return pa.table({"uid": pa.array([u for u in uids if u is not None], pa.string())})


def adopt_shards(cfg: Any, log: Log) -> dict[str, Any]:
    """The build step's record for ``cfg.start_shards``: every uid in the shards as ``no_filter``."""
    import ray

    from pipeline.shards.ray_reader import read_shards
    from pipeline.subsets.uid_files import write_subset

    store = cfg.storage.store()
    ds = read_shards(cfg.start_shards, store, with_json=True).map_batches(_uids, batch_format="pyarrow")
    tables = ray.get(ds.to_arrow_refs())
    uids = np.unique(np.concatenate([t.column("uid").to_numpy(zero_copy_only=False) for t in tables] or [[]]))
    path = storage.join(cfg.output, "subsets", "no_filter.npy")
    with store.open_output(path) as fh:
        write_subset(uids.tolist(), fh)
    log(f"[track]   existing shards {cfg.start_shards}: {len(uids)} samples; no build")
    return {
        "n_input": int(len(uids)),
        "status": {"success": int(len(uids))},
        "subsets": {"no_filter": path},
        "curation": {},
        "adopted_from": cfg.start_shards,
    }


def start_scorer(cfg: Any, checkpoint: str, log: Log) -> dict[str, Any]:
    """The scorer step's record for ``cfg.start_scorer``: imported into ``checkpoint`` when it is an import
    source, else used where it is."""
    from training.imports.load import import_checkpoint, is_import_source
    from training.model.checkpoint import load_extra

    store = cfg.storage.store()
    if is_import_source(cfg.start_scorer):
        import_checkpoint(
            cfg.start_scorer, checkpoint, store, cfg.scorer.tokenizer, cfg.scorer.tokenizer_clean
        )
    extra = (
        load_extra(checkpoint)
        if not storage.is_s3(checkpoint)
        else store.read_json(storage.join(checkpoint, "extra.json"))
    )
    log(
        f"[track]   scorer {cfg.start_scorer}: {extra.get('loss', '?')} model at {checkpoint}; not trained here"
    )
    return {
        "checkpoint": checkpoint,
        "loss": extra.get("loss", "imported"),
        "samples_seen": extra.get("samples_seen"),
        "seed": cfg.seeds[0],
        "imported_from": cfg.start_scorer,
    }


def build_or_adopt(cfg: Any, log: Log) -> dict[str, Any]:
    """The build step: the build, or the existing shards of ``start_shards``."""
    from jobs.track.steps import build_pool

    return adopt_shards(cfg, log) if cfg.start_shards else build_pool(cfg, log)


def scorer_or_start(cfg: Any, log: Log) -> dict[str, Any]:
    """The scorer step: a ProLIP trained on the unfiltered pool, or the scorer of ``start_scorer``."""
    from jobs.track.config import paths
    from jobs.track.steps import train_models

    p = paths(cfg)
    if cfg.start_scorer:
        return start_scorer(cfg, p["scorer_import"], log)
    return train_models(cfg, {"scorer": (cfg.scorer, p["shards"], cfg.seeds[0], "")}, log)["scorer"]
