"""Every named filter as one class: its typed parameters (each default written here once, with its source),
the columns and the table it reads, and ``run``, which applies its rule function of
``pipeline.filters.datacomp``, ``pipeline.filters.embedding``, ``pipeline.filters.text_based`` or
``pipeline.filters.scores`` to a table.

Defining a subclass of ``Filter`` registers it by its ``name`` (``pipeline/common/components.py``): the
build's ``filters.names``, the filter job and the track then take it by name, and ``--help-config`` lists
it with its parameters. ``pipeline.filters.specs`` parses spec strings into these classes and runs them
(its docstring has the spec syntax).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from pipeline import schema as S
from pipeline.common.components import Component
from pipeline.common.config import (
    ConfigError,
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
from pipeline.filters import datacomp as F
from pipeline.filters import embedding as C
from pipeline.filters import scores as SF
from pipeline.filters import text_based as T
from pipeline.filters import wordnet as WN
from pipeline.filters.base import FilterError, FilterResult

METADATA, SCORES = "metadata", "scores"  # the table a filter reads: the pool's metadata, or model scores
SCORE_KEYS = ("uid", "ok")  # every score filter reads these (``training.infer.scoring.SCORE_COLUMNS``)
_SIZE = (S.TEXT, S.ORIGINAL_WIDTH, S.ORIGINAL_HEIGHT)


@dataclass(frozen=True)
class Context:
    """What some filters need beyond the table: fastText labels aligned with the rows (or a
    ``LanguageId``; else a ``lang`` column is read) and the storage their input files live on."""

    lang: Any = None
    store: Storage = LOCAL
    metadata: tuple[str, ...] = ()  # the pool's metadata files: DataComp's embeddings sit beside them


class Filter(Component, family="filter", default="no_filter"):
    """A named rule over a table: ``run(table, ctx)`` → ``FilterResult`` (a keep mask, a reason per row).

    ``columns``: the columns it reads (besides a ``column`` parameter's value); ``table``: the pool's
    metadata or model scores; ``language``: needs fastText labels.
    """

    columns: ClassVar[tuple[str, ...]] = ()
    table: ClassVar[str] = METADATA
    language: ClassVar[bool] = False

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Parameter name → default (None for one the spec must give)."""
        return {k: f.default for k, f in cls.__dataclass_fields__.items() if k != "name"}  # type: ignore[attr-defined]

    def needs(self) -> tuple[str, ...]:
        column = getattr(self, "column", None)
        return self.columns + ((column,) if column else ())

    def run(self, t: Any, ctx: Context) -> FilterResult:
        raise NotImplementedError


# --- the input files some filters read ------------------------------------------------------------------


def _file(name: str, key: str, path: str) -> str:
    if not path:
        raise FilterError(f"filter {name!r} needs {key}= (e.g. {name}:{key}=PATH)")
    return path


def _read(name: str, key: str, path: str, store: Storage) -> bytes:
    path = _file(name, key, path)
    try:
        return store.read_bytes(path)
    except FileNotFoundError as exc:
        raise FilterError(f"filter {name!r}: file not found: {path}") from exc


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


# --- DataComp's baselines, over the pool's metadata (pipeline.filters.datacomp) ---------------------------


@config_class
class NoFilter(Filter):
    """Every row (DataComp's no_filter)."""

    name: Literal["no_filter"] = "no_filter"  # the filter

    def run(self, t: Any, ctx: Context) -> FilterResult:
        return F.no_filter(t)


@config_class
class RandomFilter(Filter):
    """A seeded random share of the pool (DataComp's random baseline)."""

    columns = (S.UID,)
    name: Literal["random"] = "random"  # the filter
    fraction: OpenFraction = 0.3  # the share kept (DataComp's random baseline: 30%)
    seed: Seed = 0  # the draw

    def run(self, t: Any, ctx: Context) -> FilterResult:
        return F.random_subset(t, self.fraction, self.seed)


@config_class
class English(Filter):
    """English captions by fastText (DataComp's language filter)."""

    columns = (S.TEXT,)
    language = True
    name: Literal["english"] = "english"  # the filter

    def run(self, t: Any, ctx: Context) -> FilterResult:
        return F.english(t, ctx.lang)


@config_class
class Basic(Filter):
    """DataComp's basic filter: English, caption length, image size and aspect."""

    columns = _SIZE
    language = True
    name: Literal["basic"] = "basic"  # the filter

    def run(self, t: Any, ctx: Context) -> FilterResult:
        return F.basic(t, ctx.lang)


@config_class
class TextBased(Filter):
    """Captions naming an ImageNet-21k concept (DataComp's text-based filter)."""

    columns = (S.TEXT,)
    language = True
    name: Literal["text_based"] = "text_based"  # the filter
    method: Literal["wordnet", "lemmas"] = "wordnet"  # WordNet synsets, or DataComp's lemma list
    wordnet: str = ""  # a WordNet 3.0 dict directory or nltk's wordnet.zip
    synsets_file: str = ""  # DataComp's ImageNet-21k synset id list
    concepts_file: str = ""  # method=lemmas only: the concept lemmas

    def run(self, t: Any, ctx: Context) -> FilterResult:
        if self.method == "lemmas":
            data = _read("text_based", "concepts_file", self.concepts_file, ctx.store)
            return T.text_based_lemmas(t, T.load_concepts(io.BytesIO(data)), ctx.lang)
        ids = _read("text_based", "synsets_file", self.synsets_file, ctx.store).decode("utf-8").splitlines()
        try:
            wn = WN.WordNet.load(_file("text_based", "wordnet", self.wordnet), ctx.store)
            synset_ids = WN.load_synset_ids(ids)
        except WN.WordNetError as exc:
            raise FilterError(f"filter 'text_based': {exc}") from exc
        return T.text_based(t, wn, synset_ids, ctx.lang)


@config_class
class ClipScore(Filter):
    """Top CLIP scores of the metadata (DataComp's CLIP-score filter), by fraction or threshold."""

    name: Literal["clip_score"] = "clip_score"  # the filter
    column: str = S.CLIP_L14  # the metadata column ranked
    # The share kept; 0 = keep scores at or above ``threshold`` instead. DataComp's get_threshold indexes
    # past the end at 1: it has no top-100% threshold (no_filter keeps every row).
    fraction: Annotated[float, Field(ge=0, lt=1)] = 0.3
    threshold: Finite = 0.3  # with fraction=0 (DataComp's L/14 threshold 0.3)
    nan_cut: Literal["datacomp", "all_scored"] = "datacomp"  # which rows a fraction counts

    @classmethod
    def upgrade(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``threshold=`` given without ``fraction=`` asks for the threshold rule."""
        return {**data, "fraction": 0.0} if "threshold" in data and "fraction" not in data else data

    def run(self, t: Any, ctx: Context) -> FilterResult:
        if self.fraction > 0:
            return F.clip_score_fraction(t, self.column, self.fraction, nan_cut=self.nan_cut)
        return F.clip_score_threshold(t, self.column, self.threshold)


@config_class
class Laion2b(Filter):
    """LAION-2B's rule: English and a CLIP B/32 score at or above the threshold."""

    columns = (S.CLIP_B32, S.TEXT)
    language = True
    name: Literal["laion2b"] = "laion2b"  # the filter
    threshold: Finite = 0.28  # CLIP B/32 score threshold (LAION-2B's rule)
    language_model: Literal["cld3", "fasttext"] = "cld3"  # DataComp's laion2b rule used gcld3

    def run(self, t: Any, ctx: Context) -> FilterResult:
        if self.language_model == "cld3":
            from pipeline.filters.language import Cld3LanguageId

            return F.laion2b(t, self.threshold, Cld3LanguageId())
        return F.laion2b(t, self.threshold, ctx.lang)


@config_class
class ImageBased(Filter):
    """Images nearest an ImageNet-1k centroid kept (DataComp's image-based filter)."""

    columns = (S.UID, S.TEXT)
    language = True
    name: Literal["image_based"] = "image_based"  # the filter
    embeddings_file: str = ""  # the pool's CLIP L/14 image embeddings (.npz, .npy, .parquet)
    centroids_file: str = ""  # DataComp's ImageNet-1k cluster centroids
    centroid_ids_file: str = ""  # the centroids' cluster ids to keep

    def run(self, t: Any, ctx: Context) -> FilterResult:
        emb_path = _file("image_based", "embeddings_file", self.embeddings_file)
        cen_path = _file("image_based", "centroids_file", self.centroids_file)
        ids_path = _file("image_based", "centroid_ids_file", self.centroid_ids_file)
        try:
            emb = C.load_embeddings(emb_path, ctx.store)
            centroids = C.load_centroids(cen_path, ctx.store)
            target = C.load_centroid_ids(ids_path, ctx.store)
        except (FileNotFoundError, ValueError) as exc:
            raise FilterError(f"filter 'image_based': {exc}") from exc
        return F.image_based(t, emb, centroids, target, ctx.lang)


# --- on embeddings alone, keyed by uid (pipeline.filters.embedding): any table with a uid column ----------


@config_class
class NegClipLoss(Filter):
    """negCLIPLoss (Wang et al. 2024): the CLIP score less its batch-normalising term."""

    columns = (S.UID,)
    name: Literal["neg_clip_loss"] = "neg_clip_loss"  # the filter
    fraction: OpenFraction = 0.3  # the paper's top 30% on DataComp small/medium
    embeddings_file: str = ""  # empty = DataComp's .npz beside each metadata parquet
    image_key: str = "l14_img"  # the image embeddings' array
    text_key: str = "l14_txt"  # the text embeddings' array
    temperature: PositiveFloat = 0.01  # τ of the teacher CLIP (OpenAI's learned 1/100)
    batch_size: Positive = 32768  # rows per random batch (the paper's)
    batches: Positive = 10  # K random batches per row
    seed: Seed = 0  # the batches' draw

    def run(self, t: Any, ctx: Context) -> FilterResult:
        keys = (self.image_key, self.text_key)
        image, text = _pool_embeddings("neg_clip_loss", ctx, self.embeddings_file, keys)
        return C.neg_clip_loss(t, (image, text), self.fraction, tau=self.temperature,
                               batch_size=self.batch_size, batches=self.batches, seed=self.seed)  # fmt: skip


@config_class
class NormSim(Filter):
    """NormSim (Wang et al. 2024): closeness of each image to a target distribution."""

    columns = (S.UID,)
    name: Literal["norm_sim"] = "norm_sim"  # the filter
    fraction: OpenFraction = 0.3  # the share kept (the paper's 30%)
    target_file: str = ""  # the target distribution's image embeddings (ImageNet-1k train in the paper)
    target_key: str = "embedding"  # the target file's array
    embeddings_file: str = ""  # empty = DataComp's .npz beside each metadata parquet
    image_key: str = "l14_img"  # the image embeddings' array
    p: Annotated[float, Field(ge=1)] = 2.0  # 2, or inf for the best match

    def run(self, t: Any, ctx: Context) -> FilterResult:
        target_file = _file("norm_sim", "target_file", self.target_file)
        (image,) = _pool_embeddings("norm_sim", ctx, self.embeddings_file, (self.image_key,))
        try:
            targets = C.load_targets(target_file, ctx.store, self.target_key)
        except (FileNotFoundError, ValueError) as exc:
            raise FilterError(f"filter 'norm_sim': {exc}") from exc
        return C.norm_sim(t, image, targets, self.fraction, self.p)


# --- our model's scores (pipeline.filters.scores over training.infer.scoring's table) -------------------


class _OnScores(Filter):
    """A rule of ``pipeline.filters.scores`` called with every parameter."""

    table = SCORES
    rule: ClassVar[str]

    def run(self, t: Any, ctx: Context) -> FilterResult:
        return getattr(SF, self.rule)(t, **self.params())


@config_class
class CsdBest(_OnScores):
    """The pairs of lowest CSD (ProLIP App. C.8)."""

    columns, rule = (*SCORE_KEYS, "csd"), "csd_best"
    name: Literal["csd_best"] = "csd_best"  # the filter
    fraction: OpenFraction = 0.2  # the share kept (ProLIP App. C.8: 20% of DataComp)


@config_class
class CsdUncertaintyAware(_OnScores):
    """Lowest CSD after the most uncertain captions (ProLIP App. C.8)."""

    columns, rule = (*SCORE_KEYS, "csd", "text_unc"), "csd_uncertainty_aware"
    name: Literal["csd_uncertainty_aware"] = "csd_uncertainty_aware"  # the filter
    fraction: OpenFraction = CsdBest.fraction  # the share kept
    # captions above this Σσ²_t quantile go first (1 = none)
    text_unc_quantile: OpenFraction = 0.9
    # … and those below this one (0 = none; docs/decisions/0010-demo-csd-fraction-and-uncertainty-rule.md)
    text_unc_low_quantile: Fraction = 0.0

    def __post_init__(self) -> None:
        """The two tails must leave captions between them."""
        if not self.text_unc_low_quantile < self.text_unc_quantile:
            raise ConfigError(
                f"text_unc_low_quantile must be in [0, text_unc_quantile={self.text_unc_quantile}), "
                f"got {self.text_unc_low_quantile}"
            )


@config_class
class CsdUcb(_OnScores):
    """Lowest CSD plus k standard deviations of ‖z_v − z_t‖² (docs/decisions/0052)."""

    columns, rule = (*SCORE_KEYS, "csd", "csd_std"), "csd_ucb"
    name: Literal["csd_ucb"] = "csd_ucb"  # the filter
    fraction: OpenFraction = CsdBest.fraction  # the share kept
    k: NonNegativeFloat = 1.0  # standard deviations of ‖z_v − z_t‖² added to CSD


@config_class
class CsdInclusion(_OnScores):
    """Lowest CSD after the pairs least included in their caption (docs/decisions/0052)."""

    columns, rule = (*SCORE_KEYS, "csd", "inclusion"), "csd_inclusion"
    name: Literal["csd_inclusion"] = "csd_inclusion"  # the filter
    fraction: OpenFraction = CsdBest.fraction  # the share kept
    inclusion_quantile: Annotated[float, Field(ge=0, lt=1)] = 0.1  # the least-included share dropped first


@config_class
class CsdPosterior(_OnScores):
    """Entries drawn by the scorer's match posterior (docs/decisions/0052)."""

    columns, rule = (*SCORE_KEYS, "csd", "dot", "image_unc", "text_unc"), "csd_posterior"
    name: Literal["csd_posterior"] = "csd_posterior"  # the filter
    fraction: OpenFraction = CsdBest.fraction  # entries listed, as a fraction of the scorable rows
    scale: PositiveFloat = 10.0  # the scorer's logit scale a (exp of its log scale; SigLIP init 10)
    bias: Finite = -10.0  # and its bias b (SigLIP's init)
    seed: Seed = 0  # the draw


@config_class
class ClipScoreBest(_OnScores):
    """The pairs of highest cosine of our own scorer."""

    columns, rule = (*SCORE_KEYS, "cosine"), "clip_score_best"
    name: Literal["clip_score_best"] = "clip_score_best"  # the filter
    fraction: OpenFraction = ClipScore.fraction  # the share kept (DataComp's CLIP-score 30%)


@config_class
class ClipScoreThreshold(_OnScores):
    """The pairs whose cosine of our own scorer is at or above a threshold."""

    columns, rule = (*SCORE_KEYS, "cosine"), "clip_score_threshold"
    name: Literal["clip_score_threshold"] = "clip_score_threshold"  # the filter
    threshold: Finite = ClipScore.threshold  # the lowest cosine kept


@config_class
class RandomSameSize(_OnScores):
    """A random control of a given size (``of=LABEL``: the size of that subset)."""

    columns, rule = SCORE_KEYS, "random_same_size"
    name: Literal["random_same_size"] = "random_same_size"  # the filter
    n_keep: Positive | None = None  # required, unless the spec gives of=LABEL
    seed: Seed = 0  # the draw


FILTERS: dict[str, type[Filter]] = Filter.members()  # every filter by name, live (a later class joins)
