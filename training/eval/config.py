"""What ``python -m jobs.evaluate`` resolves, and its presets (preset → YAML → flags → ``--set``)."""

from __future__ import annotations

from pipeline.common.config import NonNegativeFloat, Positive, Seed, config_class
from pipeline.common.storage_config import StorageConfig


@config_class
class EvalConfig:
    """An evaluation run: the checkpoint, the task list and where results go (training/eval/run.py)."""

    checkpoint: str = ""  # our checkpoint directory (local or s3://), e.g. one jobs.train wrote
    tasks: str = "demo"  # a task-list name (training/eval/tasks/NAME.yaml) or a YAML file
    eval_root: str = ""  # root of the task list's relative paths
    out: str = ""  # results directory (local or s3://): eval_results.jsonl, aggregates, analyses, plots
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    # encoding actors, each holding one model; null = one per GPU the cluster has up (or its autoscaler's GPU
    # node holds), 1 without GPUs
    num_actors: Positive | None = None
    # per actor; null = 1 where the cluster has or can add GPUs, else 0 (a GPU request there waits forever)
    num_gpus: NonNegativeFloat | None = None
    batch_size: Positive = 256  # images or captions per encoder call
    analyses: bool = True  # the uncertainty analyses and their plots (probabilistic checkpoints)
    max_samples: Positive | None = None  # per task, for quick checks
    seed: Seed = 0  # of the analyses' resampling (bootstrap intervals)
    resume: bool = True  # keep the tasks already in --out's eval_results.jsonl (ours or DataComp's)


EVAL_PRESETS = {
    "demo": EvalConfig(batch_size=128),
    "datacomp-small": EvalConfig(tasks="datacomp", batch_size=256),
    "prolip-b16": EvalConfig(tasks="datacomp", num_actors=4, num_gpus=1.0, batch_size=512),
}
