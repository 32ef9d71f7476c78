"""One optimizer step and the state it runs on, without Ray: the train loop's pure core.

``train_loop_per_worker`` (training/train/loop.py) only adds Ray Train around these parts: the worker's device
and dataset shard, reports and checkpoints. Everything here runs in a plain process (one worker = the
identity gather of training/train/distributed.py), so tests and benchmarks drive the real step directly.

One step (``train_step``): batch → the pixel augmentation on the device (uint8 crops → jittered,
normalised floats, pipeline/ingest/device_augment.py) → ``TrainModule`` forward (both towers, plus the
masked image/text variants of the selected samples — ProLIP Eq. 6) → gather the loss's columns from every
worker WITH gradients (training/train/distributed.py) → this worker's loss share × world size (DDP averages
gradients; the sum of shares is the global-batch loss, so the average of the scaled gradients is its exact
gradient) → backward → the guarded AdamW update (training/train/optimizer.py: gradient norm, optional
clipping, a non-finite step skipped and counted; ProLIP App. B.1 parameter groups via ``param_groups``),
LR warmup then cosine. Which columns are gathered, and whether masked variants or PCME++'s mixed images
are used, is read from the objective's ``LossConfig`` class (training/losses/objectives.py).

A local batch above ``scaling.max_local_batch`` runs in ``state.micro`` micro-batches
(training/train/accumulation.py): features of every micro-batch without a graph, the loss over the whole global
batch, each micro-batch recomputed and back-propagated with its features' gradients, one all-reduce —
the one-batch step's gradients for every objective (docs/decisions/0088-elastic-by-exact-accumulation.md).

The step never waits for the host: every rank's rows and masked count come from the batch plan
(``BatchPlan``, computed from the config and the world size) instead of an exchange, the skip decision
stays a device tensor, and the per-step figures accumulate on the device until a report
(tests/training/train/test_gpu_step.py counts the operations that would sync a GPU).

Precision: bf16 autocast on CUDA (the σ/μ heads and the losses in float32 inside), fp32 on CPU;
``precision="amp"`` float16 autocast with the update's dynamic loss scale (DataComp's setting).
``compile=true`` wraps the module in ``torch.compile(dynamic=True)``: the text length varies per batch.

Bookkeeping that makes recovery checkable: ``history`` is the list of committed step ranges, carried in
every checkpoint and extended by one per optimizer step. A restarted run restores it from the checkpoint,
so steps run after the last checkpoint by a failed attempt are *not* committed and run again; the final
history is ``[[1, total_steps]]`` exactly when no committed step was repeated or skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from pipeline.common import faults
from pipeline.ingest.device_augment import DeviceAugment
from pipeline.ingest.masking import round_half_up
from training.losses.objectives import LossConfig
from training.losses.pcmepp import mix_images, pcmepp_soft_labels
from training.losses.registry import build_loss_from_config
from training.model.config import model_config, objective_model_config, text_table
from training.model.param_groups import param_groups
from training.model.two_tower import ProLIP
from training.train.accumulation import accumulated_backward
from training.train.checkpointing import restore
from training.train.distributed import BatchPlan, ddp_loss_scale, gather_with_grad, local_batch_sizes
from training.train.optimizer import GuardedUpdate, make_adamw
from training.train.salient_masking import SalientDrop

T = TypeVar("T")
_log = logging.getLogger(__name__)


class TrainModule(nn.Module):
    """The two towers and the loss's learnable scalars under one module, so one DDP wrapper covers both.

    ``forward`` runs both towers on the batch and, when ``masked_index`` (M,) is given, the image tower on
    the selected images with their kept patches (in the same trunk run as the whole pictures) and the text
    tower on their masked tokens (concatenated with the full text batch: one text forward). The loss is
    applied outside ``forward``, after the cross-worker gather.
    """

    def __init__(self, model: ProLIP, loss: nn.Module, spec: LossConfig) -> None:
        super().__init__()
        self.model, self.loss, self.spec = model, loss, spec

    def forward(
        self,
        images: Tensor,
        tokens: Tensor,
        masked_tokens: Tensor | None = None,
        keep_idx: Tensor | None = None,
        masked_index: Tensor | None = None,
    ) -> dict[str, Tensor | None]:
        b = tokens.shape[0]
        text = tokens
        # numel() is shape metadata: no device sync, and M = 0 (possible on one rank) skips the extra rows.
        masked = masked_index is not None and masked_index.numel() > 0 and keep_idx is not None
        if masked:
            (mu_v, logvar_v), (mu_vm, logvar_vm) = self.model.encode_image_with_dropped(
                images, images[masked_index], keep_idx[masked_index]
            )  # (B, E), (M, E)
            out: dict[str, Tensor | None] = {"mu_v_masked": mu_vm, "logvar_v_masked": logvar_vm}
            text = torch.cat([tokens, masked_tokens[masked_index]])  # (B + M, L)
        else:
            mu_v, logvar_v = self.model.encode_image(images)  # (B, E)
            out = {}
        out |= {"mu_v": mu_v, "logvar_v": logvar_v}
        mu_t, logvar_t = self.model.encode_text(text)  # (B [+ M], E)
        out["mu_t"], out["logvar_t"] = mu_t[:b], None if logvar_t is None else logvar_t[:b]
        if masked:
            out["mu_t_masked"], out["logvar_t_masked"] = mu_t[b:], None if logvar_t is None else logvar_t[b:]
        return out


def loss_shares(
    loss: nn.Module,
    spec: LossConfig,
    feats: Mapping[str, Tensor | None],
    masked_index: Tensor | None = None,
    mix: tuple[Tensor, Tensor] | None = None,
    plan: BatchPlan | None = None,
) -> dict[str, Tensor]:
    """This worker's share of every loss term (sum over workers = the single-process global-batch loss).

    ``mix`` = (partner_index, lam) of PCME++'s mixed images (local indices), turned into soft labels
    against the global columns; ``plan`` every rank's rows and masked count (else exchanged). Identity
    gather in one process.
    """
    n_masked = 0 if masked_index is None else int(masked_index.numel())  # a shape: no device sync
    g = gather_with_grad({k: feats[k] for k in spec.columns}, extra_counts=[n_masked], plan=plan)
    inputs: dict[str, Any] = {f"{k}_all": v for k, v in g.columns.items()}
    inputs["offset"] = g.offset
    if spec.uses_masked and masked_index is not None:
        for k in ("mu_v_masked", "logvar_v_masked", "mu_t_masked", "logvar_t_masked"):
            inputs[k] = feats.get(k)
        inputs["masked_index"] = masked_index
        inputs["n_masked_global"] = g.total(0)
    if spec.uses_soft_labels and mix is not None:
        lam = mix[1].to(feats["mu_v"].device)
        inputs["soft_labels"] = pcmepp_soft_labels(mix[0], lam, g.offset, g.n_global)
    return loss(feats["mu_v"], feats["logvar_v"], feats["mu_t"], feats["logvar_t"], **inputs)


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the base LR after ``step`` scheduler steps: linear warmup, then cosine to min_ratio."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def extend_history(history: list[list[int]], step: int) -> None:
    """Append ``step`` to run-length ranges [[first, last], ...]; a repeat or gap starts a new range."""
    if history and history[-1][1] == step - 1:
        history[-1][1] = step
    else:
        history.append([step, step])


def batch_plan(cfg: Any, spec: LossConfig, world: int) -> BatchPlan:
    """Every rank's rows and masked-sample count at ``world`` workers (the collate step masks exactly
    round_half_up(mask_fraction · rows) of each batch, pipeline/ingest/masking.py)."""
    sizes = local_batch_sizes(cfg.global_batch_size, world)
    masked = [int(round_half_up(cfg.data.mask_fraction * n)) if spec.uses_masked else 0 for n in sizes]
    return BatchPlan(sizes, [[m] for m in masked])


def autocast(device: torch.device, precision: str) -> Any:
    if precision == "amp":  # float16, with the update's loss scale (training/train/optimizer.py)
        return torch.autocast(device.type, dtype=torch.float16)
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def build_module(cfg: Any, tokenizer: Any) -> tuple[TrainModule, Any]:
    """A fresh ``TrainModule`` and its model config (deterministic init from ``cfg.seed``)."""
    loss, spec = build_loss_from_config(cfg.loss)
    eot = not spec.probabilistic and model_config(cfg.model).text_pool == "eot"
    mcfg = objective_model_config(
        cfg.model,
        spec.probabilistic,
        vocab_size=text_table(tokenizer, eot),
        pad_id=tokenizer.pad_id,
        grad_checkpointing=cfg.grad_checkpointing,
    )
    torch.manual_seed(cfg.seed)
    return TrainModule(ProLIP(mcfg), loss, spec), mcfg


@dataclass
class TrainState:
    """What one worker carries from step to step; ``extra`` fields are what a checkpoint restores."""

    cfg: Any  # training.config.TrainConfig
    module: TrainModule  # the unwrapped module (loss scalars, model)
    ddp: nn.Module  # the module as the step calls it (DDP-wrapped on several workers)
    mcfg: Any
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    mix_gen: torch.Generator
    update: GuardedUpdate  # gradient norm, clipping, the finite guard and AdamW
    augment: DeviceAugment  # uint8 crops → the model's input, on the device
    plan: BatchPlan | None = None  # every rank's rows and masked count (None in one process)
    micro: int = 1  # micro-batches a local batch runs in (scaling.max_local_batch; accumulated_backward)
    step: int = 0
    epoch: int = 0
    epoch_start: int = 0  # the step the epoch began at (data.exact_position: where in the epoch a resume is)
    history: list[list[int]] = field(default_factory=list)
    logged: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)  # first step of every (re)start
    start_step: int = 0
    restored: bool = False  # resumed from a checkpoint (a restarted attempt)
    # data.text_mask_mode="salient": rewrites the collated masked captions with the model's own choice of
    # words to remove (training/train/salient_masking.py); None for every other mode.
    salient: SalientDrop | None = None


def setup_state(
    cfg: Any,
    tokenizer: Any,
    device: torch.device,
    rank: int,
    restore_dir: str | None = None,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    world: int = 1,
) -> TrainState:
    """Model, loss, optimizer and schedule for one worker, restored from ``restore_dir`` when given.

    ``wrap`` is the DDP wrapper (Ray Train's ``prepare_model``), applied after restoring the weights;
    ``world`` the number of workers (the batch plan's size).
    """
    module, mcfg = build_module(cfg, tokenizer)
    extra, saved = restore(module, restore_dir) if restore_dir else ({}, None)
    ddp = wrap(module.to(device))
    inner: TrainModule = ddp.module if hasattr(ddp, "module") else ddp
    if cfg.compile:
        ddp = torch.compile(ddp, dynamic=True)
    o = cfg.optim
    groups = param_groups(inner, o.weight_decay, o.lr, o.unc_lr_mult, o.unc_lr_mult_image, o.decay_rule)
    opt, fused = make_adamw(groups, o)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.total_steps, o.warmup_steps, o.min_lr_ratio))
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
    step = int(extra.get("step", 0))
    return TrainState(
        cfg=cfg,
        module=inner,
        ddp=ddp,
        mcfg=mcfg,
        opt=opt,
        sched=sched,
        device=device,
        mix_gen=torch.Generator().manual_seed(cfg.seed * 1000 + rank),
        update=guarded_update(opt, fused, inner, cfg, saved),
        augment=DeviceAugment(cfg.data.mean, cfg.data.std),
        plan=batch_plan(cfg, inner.spec, world) if world > 1 else None,
        micro=cfg.micro_batches(world),
        step=step,
        # Exact position: the checkpoint's epoch, at its step; else a resumed run starts a fresh pass.
        epoch=int(extra.get("epoch", 0)) + (0 if cfg.data.exact_position or not restore_dir else 1),
        epoch_start=int(extra.get("data_position", {}).get("epoch_start_step", step)),
        history=[list(r) for r in extra.get("history", [])],
        logged=list(extra.get("metrics", [])),
        attempts=[int(a) for a in extra.get("attempts", [])] + [step],
        start_step=step,
        restored=restore_dir is not None,
        salient=salient_masker(cfg, tokenizer),
    )


def guarded_update(opt: Any, fused: bool, module: nn.Module, cfg: Any, saved: Any) -> GuardedUpdate:
    """The step's update, with float16 amp's loss scale (restored from ``saved``) when ``precision="amp"``."""
    update = GuardedUpdate(opt, fused, module.parameters(), cfg.optim.grad_clip, cfg.precision == "amp")
    if update.loss_scale is not None and saved is not None and saved.get("loss_scale"):
        update.loss_scale.load_state_dict(saved["loss_scale"])
    return update


def salient_masker(cfg: Any, tokenizer: Any) -> SalientDrop | None:
    """The ``SalientDrop`` of ``data.text_mask_mode="salient"`` (same ratio and protected ids as the collate's
    masks), else None."""
    if cfg.data.text_mask_mode != "salient":
        return None
    start = getattr(tokenizer, "start_id", None)
    return SalientDrop(
        tokenizer.pad_id, tokenizer.end_id, cfg.data.text_mask_ratio, () if start is None else (start,)
    )


def step_inputs(
    state: TrainState, batch: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor | None], Tensor | None, tuple[Tensor, Tensor] | None]:
    """A collated batch as the forward takes it, on the device: (forward inputs, masked rows, PCME++'s
    mix). Every random draw of a step (mixing, the salient rewrite) happens here, once for the whole
    local batch, so micro-batches see the one-batch step's inputs."""
    cfg, device, spec = state.cfg, state.device, state.module.spec
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # no-op once prefetched
    images = state.augment(batch)  # (B, 3, S, S) normalised float32
    mix = None
    if spec.uses_soft_labels:
        images, partner, lam = mix_images(images, state.mix_gen, cfg.loss.mix_fraction)
        mix = (partner.to(device), lam)
    masked_index = batch.get("masked_index")
    tokens, masked_tokens = batch["tokens"], batch.get("masked_tokens")
    if state.salient is not None and masked_index is not None and masked_index.numel():
        # Outside DDP (no gradient, no reducer hooks): the current weights choose the words to remove, for
        # the first round(share·M) masked captions in batch order (rows arrive shuffled, so any of them).
        rows = masked_index[: int(round_half_up(cfg.data.salient_share * masked_index.numel()))]
        with autocast(device, cfg.precision):
            masked_tokens = state.salient.rewrite(state.module.model.encode_text, tokens, masked_tokens, rows)
    inputs = {
        "images": images,
        "tokens": tokens,
        "masked_tokens": masked_tokens,
        "keep_idx": batch.get("keep_idx"),
    }
    return inputs, masked_index, mix


def forward_terms(state: TrainState, batch: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The forward half of a step on one collated batch, gradients kept: (this worker's loss terms, the
    features it computed). ``train_step`` backpropagates its total; diagnostics read single terms."""
    inputs, masked_index, mix = step_inputs(state, batch)
    with autocast(state.device, state.cfg.precision):
        feats = state.ddp(
            inputs["images"], inputs["tokens"], inputs["masked_tokens"], inputs["keep_idx"], masked_index
        )
    return loss_shares(state.module.loss, state.module.spec, feats, masked_index, mix, state.plan), feats


def train_step(state: TrainState, batch: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """One optimizer step on one collated batch: (this worker's loss terms, the features it computed).

    ``feats["grad_norm"]`` is the step's global gradient norm (before clipping); a step whose loss or norm
    is not finite leaves the weights as they were and counts in ``state.update.skipped``."""
    state.opt.zero_grad(set_to_none=True)
    if state.micro > 1:
        inputs, masked_index, mix = step_inputs(state, batch)
        module = state.module
        terms, feats = accumulated_backward(
            state.ddp,
            module,
            inputs,
            state.micro,
            lambda f: loss_shares(module.loss, module.spec, f, masked_index, mix, state.plan),
            masked_index,
            backward=state.update.backward,
            forward_ctx=lambda: autocast(state.device, state.cfg.precision),
        )
    else:
        terms, feats = forward_terms(state, batch)
        state.update.backward(terms["total"] * ddp_loss_scale())
    faults.point("train.mid_step")  # gradients reduced, weights not yet updated
    feats = {**feats, "grad_norm": state.update(terms["total"])}
    state.sched.step()
    state.step += 1
    extend_history(state.history, state.step)
    return terms, feats
