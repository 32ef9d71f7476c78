"""``python -m jobs.import_checkpoint --source SPEC --out DIR [--tokenizer T]``: an open_clip CLIP or a
released ProLIP as one of our checkpoint directories, which every job (filter, evaluate, embed) loads.

Like every job it also takes ``--preset``, ``--config FILE.yaml`` and ``--set key=value``. Source specs
(training/imports/load.py): ``openclip:MODEL:LOCATION`` (e.g. ``openclip:ViT-B-32-quickgelu:w.safetensors``)
and ``prolip:LOCATION`` (e.g. ``prolip:hf-hub:SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B``); LOCATION is a
file, a directory or ``hf-hub:REPO``. Weights are read from safetensors or with ``weights_only=True``. A
local LOCATION and the output are checked before torch loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from jobs.common import job_main, parse_job_config, print_table
from pipeline.common.config import config_class
from pipeline.common.errors import InputError, JobError, UsageError
from pipeline.common.preflight import output_location, sniff
from pipeline.common.storage import Storage
from pipeline.common.storage_config import StorageConfig


@config_class
class ImportJobConfig:
    source: str = ""  # openclip:MODEL:LOCATION | prolip:LOCATION
    out: str = ""  # our checkpoint directory (local or s3://)
    tokenizer: str = ""  # "" = the source's own (CLIP's BPE; ProLIP: its config's SigLIP tokenizer.json)
    # for a tokenizer.json: lower | canonicalize ("" = the source's own)
    tokenizer_clean: Literal["", "lower", "canonicalize"] = ""
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment


PRESETS = {"demo": ImportJobConfig()}
FLAGS = {
    "--source": "source",
    "--out": "out",
    "--tokenizer": "tokenizer",
    "--s3-endpoint": "storage.s3_endpoint",
}
SUMMARY = """\
An open_clip CLIP or a released ProLIP as one of our checkpoint directories, which jobs.filter,
jobs.evaluate and jobs.embed load; weights from safetensors or torch files read with weights_only."""
EXAMPLE = "python -m jobs.import_checkpoint --source openclip:ViT-B-32-quickgelu:w.safetensors --out runs/b32"


def check_source(source: str) -> None:
    """The spec's form and, for a local LOCATION, that it exists and is not a text file."""
    kind, _, rest = source.partition(":")
    location = rest.partition(":")[2] if kind == "openclip" else rest
    if kind not in ("openclip", "prolip") or not location:
        raise UsageError(f"source: expected openclip:MODEL:LOCATION or prolip:LOCATION, got {source!r}")
    if location.startswith("hf-hub:"):
        return
    local = Storage()
    if not local.exists(location):
        raise InputError(f"source {location}: not found")
    if not local.isdir(location):
        found = sniff(local, location)
        if found in ("text", "json", "empty"):
            raise InputError(
                f"source {location}: not a weights file (safetensors or torch.save); it is {found}"
            )


@job_main
def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, PRESETS, FLAGS, required=("source", "out"), prog="jobs.import_checkpoint",
        example=EXAMPLE,
    )  # fmt: skip
    store = cfg.storage.store()
    check_source(cfg.source)
    output_location(store, cfg.out, "out")
    from training.imports.load import import_checkpoint
    from training.model.checkpoint import load_checkpoint

    try:
        out = import_checkpoint(cfg.source, cfg.out, store, cfg.tokenizer, cfg.tokenizer_clean)
    except JobError:
        raise
    except (FileNotFoundError, ValueError) as exc:
        raise InputError(str(exc)) from None
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
