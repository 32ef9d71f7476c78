"""Training step and ingest on CPU, as ratios measured in one run.

1. Step: one optimizer step (forward, loss, backward, AdamW) of the ``tiny`` model at batch B, median over
   ``--steps`` after warm-up, single process:
     prolip       probabilistic towers, ProLIP objective, masked variants for 12.5% of the batch
     clip         deterministic towers (no UNC token / σ head), CLIP InfoNCE — the baseline we train
     prolip_loss  the probabilistic towers with the CLIP objective (isolates the objective's share)
     prolip_salient  prolip with the demo scorer's salient masked captions (``data.text_mask_mode=salient``,
                  training/train/salient_masking.py: one no-grad text pass over every leave-one-out caption); reported
                  as prolip_salient ÷ prolip, the cost of that demo-only deviation
   Ratio: prolip ÷ clip (goal ≤ 1.10), per round of the alternated cases (bench/alternate.py: each
   case one step per round, in turn), as median (min–max) over ``--rounds`` (≥ 3) with the load average
   of those rounds; wall and CPU time both. Batches come through the ingest's collate step (masked
   variants, all-padding token columns trimmed as in training; ``--no-trim`` keeps the full 32-token
   context). A loaded run (load > cores) does not overwrite the results file unless ``--allow-loaded``.
2. Ingest: samples/s delivered to a consumer by the real pipeline (Ray Data read → window shuffle →
   decode/augment/tokenize tasks → ``iter_torch_batches`` with the masked-variant collate) on a local
   Ray with ``--cpus`` CPUs, against the ceiling: ``DecodeAugment`` called in-process on the same raw
   samples (one core, no Ray). Ratio: delivered ÷ ceiling. Both use ``--ingest-samples`` 64-px demo
   pictures (tests/fixtures/train_shards.py) so the figures compare like with like.
Writes bench/results/train_step.json. Usage: python -m bench.train_step [--batch 64] [--rounds 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.alternate import MIN_ROUNDS, alternate, fmt_spread, loads_note, ratios, results_path, times
from pipeline.ingest.tokenizer import train_tokenizer
from pipeline.ingest.transforms import DecodeAugment, MaskedVariants, TrainCollate
from tests.fixtures.train_shards import demo_samples, write_demo_shards
from training.config import DataConfig
from training.losses.registry import build_loss_from_config, loss_spec
from training.model.config import model_config
from training.model.param_groups import param_groups
from training.model.two_tower import ProLIP
from training.train.salient_masking import SalientDrop
from training.train.step import TrainModule, loss_shares

ROOT = Path(__file__).resolve().parents[1]


class StepCase:
    """One objective/tower combination with its model, optimizer and a fixed batch."""

    def __init__(
        self, objective: str, probabilistic: bool, batch: int, tokenizer, trim: bool, salient: bool = False
    ) -> None:
        torch.manual_seed(0)
        self.salient = SalientDrop(tokenizer.pad_id, tokenizer.end_id, 0.5) if salient else None
        self.objective = objective
        self.loss = build_loss_from_config(loss_spec(objective)())[0]
        cfg = model_config("tiny", vocab_size=tokenizer.vocab_size, probabilistic=probabilistic)
        self.module = TrainModule(ProLIP(cfg), self.loss, loss_spec(objective))
        self.opt = torch.optim.AdamW(param_groups(self.module, 0.2), lr=5e-4, betas=(0.9, 0.98))
        samples = demo_samples(batch, size=16, seed=3)
        raw = {
            "key": np.array([s["__key__"] for s in samples], dtype=object),
            "image": np.random.default_rng(0).standard_normal(
                (batch, 3, cfg.image_size, cfg.image_size), np.float32
            ),
            "tokens": tokenizer.encode_batch([s["txt"] for s in samples], cfg.context_length),
        }
        masker = None
        if loss_spec(objective).uses_masked:
            masker = MaskedVariants(cfg.n_patches, tokenizer.pad_id, tokenizer.end_id, tokenizer.mask_id)
        # The batch the loop gets: masked variants and padding trimmed by the ingest's collate step.
        b = TrainCollate(masker, 0, tokenizer.pad_id if trim else None)(raw)
        self.images, self.tokens = b["images"], b["tokens"]
        self.extra = (b.get("masked_tokens"), b.get("keep_idx"), b.get("masked_index"))

    def step(self) -> None:
        masked_tokens, keep_idx, masked_index = self.extra
        if self.salient is not None:  # as training/train/step.py's train_step does it
            masked_tokens = self.salient.rewrite(
                self.module.model.encode_text, self.tokens, masked_tokens, masked_index
            )
        feats = self.module(self.images, self.tokens, masked_tokens, keep_idx, masked_index)
        terms = loss_shares(self.loss, loss_spec(self.objective), feats, self.extra[2])
        self.opt.zero_grad(set_to_none=True)
        terms["total"].backward()
        self.opt.step()


def step_times(batch: int, rounds: int, tokenizer, trim: bool = True) -> dict:
    """The cases alternated for `rounds` rounds after 3 warm-up rounds; per-case times and per-round ratios."""
    cases = {
        "prolip": StepCase("prolip", True, batch, tokenizer, trim),
        "clip": StepCase("clip", False, batch, tokenizer, trim),
        "prolip_towers_clip_loss": StepCase("clip", True, batch, tokenizer, trim),
        "prolip_salient": StepCase("prolip", True, batch, tokenizer, trim, salient=True),
    }
    log = alternate({k: c.step for k, c in cases.items()}, rounds, warmup=3)
    return {
        "step": {k: times(log, k) for k in cases},
        "prolip_over_clip": ratios(log, "prolip", "clip"),
        "prolip_towers_clip_loss_over_clip": ratios(log, "prolip_towers_clip_loss", "clip"),
        "prolip_salient_over_prolip": ratios(log, "prolip_salient", "prolip"),
        "rounds": log,
    }


def ingest(n: int, cpus: int, tokenizer, batch: int) -> dict[str, float]:
    import ray

    from pipeline.common.storage import LOCAL
    from pipeline.ingest.dataset import RayTrainCollate, build_train_dataset

    with tempfile.TemporaryDirectory() as d:
        per_shard = max(1, n // 8)
        write_demo_shards(d, n_shards=8, per_shard=per_shard, size=256)
        samples = [s for i in range(8) for s in demo_samples(per_shard, size=256, start=i * per_shard)]
        data = DataConfig(
            shards=d, decode_cpus=0.5, decode_tasks=cpus, decode_batch_size=64, shuffle_window=256
        )
        cfg = model_config("tiny")
        # Ceiling: the stage itself, in this process, on the same raw samples.
        stage = DecodeAugment(cfg.image_size, cfg.context_length, tokenizer, data, seed=0)
        t0 = time.perf_counter()
        for i in range(0, len(samples), 64):
            chunk = samples[i : i + 64]
            stage({k: np.array([s[m] for s in chunk], dtype=object) for k, m in
                   (("key", "__key__"), ("jpg", "jpg"), ("txt", "txt"))})  # fmt: skip
        ceiling = len(samples) / (time.perf_counter() - t0)

        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            ds = build_train_dataset(data, LOCAL, tokenizer, cfg.image_size, cfg.context_length)
            masker = MaskedVariants(cfg.n_patches, tokenizer.pad_id, tokenizer.end_id, tokenizer.mask_id)
            delivered = []
            for epoch in range(2):  # the first pass warms Ray's worker processes
                count, t_first = 0, None
                for b in ds.iterator().iter_torch_batches(
                    batch_size=batch,
                    drop_last=True,
                    collate_fn=RayTrainCollate(TrainCollate(masker, epoch)),
                    prefetch_batches=2,
                ):
                    if t_first is None:
                        t_first = time.perf_counter()  # steady state: from the first batch on
                    else:
                        count += b["images"].shape[0]
                delivered.append(count / (time.perf_counter() - t_first))
        finally:
            ray.shutdown()
    return {"ceiling_samples_per_s": ceiling, "delivered_samples_per_s": delivered[-1],
            "first_epoch_samples_per_s": delivered[0], "ratio": delivered[-1] / ceiling,
            "load_avg_1m": os.getloadavg()[0]}  # fmt: skip


DEFAULT_OUT = ROOT / "bench" / "results" / "train_step.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20, help="alternated rounds, one step per case each (>= 3)")
    ap.add_argument("--ingest-samples", type=int, default=2048)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--no-trim", action="store_true", help="keep full-context token batches")
    ap.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); 1 steadies a loaded machine"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--allow-loaded", action="store_true", help="write --out even if load > cores")
    args = ap.parse_args()
    if args.rounds < MIN_ROUNDS:
        print(f"note: --rounds {args.rounds} < {MIN_ROUNDS}: a smoke run, not a measurement")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the train loop does on CPU (training/train/loop.py)
    tokenizer = train_tokenizer([s["txt"] for s in demo_samples(500, size=16)], vocab_size=512)
    cores = os.cpu_count() or 1

    steps = step_times(args.batch, args.rounds, tokenizer, trim=not args.no_trim)
    ratio = steps["prolip_over_clip"]
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "batch": args.batch,
        "trim_text_padding": not args.no_trim,
        "goal_prolip_over_clip": 1.10,
        "method": f"cases alternated, {args.rounds} rounds after 3 warm-up rounds; per-round ratios of wall "
        "and CPU time, median (min–max); load = 1-min load average",
        **steps,
    }
    print(f"{'case':<26}{'ms/step wall, median (min–max)':>34}")
    for k, v in steps["step"].items():
        w = {q: 1000 * v["wall_s"][q] for q in ("median", "min", "max")}
        print(f"{k:<26}{w['median']:>14.1f} ({w['min']:.1f}–{w['max']:.1f})")
    note = loads_note([ratio["load_min"], ratio["load_max"]], cores)
    print(
        f"ProLIP ÷ CLIP step: wall {fmt_spread(ratio['wall'])}, CPU {fmt_spread(ratio['cpu'])} (goal ≤ 1.10), {note}"
    )
    sal = steps["prolip_salient_over_prolip"]
    print(
        f"salient masked captions ÷ ProLIP step: wall {fmt_spread(sal['wall'])}, CPU {fmt_spread(sal['cpu'])}"
    )
    if not args.skip_ingest:
        result["ingest"] = ingest(args.ingest_samples, args.cpus, tokenizer, args.batch)
        ing = result["ingest"]
        print(
            f"ingest: ceiling {ing['ceiling_samples_per_s']:.0f}/s (1 core, in-process), delivered "
            f"{ing['delivered_samples_per_s']:.0f}/s on {args.cpus} CPUs → ratio {ing['ratio']:.2f}, "
            f"{loads_note([ing['load_avg_1m']], cores)}"
        )
    max_load = max(ratio["load_max"], result.get("ingest", {}).get("load_avg_1m", 0.0))
    result["max_load_avg_1m"], result["loaded"] = max_load, max_load > cores
    out = results_path(args.out, DEFAULT_OUT, max_load, cores, args.allow_loaded)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
