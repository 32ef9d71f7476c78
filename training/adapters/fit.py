"""Training loops for the post-hoc adapters on cached (frozen) embeddings: CPU, seeded, deterministic.

Inputs are numpy arrays ``image_emb`` (n, d) and ``text_emb`` (n, d), row i a matched pair (what the
embedding-extraction job writes; rows with ``ok = False`` must be dropped before). The same seed gives the
same weights and history on the same machine: weights come from ``torch.manual_seed(seed)``, batch order
from a private ``torch.Generator`` seeded alike, and dropout from the global generator seeded once.

Defaults and their source:
- ProbVLM: Adam lr 1e−4, 100 epochs (ProbVLM §4 "Implementation details"), λ_cross = 1e−4 (authors'
  code), constant learning rate; batch 256 is ours (the paper gives none).
- AsymVLM: SGD momentum 0.9, lr 1e−2 cosine-annealed per step to 1e−6, batch 2048, 200 epochs
  (AsymVLM App. B.4, Table A.1; the momentum value is not given, 0.9 is the usual one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.common.storage import LOCAL, Storage
from training.adapters.asymvlm import AsymVLM, asymvlm_loss
from training.adapters.probvlm import LAMBDA_CROSS, ProbVLM, probvlm_loss

History = list[dict[str, float]]
VECTOR_COLUMNS = ("image_mu", "text_mu", "image_logvar", "text_logvar")


def load_embeddings(path: str, store: Storage = LOCAL) -> dict[str, np.ndarray]:
    """Read an embedding parquet (file, directory or glob) into numpy, keeping only rows with ``ok``.

    Columns: ``uid`` (str), ``ok`` (bool), ``text`` (str), ``image_mu``/``text_mu`` (vectors of dim D) and,
    for probabilistic models, ``image_logvar``/``text_logvar``. Vector columns may be list or
    fixed-size-list typed; the result holds float32 (n, D) arrays, and ``uid``/``text`` as object arrays.
    """
    table = store.read_parquet(path)
    missing = [c for c in ("uid", "image_mu", "text_mu") if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: embedding parquet lacks column(s) {missing}")
    if "ok" in table.column_names:
        table = table.filter(table.column("ok").fill_null(False))
    n = table.num_rows
    out: dict[str, np.ndarray] = {"uid": np.asarray(table.column("uid").to_pylist(), dtype=object)}
    out["text"] = np.asarray(
        table.column("text").to_pylist() if "text" in table.column_names else [""] * n, dtype=object
    )
    for name in VECTOR_COLUMNS:
        if name not in table.column_names:
            continue
        col = table.column(name).combine_chunks()
        flat = np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
        if n and flat.size % n:
            raise ValueError(f"{path}: column {name!r} has vectors of unequal length")
        out[name] = flat.reshape(n, -1 if n else 0)
    if out["image_mu"].shape != out["text_mu"].shape:
        raise ValueError(
            f"{path}: image_mu {out['image_mu'].shape} and text_mu {out['text_mu'].shape} differ"
        )
    return out


def _as_pairs(image_emb: np.ndarray, text_emb: np.ndarray) -> tuple[Tensor, Tensor]:
    zi = torch.tensor(np.asarray(image_emb, dtype=np.float32))
    zt = torch.tensor(np.asarray(text_emb, dtype=np.float32))
    if zi.ndim != 2 or zi.shape != zt.shape:
        raise ValueError(
            f"image and text embeddings must be (n, d) alike, got {tuple(zi.shape)} / {tuple(zt.shape)}"
        )
    if zi.shape[0] < 2:
        raise ValueError("need at least two pairs")
    if not (torch.isfinite(zi).all() and torch.isfinite(zt).all()):
        raise ValueError("embeddings contain NaN/inf (drop the rows with ok = False first)")
    return zi, zt


def _run(
    model: nn.Module,
    zi: Tensor,
    zt: Tensor,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], dict[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    lr_at: Callable[[int], float] | None,
    log_every: int,
    log: Callable[[str], None] | None,
) -> History:
    n = zi.shape[0]
    gen = torch.Generator().manual_seed(seed)
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    history: History = []
    step = 0
    model.train()
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=gen)
        sums: dict[str, float] = {}
        count = 0
        for b in range(steps_per_epoch):
            idx = perm[b * batch_size : (b + 1) * batch_size]
            if idx.numel() < 2:  # a one-pair batch has no negatives for InfoNCE
                continue
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
            terms = loss_fn(model, zi[idx], zt[idx])
            optimizer.zero_grad(set_to_none=True)
            terms["loss"].backward()
            optimizer.step()
            step += 1
            k = idx.numel()
            count += k
            for name, value in terms.items():
                sums[name] = sums.get(name, 0.0) + float(value.detach()) * k
        row = {"epoch": float(epoch), **{k: v / max(count, 1) for k, v in sums.items()}}
        history.append(row)
        if log is not None and (epoch % log_every == 0 or epoch == epochs - 1):
            log(" ".join(f"{k}={v:.4g}" for k, v in row.items()))
    model.eval()
    return history


def fit_probvlm(
    image_emb: np.ndarray,
    text_emb: np.ndarray,
    *,
    epochs: int = 100,
    lr: float = 1e-4,
    batch_size: int = 256,
    seed: int = 0,
    lambda_cross: float = LAMBDA_CROSS,
    hidden: int = 256,
    dropout: float = 0.1,
    log_every: int = 10,
    log: Callable[[str], None] | None = None,
) -> tuple[ProbVLM, History]:
    """Train both ProbVLM heads on frozen pairs (ProbVLM Eq. 8); returns the model (eval mode) and history.

    History rows: ``epoch``, ``loss``, ``rec_image``, ``rec_text``, ``cross`` (sample-weighted means).
    """
    zi, zt = _as_pairs(image_emb, text_emb)
    torch.manual_seed(seed)
    model = ProbVLM(zi.shape[1], hidden=hidden, dropout=dropout)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def loss_fn(m: nn.Module, a: Tensor, b: Tensor) -> dict[str, Tensor]:
        return probvlm_loss(m, a, b, lambda_cross)  # type: ignore[arg-type]

    hist = _run(
        model,
        zi,
        zt,
        loss_fn,
        opt,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        lr_at=None,
        log_every=log_every,
        log=log,
    )
    return model, hist


def cosine_lr(step: int, total: int, lr: float, lr_min: float) -> float:
    """``lr_min + ½(lr − lr_min)(1 + cos(π·step/total))`` (AsymVLM App. B.4: cosine annealing to 1e−6)."""
    frac = min(step, total) / max(total, 1)
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * frac))


def fit_asymvlm(
    image_emb: np.ndarray,
    text_emb: np.ndarray,
    *,
    head: str = "vmf",
    epochs: int = 200,
    lr: float = 1e-2,
    lr_min: float = 1e-6,
    momentum: float = 0.9,
    batch_size: int = 2048,
    seed: int = 0,
    hidden: int = 1024,
    log_every: int = 20,
    log: Callable[[str], None] | None = None,
) -> tuple[AsymVLM, History]:
    """Train the AsymVLM text head (``head`` = "vmf" or "ps") and τ with symmetric InfoNCE on τ·L.

    History rows: ``epoch``, ``loss``, ``tau``, ``kappa_mean``.
    """
    zi, zt = _as_pairs(image_emb, text_emb)
    torch.manual_seed(seed)
    model = AsymVLM(zi.shape[1], family=head, hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    total = epochs * max(1, math.ceil(zi.shape[0] / batch_size))

    def loss_fn(m: nn.Module, a: Tensor, b: Tensor) -> dict[str, Tensor]:
        return asymvlm_loss(m, a, b)  # type: ignore[arg-type]

    hist = _run(
        model,
        zi,
        zt,
        loss_fn,
        opt,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        lr_at=lambda s: cosine_lr(s, total, lr, lr_min),
        log_every=log_every,
        log=log,
    )
    return model, hist


def describe(history: History) -> dict[str, Any]:
    """First/last epoch losses, for summaries and reports."""
    if not history:
        return {"epochs": 0}
    return {"epochs": len(history), "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"]}
