"""The filter job as a library function: score the pool with a checkpoint, run score filters, write
DataComp subsets, optionally reshard each one.

Run directory (local or ``s3://``), docs/formats.md:

- ``<out>/scores/scores.parquet`` — one row per pool sample (``training.infer.scoring.SCORE_COLUMNS``, by uid);
- ``<out>/subsets/<label>.npy`` — DataComp's sorted ``u8,u8`` uid array per filter;
- ``<out>/subsets/<label>/shards/`` — with ``reshard``, the subset materialised by ``pipeline.subsets.reshard``;
- ``<out>/filters.json`` — per filter: spec, size, fraction of the scorable pool, counts per reason.

Filters are spec strings of ``pipeline.filters.specs`` (the syntax the build uses too), e.g.
``csd_best:fraction=0.2`` (ProLIP App. C.8's 20%), ``clip_score_best:fraction=0.3`` (DataComp's best
CLIP-score fraction on the small track), ``random_same_size:of=csd_best,seed=0`` (the control, sized
like the filter labelled ``csd_best``); ``label=`` names the subset when a filter appears twice.
Scores carry no metadata, so only score filters (``pipeline.filters.specs.SCORES``) apply here.
``reuse_scores`` skips scoring when ``scores.parquet`` already exists (re-running only the filters).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from pydantic import BeforeValidator

from pipeline.common import storage
from pipeline.common.config import (
    ConfigError,
    NonNegativeFloat,
    Positive,
    config_class,
    names_from_text,
)
from pipeline.common.storage import Storage
from pipeline.common.storage_config import StorageConfig
from pipeline.filters.specs import FilterSpec, parse_filter_specs, required_columns, run_filters

if TYPE_CHECKING:
    from training.infer.scoring import ScoreResult


@config_class
class FilterJobConfig:
    shards: str = ""  # directory, glob or comma list of pool shards (local or s3://)
    # our checkpoint directory (local or s3://), or a source to import first into <out>/checkpoint:
    # openclip:MODEL:LOCATION | prolip:LOCATION (training/imports/load.py)
    checkpoint: str = ""
    checkpoint_tokenizer: str = ""  # for an imported source: a tokenizer other than its own
    out: str = "runs/demo/filter"  # run directory (local or s3://)
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    num_actors: Positive = 1  # scoring actors, each holding one model
    num_gpus: NonNegativeFloat = (
        0.0  # per actor; 0 on CPU (a GPU request on a CPU-only cluster waits forever)
    )
    cpus_per_actor: NonNegativeFloat = 1.0  # Ray CPUs reserved per scoring actor
    batch_size: Positive = 256  # pairs per encoder call
    # filter specs (pipeline/filters/specs.py), one subset .npy each under <out>/subsets/
    filters: Annotated[tuple[str, ...], BeforeValidator(names_from_text)] = (
        "csd_best:fraction=0.2",
        "csd_uncertainty_aware:fraction=0.2",
        "clip_score_best:fraction=0.3",
        "random_same_size:of=csd_best,seed=0",
    )
    reshard: bool = False  # also materialise each subset as shards (<out>/subsets/<label>/shards/)
    samples_per_shard: Positive = 10_000  # DataComp's resharder default
    reshard_workers: Positive = 1  # input shards read ahead in parallel while resharding (hides S3 latency)
    reuse_scores: bool = False  # keep <out>/scores/scores.parquet when it exists (re-run the filters only)


FILTER_PRESETS: dict[str, FilterJobConfig] = {
    "demo": FilterJobConfig(out="runs/demo/filter", reshard=True, samples_per_shard=500, batch_size=128),
    # No shards or out of its own: the job asks for both, so a forgotten flag writes to no bucket.
    "datacomp-small": FilterJobConfig(
        out="",
        num_actors=8,
        num_gpus=1.0,
        cpus_per_actor=4.0,
        batch_size=1024,
        reshard=True,
        reshard_workers=8,
    ),
}


@dataclass
class SubsetResult:
    label: str
    spec: str
    path: str
    size: int
    fraction: float  # of the rows whose image decoded
    counts: dict[str, int]
    shards: list[str] = field(default_factory=list)


@dataclass
class FilterJobResult:
    scores_path: str
    n_scored: int
    n_failed: int
    subsets: dict[str, SubsetResult]
    timings: dict[str, float]
    score: ScoreResult | None = None  # None when the scores were reused


def validate(cfg: FilterJobConfig) -> list[FilterSpec]:
    """Field checks that need no I/O; raises ConfigError naming the field."""
    if not cfg.shards:
        raise ConfigError("shards: give the pool shards (--shards or --set shards=…)")
    if not cfg.checkpoint:
        raise ConfigError("checkpoint: give a checkpoint directory (--checkpoint)")
    if not cfg.out:
        raise ConfigError("out: give a run directory")
    specs = parse_filter_specs(list(cfg.filters))
    from training.infer.scoring import SCORE_COLUMNS  # loads torch: after the checks that need none

    for i, spec in enumerate(specs):
        missing = sorted(required_columns([spec]) - set(SCORE_COLUMNS))
        if missing:
            raise ConfigError(
                f"filters[{i}]: {spec.name} reads {missing}, which the scores table lacks (use a score filter)"
            )
    return specs


def check_checkpoint(cfg: FilterJobConfig, specs: list[FilterSpec]) -> bool:
    """Load the checkpoint once on the driver (raises CheckpointError naming the file) before any
    actor starts; a filter that needs σ² with a deterministic checkpoint is a ConfigError."""
    from training.infer.scoring import verify_checkpoint

    model_cfg = verify_checkpoint(cfg.checkpoint, cfg.storage.store())
    for i, spec in enumerate(specs):
        if "text_unc" in required_columns([spec]) and not model_cfg.probabilistic:
            raise ConfigError(
                f"filters[{i}]: {spec.name} needs a probabilistic checkpoint; {cfg.checkpoint} is deterministic"
            )
    return bool(model_cfg.probabilistic)


def _score(cfg: FilterJobConfig, store: Storage, scores_path: str) -> ScoreResult | None:
    """Score the pool into ``scores_path``, unless ``reuse_scores`` and it exists (then None)."""
    from training.infer.scoring import scores_complete

    if cfg.reuse_scores and scores_complete(scores_path, store):
        return None
    from training.infer.batch_inference import score_shards

    return score_shards(
        cfg.shards,
        cfg.checkpoint,
        scores_path,
        store=store,
        num_actors=cfg.num_actors,
        num_gpus=cfg.num_gpus,
        batch_size=cfg.batch_size,
        cpus_per_actor=cfg.cpus_per_actor,
    )


def run_filter_job(cfg: FilterJobConfig) -> FilterJobResult:
    """Score → filter → write subsets (→ reshard); see the module docstring for the outputs."""
    specs = validate(cfg)
    check_checkpoint(cfg, specs)
    store = cfg.storage.store()
    timings: dict[str, float] = {}
    scores_path = storage.join(cfg.out, "scores", "scores.parquet")
    t0 = time.perf_counter()
    score = _score(cfg, store, scores_path)
    timings["score"] = time.perf_counter() - t0
    from training.infer.scoring import read_scores

    table = read_scores(scores_path, store)

    t0 = time.perf_counter()
    results = run_filters(table, specs, store=store)
    timings["filter"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    from pipeline.subsets.uid_files import write_subsets

    paths = {s.label: storage.join(cfg.out, "subsets", f"{s.label}.npy") for s in specs}
    sizes = write_subsets(store, table, results, paths)
    timings["subsets"] = time.perf_counter() - t0
    ok = table.column("ok").to_numpy(zero_copy_only=False)
    n_ok = max(int(ok.sum()), 1)
    subsets = {
        s.label: SubsetResult(
            s.label, s.text, paths[s.label], sizes[s.label], sizes[s.label] / n_ok, results[s.label].counts()
        )
        for s in specs
    }
    if cfg.reshard:
        from pipeline.subsets.materialize import reshard_subsets

        t0 = time.perf_counter()
        outputs = {label: storage.join(cfg.out, "subsets", label, "shards") for label in paths}
        done = reshard_subsets(
            store, cfg.shards.split(","), paths, outputs, cfg.samples_per_shard, cfg.reshard_workers
        )
        for label, res in done.items():
            subsets[label].shards = list(res.shards)
        timings["reshard"] = time.perf_counter() - t0

    summary = {
        "scores": scores_path,
        "n_scored": table.num_rows,
        "n_image_failed": int((~ok).sum()),
        "filters": {k: dataclasses.asdict(v) for k, v in subsets.items()},
    }
    store.write_json(summary, storage.join(cfg.out, "filters.json"))
    return FilterJobResult(scores_path, table.num_rows, int((~ok).sum()), subsets, timings, score)
