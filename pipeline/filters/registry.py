"""The filter registry: every named filter, the parameters a spec may give it (with defaults that type
them), the columns it reads, and the table it reads (the pool's metadata or model scores).

Each entry adapts ``(table, ctx, **params)`` to a rule function of ``pipeline.filters.datacomp``,
``pipeline.filters.text_based`` or ``pipeline.filters.scores``; ``pipeline.filters.specs`` parses spec strings against
this registry and runs them (its docstring has the spec syntax).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from pipeline import schema as S
from pipeline.common.config import (
    Finite,
    Fraction,
    NonNegativeFloat,
    OpenFraction,
    Positive,
    PositiveFloat,
    Seed,
    config_class,
)
from pipeline.common.storage import LOCAL, Storage
from pipeline.config import FilterConfig
from pipeline.filters import datacomp as F
from pipeline.filters import embedding as C
from pipeline.filters import scores as SF
from pipeline.filters import text_based as T
from pipeline.filters import wordnet as WN
from pipeline.filters.base import FilterError, FilterResult

METADATA, SCORES = "metadata", "scores"  # the table a filter reads: the pool's metadata, or model scores
SCORE_KEYS = ("uid", "ok")  # every score filter reads these (``training.infer.scoring.SCORE_COLUMNS``)


@dataclass(frozen=True)
class Context:
    """What some filters need beyond the table: fastText labels aligned with the rows (or a
    ``LanguageId``; else a ``lang`` column is read) and the storage their input files live on."""

    lang: Any = None
    store: Storage = LOCAL
    metadata: tuple[str, ...] = ()  # the pool's metadata files: DataComp's embeddings sit beside them


@dataclass(frozen=True)
class Filter:
    run: Callable[..., FilterResult]  # run(table, ctx, **params)
    settings: type | None = None  # the parameters a spec may give: a config class (types, ranges, defaults)
    columns: tuple[str, ...] = ()  # columns read, besides a ``column`` parameter's value
    table: str = METADATA
    language: bool = False  # needs fastText labels

    @property
    def params(self) -> dict[str, Any]:
        """Parameter name → default (None for one the spec must give)."""
        if self.settings is None:
            return {}
        return {f.name: f.default for f in dataclasses.fields(self.settings)}

    def needs(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        return self.columns + ((params["column"],) if "column" in params else ())


# --- each filter's parameters, declared once (a spec's ``key=value`` is validated against these) --------


@config_class
class RandomParams:
    fraction: OpenFraction = 0.3
    seed: Seed = 0


@config_class
class TextBasedParams:
    method: Literal["wordnet", "lemmas"] = "wordnet"
    wordnet: str = ""
    synsets_file: str = ""
    concepts_file: str = ""


@config_class
class ClipScoreParams:
    column: str = S.CLIP_L14
    fraction: Annotated[float, Field(ge=0, lt=1)] = 0.3  # 0 = by threshold
    threshold: Finite = 0.3
    nan_cut: Literal["datacomp", "all_scored"] = "datacomp"


@config_class
class Laion2bParams:
    threshold: Finite = 0.28
    language_model: Literal["cld3", "fasttext"] = "cld3"


@config_class
class ImageBasedParams:
    embeddings_file: str = ""
    centroids_file: str = ""
    centroid_ids_file: str = ""


@config_class
class NegClipLossParams:
    fraction: OpenFraction = 0.3  # the paper's top 30% on DataComp small/medium
    embeddings_file: str = ""  # empty = DataComp's .npz beside each metadata parquet
    image_key: str = "l14_img"
    text_key: str = "l14_txt"
    temperature: PositiveFloat = 0.01  # τ of the teacher CLIP (OpenAI's learned 1/100)
    batch_size: Positive = 32768
    batches: Positive = 10  # K random batches per row
    seed: Seed = 0


@config_class
class NormSimParams:
    fraction: OpenFraction = 0.3
    target_file: str = ""  # the target distribution's image embeddings (ImageNet-1k train in the paper)
    target_key: str = "embedding"
    embeddings_file: str = ""
    image_key: str = "l14_img"
    p: Annotated[float, Field(ge=1)] = 2.0  # 2, or inf for the best match


@config_class
class CsdBestParams:
    fraction: OpenFraction = 0.2


@config_class
class CsdUncertaintyParams:
    fraction: OpenFraction = 0.2
    text_unc_quantile: OpenFraction = 0.9
    text_unc_low_quantile: Fraction = 0.0  # may be 0; below text_unc_quantile, checked by the rule


@config_class
class CsdUcbParams:
    fraction: OpenFraction = 0.2
    k: NonNegativeFloat = 1.0  # standard deviations of ‖z_v − z_t‖² added to CSD


@config_class
class CsdInclusionParams:
    fraction: OpenFraction = 0.2
    inclusion_quantile: Annotated[float, Field(ge=0, lt=1)] = 0.1


@config_class
class CsdPosteriorParams:
    fraction: OpenFraction = 0.2  # entries listed, as a fraction of the scorable rows
    scale: PositiveFloat = 10.0  # the scorer's logit scale a (exp of its log scale; SigLIP init 10)
    bias: Finite = -10.0  # and its bias b
    seed: Seed = 0


@config_class
class ClipScoreBestParams:
    fraction: OpenFraction = 0.3


@config_class
class ThresholdParams:
    threshold: Finite = 0.3


@config_class
class SameSizeParams:
    n_keep: Positive | None = None  # required, unless the spec gives of=LABEL
    seed: Seed = 0


# --- adapters from (table, ctx, **params) to the rule functions -----------------------------------------


def _file(name: str, key: str, path: str) -> str:
    if not path:
        hint = f" (filters.{_CONFIG_KEYS[key]})" if key in _CONFIG_KEYS else ""
        raise FilterError(f"filter {name!r} needs {key}={hint}")
    return path


def _clip_score(
    t: Any, ctx: Context, column: str, fraction: float, threshold: float, nan_cut: str
) -> FilterResult:
    if fraction > 0:
        return F.clip_score_fraction(t, column, fraction, nan_cut=nan_cut)
    return F.clip_score_threshold(t, column, threshold)


def _read(name: str, key: str, path: str, store: Storage) -> bytes:
    path = _file(name, key, path)
    try:
        return store.read_bytes(path)
    except FileNotFoundError as exc:
        raise FilterError(f"filter {name!r}: file not found: {path}") from exc


def _text_based(
    t: Any, ctx: Context, method: str, wordnet: str, synsets_file: str, concepts_file: str
) -> FilterResult:
    if method == "lemmas":
        concepts = T.load_concepts(io.BytesIO(_read("text_based", "concepts_file", concepts_file, ctx.store)))
        return T.text_based_lemmas(t, concepts, ctx.lang)
    ids = _read("text_based", "synsets_file", synsets_file, ctx.store).decode("utf-8").splitlines()
    try:
        wn = WN.WordNet.load(_file("text_based", "wordnet", wordnet), ctx.store)
        synset_ids = WN.load_synset_ids(ids)
    except WN.WordNetError as exc:
        raise FilterError(f"filter 'text_based': {exc}") from exc
    return T.text_based(t, wn, synset_ids, ctx.lang)


def _image_based(
    t: Any, ctx: Context, embeddings_file: str, centroids_file: str, centroid_ids_file: str
) -> FilterResult:
    emb_path = _file("image_based", "embeddings_file", embeddings_file)
    cen_path = _file("image_based", "centroids_file", centroids_file)
    ids_path = _file("image_based", "centroid_ids_file", centroid_ids_file)
    try:
        emb = C.load_embeddings(emb_path, ctx.store)
        centroids = C.load_centroids(cen_path, ctx.store)
        target = C.load_centroid_ids(ids_path, ctx.store)
    except (FileNotFoundError, ValueError) as exc:
        raise FilterError(f"filter 'image_based': {exc}") from exc
    return F.image_based(t, emb, centroids, target, ctx.lang)


def _pool_embeddings(name: str, ctx: Context, path: str, keys: tuple[str, ...]) -> list[C.Embeddings]:
    """The embeddings ``keys`` of ``path`` or, when it is empty, of the shards beside the pool's metadata."""
    sources = [path] if path else list(ctx.metadata)
    if not sources:
        raise FilterError(f"filter {name!r} needs embeddings_file= (no metadata files to find them beside)")
    uids: list[str] = []
    parts: dict[str, list] = {k: [] for k in keys}
    try:
        for src in sources:
            u, arrays = C.load_embedding_set(src, keys, ctx.store)
            uids += u
            for k in keys:
                parts[k].append(arrays[k])
    except (FileNotFoundError, ValueError) as exc:
        raise FilterError(f"filter {name!r}: {exc}") from exc
    return [C.Embeddings(uids, np.concatenate(parts[k])) for k in keys]


