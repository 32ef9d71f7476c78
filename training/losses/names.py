"""The objectives by name, and whether each needs the σ² heads: what a config checks without torch.

``training/losses/registry.py`` holds the ``LossSpec`` of each objective, whose modules import torch; a
config (``training.config.LossConfig``) only needs the names and one flag, and a job's ``--help`` must
answer before torch loads. The registry checks at import that its specs and this table agree, so a new
loss cannot be registered without being named here.
"""

from __future__ import annotations

# name → probabilistic (the loss reads log σ², so the model needs its [UNC] tokens)
LOSS_NAMES: dict[str, bool] = {"prolip": True, "siglip": False, "clip": False, "pcmepp": True}
