"""The track's typed configuration, its presets (``demo``, ``tiny``, ``datacomp-small``) and the run layout.

Kept apart from ``run.py`` (the orchestration) and ``steps.py`` (one function per step) so both import it
without importing each other.
"""

from __future__ import annotations

import math
import typing
from dataclasses import field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from jobs.track.datacomp.baselines import METADATA_SCORES
from jobs.track.datacomp.recipe import check_recipe
from pipeline.common import storage
from pipeline.common.components import SpecsOf
from pipeline.common.config import (
    ConfigError,
    Names,
    NonNegative,
    NonNegativeFloat,
    OpenFraction,
    Positive,
    Seed,
    config_class,
    merge,
    names_from_text,
)
from pipeline.common.storage_config import StorageConfig
from pipeline.config import BUILD_PRESETS, BuildConfig
from pipeline.filters.registry import Filter
from pipeline.filters.specs import parse_filter_specs
from training.config import TRAIN_PRESETS, TrainConfig
from training.eval.sets import EvalSetError, load_tasks

# written by the build's own filters (text_based and image_based need their files in build.filters.names)
RECIPES: dict[str, TrainConfig] = {}  # filled below, once the presets exist
BUILD_SUBSETS = ("no_filter", "basic", "english", "text_based", "image_based")
SubsetKind = Literal[
    "no_filter", "basic", "english", "text_based", "image_based", "csd", "csd_uncertainty", "random",
    # DataComp's CLIP-score baselines on the metadata's scores (jobs/track/datacomp/baselines.py), and the
    # same rule on our own scorer's cosine
    "clip_score_l14", "clip_score_l14_30", "clip_score_b32_30", "scorer_cosine",
    # uncertainty-native selection (pipeline/filters/scores.py) and the embedding-only filters
    "csd_ucb", "csd_inclusion", "csd_posterior", "neg_clip_loss", "norm_sim",
]  # fmt: skip
SUBSET_KINDS = typing.get_args(SubsetKind)


