"""AdamW parameter groups: which parameters decay, and the σ heads' own learning rate.

Two rules (``OptimConfig.decay_rule``):

- ``prolip`` (App. B.1: "not on gains, biases, logit scale/bias"): also exempts the positional embeddings
  and the CLS/UNC token vectors — they are additive per-position biases, not weight matrices (the ViT/MAE
  convention). The [MASK] row lives in the token-embedding table, which decays as a whole like every other
  vocabulary row (CLIP's convention).
- ``open_clip`` (open_clip_train's rule, which DataComp's recipe runs): every parameter of two or more
  dimensions decays — the positional embeddings too; gains, biases, the CLS vector and the logit scale not.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Parameter names (last component) that never decay although they are 2-D or more (ProLIP App. B.1: no
# decay on embeddings and tokens). Gains, biases and the losses' learnable scalars (``log_scale``, ``bias``,
# ``scale``, ``shift``: 0-d) are 1-D or less and never decay by rank alone.
NO_DECAY_NAMES = frozenset({"pos_embed", "cls_token", "unc_token"})


def decay_split(model: nn.Module, rule: str = "prolip") -> tuple[list[str], list[str]]:
    """Names of trainable parameters that get weight decay and those that do not (see module docstring)."""
    if rule not in ("prolip", "open_clip"):
        raise ValueError(f"decay rule must be 'prolip' or 'open_clip', got {rule!r}")
    exempt = NO_DECAY_NAMES if rule == "prolip" else frozenset()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        (no_decay if p.ndim < 2 or leaf in exempt else decay).append(name)
    return decay, no_decay


UNC_PARAM_NAMES = frozenset({"logvar_proj", "unc_token"})  # the σ heads: log σ² projections and [UNC]


def is_unc_param(name: str) -> bool:
    """Whether parameter ``name`` belongs to a σ head (a tower's log σ² projection or its [UNC] token)."""
    return any(part in UNC_PARAM_NAMES for part in name.split("."))


def param_groups(
    model: nn.Module,
    weight_decay: float,
    lr: float | None = None,
    unc_lr_mult: float = 1.0,
    unc_lr_mult_image: float | None = None,
    decay_rule: str = "prolip",
) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices decay by ``weight_decay``; gains, biases, scalars, embeddings not.

    With ``unc_lr_mult`` != 1 the σ-head parameters (``is_unc_param``) get their own groups at
    ``lr * unc_lr_mult`` (same decay rule); ``unc_lr_mult_image`` (None: the same) sets the image tower's
    σ head apart from the text tower's. The LR schedule scales every group alike. ``decay_rule``: the module
    docstring's ``prolip`` or ``open_clip``.
    """
    params = dict(model.named_parameters())
    decay, no_decay = decay_split(model, decay_rule)
    image_mult = unc_lr_mult if unc_lr_mult_image is None else unc_lr_mult_image
    split = lr is not None and (unc_lr_mult != 1.0 or image_mult != 1.0)

    def mult(name: str) -> float:
        return image_mult if "visual" in name.split(".") else unc_lr_mult

    groups = []
    for names, wd in ((decay, weight_decay), (no_decay, 0.0)):
        unc = [n for n in names if split and is_unc_param(n)]
        groups.append(
            {"params": [params[n] for n in names if not (split and is_unc_param(n))], "weight_decay": wd}
        )
        for m in dict.fromkeys(mult(n) for n in unc):  # one group per multiplier, in first-seen order
            ps = [params[n] for n in unc if mult(n) == m]
            groups.append({"params": ps, "weight_decay": wd, "lr": lr * m})  # type: ignore[operator]
    return groups
