"""Cross-worker exchange for the exact global-batch loss: gather features WITH gradients, and the bookkeeping.

The losses (training/losses/contrastive.py) take this worker's local rows, the global columns and ``offset`` and
return this worker's *share*; the shares sum to the single-process loss on the global batch of N rows.
Why gathering with gradients makes the gradients exact too: ``torch.distributed.nn.functional.all_gather``
is differentiable — its backward sends each slot's gradient back to the rank that owns the slot and sums
what arrives (an all-to-all, so it also works on gloo, which has no reduce-scatter). So after every rank
back-propagates its own share S_r, rank r holds ∂(Σ_q S_q)/∂f_r for its features f_r, i.e. exactly the
global loss's gradient restricted to the parameters' use on rank r's samples. The full gradient is the
SUM of those over ranks, while DDP AVERAGES them: multiply the share by ``world_size`` before backward
(``ddp_loss_scale``) and DDP's average is the single-process gradient — no approximation, no skipped
negatives (unlike the official ring exchange; docs/fidelity.md), verified in tests/training/train/test_distributed.py.

Every function is the identity when no process group is initialised (or the world is one process), so
the train loop runs unchanged in a single process. No loss math lives here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    return rank_and_world()[1] > 1


def ddp_loss_scale() -> int:
    """Factor for the local share before backward so that DDP's gradient *average* equals the gradient
    of the global loss (the sum of shares): the world size."""
    return rank_and_world()[1]


@dataclass
class Gathered:
    """Global columns (rank order, this rank included), this rank's first row in them, and per-rank info."""

    columns: dict[str, Tensor]  # name -> (N, ...) where N = sum(sizes)
    offset: int  # index of this rank's first row in the global batch
    sizes: list[int]  # rows per rank
    counts: list[list[int]]  # per rank, the ``extra_counts`` it passed

    @property
    def n_global(self) -> int:
        return sum(self.sizes)

    def total(self, i: int) -> int:
        """Sum over ranks of extra count ``i`` (e.g. the global number of masked samples)."""
        return sum(c[i] for c in self.counts)


def exchange_counts(values: Sequence[int], device: torch.device | str = "cpu") -> list[list[int]]:
    """All ranks' integer vectors (same length everywhere), in rank order; no gradient."""
    local = torch.tensor([list(values)], dtype=torch.int64, device=device)  # (1, k)
    if not is_distributed():
        return local.tolist()
    out = [torch.empty_like(local) for _ in range(rank_and_world()[1])]
    dist.all_gather(out, local)
    return torch.cat(out).tolist()


def local_batch_sizes(global_batch: int, world: int) -> list[int]:
    """Rows each rank takes of a global batch: ``global_batch // world``, one more on the first
    ``global_batch % world`` ranks. Every rank computes the same list, so no rank has to be asked."""
    base, extra = divmod(global_batch, world)
    return [base + (r < extra) for r in range(world)]


@dataclass(frozen=True)
class BatchPlan:
    """Rows and extra counts of every rank, known before the step (from the config and the world size), so
    the gather needs no count exchange — an all-gather whose ``.tolist()`` would stop the host until the
    device queue drains, every step."""

    sizes: list[int]  # rows per rank
    counts: list[list[int]]  # per rank, the ``extra_counts`` it will pass


def gather_with_grad(
    tensors: Mapping[str, Tensor], extra_counts: Sequence[int] = (), plan: BatchPlan | None = None
) -> Gathered:
    """Gather same-width local tensors (B_r, ...) from every rank into (N, ...) columns, differentiably.

    Ranks may hold different numbers of rows (padded to the largest for the collective, then trimmed).
    All tensors are packed into one (B, W) matrix so a step costs one collective forward and one
    backward whatever the number of features. The rows and ``extra_counts`` (e.g. this rank's
    masked-sample count) of every rank come from ``plan`` when given (checked against this rank's own,
    which are shapes, known on the host); without one they travel in one small integer exchange, which
    syncs the host with the device.
    """
    names = list(tensors)
    if not names:
        raise ValueError("gather_with_grad needs at least one tensor")
    first = tensors[names[0]]
    rows = first.shape[0]
    for name in names:
        if tensors[name].shape[0] != rows:
            raise ValueError(f"{name} has {tensors[name].shape[0]} rows, {names[0]} has {rows}")
    rank, world = rank_and_world()
    if world == 1:
        return Gathered(dict(tensors), 0, [rows], [list(extra_counts)])
    if plan is None:
        counts = exchange_counts([rows, *extra_counts], first.device)
    else:
        mine = [plan.sizes[rank], *plan.counts[rank]]
        if [rows, *extra_counts] != mine:
            raise ValueError(
                f"rank {rank} holds rows/counts {[rows, *extra_counts]}, its batch plan says {mine}"
            )
        counts = [[n, *c] for n, c in zip(plan.sizes, plan.counts, strict=True)]

    from torch.distributed.nn.functional import all_gather

    sizes = [c[0] for c in counts]
    dtype = first.dtype
    for name in names[1:]:
        dtype = torch.promote_types(dtype, tensors[name].dtype)
    flat = [tensors[n].reshape(rows, -1).to(dtype) for n in names]
    widths = [f.shape[1] for f in flat]
    packed = torch.cat(flat, dim=1)  # (B, W)
    longest = max(sizes)
    if rows < longest:
        packed = torch.cat([packed, packed.new_zeros(longest - rows, packed.shape[1])])  # (B_max, W)
    slots = all_gather(packed)  # world × (B_max, W), differentiable
    packed_all = torch.cat([s[:n] for s, n in zip(slots, sizes, strict=True)])  # (N, W)
    columns = {}
    for name, part in zip(names, packed_all.split(widths, dim=1), strict=True):
        columns[name] = part.reshape(-1, *tensors[name].shape[1:]).to(tensors[name].dtype)
    return Gathered(columns, sum(sizes[:rank]), sizes, [c[1:] for c in counts])


def all_reduce_sum(values: Tensor) -> Tensor:
    """Sum of a (detached) tensor over ranks; the identity in one process."""
    out = values.detach().clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(values: Tensor) -> Tensor:
    out = values.detach().clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


class EpochEnd:
    """Ends an epoch on every rank together: ``all_have(have)`` is True while every rank still holds a batch.

    Ranks' shards of an epoch need not split into the same number of batches (uneven local batches, or
    a split that is not exactly equal); a rank that stopped while the others entered the step's
    collectives would hang them until the collective timeout. One int goes through a MIN all-reduce on a
    CPU (gloo) group — a host-to-host exchange that never waits on the GPU's queue. Build it on every rank
    (creating the group is itself collective).
    """

    def __init__(self) -> None:
        self.group: object | None = None
        if is_distributed() and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def all_have(self, have: bool) -> bool:
        if not is_distributed():
            return have
        flag = torch.tensor([int(have)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())  # a CPU tensor: no device sync