@config_class
class TrackConfig:
    # Knobs that became filter specs (decision 0100): each names its new spelling in a one-line error.
    removed_keys: ClassVar[dict[str, str]] = {
        "text_unc_quantile": "filters=csd_uncertainty_aware:text_unc_quantile=…,label=csd_uncertainty",
        "text_unc_low_quantile": "filters=csd_uncertainty_aware:text_unc_low_quantile=…,label=csd_uncertainty",
        "ucb_k": "filters=csd_ucb:k=…,label=csd_ucb",
        "inclusion_quantile": "filters=csd_inclusion:inclusion_quantile=…,label=csd_inclusion",
    }

    output: str = "runs/demo"  # the run directory, local or s3://
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    num_cpus: NonNegative = 0  # local Ray: 0 = all cores
    # the build also trains the BPE that every model shares (share_tokenizer)
    build: BuildConfig = field(
        default_factory=lambda: merge(BUILD_PRESETS["demo"], {"tokenizer_vocab": 4096})
    )
    scorer: TrainConfig = field(default_factory=lambda: TRAIN_PRESETS["demo"])
    train: TrainConfig = field(default_factory=lambda: TRAIN_PRESETS["demo"])  # one per subset and seed
    # one model per subset and seed: no_filter, basic, english, text_based, image_based (the build's), csd,
    # csd_uncertainty, clip_score_l14 (L/14 at csd_fraction), clip_score_l14_30, clip_score_b32_30,
    # scorer_cosine, random; or the label of any other subset of build.filters.names or of filters
    subsets: Annotated[tuple[str, ...], BeforeValidator(names_from_text)] = (
        "no_filter",
        "basic",
        "csd",
        "csd_uncertainty",
        "random",
    )
    # of the scored (successful) pairs: the size every score subset shares; App. C.8 keeps 20% of DataComp
    csd_fraction: OpenFraction = 0.5
    clip_fraction: OpenFraction = 0.3  # scorer_cosine: the top fraction by our own scorer's cosine
    random_of: str = "csd"  # the random control matches this subset's size
    # More subsets chosen on the scorer's scores (or the pool's embeddings), as filter specs
    # (pipeline/filters/specs.py, e.g. csd_ucb:k=2,label=ucb2): one model each where subsets names its label.
    # A spec labelled like a built-in subset (csd_uncertainty_aware:text_unc_quantile=1,label=csd_uncertainty)
    # replaces it, at that subset's size unless it gives fraction; the built-ins take their filters' defaults.
    filters: Annotated[Names, SpecsOf(Filter)] = field(default_factory=list)
    # neg_clip_loss, norm_sim: the build's embeddings (DataComp's .npz beside its metadata, or the demo
    # pool's stand-in ones) and NormSim's target distribution; empty = the demo pool's
    embeddings: str = ""  # the build's image embeddings; empty = the demo pool's stand-in ones
    norm_sim_target: str = ""  # NormSim's target embeddings; empty = the demo pool's
    # the first seeds the scorer; each trains one model per subset (more seeds: one more model each)
    seeds: Annotated[tuple[Seed, ...], Field(min_length=1)] = (0,)
    eval_tasks: str = "demo"  # a task-list name (training/eval/tasks/<name>.yaml) or a YAML path
    eval_root: str = ""  # where the task paths resolve; empty = <output>/pool/eval (the demo pool's)
    eval_max_samples: NonNegative = 0  # 0 = whole sets
    score_actors: Positive = 1  # scoring actors, each holding the scorer
    # per scoring actor; 0 on CPU-only clusters (a GPU ask there waits forever)
    score_gpus: NonNegativeFloat = 0.0
    eval_gpus: NonNegativeFloat = 0.0  # per evaluation actor; 0 on CPU-only clusters
    # Models evaluated at once, one actor of eval_gpus each; above 1 the scorer's evaluation also runs beside
    # the scoring. Keep 1 on a few CPUs: two evaluations' actors can take every CPU their reads need.
    eval_parallel: Positive = 1
    # Subset models trained at once, each with train.scaling's workers and threads
    # (docs/decisions/0007-subset-models-two-at-a-time.md).
    train_parallel: Positive = 1
    # A BPE trained by the build for every model whose config names no tokenizer (local or s3:// output)
    share_tokenizer: bool = True
    # How a subset model reads its subset: "subset" = the build's shards, filtered through the subset's .npy
    # as they are read (pipeline/ingest/subset_reader.py, no copy); "reshard" = a resharded copy of every
    # subset first (jobs.reshard's output). The models see the same samples either way.
    train_from: Literal["subset", "reshard"] = "subset"
    # The preset whose subset-model recipe is locked (jobs/track/datacomp/recipe.py); a change to it stops the
    # track unless unofficial=true, which the report, track_results.json, submissions and exports then carry.
    recipe: str = ""
    unofficial: bool = False  # allow a change to the locked recipe; the run is marked unofficial everywhere
    # "datacomp": the build follows DataComp's pool rules — no sha256 refusal, no retries, no
    # decontamination or further dedupe (jobs/track/datacomp/pool.py); "ours": the safer defaults
    pool: Literal["ours", "datacomp"] = "ours"
    # Starting points (jobs/track/datacomp/starts.py): an existing shard folder (DataComp's download output
    # or ours) instead of the build, and a scorer to use instead of training one — openclip:MODEL:LOCATION,
    # prolip:LOCATION or one of our checkpoint directories.
    start_shards: str = ""
    start_scorer: str = (
        ""  # a scorer instead of training one: openclip:MODEL:LOC, prolip:LOC or our checkpoint
    )

    def __post_init__(self) -> None:
        """Checks on construction; ``ConfigError`` names the key."""
        try:  # the task list is read at the end, after the build and every training: check it now
            load_tasks(self.eval_tasks)
        except EvalSetError as exc:
            raise ConfigError(f"eval_tasks: {exc}") from None
        # A repeated seed or subset would train the same model twice and count it twice in the report's
        # "n/n seeds better" lines.
        for name in ("seeds", "subsets"):
            values = list(getattr(self, name))
            repeated = sorted({v for v in values if values.count(v) > 1}, key=values.index)
            if repeated:
                raise ConfigError(f"{name}: repeated {repeated} (each may appear once)")
        self._check_subset_names()
        built = [
            spec.label for spec in parse_filter_specs(list(self.build.filters.names), "build.filters.names")
        ]
        from_build = [s for s in self.subsets if s in BUILD_SUBSETS and s not in built]
        self._check_starts()
        if from_build and not self.start_shards:
            raise ConfigError(f"build.filters.names: add {from_build} (subsets takes them from the build)")
        if "random" in self.subsets and self.random_of not in self.subsets:
            raise ConfigError(f"random_of: {self.random_of!r} is not one of subsets {list(self.subsets)}")
        if self._scorer_kind() != "prolip" and any(s.startswith("csd") for s in self.subsets):
            raise ConfigError(
                f"scorer.loss.name: CSD subsets need a prolip scorer, got {self.scorer.loss.name!r}"
            )
        self._check_one_tokenizer()
        check_recipe(self, RECIPES)

    def _check_subset_names(self) -> None:
        """Each subset is a kind of the track, or the label of a build subset or of a spec in ``filters``."""
        built = parse_filter_specs(list(self.build.filters.names), "build.filters.names")
        extra = parse_filter_specs(self.filters, "filters", known=SUBSET_KINDS) if self.filters else []
        for i, spec in enumerate(extra):
            try:
                _ = spec.filters  # building each filter runs its own cross-field rules, at start
            except ConfigError as exc:
                raise ConfigError(f"filters[{i}]: {exc}") from None
        labels = {*SUBSET_KINDS, *(s.label for s in built), *(s.label for s in extra)}
        unknown = [s for s in self.subsets if s not in labels]
        if unknown:
            raise ConfigError(f"subsets: {unknown} are neither subset kinds ({', '.join(SUBSET_KINDS)}) nor labels "
                              "of build.filters.names or filters")  # fmt: skip

    def _scorer_kind(self) -> str:
        """The scorer's objective family: an imported open_clip model is a CLIP."""
        if self.start_scorer.startswith("openclip:"):
            return "clip"
        return "prolip" if self.start_scorer.startswith("prolip:") else self.scorer.loss.name

    def _check_starts(self) -> None:
        if not self.start_shards:
            return
        if not self.eval_root:
            raise ConfigError(
                "eval_root: give the eval sets' root (start_shards skips the build, which writes the demo's)"
            )
        need = [s for s in self.subsets if s != "no_filter" and (s in BUILD_SUBSETS or s in METADATA_SCORES)]
        if need:
            raise ConfigError(
                f"subsets: {need} come from the build's metadata filters, which start_shards skips (no_filter "
                "and the score subsets need only the shards)"
            )

    def _check_one_tokenizer(self) -> None:
        """Every model of a track reads captions through one tokenizer (DataComp: only the data differs)."""
        shared = self.share_tokenizer and self.build.tokenizer_vocab > 0 and not self.start_shards
        given = {self.scorer.tokenizer, self.train.tokenizer}
        if self.start_scorer and self.train.tokenizer in ("", self.scorer.tokenizer):
            return  # the subset models read through the started scorer's own tokenizer
        if given == {""} and shared:
            return
        if len(given) == 1 and "" not in given:
            return
        raise ConfigError(
            f"scorer.tokenizer={self.scorer.tokenizer!r}, train.tokenizer={self.train.tokenizer!r}: every "
            "model of a track needs the same tokenizer — set both to one value (e.g. 'clip'), or leave both "
            "empty with share_tokenizer=true and build.tokenizer_vocab>0"
        )


