"""``python -m jobs.train --preset NAME [--shards P] [--tokenizer P] [--config F] [--set k=v ...]``.

Presets: demo, datacomp-small, prolip-b16 (training/config.py).

Trains (or resumes: same ``run.storage_path`` + ``run.name``) a ProLIP / CLIP / SigLIP / PCME++ model on
webdataset shards with Ray Train. ``--tokenizer`` takes ``clip`` (CLIP's BPE; the ``datacomp-small``
default), ``clip:VOCAB_PATH``, a saved tokenizer directory or any ``tokenizer.json`` (``--set
tokenizer_clean=canonicalize`` for SigLIP's); without one a BPE is trained on the shards' captions. The
tokenizer is saved in the run directory and in every checkpoint. Writes ``manifest.json`` into the run directory.
The shards, the tokenizer and the run's storage are checked before Ray starts.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, job_main, parse_job_config, print_table
from pipeline.common import storage
from pipeline.common.manifest import write_manifest
from pipeline.common.preflight import input_files, output_location
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage import Storage
from training.config import TRAIN_PRESETS, TrainConfig, to_plain

FLAGS = {"--shards": "data.shards", "--tokenizer": "tokenizer"}
# The cluster presets name no bucket: a forgotten flag must not read or write someone else's.
REQUIRED = ("data.shards", "run.storage_path")
SUMMARY = """\
Train (or resume: the same run.storage_path and run.name) ProLIP, CLIP, SigLIP or PCME++ on webdataset
shards with Ray Train; checkpoints, TensorBoard logs and manifest.json go to the run directory."""
EXAMPLE = (
    "python -m jobs.train --preset demo --shards runs/demo/shards --set loss.name=clip "
    "--set run.storage_path=runs/train"
)


def check_inputs(cfg: TrainConfig) -> None:
    """The shards (tar files), a tokenizer given as a path, and the run's storage, before Ray starts."""
    input_files(cfg.data.storage.store(), cfg.data.shards, "data.shards", "tar", ".tar")
    spec = cfg.tokenizer
    path = spec.partition(":")[2] if spec.startswith("clip:") else ("" if spec == "clip" else spec)
    if path and not spec.startswith("hf-hub:"):  # a Hub repository is fetched (and cached) by the trainer
        local = cfg.data.storage.store() if storage.is_s3(path) else Storage()
        if local.isdir(path):
            input_files(local, path, "tokenizer", suffix=".json")
        else:
            input_files(local, path, "tokenizer", kind=None if spec.startswith("clip:") else "json")
    output_location(cfg.run.storage.store(), cfg.run.storage_path, "run.storage_path")


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, TRAIN_PRESETS, FLAGS, required=REQUIRED, prog="jobs.train", example=EXAMPLE
    )
    check_inputs(cfg)
    from training.train.trainer import train

    init_ray()
    # the Train workers and the ingest's tasks open these on every host
    require_shared_storage(
        {
            "data.shards": cfg.data.shards,
            "data.subset": cfg.data.subset,
            "run.storage_path": cfg.run.storage_path,
        }
    )
    out = train(cfg)
    final = out.metrics[-1] if out.metrics else {}
    write_manifest(
        out.run_dir,
        job="train",
        config=to_plain(cfg),
        counts={"steps": out.return_value.get("final_step"), "ingest": out.ingest},
        timings={"train": out.wall_s},
        store=cfg.run.storage.store(),
        extra={
            "checkpoint": out.checkpoint_path,
            "final_metrics": final,
            "checkpoint_warnings": out.warnings,
        },
    )
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else v) for k, v in final.items()]
    print_table(
        f"{cfg.loss.name} · {cfg.model} · checkpoint {out.checkpoint_path}", rows, ("metric", "value")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
