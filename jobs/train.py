"""``python -m jobs.train --preset NAME [--shards P] [--tokenizer P] [--config F] [--set k=v ...]``.

Presets: demo, datacomp-small, prolip-b16 (training/config.py).

Trains (or resumes: same ``run.storage_path`` + ``run.name``) a ProLIP / CLIP / SigLIP / PCME++ model on
webdataset shards with Ray Train. ``--tokenizer`` takes ``clip`` (CLIP's BPE; the ``datacomp-small``
default), ``clip:VOCAB_PATH``, a saved tokenizer directory or any ``tokenizer.json`` (``--set
tokenizer_clean=canonicalize`` for SigLIP's); without one a BPE is trained on the shards' captions. The
tokenizer is saved in the run directory and in every checkpoint. Writes ``manifest.json`` into the run directory.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, parse_job_config, print_table
from pipeline.common.manifest import write_manifest
from pipeline.common.storage import Storage
from pipeline.shards.reader import TooManyBadShards
from training.config import TRAIN_PRESETS, to_plain
from training.model.checkpoint import CheckpointError
from training.train.trainer import train

# clip, clip:VOCAB, a tokenizer directory or tokenizer.json; a shard directory, glob or list
FLAGS = {"--shards": "data.shards", "--tokenizer": "tokenizer"}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(argv, __doc__.splitlines()[0], TRAIN_PRESETS, FLAGS)
    init_ray()
    try:
        out = train(cfg)
    except (TooManyBadShards, CheckpointError) as exc:  # the project's own reason, in one line
        print(f"input error: {exc}", file=sys.stderr)
        return 3
    final = out.metrics[-1] if out.metrics else {}
    write_manifest(
        out.run_dir,
        job="train",
        config=to_plain(cfg),
        counts={"steps": out.return_value.get("final_step"), "ingest": out.ingest},
        timings={"train": out.wall_s},
        store=Storage.from_env(cfg.run.s3_endpoint),
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
