"""Two gloo processes vs one process on the same global batch: loss and every parameter gradient agree.

This exercises the real path of the train loop: ``TrainModule`` forward under DDP (masked variants
included), ``loss_shares`` (the differentiable all-gather of training/train/distributed.py), the share scaled by
the world size, DDP's gradient averaging. Rank 1 gets no masked sample (M = 0) to cover the skipped pass.
One pair of processes computes all four objectives; the per-objective tests compare the saved results.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from training.losses.registry import LOSS_SPECS, build_loss_from_config, loss_spec
from training.model.config import model_config
from training.model.two_tower import ProLIP
from training.train import distributed as D
from training.train.step import TrainModule, loss_shares

OBJECTIVES = tuple(LOSS_SPECS)  # every registered loss
WORLD, N, PAD, END, MASK = 2, 8, 0, 1, 2


def tiny_module(name: str) -> TrainModule:
    loss = build_loss_from_config(loss_spec(name)())[0]
    cfg = model_config(
        "tiny",
        image_size=16,
        patch_size=4,
        vision_width=32,
        vision_layers=1,
        vision_heads=2,
        text_width=32,
        text_layers=1,
        text_heads=2,
        context_length=8,
        vocab_size=64,
        embed_dim=16,
        probabilistic=loss_spec(name).probabilistic,
    )
    torch.manual_seed(0)
    return TrainModule(ProLIP(cfg), loss, loss_spec(name))


def global_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 64, (N, 8), generator=g)
    lengths = torch.tensor([3, 5, 7, 2, 6, 4, 7, 1])
    pos = torch.arange(8)[None, :]
    tokens = torch.where(pos < lengths[:, None], tokens, PAD)
    tokens[torch.arange(N), lengths] = END
    masked = tokens.clone()
    masked[:, 0] = MASK
    keep = torch.stack([torch.randperm(16, generator=g)[:4].sort().values for _ in range(N)])
    return {
        "images": torch.randn(N, 3, 16, 16, generator=g),
        "tokens": tokens,
        "masked_tokens": masked,
        "keep_idx": keep,
        "selected": torch.tensor([True, False, True, False, False, False, False, False]),
        # PCME++ mixing inside each local half: partner (local index) and lambda per row.
        "partner": torch.tensor([1, 1, 2, 0, 1, 0, 2, 3]),
        "lam": torch.tensor([0.7, 1.0, 0.4, 1.0, 0.6, 1.0, 1.0, 1.0]),
    }


def step(module: torch.nn.Module, inner: TrainModule, batch: dict[str, torch.Tensor], offset: int):
    masked_index = batch["selected"].nonzero().squeeze(1)
    feats = module(batch["images"], batch["tokens"], batch["masked_tokens"], batch["keep_idx"], masked_index)
    mix = (batch["partner"] + offset, batch["lam"])
    terms = loss_shares(inner.loss, inner.spec, feats, masked_index, mix)
    (terms["total"] * D.ddp_loss_scale()).backward()
    return {k: float(v.detach()) for k, v in terms.items()}


def _worker(rank: int, port: int, out_dir: str, backend: str = "gloo") -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        batch = {k: v.chunk(WORLD)[rank].to(device) for k, v in global_batch().items()}
        results = {}
        for name in OBJECTIVES:
            inner = tiny_module(name).to(device)
            ddp = DDP(inner, device_ids=[rank] if backend == "nccl" else None)
            # partner indices are local to the half; the single process adds the half's offset.
            local = step(ddp, inner, batch, offset=0)
            totals = D.all_reduce_sum(torch.tensor([local[k] for k in sorted(local)], dtype=torch.float64))
            grads = {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}
            results[name] = {
                "loss": dict(zip(sorted(local), totals.tolist(), strict=True)),
                "grads": {n: g.cpu() for n, g in grads.items()},
            }
        if (
            backend == "nccl"
        ):  # the gather's NCCL backward (a reduce-scatter beside DDP's buckets) is the point
            if rank == 0:
                torch.save(results, os.path.join(out_dir, "nccl.pt"))
            dist.barrier()
            return
        results["uneven"] = _uneven_planned_step(rank)
        results["epoch_end"] = [D.EpochEnd().all_have(rank == 0), D.EpochEnd().all_have(True)]
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "distributed.pt"))
        # Both ranks tear gloo down together: rank 1 destroying its group while rank 0 still saved
        # aborted rank 1 now and then ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


UNEVEN = [5, 3]  # rows of rank 0 and rank 1: a global batch of 8 that the world does not split evenly


def _uneven_planned_step(rank: int) -> dict:
    """ProLIP on an uneven split with the batch plan (no count exchange), under the host-sync counter."""
    from tests.fixtures.sync_counter import SyncCounter

    start = sum(UNEVEN[:rank])
    batch = {k: v[start : start + UNEVEN[rank]] for k, v in global_batch().items()}
    masked = [
        int(global_batch()["selected"][sum(UNEVEN[:r]) : sum(UNEVEN[: r + 1])].sum()) for r in range(WORLD)
    ]
    plan = D.BatchPlan(UNEVEN, [[m] for m in masked])
    inner = tiny_module("prolip")
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(inner)
    masked_index = batch["selected"].nonzero().squeeze(1)
    feats = ddp(batch["images"], batch["tokens"], batch["masked_tokens"], batch["keep_idx"], masked_index)
    with SyncCounter() as sync:
        terms = loss_shares(inner.loss, inner.spec, feats, masked_index, plan=plan)
        (terms["total"] * D.ddp_loss_scale()).backward()
    totals = D.all_reduce_sum(torch.stack([terms[k].detach().double() for k in sorted(terms)]))
    grads = {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}
    return {
        "loss": dict(zip(sorted(terms), totals.tolist(), strict=True)),
        "grads": grads,
        "syncs": sync.events,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return torch.load(out / "distributed.pt", weights_only=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", OBJECTIVES)
def test_two_nccl_workers_match_single_process(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same parity on two GPUs over NCCL (skipped with fewer than two)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path_factory.getbasetemp() / "nccl"
    if not (out / "nccl.pt").is_file():
        out.mkdir(exist_ok=True)
        mp.spawn(_worker, args=(_free_port(), str(out), "nccl"), nprocs=WORLD, join=True)
    dist = torch.load(out / "nccl.pt", weights_only=True)[name]
    terms, grads = single_process(name)
    for k, v in terms.items():
        assert dist["loss"][k] == pytest.approx(v, abs=1e-4, rel=1e-4), k
    worst = max(float((dist["grads"][n] - g).abs().max()) for n, g in grads.items())
    assert worst <= 1e-4, f"{name}: max |grad difference| {worst:.2e}"


def single_process(name: str) -> tuple[dict, dict]:
    inner = tiny_module(name)
    batch = global_batch()
    half = N // WORLD
    batch["partner"] = batch["partner"] + torch.arange(N) // half * half  # local → global partner
    terms = step(inner, inner, batch, offset=0)
    grads = {n: p.grad.detach().clone() for n, p in inner.named_parameters() if p.grad is not None}
    return terms, grads


def test_identity_without_process_group() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    g = D.gather_with_grad({"x": x}, extra_counts=[2])
    assert g.columns["x"] is x and g.offset == 0 and g.sizes == [4] and g.total(0) == 2
    assert D.ddp_loss_scale() == 1 and D.rank_and_world() == (0, 1)


@pytest.mark.slow  # two spawned processes importing torch + DDP's lazy imports: ≈15 s on 2 cores
@pytest.mark.parametrize("name", OBJECTIVES)
def test_two_gloo_workers_match_single_process(name: str, distributed_results: dict) -> None:
    terms, grads = single_process(name)
    dist = distributed_results[name]
    for k, v in terms.items():
        assert dist["loss"][k] == pytest.approx(v, abs=1e-5, rel=1e-5), k
    assert set(dist["grads"]) == set(grads)
    assert len(grads) > 10  # towers, heads and the loss's learnable scalars
    worst = max(float((dist["grads"][n] - g).abs().max()) for n, g in grads.items())
    assert worst <= 1e-5, f"{name}: max |grad difference| {worst:.2e}"
    # The comparison is not vacuous: the loss's scalars and the towers both receive gradient.
    assert any(float(g.abs().max()) > 1e-4 for n, g in grads.items() if n.startswith("loss."))


@pytest.mark.slow  # shares the two processes above
def test_uneven_batches_with_a_plan_match_and_never_sync(distributed_results: dict) -> None:
    """Rank 0 holds 5 rows, rank 1 holds 3: with the batch plan (sizes known to every rank, no exchange) the
    loss and gradients still equal one process on all 8, and the loss and its backward never sync."""
    terms, grads = single_process("prolip")
    got = distributed_results["uneven"]
    assert got["syncs"] == []
    for k, v in terms.items():
        assert got["loss"][k] == pytest.approx(v, abs=1e-5, rel=1e-5), k
    worst = max(float((got["grads"][n] - g).abs().max()) for n, g in grads.items())
    assert worst <= 1e-5, f"max |grad difference| {worst:.2e}"
    # The epoch ends on both ranks when one of them has no batch left.
    assert distributed_results["epoch_end"] == [False, True]


def test_local_batch_sizes_split_every_sample_once() -> None:
    assert D.local_batch_sizes(8, 2) == [4, 4] and D.local_batch_sizes(100, 3) == [34, 33, 33]
    for world in range(1, 9):
        sizes = D.local_batch_sizes(4096, world)
        assert sum(sizes) == 4096 and max(sizes) - min(sizes) <= 1
