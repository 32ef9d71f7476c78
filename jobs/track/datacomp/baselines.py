"""DataComp's CLIP-score baselines as track subsets, read from the metadata's own scores.

DataComp's ``clip_score`` baselines rank the pool by the metadata's ``clip_l14_similarity_score`` (OpenAI
CLIP ViT-L/14) or ``clip_b32_similarity_score`` and keep a top fraction of the whole pool; the ProLIP paper
(Table C.7) sets CSD at 20% beside CLIP L/14 at 20% and 30%. The track names them:

- ``clip_score_l14``: L/14 at the CSD subsets' fraction (``csd_fraction``) — the verdict's control for CSD
  and each uncertainty-native method at the same fraction;
- ``clip_score_l14_30``, ``clip_score_b32_30``: DataComp's published 30% baselines.

They are build filters (``clip_score`` over the metadata, DataComp's threshold rule), added to the build's
``filters.names`` by the track, so their subsets list metadata uids as DataComp's do. Our own scorer's
cosine is the ``scorer_cosine`` subset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeline import schema as S

# subset → (metadata column, fraction; None = the track's csd_fraction)
METADATA_SCORES: dict[str, tuple[str, float | None]] = {
    "clip_score_l14": (S.CLIP_L14, None),
    "clip_score_l14_30": (S.CLIP_L14, 0.3),
    "clip_score_b32_30": (S.CLIP_B32, 0.3),
}
SAME_FRACTION = "clip_score_l14"  # the verdict's control at the CSD fraction


def build_specs(cfg: Any) -> list[str]:
    """The build filter specs of the track's CLIP-score subsets, labelled by subset."""
    out = []
    for name in cfg.subsets:
        if name in METADATA_SCORES:
            column, fraction = METADATA_SCORES[name]
            out.append(f"clip_score:column={column},fraction={fraction or cfg.csd_fraction},label={name}")
    return out


def with_baselines(cfg: Any, bcfg: Any) -> Any:
    """``bcfg`` (the build's config) with the track's CLIP-score subsets among its filters."""
    extra = [spec for spec in build_specs(cfg) if spec not in bcfg.filters.names]
    if not extra:
        return bcfg
    return dataclasses.replace(
        bcfg, filters=dataclasses.replace(bcfg.filters, names=[*bcfg.filters.names, *extra])
    )
