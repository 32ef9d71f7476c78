"""Import a checkpoint named by a source spec into one of our checkpoint directories.

Source specs (``python -m jobs.import_checkpoint --source ...``, or ``--checkpoint`` of the filter job):

- ``openclip:MODEL:LOCATION`` — an open_clip CLIP, e.g. ``openclip:ViT-B-32-quickgelu:/w/model.safetensors``
  (OpenAI's weights need the ``-quickgelu`` name, as in open_clip) or
  ``openclip:ViT-B-16:hf-hub:laion/CLIP-ViT-B-16-DataComp.XL-s13B-b90K``;
- ``prolip:LOCATION`` — a released ProLIP, e.g. ``prolip:hf-hub:SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B``.

``LOCATION`` is a weights file (``.safetensors``, or a torch file read with ``weights_only=True``), a
directory holding the library's file name (``open_clip_model.safetensors`` / ``model.safetensors``), or
``hf-hub:REPO`` (downloaded with ``huggingface_hub``; safetensors only — a hub pickle is never loaded).
Tokenizers: CLIP's BPE for open_clip models (``tokenizer`` may name another); for ProLIP the SigLIP
``tokenizer.json`` given as ``tokenizer``, else the one named by the checkpoint's ``config.json``
(``text_cfg.hf_tokenizer_name``) from the hub, with its ``canonicalize`` cleaning.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.ingest.tokenizer import TextTokenizer, tokenizer_from_spec
from training.config import OPENAI_MEAN, OPENAI_STD
from training.imports import open_clip as oc
from training.imports import prolip_official as po
from training.imports.common import read_weights, write_imported
from training.imports.export import OPEN_CLIP_CONFIG, TOKENIZER_FILES
from training.model.checkpoint import CheckpointError

HUB = "hf-hub:"
KINDS = ("openclip", "prolip")


@dataclass(frozen=True)
class ImportSource:
    kind: str  # openclip | prolip
    model: str  # open_clip model name ("" for prolip)
    location: str  # path or hf-hub:REPO


def is_import_source(spec: str) -> bool:
    return spec.split(":", 1)[0] in KINDS and ":" in spec


def parse_source(spec: str) -> ImportSource:
    """``openclip:MODEL:LOCATION`` or ``prolip:LOCATION``; a malformed spec raises naming the format."""
    kind, _, rest = spec.partition(":")
    if kind == "openclip":
        model, _, location = rest.partition(":")
        if model and location:
            return ImportSource(kind, model, location)
    elif kind == "prolip" and rest:
        return ImportSource(kind, "", rest)
    raise ValueError(f"checkpoint source {spec!r}: expected openclip:MODEL:LOCATION or prolip:LOCATION")


def fetch(location: str, filename: str) -> Path:
    """The weights (or a sibling file) at ``location``: a file, a directory holding ``filename``, or a hub
    repository (downloaded into the Hugging Face cache)."""
    if location.startswith(HUB):
        from huggingface_hub import hf_hub_download

        repo = location[len(HUB) :]
        try:
            return Path(hf_hub_download(repo, filename))
        except Exception as e:  # huggingface_hub's HTTP/offline/missing-entry errors
            raise CheckpointError(f"{location}: cannot download {filename} ({type(e).__name__}: {e})") from e
    path = Path(location)
    return path / filename if path.is_dir() else path


def _sibling_json(src: ImportSource, weights: Path, name: str) -> dict[str, Any]:
    """The JSON file ``name`` beside the weights (or in the hub repository), or {} when there is none."""
    try:
        path = fetch(src.location, name) if src.location.startswith(HUB) else weights.parent / name
    except Exception:  # noqa: BLE001 — a hub repo without that file: fall back to the defaults
        return {}
    return json.loads(path.read_text()) if path.is_file() else {}


def _prolip_settings(src: ImportSource, weights: Path) -> dict[str, Any]:
    """The released ``config.json`` (beside the weights or on the hub), or {} when there is none."""
    return _sibling_json(src, weights, po.HUB_CONFIG)


def _exported_tokenizer(weights: Path) -> str:
    """The directory of the weights when our export left its tokenizer there (training/imports/export.py)."""
    return str(weights.parent) if all((weights.parent / f).is_file() for f in TOKENIZER_FILES) else ""


def _convert(src: ImportSource, tokenizer: str, clean: str) -> tuple[Any, TextTokenizer, dict[str, Any]]:
    if src.kind == "openclip":
        weights = fetch(src.location, oc.HUB_FILE)
        tok = tokenizer_from_spec(tokenizer or _exported_tokenizer(weights) or "clip", clean or None)
        model_cfg = _sibling_json(src, weights, OPEN_CLIP_CONFIG).get("model_cfg")
        model, extra = oc.convert_open_clip(
            read_weights(weights), tok, quick_gelu=src.model.endswith("-quickgelu"), model_cfg=model_cfg
        )
        named = re.search(r"ViT-[A-Za-z]+-(\d+)", src.model)
        if named and int(named.group(1)) != model.config.patch_size:
            raise CheckpointError(f"{src.model}: the weights have patch size {model.config.patch_size}")
        return model, tok, extra
    weights = fetch(src.location, po.HUB_FILE)
    settings = _prolip_settings(src, weights)
    text_cfg = settings.get("text_cfg", {})
    tokenizer = tokenizer or _exported_tokenizer(weights)
    if not tokenizer:
        name = text_cfg.get("hf_tokenizer_name")
        if not name:
            raise CheckpointError(
                f"{src.location}: give the SigLIP tokenizer.json (tokenizer) for this ProLIP"
            )
        tokenizer = str(fetch(HUB + name, "tokenizer.json"))
    clean = clean or (text_cfg.get("tokenizer_kwargs") or {}).get("clean", "canonicalize")
    tok = tokenizer_from_spec(tokenizer, clean)
    eps = float((text_cfg.get("norm_kwargs") or {}).get("eps", 1e-6))
    model, extra = po.convert_prolip(read_weights(weights), tok, eps, bool(settings.get("quick_gelu", False)))
    return model, tok, extra


def import_checkpoint(
    source: str, out: str, store: Storage = LOCAL, tokenizer: str = "", tokenizer_clean: str = ""
) -> str:
    """Convert ``source`` into our checkpoint directory ``out`` (local or s3://); returns ``out``."""
    src = parse_source(source)
    model, tok, extra = _convert(src, tokenizer, tokenizer_clean)
    extra = {**extra, "imported_from": source, "pixel_mean": list(OPENAI_MEAN), "pixel_std": list(OPENAI_STD)}
    if not storage.is_s3(out):
        write_imported(out, model, tok, extra)
        return out
    with tempfile.TemporaryDirectory() as d:
        for f in sorted(write_imported(d, model, tok, extra).iterdir()):
            store.write_bytes(f.read_bytes(), storage.join(out, f.name))
    return out
