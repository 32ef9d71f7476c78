"""``python -m jobs.import_checkpoint --source SPEC --out DIR [--tokenizer T]``: an open_clip CLIP or a
released ProLIP as one of our checkpoint directories, which every job (filter, evaluate, embed) loads.

Like every job it also takes ``--preset``, ``--config FILE.yaml`` and ``--set key=value``. Source specs
(training/imports/load.py): ``openclip:MODEL:LOCATION`` (e.g. ``openclip:ViT-B-32-quickgelu:w.safetensors``)
and ``prolip:LOCATION`` (e.g. ``prolip:hf-hub:SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B``); LOCATION is a
file, a directory or ``hf-hub:REPO``. Weights are read from safetensors or with ``weights_only=True``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Literal

from jobs.common import parse_job_config, print_table
from pipeline.common.config import config_class
from pipeline.common.storage import Storage
from training.model.checkpoint import CheckpointError, load_checkpoint


@config_class
class ImportJobConfig:
    source: str = ""  # openclip:MODEL:LOCATION | prolip:LOCATION
    out: str = ""  # our checkpoint directory (local or s3://)
    tokenizer: str = ""  # "" = the source's own (CLIP's BPE; ProLIP: its config's SigLIP tokenizer.json)
    # for a tokenizer.json: lower | canonicalize ("" = the source's own)
    tokenizer_clean: Literal["", "lower", "canonicalize"] = ""
    s3_endpoint: str = ""


PRESETS = {"demo": ImportJobConfig()}
FLAGS = {"--source": "source", "--out": "out", "--tokenizer": "tokenizer", "--s3-endpoint": "s3_endpoint"}


def main(argv: Sequence[str] | None = None) -> int:
    from training.imports.load import import_checkpoint

    cfg = parse_job_config(argv, __doc__.splitlines()[0], PRESETS, FLAGS, required=("source", "out"))
    store = Storage.from_env(cfg.s3_endpoint)
    try:
        out = import_checkpoint(cfg.source, cfg.out, store, cfg.tokenizer, cfg.tokenizer_clean)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"import_checkpoint: {exc}", file=sys.stderr)
        return 1
    if out == cfg.out and "://" not in out:
        model, mcfg, tok = load_checkpoint(out)
        rows = [
            ("source", cfg.source),
            (
                "image",
                f"{mcfg.image_size}px patch {mcfg.patch_size}, {mcfg.vision_layers}×{mcfg.vision_width}",
            ),
            (
                "text",
                f"context {mcfg.context_length}, {mcfg.text_layers}×{mcfg.text_width}, vocab {mcfg.vocab_size}",
            ),
            ("embedding", f"{mcfg.embed_dim}, {'Gaussian' if mcfg.probabilistic else 'deterministic'}"),
            ("parameters", sum(p.numel() for p in model.parameters())),
        ]
        print_table(f"imported → {out}", rows, ("", ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