def _demo_train(samples_seen: int, name: str) -> TrainConfig:
    """The demo training preset for the track: ``demo-32px``, no augmentation, bias −log B, decoded rows
    cached, one worker on every core (docs/decisions/0009-demo-training-settings.md)."""
    return merge(
        TRAIN_PRESETS["demo"],
        {
            "model": "demo-32px",
            "samples_seen": samples_seen,
            "data": {"augment": False, "cache_decoded": True},
            "loss": {"init_bias": -math.log(TRAIN_PRESETS["demo"].global_batch_size)},
            "scaling": {"num_workers": 1, "cpus_per_worker": 1.0, "torch_threads": -1},
            "run": {"name": name},
        },
    )


# The demo pool's planted semantic duplicates and eval leaks are looked for (pipeline/dedup/curation_stage.py).
_CURATION = {"dedupe": {"semantic": True}, "decontam": {"reference": "demo"}}

TRACK_PRESETS: dict[str, TrackConfig] = {
    "demo": TrackConfig(
        # The pool's size and each model's samples: docs/decisions/0003-demo-pool-and-budgets.md; the
        # curation stage against the pool's planted truth: docs/decisions/0051-semantic-dedup-and-decontamination.md.
        build=merge(BUILD_PRESETS["demo"], {"tokenizer_vocab": 4096, "demo_n": 8000, **_CURATION}),
        # The scorer: docs/decisions/0001-demo-scorer-model.md; its σ heads at 10× the LR:
        # docs/decisions/0005-sigma-head-lr-multiplier.md; its masked captions:
        # docs/decisions/0004-salient-masked-captions.md.
        scorer=merge(
            _demo_train(96_000, "scorer"),
            {
                "model": "demo-32px-cnn-unc",
                "global_batch_size": 64,
                "optim": {"lr": 2e-4, "grad_clip": 1.0, "warmup_steps": 80, "unc_lr_mult": 10.0},
                "loss": {"reduction": "joint", "init_bias": -math.log(64)},
                "data": {"text_mask_mode": "salient", "text_mask_ratio": 0.5},
            },
        ),
        # DataComp's protocol: one fixed CLIP recipe for every subset, so only the data differs between rows
        # (docs/decisions/0002-demo-subset-model.md).
        train=merge(
            _demo_train(76_800, "subset"),
            {
                "model": "demo-32px-cnn",
                "loss": {"name": "clip"},
                "global_batch_size": 64,
                "optim": {"warmup_steps": 10, "lr": 3e-4},
                # One thread each, two at a time (train_parallel): the same numbers on any number of cores.
                "scaling": {"cpus_per_worker": 0.5, "torch_threads": 1},
            },
        ),
        # No ``basic`` model (docs/decisions/0006-no-basic-model-in-demo.md); the build still writes its subset.
        subsets=("no_filter", "csd", "csd_uncertainty", "clip_score_l14", "random"),
        train_parallel=2,
        recipe="demo",
    ),
    # Runs inside ``make test``: the same steps on a 300-row pool with a few dozen steps per model.
    "tiny": TrackConfig(
        build=merge(
            BUILD_PRESETS["demo"], {"demo_n": 300, "tokenizer_vocab": 1024, "part_size": 150, **_CURATION}
        ),
        scorer=merge(
            _demo_train(512, "scorer"),
            {
                "global_batch_size": 32,
                "loss": {"init_bias": -math.log(32)},
                "run": {"checkpoint_every": 8, "log_every": 4},
            },
        ),
        train=merge(
            _demo_train(256, "subset"),
            {
                "model": "demo-32px-clip",  # open_clip-shaped: its submissions carry an open_clip export
                "global_batch_size": 32,
                "loss": {"name": "clip"},
                "run": {"checkpoint_every": 8, "log_every": 4},
                "scaling": {"cpus_per_worker": 0.5, "torch_threads": 1},
            },
        ),
        subsets=("no_filter", "csd", "clip_score_l14", "random"),
        train_parallel=2,
        eval_max_samples=64,
        recipe="tiny",
    ),
    # No output, metadata or eval root of its own: jobs.track asks for all three, so a forgotten flag
    # writes to no bucket nobody chose.
    "datacomp-small": TrackConfig(
        output="",
        # decontaminated by pHash against the 38 sets the models are evaluated on (DataComp's own pool
        # was, before release); semantic dedup stays off so the subsets compare with DataComp's
        build=merge(BUILD_PRESETS["datacomp-small"], {"decontam": {"reference": "eval"}}),
        # The scorer is ProLIP's (bf16 on GPUs, App. B.1's decay groups); the subset models DataComp's recipe.
        scorer=merge(
            TRAIN_PRESETS["datacomp-small"],
            {
                "loss": {"name": "prolip"},
                "run": {"name": "scorer"},
                "precision": "auto",
                "optim": {"decay_rule": "prolip"},
            },
        ),
        train=merge(TRAIN_PRESETS["datacomp-small"], {"loss": {"name": "clip"}, "run": {"name": "subset"}}),
        subsets=(
            "no_filter",
            "basic",
            "csd",
            "csd_uncertainty",
            "clip_score_l14",
            "clip_score_l14_30",
            "clip_score_b32_30",
            "random",
        ),  # fmt: skip
        recipe="datacomp-small",
        csd_fraction=0.2,
        eval_tasks="datacomp",
        # One 8-GPU node at a time, one actor per GPU: 7 scoring actors beside the scorer's evaluation, then
        # the 6 subset models' evaluations at once.
        score_actors=7,
        score_gpus=1.0,
        eval_gpus=1.0,
        eval_parallel=6,
    ),
}