def _neg_clip_loss(
    t: Any, ctx: Context, fraction: float, embeddings_file: str, image_key: str, text_key: str,
    temperature: float, batch_size: int, batches: int, seed: int,
) -> FilterResult:  # fmt: skip
    image, text = _pool_embeddings("neg_clip_loss", ctx, embeddings_file, (image_key, text_key))
    return C.neg_clip_loss(
        t, (image, text), fraction, tau=temperature, batch_size=batch_size, batches=batches, seed=seed
    )


def _norm_sim(
    t: Any, ctx: Context, fraction: float, target_file: str, target_key: str, embeddings_file: str,
    image_key: str, p: float,
) -> FilterResult:  # fmt: skip
    target_file = _file("norm_sim", "target_file", target_file)
    (image,) = _pool_embeddings("norm_sim", ctx, embeddings_file, (image_key,))
    try:
        targets = C.load_targets(target_file, ctx.store, target_key)
    except (FileNotFoundError, ValueError) as exc:
        raise FilterError(f"filter 'norm_sim': {exc}") from exc
    return C.norm_sim(t, image, targets, fraction, p)


def _laion2b(t: Any, ctx: Context, threshold: float, language_model: str) -> FilterResult:
    if language_model == "cld3":  # DataComp's laion2b rule used gcld3
        from pipeline.filters.language import Cld3LanguageId

        return F.laion2b(t, threshold, Cld3LanguageId())
    return F.laion2b(t, threshold, ctx.lang)


