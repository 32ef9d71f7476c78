"""Exact gradient accumulation: a step over k micro-batches equals the one-batch step, for every objective.

``accumulated_backward`` (training/train/accumulation.py) against the plain step on the same global batch, in float64:
k = 1, 2, 4 and k = 3 (8 rows: 3, 3, 2, an uneven last micro-batch), in one process and on two gloo ranks
under DDP (rows 5 and 3, the batch plan, only the last micro-batch's backward synchronised); loss terms and
every parameter's gradient (the loss's logit scale and bias included) to 1e-5. ProLIP runs with its masked
variants (rows 0 and 2), so its inclusion and VIB terms are covered; PCME++ with its mixed-image labels. The
trainer's own ``train_step`` with ``scaling.max_local_batch`` below the local batch updates the weights as
the one-batch step does.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.training.train.test_distributed import UNEVEN, _free_port, global_batch, tiny_module
from tests.training.train.test_gpu_step import TOKENIZER, uint8_batch
from training.config import OptimConfig, TrainConfig, WorkersConfig
from training.losses.registry import LOSS_SPECS
from training.train import distributed as D
from training.train.accumulation import accumulated_backward, micro_slices
from training.train.step import loss_shares, setup_state, train_step

OBJECTIVES = tuple(LOSS_SPECS)
KS = (1, 2, 3, 4)
TOL = dict(rtol=1e-5, atol=1e-5)


# PCME++'s mixing partners, local to each rank's rows of the UNEVEN split (5, 3); GLOBAL_PARTNER in one process.
LOCAL_PARTNER = torch.tensor([1, 1, 2, 0, 1, 0, 2, 1])
GLOBAL_PARTNER = LOCAL_PARTNER + torch.tensor([0] * UNEVEN[0] + [UNEVEN[0]] * UNEVEN[1])


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in ("images", "tokens", "masked_tokens", "keep_idx")}


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def one_batch(name: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The single-process step on all 8 rows (the reference)."""
    batch = {k: v.double() if v.is_floating_point() else v for k, v in global_batch().items()}
    module = tiny_module(name).double()
    masked_index = batch["selected"].nonzero().squeeze(1)
    feats = module(*_inputs(batch).values(), masked_index)
    terms = loss_shares(module.loss, module.spec, feats, masked_index, (GLOBAL_PARTNER, batch["lam"]))
    terms["total"].backward()
    return {k: float(v.detach()) for k, v in terms.items()}, _grads(module)


