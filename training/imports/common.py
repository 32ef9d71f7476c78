"""What both importers share: reading a weights file safely, the transformer-block key mapping, and
turning a converted state dict into one of our checkpoint directories.

Both open_clip and the official ProLIP code store their transformer blocks in open_clip's layout:
``<prefix>resblocks.N.{ln_1, attn.in_proj_weight/bias, attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}``. The
fused ``in_proj_weight`` stacks the q, k and v rows in that order, each split into heads contiguously —
exactly how ``training/model/towers.py::Block.qkv`` is read, so it is copied as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from training.model.checkpoint import CheckpointError, save_checkpoint
from training.model.two_tower import ProLIP

# open_clip block name → ours (``Block`` in training/model/towers.py)
BLOCK_MAP = {
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "attn.in_proj_weight": "qkv.weight",
    "attn.in_proj_bias": "qkv.bias",
    "attn.out_proj.weight": "attn_out.weight",
    "attn.out_proj.bias": "attn_out.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "mlp.c_fc.weight": "fc_1.weight",
    "mlp.c_fc.bias": "fc_1.bias",
    "mlp.c_proj.weight": "fc_2.weight",
    "mlp.c_proj.bias": "fc_2.bias",
}
HEAD_WIDTH = 64  # open_clip's default head width: ViT-B/L and CLIP's text towers all use 64


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch file loaded with ``weights_only=True`` (never unpickled).

    Training checkpoints that wrap the weights (``{"state_dict": ...}``) or carry DDP's ``module.``
    prefix are unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, a pickle weights_only refuses, not a safetensors file
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint file {path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def count_blocks(state: Mapping[str, torch.Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"resblocks\.(\d+)\.")
    ids = {int(m.group(1)) for k in state if (m := pattern.match(k))}
    if not ids or ids != set(range(len(ids))):
        raise CheckpointError(f"no contiguous '{prefix}resblocks.N' blocks in the state dict")
    return len(ids)


def map_blocks(state: Mapping[str, torch.Tensor], src: str, dst: str, n: int) -> dict[str, torch.Tensor]:
    """Blocks ``src``resblocks.i.* → ``dst``blocks.i.* for i < n."""
    out = {}
    for i in range(n):
        for theirs, ours in BLOCK_MAP.items():
            out[f"{dst}blocks.{i}.{ours}"] = take(state, f"{src}resblocks.{i}.{theirs}")
    return out


def tower_shapes(state: Mapping[str, torch.Tensor], text_prefix: str, probabilistic: bool, vocab_size: int):
    """``ModelConfig`` architecture fields read from the weight shapes, which both libraries name alike.

    Image positions: CLS (+ UNC) + patches; text positions: the context (+ UNC, CLS for ProLIP)."""
    conv = take(state, "visual.conv1.weight")  # (D, 3, p, p)
    v_width, patch = conv.shape[0], conv.shape[-1]
    grid = round((take(state, "visual.positional_embedding").shape[0] - 1 - int(probabilistic)) ** 0.5)
    tok = take(state, f"{text_prefix}token_embedding.weight")  # (V, W)
    t_width = tok.shape[1]
    ratios = {
        take(state, f"{p}transformer.resblocks.0.mlp.c_fc.weight").shape[0] / w
        for p, w in (("visual.", v_width), (text_prefix, t_width))
    }
    if len(ratios) != 1:
        raise CheckpointError(f"image and text MLP ratios differ ({ratios}); one mlp_ratio is supported")
    return {
        "image_size": grid * patch,
        "patch_size": patch,
        "vision_width": v_width,
        "vision_layers": count_blocks(state, "visual.transformer."),
        "vision_heads": v_width // HEAD_WIDTH,
        "text_width": t_width,
        "text_layers": count_blocks(state, f"{text_prefix}transformer."),
        "text_heads": t_width // HEAD_WIDTH,
        "context_length": take(state, f"{text_prefix}positional_embedding").shape[0] - 2 * int(probabilistic),
        "vocab_size": max(vocab_size, tok.shape[0]),
        "embed_dim": take(state, "visual.proj").shape[1],
        "mlp_ratio": ratios.pop(),
        "probabilistic": probabilistic,
    }


def block_keys(prefix: str, n: int) -> set[str]:
    """The source keys ``map_blocks`` reads."""
    return {f"{prefix}resblocks.{i}.{k}" for i in range(n) for k in BLOCK_MAP}


def take(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise CheckpointError(f"key {key!r} missing from the state dict")
    return state[key].float()


def grow_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """The token table with zero rows appended up to ``rows`` (our added ``<pad>``/``<mask>`` tokens)."""
    if rows < table.shape[0]:
        raise CheckpointError(f"tokenizer has {rows} ids but the token table holds {table.shape[0]} rows")
    return torch.cat([table, table.new_zeros(rows - table.shape[0], table.shape[1])])


def build_and_check(config: Any, ours: dict[str, torch.Tensor], used: set[str], state: Mapping) -> ProLIP:
    """Our model with ``ours`` loaded strictly; every source key must have been used (nothing dropped)."""
    unused = sorted(set(state) - used)
    if unused:
        raise CheckpointError(f"unexpected keys in the source state dict: {unused[:8]}")
    model = ProLIP(config)
    try:
        model.load_state_dict(ours, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"converted weights do not fit the inferred model config: {e}") from e
    return model.eval()


def write_imported(out: str | Path, model: ProLIP, tokenizer: Any, extra: Mapping[str, Any]) -> Path:
    """Save as one of our checkpoint directories (``training/model/two_tower.py``), usable by every job."""
    return save_checkpoint(out, model, model.config, tokenizer, extra)