# The uncertainty-native selection methods against csd and a CLIP-score fraction of the same size, on the
# demo pool (``make demo-selection``: three scorer seeds, docs/decisions/0052-uncertainty-native-selection.md).
TRACK_PRESETS["demo-selection"] = merge(
    TRACK_PRESETS["demo"],
    {
        "output": "runs/demo-selection",
        "subsets": ["csd", "scorer_cosine", "csd_ucb", "csd_inclusion", "csd_posterior"],
        "clip_fraction": TRACK_PRESETS["demo"].csd_fraction,
    },
)


# Each preset's locked subset-model recipe (jobs/track/datacomp/recipe.py), by the preset's name.
RECIPES.update({name: preset.train for name, preset in TRACK_PRESETS.items() if preset.recipe == name})


def paths(cfg: TrackConfig) -> dict[str, str]:
    o = cfg.output
    return {
        "shards": cfg.start_shards or storage.join(o, "shards"),
        # an imported scorer's checkpoint (one of ours is used where it is); its tokenizer is the track's
        "scorer_import": (
            storage.join(o, "train", "scorer_imported")
            if cfg.start_scorer.startswith(("openclip:", "prolip:"))
            else cfg.start_scorer
        ),
        "subsets": storage.join(o, "subsets"),
        "train": storage.join(o, "train"),
        "scores": storage.join(o, "scores", "scores.parquet"),
        "subset_shards": storage.join(o, "subset_shards"),
        "eval": storage.join(o, "eval"),
        "tokenizer": storage.join(o, "tokenizer"),
        "eval_root": cfg.eval_root or storage.join(o, "pool", "eval"),
        # the embedding-only filters' inputs: the build's metadata shards or the demo pool's files
        "embeddings": cfg.embeddings or cfg.build.metadata or storage.join(o, "pool", "embeddings.npz"),
        "norm_sim_target": cfg.norm_sim_target or storage.join(o, "pool", "target_embeddings.npy"),
    }


def train_config(
    cfg: TrackConfig, base: TrainConfig, name: str, shards: str, seed: int, subset: str = ""
) -> TrainConfig:
    """``base`` pointed at ``shards`` (only ``subset``'s rows when given) and this run's storage, seeded for a
    reproducible run."""
    p = paths(cfg)
    updates: dict[str, Any] = {
        "seed": seed,
        "data": {
            "shards": shards,
            "subset": subset,
            "storage": cfg.storage,
            "shuffle_seed": seed,
            "mask_seed": seed,
        },
        "run": {"storage_path": p["train"], "name": name, "storage": cfg.storage},
    }
    if not base.tokenizer and cfg.start_scorer:
        updates["tokenizer"] = p["scorer_import"]  # the started scorer's own tokenizer, saved with it
    elif not base.tokenizer and cfg.share_tokenizer and cfg.build.tokenizer_vocab > 0:
        updates["tokenizer"] = p["tokenizer"]
    return merge(base, updates)
