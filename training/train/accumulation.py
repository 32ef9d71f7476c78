"""Exact gradient accumulation: one local batch's gradients computed a few micro-batches at a time.

open_clip's ``--accum-freq`` scheme, for every objective: (1) every micro-batch forward without a graph,
its features kept; (2) the loss over the whole global batch on those features (``loss_of``: gathered
across workers with gradients, as in one step), differentiated with respect to the features and the
loss's own scalars only — no tower runs there; (3) every micro-batch forward again with a graph and
backward of Σ (features · their gradient), plus Σ (scalar · its gradient) on the last. By the chain rule
the parameters' gradients are the one-batch step's (tests/training/train/test_accumulation.py). Under DDP
only the last backward all-reduces (``no_sync`` before it). Each micro-batch's recompute starts from the
RNG state its first forward saw, so any sampling in the towers is drawn again identically
(docs/decisions/0088-elastic-by-exact-accumulation.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from training.train.distributed import ddp_loss_scale

Features = dict[str, Tensor | None]


def micro_slices(rows: int, n_micro: int) -> list[slice]:
    """``n_micro`` consecutive near-even pieces of ``rows`` rows (the first ``rows % n_micro`` one longer),
    empty pieces dropped: the micro-batches of one local batch."""
    base, extra = divmod(rows, n_micro)
    out, start = [], 0
    for j in range(n_micro):
        n = base + (j < extra)
        if n:
            out.append(slice(start, start + n))
        start += n
    return out


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, saved: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(saved[0])
    if saved[1] is not None:
        torch.cuda.set_rng_state(saved[1], device)


def _micro_masked(
    masked_index: Tensor | None, slices: list[slice], device: torch.device
) -> list[Tensor | None]:
    """Each micro-batch's masked rows, local to it (read on the host once a step: a sorted index)."""
    if masked_index is None:
        return [None] * len(slices)
    rows = masked_index.cpu().tolist()
    return [
        torch.tensor([i - s.start for i in rows if s.start <= i < s.stop], dtype=torch.long, device=device)
        for s in slices
    ]


def _concatenated(cached: list[Features]) -> dict[str, Tensor]:
    """The micro-batches' features end to end, as leaves that take gradients. Masked rows are sorted and
    micro-batches consecutive: concatenated, they are the one-batch order."""
    keys = list(dict.fromkeys(k for c in cached for k in c))
    out = {}
    for k in keys:
        parts = [c[k] for c in cached if c.get(k) is not None]
        if parts:
            out[k] = torch.cat(parts).requires_grad_(True)
    return out


def accumulated_backward(
    ddp: nn.Module,
    module: nn.Module,
    inputs: Mapping[str, Any],
    n_micro: int,
    loss_of: Callable[[Features], dict[str, Tensor]],
    masked_index: Tensor | None = None,
    backward: Callable[[Tensor], None] = lambda t: t.backward(),
    forward_ctx: Callable[[], Any] = nullcontext,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The gradients of the whole local batch's loss share, ``n_micro`` micro-batches at a time.

    ``module`` the train module (its ``loss`` holds the learnable scalars), ``ddp`` it or its DDP wrapper;
    ``inputs``: the forward's ``images``, ``tokens``, ``masked_tokens``, ``keep_idx`` (whole local batch);
    ``loss_of``: the loss terms of the whole local batch's features; ``masked_index`` sorted local rows with
    masked variants; ``backward`` the update's (loss scale); ``forward_ctx`` the autocast.
    Returns (loss terms, the detached features of the whole local batch)."""
    images, tokens = inputs["images"], inputs["tokens"]
    masked_tokens, keep_idx = inputs.get("masked_tokens"), inputs.get("keep_idx")
    slices = micro_slices(tokens.shape[0], n_micro)
    device = images.device
    micro_masked = _micro_masked(masked_index, slices, device)

    def run(net: nn.Module, j: int) -> Features:
        s = slices[j]
        with forward_ctx():
            return net(
                images[s],
                tokens[s],
                None if masked_tokens is None else masked_tokens[s],
                None if keep_idx is None else keep_idx[s],
                micro_masked[j],
            )

    rng, cached = [], []
    with torch.no_grad():
        for j in range(len(slices)):
            rng.append(_rng_state(device))
            cached.append(run(module, j))  # the unwrapped module: no DDP hooks, no collectives
    leaves = _concatenated(cached)
    terms = loss_of({k: leaves.get(k) for c in cached for k in c})
    scalars = [p for p in module.loss.parameters() if p.requires_grad]
    grads = torch.autograd.grad(
        terms["total"] * ddp_loss_scale(), [*leaves.values(), *scalars], allow_unused=True
    )
    feat_grads = dict(zip(leaves, grads[: len(leaves)], strict=True))
    starts = {k: 0 for k in leaves}  # where each micro-batch's rows sit in the concatenated features
    no_sync = getattr(getattr(ddp, "_orig_mod", ddp), "no_sync", nullcontext)
    for j in range(len(slices)):
        last = j == len(slices) - 1
        _set_rng_state(device, rng[j])
        with nullcontext() if last else no_sync():
            out = run(ddp, j)
            surrogate = torch.zeros((), device=device)
            for k in leaves:
                f, g = out.get(k), feat_grads[k]
                n = 0 if f is None else f.shape[0]
                if g is not None and n:
                    surrogate = surrogate + (f * g[starts[k] : starts[k] + n]).sum()
                starts[k] += n
            if last:
                for p, g in zip(scalars, grads[len(leaves) :], strict=True):
                    if g is not None:
                        surrogate = surrogate + (p * g).sum()
            backward(surrogate)
    return {k: v.detach() for k, v in terms.items()}, {k: v.detach() for k, v in leaves.items()}