def _counting_ddp(module: torch.nn.Module, calls: list[int]) -> torch.nn.Module:
    """DDP whose gradient all-reduce counts its bucket calls in ``calls``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    net = DDP(module)
    net.register_comm_hook(None, hook)
    return net


def accumulated(name: str, k: int, rank: int = 0, sizes: list[int] | None = None, calls: list | None = None):
    """This rank's accumulated step over its rows of the global batch (all rows in one process); under DDP
    when ``calls`` is a list (its all-reduce bucket calls appended there)."""
    full = {k_: v.double() if v.is_floating_point() else v for k_, v in global_batch().items()}
    sizes = sizes or [8]
    start = sum(sizes[:rank])
    batch = {k_: v[start : start + sizes[rank]] for k_, v in full.items()}
    module = tiny_module(name).double()
    net = module if calls is None else _counting_ddp(module, calls)
    masked_index = batch["selected"].nonzero().squeeze(1)
    plan = None
    if len(sizes) > 1:
        masked = [
            int(full["selected"][sum(sizes[:r]) : sum(sizes[: r + 1])].sum()) for r in range(len(sizes))
        ]
        plan = D.BatchPlan(sizes, [[m] for m in masked])
    partner = GLOBAL_PARTNER if len(sizes) == 1 else LOCAL_PARTNER[start : start + sizes[rank]]
    mix = (partner, batch["lam"])
    loss_of = lambda f: loss_shares(module.loss, module.spec, f, masked_index, mix, plan)  # noqa: E731
    terms, _ = accumulated_backward(net, module, _inputs(batch), k, loss_of, masked_index)
    return {k_: float(v) for k_, v in terms.items()}, _grads(module)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]]:
    return {name: one_batch(name) for name in OBJECTIVES}


def _same(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert loss.keys() == ref_loss.keys()
    for term, value in ref_loss.items():
        assert loss[term] == pytest.approx(value, rel=1e-5, abs=1e-5), term
    assert grads.keys() == ref_grads.keys()
    for pname, g in ref_grads.items():
        torch.testing.assert_close(grads[pname], g, **TOL, msg=pname)


def test_micro_slices_cover_every_row_once() -> None:
    assert [(s.start, s.stop) for s in micro_slices(8, 3)] == [(0, 3), (3, 6), (6, 8)]
    assert [(s.start, s.stop) for s in micro_slices(2048, 4)] == [(i * 512, i * 512 + 512) for i in range(4)]
    assert [(s.start, s.stop) for s in micro_slices(2, 4)] == [(0, 1), (1, 2)]  # no empty micro-batch


@pytest.mark.parametrize("name", OBJECTIVES)
def test_accumulated_step_equals_one_batch_step(name: str, references: dict) -> None:
    for k in KS:
        _same(accumulated(name, k), references[name])
    assert references[name][1]  # gradients reached the parameters


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results, calls = {}, {}
        for name in OBJECTIVES:
            for k in (1, 2, 3):  # rank 0: 5, 3+2 or 2+2+1 rows; rank 1: 3, 2+1 or 1+1+1
                calls[(name, k)] = []
                loss, grads = accumulated(name, k, rank, UNEVEN, calls[(name, k)])
                totals = D.all_reduce_sum(torch.tensor([loss[t] for t in sorted(loss)], dtype=torch.float64))
                results[(name, k)] = (dict(zip(sorted(loss), totals.tolist(), strict=True)), grads)
        results["allreduce_calls"] = {key: len(c) for key, c in calls.items()}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "accumulated.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_accumulating_match_one_batch(references: dict, tmp_path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    results = torch.load(tmp_path / "accumulated.pt")
    calls = results.pop("allreduce_calls")
    for (name, _k), got in results.items():
        _same(got, references[name])
    for name in OBJECTIVES:  # only the last micro-batch's backward all-reduces: as many calls as one step
        assert calls[(name, 2)] == calls[(name, 3)] == calls[(name, 1)] >= 1, calls


@pytest.mark.parametrize(
    ("loss", "precision", "tol"),
    [("prolip", "fp32", 1e-4), ("pcmepp", "fp32", 1e-4), ("prolip", "bf16", 2e-2), ("clip", "amp", 2e-2)],
)
def test_train_step_with_a_micro_batch_cap_updates_as_one_batch(
    loss: str, precision: str, tol: float
) -> None:
    """The trainer's step (augment, autocast, guarded AdamW; float16 amp's loss scale) with a cap of 3 on
    8 rows: 3 micro-batches. Under autocast the two steps' trunks run at other batch sizes, so they agree to
    the autocast dtype's precision; the σ heads stay float32 either way."""
    torch.set_num_threads(1)
    states = []
    for cap in (0, 3):
        cfg = TrainConfig(
            model="tiny",
            global_batch_size=8,
            samples_seen=64,
            precision=precision,
            loss={"name": loss},
            optim=OptimConfig(warmup_steps=1, grad_clip=1.0),
            scaling=WorkersConfig(num_workers=1, max_local_batch=cap),
        )
        state = setup_state(cfg, TOKENIZER, torch.device("cpu"), 0)
        terms, feats = train_step(state, uint8_batch())
        states.append((state, terms, feats))
    (plain, t1, f1), (accum, t2, f2) = states
    assert (plain.micro, accum.micro) == (1, 3)
    torch.testing.assert_close(t2["total"], t1["total"].detach(), rtol=tol / 10, atol=1e-6)
    torch.testing.assert_close(f2["grad_norm"], f1["grad_norm"], rtol=tol, atol=1e-6)
    if "logvar_v" in f2:
        assert f2["logvar_v"].dtype == f1["logvar_v"].dtype == torch.float32
    if precision == "fp32":
        for (n, p), q in zip(plain.module.named_parameters(), accum.module.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=tol, atol=1e-6, msg=n)
    # The step's (unscaled) gradients as one vector: AdamW's first update is ~lr·sign(g), so weights would
    # amplify autocast's rounding of near-zero gradients.
    g1, g2 = (torch.cat([p.grad.flatten() for p in s.module.parameters()]) for s in (plain, accum))
    assert float((g2 - g1).norm() / g1.norm()) < tol


def test_prolip_b16_on_eight_workers_plans_four_micro_batches() -> None:
    import dataclasses

    from training.config import TRAIN_PRESETS
    from training.train.trainer import micro_batch_plan

    preset = TRAIN_PRESETS["prolip-b16"]
    cfg = dataclasses.replace(
        preset, scaling=dataclasses.replace(preset.scaling, num_workers=8, max_local_batch=512)
    )
    assert cfg.micro_batches(8) == 4  # 16,384 / 8 = 2,048 per device, 512 at a time
    assert (
        micro_batch_plan(cfg)
        == "scaling.max_local_batch=512: world 8: 2048 a worker in 4 micro-batches of ≤ 512"
    )
    elastic = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, min_workers=1))
    assert [elastic.micro_batches(w) for w in (1, 2, 3, 8)] == [32, 16, 11, 4]
