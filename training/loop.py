"""The per-worker training loop run by Ray Train's ``TorchTrainer`` (``train_loop_per_worker(config)``).

One optimizer step: batch from ``get_dataset_shard("train").iter_torch_batches`` (masked variants added in
its collate step, pipeline/ingest_train.py) → ``TrainModule`` forward under DDP (both towers, plus the
masked image/text variants of the selected samples — ProLIP Eq. 6) → gather the loss's columns from every
worker WITH gradients (training/distributed.py) → this worker's loss share × world size (DDP averages
gradients; the sum of shares is the global-batch loss, so the average of the scaled gradients is its exact
gradient) → backward, optional clipping, AdamW (App. B.1 parameter groups via ``param_groups``), LR warmup
then cosine by step.

Precision: bf16 autocast on CUDA (the losses run in float32 inside), fp32 on CPU with subnormals flushed
to zero (``torch.set_flush_denormal``): saturated inclusion terms (Eq. 5, c = 1000) send gradients of
~1e-39 through the masked forward, and subnormal arithmetic made CPU steps 5–15× slower.

Bookkeeping that makes recovery checkable: ``history`` is the list of committed step ranges, carried in
every checkpoint and extended by one per optimizer step. A restarted run restores it from the checkpoint,
so steps run after the last checkpoint by a failed attempt are *not* committed and run again; the final
history is ``[[1, total_steps]]`` exactly when no committed step was repeated or skipped.

Data position on resume: Ray Data cannot seek into a streaming epoch, so a resumed run starts a fresh
pass (epoch + 1, new shard order and masks), as open_clip does; the step count, LR schedule and samples
seen continue from the checkpoint.

Reports: every ``log_every`` steps, at every checkpoint and at the last step, every rank calls
``ray.train.report`` (a barrier, so all ranks call it at the same steps); rank 0 attaches the checkpoint.
Metrics are global: loss terms summed over ranks (the shares add up to the global loss), σ² means and the
data-wait fraction averaged over ranks.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from training.distributed import all_reduce_sum, ddp_loss_scale, gather_with_grad, rank_and_world
from training.model import ProLIP, load_extra, model_config, param_groups, save_checkpoint

TRAIN_STATE_FILE = "train_state.pt"
# Global columns each objective scores its local rows against (training/losses.py contract).
LOSS_COLUMNS = {
    "clip": ("mu_v", "mu_t"),
    "siglip": ("mu_t",),
    "prolip": ("mu_t", "logvar_t"),
    "pcmepp": ("mu_t", "logvar_t"),
}


class TrainModule(nn.Module):
    """The two towers and the loss's learnable scalars under one module, so one DDP wrapper covers both.

    ``forward`` runs both towers on the batch and, when ``masked_index`` (M,) is given, the image tower on
    the selected images with their kept patches and the text tower on their masked tokens (concatenated
    with the full text batch: one text forward). The loss is applied outside ``forward``, after the
    cross-worker gather.
    """

    def __init__(self, model: ProLIP, loss: nn.Module, loss_name: str) -> None:
        super().__init__()
        self.model, self.loss, self.loss_name = model, loss, loss_name

    def forward(
        self,
        images: Tensor,
        tokens: Tensor,
        masked_tokens: Tensor | None = None,
        keep_idx: Tensor | None = None,
        masked_index: Tensor | None = None,
    ) -> dict[str, Tensor | None]:
        b = tokens.shape[0]
        mu_v, logvar_v = self.model.encode_image(images)  # (B, E)
        out: dict[str, Tensor | None] = {"mu_v": mu_v, "logvar_v": logvar_v}
        text = tokens
        # numel() is shape metadata: no device sync, and M = 0 (possible on one rank) skips the extra pass.
        masked = masked_index is not None and masked_index.numel() > 0 and keep_idx is not None
        if masked:
            out["mu_v_masked"], out["logvar_v_masked"] = self.model.encode_image(
                images[masked_index], keep_idx[masked_index]
            )  # (M, E)
            text = torch.cat([tokens, masked_tokens[masked_index]])  # (B + M, L)
        mu_t, logvar_t = self.model.encode_text(text)  # (B [+ M], E)
        out["mu_t"], out["logvar_t"] = mu_t[:b], None if logvar_t is None else logvar_t[:b]
        if masked:
            out["mu_t_masked"], out["logvar_t_masked"] = mu_t[b:], None if logvar_t is None else logvar_t[b:]
        return out


def loss_shares(
    loss: nn.Module,
    loss_name: str,
    feats: Mapping[str, Tensor | None],
    masked_index: Tensor | None = None,
    mix: tuple[Tensor, Tensor] | None = None,
) -> dict[str, Tensor]:
    """This worker's share of every loss term (sum over workers = the single-process global-batch loss).

    ``mix`` = (partner_index, lam) of PCME++'s mixed images (local indices), turned into soft labels
    against the global columns. Identity gather in one process.
    """
    n_masked = 0 if masked_index is None else int(masked_index.numel())
    g = gather_with_grad({k: feats[k] for k in LOSS_COLUMNS[loss_name]}, extra_counts=[n_masked])
    inputs: dict[str, Any] = {f"{k}_all": v for k, v in g.columns.items()}
    inputs["offset"] = g.offset
    if getattr(loss, "uses_masked", False) and masked_index is not None:
        for k in ("mu_v_masked", "logvar_v_masked", "mu_t_masked", "logvar_t_masked"):
            inputs[k] = feats.get(k)
        inputs["masked_index"] = masked_index
        inputs["n_masked_global"] = g.total(0)
    if getattr(loss, "uses_soft_labels", False) and mix is not None:
        from training.pcmepp import pcmepp_soft_labels

        inputs["soft_labels"] = pcmepp_soft_labels(
            mix[0], mix[1].to(feats["mu_v"].device), g.offset, g.n_global
        )
    return loss(feats["mu_v"], feats["logvar_v"], feats["mu_t"], feats["logvar_t"], **inputs)


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float = 0.0):
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


def _autocast(device: torch.device, precision: str):
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def build_module(cfg: Any, tokenizer: Any) -> tuple[TrainModule, Any]:
    """A fresh ``TrainModule`` and its model config (deterministic init from ``cfg.seed``)."""
    from training.config import loss_kwargs
    from training.losses import build_loss

    loss = build_loss(cfg.loss.name, **loss_kwargs(cfg.loss))
    mcfg = model_config(
        cfg.model,
        vocab_size=tokenizer.vocab_size,
        pad_id=tokenizer.pad_id,
        probabilistic=bool(loss.needs_logvar),
        grad_checkpointing=cfg.grad_checkpointing,
    )
    torch.manual_seed(cfg.seed)
    return TrainModule(ProLIP(mcfg), loss, cfg.loss.name), mcfg


class _Window:
    """Per-step figures between two reports, kept as device tensors (no per-step host sync)."""

    def __init__(self) -> None:
        self.terms: dict[str, Tensor] = {}
        self.var: dict[str, Tensor] = {}
        self.steps, self.wait, self.busy = 0, 0.0, 0.0
        self.t0 = time.perf_counter()

    def add(self, terms: Mapping[str, Tensor], feats: Mapping[str, Tensor | None], wait: float, total: float):
        for k, v in terms.items():
            self.terms[k] = self.terms.get(k, 0.0) + v.detach().double()
        for k in ("logvar_v", "logvar_t"):
            if feats.get(k) is not None:
                self.var[k] = self.var.get(k, 0.0) + feats[k].detach().double().exp().mean()
        self.steps, self.wait, self.busy = self.steps + 1, self.wait + wait, self.busy + total


def _report_metrics(
    window: _Window, module: TrainModule, step: int, epoch: int, global_batch: int, lr: float
) -> dict[str, Any]:
    _, world = rank_and_world()
    device = next(module.parameters()).device
    names = sorted(window.terms)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    local = [window.terms[k] for k in names]
    local += [window.var.get("logvar_v", zero), window.var.get("logvar_t", zero)]
    local += [torch.tensor(window.wait, dtype=torch.float64, device=device)]
    local += [torch.tensor(window.busy, dtype=torch.float64, device=device)]
    summed = all_reduce_sum(torch.stack([torch.as_tensor(v, device=device) for v in local])).tolist()
    n = max(window.steps, 1)
    metrics: dict[str, Any] = {f"loss/{k}": summed[i] / n for i, k in enumerate(names)}
    var_v, var_t, wait, busy = summed[len(names) :]
    elapsed = time.perf_counter() - window.t0
    loss = module.loss
    if hasattr(loss, "log_scale"):
        scale = math.exp(float(loss.log_scale))
    else:
        scale = float(getattr(loss, "scale", float("nan")))
    bias = getattr(loss, "bias", getattr(loss, "shift", None))
    metrics.update(
        {
            "step": step,
            "epoch": epoch,
            "samples_seen": step * global_batch,
            "lr": lr,
            "logit_scale": scale,
            "logit_bias": float(bias) if bias is not None else 0.0,
            "sigma2_image": var_v / (n * world),
            "sigma2_text": var_t / (n * world),
            "samples_per_s": window.steps * global_batch / max(elapsed, 1e-9),
            "data_wait_fraction": wait / max(busy, 1e-9),
        }
    )
    return metrics


def _restore(module: TrainModule, checkpoint: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    from training.model import load_checkpoint

    # A private copy per worker: ``as_directory()`` downloads a remote checkpoint into one temp path per
    # node, and two workers of a node reading it while it is being written saw a torn weights.pt.
    with tempfile.TemporaryDirectory(prefix="prolip-restore-") as d:
        checkpoint.to_directory(d)
        model, _, _ = load_checkpoint(d)
        module.model.load_state_dict(model.state_dict())
        state = torch.load(os.path.join(d, TRAIN_STATE_FILE), map_location="cpu", weights_only=True)
        module.loss.load_state_dict(state["loss"])
        return load_extra(d), state


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train entry point. ``config``: ``train`` (plain TrainConfig), ``tokenizer`` (state),
    ``counters`` (IngestCounters actor name or None), ``tensorboard_dir`` (local path or None)."""
    import ray.train
    import ray.train.torch

    from pipeline.ingest_train import (
        DecodedCache,
        MaskedVariants,
        TrainCollate,
        read_counters,
        tokenizer_from_state,
    )
    from pipeline.shard_source import publish_progress
    from training.config import from_plain

    cfg = from_plain(config["train"])
    tokenizer = tokenizer_from_state(config["tokenizer"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if cfg.scaling.torch_threads:
        torch.set_num_threads(
            cfg.scaling.torch_threads if cfg.scaling.torch_threads > 0 else os.cpu_count() or 1
        )
    if device.type == "cpu":
        # The saturated inclusion terms back-propagate gradients below 1e-38 through the masked branch;
        # x86 runs subnormal arithmetic ~100x slower (steps went from 0.45 s to 2–7 s). Flush to zero.
        torch.set_flush_denormal(True)
    local_batch = cfg.global_batch_size // world
    total = cfg.total_steps

    module, mcfg = build_module(cfg, tokenizer)
    checkpoint = ray.train.get_checkpoint()
    extra, state = _restore(module, checkpoint) if checkpoint else ({}, None)
    ddp = ray.train.torch.prepare_model(module)
    inner: TrainModule = ddp.module if hasattr(ddp, "module") else ddp
    opt = torch.optim.AdamW(
        param_groups(inner, cfg.optim.weight_decay), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(total, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio)
    )
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    step = int(extra.get("step", 0))
    epoch = int(extra["epoch"]) + 1 if checkpoint else 0
    history: list[list[int]] = [list(r) for r in extra.get("history", [])]
    logged: list[dict[str, Any]] = list(extra.get("metrics", []))
    start_step = step
    attempts = [int(a) for a in extra.get("attempts", [])] + [start_step]  # first step of every (re)start
    fail_armed = cfg.run.fail_at_step > 0 and checkpoint is None and rank == cfg.run.fail_rank

    masker = None
    if getattr(inner.loss, "uses_masked", False):
        masker = MaskedVariants(
            mcfg.n_patches,
            tokenizer.pad_id,
            tokenizer.end_id,
            tokenizer.mask_id,
            cfg.data.mask_fraction,
            cfg.data.text_mask_ratio,
            cfg.data.patch_keep_ratio,
            seed=cfg.data.mask_seed,
            protected_ids=() if tokenizer.start_id is None else (tokenizer.start_id,),
        )
    writer = _tensorboard(config.get("tensorboard_dir")) if rank == 0 else None
    shard = ray.train.get_dataset_shard("train")
    mix_gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    window = _Window()
    cache = DecodedCache() if cfg.data.cache_decoded else None
    pad_id = tokenizer.pad_id if cfg.data.trim_text_padding else None
    while step < total:
        if cache is not None and cache.sealed:
            seed = cfg.data.shuffle_seed
            rng = np.random.default_rng(None if seed is None else [seed, epoch, rank])
            batches = cache.batches(local_batch, rng, TrainCollate(masker, epoch, pad_id))
        else:
            batches = iter(
                shard.iter_torch_batches(
                    batch_size=local_batch,
                    # The cache keeps the last partial batch too; the loop skips it below.
                    drop_last=cache is None,
                    collate_fn=TrainCollate(masker, epoch, pad_id, cache=cache),
                    prefetch_batches=cfg.data.prefetch_batches,
                    local_shuffle_buffer_size=cfg.data.local_shuffle_buffer or None,
                )
            )
        in_epoch = 0
        while step < total:
            t0 = time.perf_counter()
            batch = next(batches, None)
            wait = time.perf_counter() - t0
            if batch is None:
                if cache is not None and not cache.sealed:
                    cache.seal()
                break
            if batch["images"].shape[0] < local_batch:
                continue  # the first epoch's remainder, kept by the cache (drop_last is off only then)
            images = batch["images"].to(device, non_blocking=True)
            mix = None
            if getattr(inner.loss, "uses_soft_labels", False):
                from training.pcmepp import mix_images

                images, partner, lam = mix_images(images, mix_gen, cfg.loss.mix_fraction)
                mix = (partner.to(device), lam)
            masked_index = batch.get("masked_index")
            masked_index = None if masked_index is None else masked_index.to(device)
            with _autocast(device, cfg.precision):
                feats = ddp(
                    images,
                    batch["tokens"].to(device),
                    batch.get("masked_tokens"),
                    batch.get("keep_idx"),
                    masked_index,
                )
            terms = loss_shares(inner.loss, cfg.loss.name, feats, masked_index, mix)
            opt.zero_grad(set_to_none=True)
            (terms["total"] * ddp_loss_scale()).backward()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.optim.grad_clip)
            opt.step()
            sched.step()
            step, in_epoch = step + 1, in_epoch + 1
            extend_history(history, step)
            window.add(terms, feats, wait, time.perf_counter() - t0)
            if fail_armed and step == cfg.run.fail_at_step:
                raise RuntimeError(f"injected failure at step {step} on rank {rank} (run.fail_at_step)")
            is_ckpt = step % cfg.run.checkpoint_every == 0 or step == total
            if step % cfg.run.log_every == 0 or is_ckpt:
                metrics = _report_metrics(
                    window, inner, step, epoch, cfg.global_batch_size, sched.get_last_lr()[0]
                )
                if rank == 0 and config.get("counters"):
                    metrics.update({f"ingest/{k}": v for k, v in read_counters(config["counters"]).items()
                                    if isinstance(v, int)})  # fmt: skip
                    publish_progress(config["counters"], {**metrics, "total_steps": total})
                logged.append(metrics)
                if writer is not None:
                    for k, v in metrics.items():
                        writer.add_scalar(k, v, step)
                    writer.flush()
                window = _Window()
                extra_out = {
                    "step": step,
                    "epoch": epoch,
                    "samples_seen": step * cfg.global_batch_size,
                    "history": history,
                    "attempts": attempts,
                    "metrics": logged,
                    "loss": cfg.loss.name,
                    # Inference (training/encode.py) must normalise pixels as this run did.
                    "pixel_mean": list(cfg.data.mean),
                    "pixel_std": list(cfg.data.std),
                }
                _report(metrics, is_ckpt, rank, inner, mcfg, tokenizer, opt, sched, extra_out)
        if in_epoch == 0:
            raise RuntimeError(
                f"epoch {epoch} gave no full batch of {local_batch} per worker: "
                f"the dataset is smaller than global_batch_size={cfg.global_batch_size}"
            )
        epoch += 1
    if writer is not None:
        writer.close()
    return {
        "history": history,
        "attempts": attempts,
        "start_step": start_step,
        "final_step": step,
        "epoch": epoch,
        "world_size": world,
        "cached_rows": cache.n_rows if cache is not None else 0,
        "metrics": logged,
    }


def _report(metrics, is_ckpt, rank, inner, mcfg, tokenizer, opt, sched, extra) -> None:
    import ray.train

    if not is_ckpt or rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="prolip-ckpt-") as d:
        loss_values = {k: float(v) for k, v in inner.loss.state_dict().items() if v.numel() == 1}
        save_checkpoint(d, inner.model, mcfg, tokenizer, {**extra, "loss_state": loss_values})
        torch.save(
            {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "loss": inner.loss.state_dict()},
            os.path.join(d, TRAIN_STATE_FILE),
        )
        with open(os.path.join(d, "metrics.json"), "w") as f:
            json.dump(metrics, f)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(d),
            checkpoint_dir_name=f"checkpoint_{extra['step']:08d}",
        )


def _tensorboard(log_dir: str | None) -> Any:
    """A SummaryWriter (torch's, else tensorboardX's) or None when neither imports or no dir is given."""
    if not log_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter(log_dir=log_dir)