def _on_scores(rule: Callable[..., FilterResult]) -> Callable[..., FilterResult]:
    return lambda t, ctx, **params: rule(t, **params)


_CONFIG_KEYS = {
    "wordnet": "text_wordnet",
    "synsets_file": "text_synsets_file",
    "concepts_file": "text_concepts_file",
    "embeddings_file": "image_embeddings_file",
    "centroids_file": "image_centroids_file",
    "centroid_ids_file": "image_centroid_ids_file",
}
_SIZE = (S.TEXT, S.ORIGINAL_WIDTH, S.ORIGINAL_HEIGHT)
FILTERS: dict[str, Filter] = {
    # DataComp's baselines, over the pool's metadata (pipeline.filters.datacomp).
    "no_filter": Filter(lambda t, ctx: F.no_filter(t)),
    "random": Filter(lambda t, ctx, **p: F.random_subset(t, **p), RandomParams, (S.UID,)),
    "english": Filter(lambda t, ctx: F.english(t, ctx.lang), None, (S.TEXT,), language=True),
    "basic": Filter(lambda t, ctx: F.basic(t, ctx.lang), None, _SIZE, language=True),
    "text_based": Filter(_text_based, TextBasedParams, (S.TEXT,), language=True),
    "clip_score": Filter(_clip_score, ClipScoreParams),
    "laion2b": Filter(_laion2b, Laion2bParams, (S.CLIP_B32, S.TEXT), language=True),
    "image_based": Filter(_image_based, ImageBasedParams, (S.UID, S.TEXT), language=True),
    # On embeddings alone, keyed by uid (pipeline.filters.embedding): any table with a uid column.
    "neg_clip_loss": Filter(_neg_clip_loss, NegClipLossParams, (S.UID,)),
    "norm_sim": Filter(_norm_sim, NormSimParams, (S.UID,)),
    # Our model's scores (pipeline.filters.scores over training.infer.scoring's table).
    "csd_best": Filter(_on_scores(SF.csd_best), CsdBestParams, (*SCORE_KEYS, "csd"), SCORES),
    "csd_uncertainty_aware": Filter(
        _on_scores(SF.csd_uncertainty_aware), CsdUncertaintyParams, (*SCORE_KEYS, "csd", "text_unc"), SCORES
    ),
    "csd_ucb": Filter(_on_scores(SF.csd_ucb), CsdUcbParams, (*SCORE_KEYS, "csd", "csd_std"), SCORES),
    "csd_inclusion": Filter(
        _on_scores(SF.csd_inclusion), CsdInclusionParams, (*SCORE_KEYS, "csd", "inclusion"), SCORES
    ),
    "csd_posterior": Filter(
        _on_scores(SF.csd_posterior),
        CsdPosteriorParams,
        (*SCORE_KEYS, "csd", "dot", "image_unc", "text_unc"),
        SCORES,
    ),
    "clip_score_best": Filter(
        _on_scores(SF.clip_score_best), ClipScoreBestParams, (*SCORE_KEYS, "cosine"), SCORES
    ),
    "clip_score_threshold": Filter(
        _on_scores(SF.clip_score_threshold), ThresholdParams, (*SCORE_KEYS, "cosine"), SCORES
    ),
    "random_same_size": Filter(_on_scores(SF.random_same_size), SameSizeParams, SCORE_KEYS, SCORES),
}


def config_params(cfg: FilterConfig) -> dict[str, dict[str, Any]]:
    """The build's ``FilterConfig`` fields as per-filter parameters (a spec's own ``key=value`` wins)."""
    return {
        "random": {"fraction": cfg.random_fraction, "seed": cfg.random_seed},
        "clip_score": {
            "column": cfg.clip_column,
            "fraction": cfg.clip_fraction,
            "threshold": cfg.clip_threshold,
        },
        "laion2b": {"threshold": cfg.laion_threshold},
        "text_based": {
            k: getattr(cfg, _CONFIG_KEYS[k]) for k in ("wordnet", "synsets_file", "concepts_file")
        },
        "image_based": {k: getattr(cfg, _CONFIG_KEYS[k]) for k in FILTERS["image_based"].params},
    }
