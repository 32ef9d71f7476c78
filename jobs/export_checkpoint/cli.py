"""``python -m jobs.export_checkpoint --checkpoint DIR --out DIR [--format open_clip|prolip]``.

The inverse of ``jobs.import_checkpoint`` (training/imports/export.py): a deterministic, open_clip-shaped
model (the CLIP subset models of ``datacomp-small``, ViT-B-32) becomes an open_clip directory —
``open_clip_model.safetensors`` + ``open_clip_config.json`` — that ``open_clip.create_model_and_transforms
("local-dir:DIR")``, ``("ViT-B-32", pretrained=DIR/open_clip_model.safetensors)`` and DataComp's
``evaluate.py --use_model "ViT-B-32 DIR/open_clip_model.safetensors"`` load; a ProLIP with the released
heads becomes ``model.safetensors`` + ``config.json`` in the released layout. Like every job it also takes
``--preset``, ``--config FILE.yaml`` and ``--set key=value``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from jobs.common import job_main, parse_job_config, print_table
from pipeline.common.config import config_class
from pipeline.common.errors import InputError
from pipeline.common.preflight import output_location
from pipeline.common.storage import Storage


@config_class
class ExportJobConfig:
    checkpoint: str = ""  # our checkpoint directory (local)
    out: str = ""  # the directory to write (local)
    # open_clip (deterministic CLIP), prolip (released ProLIP layout), auto: by whether the model is Gaussian
    format: Literal["auto", "open_clip", "prolip"] = "auto"


PRESETS = {"demo": ExportJobConfig()}
FLAGS = {"--checkpoint": "checkpoint", "--out": "out", "--format": "format"}
SUMMARY = """\
One of our checkpoints as an open_clip directory (open_clip_model.safetensors + open_clip_config.json,
loaded by open_clip and DataComp's evaluate.py) or, for a ProLIP with the released heads, in the released
ProLIP layout. jobs.import_checkpoint reads either back unchanged."""
EXAMPLE = "python -m jobs.export_checkpoint --checkpoint runs/demo/train/subset/checkpoint --out runs/oc"


@job_main
def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, PRESETS, FLAGS, required=("checkpoint", "out"), prog="jobs.export_checkpoint",
        example=EXAMPLE,
    )  # fmt: skip
    local = Storage()
    if not local.isdir(cfg.checkpoint):
        raise InputError(f"checkpoint {cfg.checkpoint}: not a checkpoint directory")
    output_location(local, cfg.out, "out")
    from training.imports.export import export_open_clip, export_prolip
    from training.model.checkpoint import load_checkpoint

    _, mcfg, _ = load_checkpoint(cfg.checkpoint)
    fmt = cfg.format if cfg.format != "auto" else ("prolip" if mcfg.probabilistic else "open_clip")
    out = (export_prolip if fmt == "prolip" else export_open_clip)(cfg.checkpoint, cfg.out)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print_table(f"exported → {out}", [("format", fmt), ("files", files)], ("", ""))
    return 0
