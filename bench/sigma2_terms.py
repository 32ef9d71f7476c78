"""Which term of the ProLIP objective pushes which captions' σ², at a trained track scorer's weights.

For random training batches of a demo run's pool, made as the training loop makes them (the scorer
preset's masking, salient words included), the gradient of each named loss term with respect to every
caption's text log σ² (summed over dimensions, times the batch size) and PPCL's Σ_v p_vt (the caption's
match probabilities summed over the batch's images): positive gradient / Σp < 1 means gradient descent
lowers that caption's σ². Averaged per kind of caption from the pool's ground truth: clean level 0
("a photo of an object"), clean levels 1–3, mismatched, non-English. A diagnostic, not a timing
benchmark: it shows why non-English captions get the lowest σ²
(docs/decisions/0010-demo-csd-fraction-and-uncertainty-rule.md); the recorded runs are in
docs/benchmarks.md. Appends one JSON line per run to ``--out``.

Usage: python bench/sigma2_terms.py --run runs/demo-seed1 --seed 1 [--batches 150]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scorer_replica import (  # noqa: E402
    append_result,
    cpu_as_train_loop,
    decode_pool,
    read_tars,
    replica_parser,
    seeded_config,
)
from jobs.track.config import TRACK_PRESETS  # noqa: E402
from pipeline.ingest.tokenizer import TextTokenizer  # noqa: E402
from pipeline.ingest.transforms import TrainCollate  # noqa: E402
from training.losses.contrastive import ppcl_logits  # noqa: E402
from training.model.checkpoint import load_checkpoint  # noqa: E402
from training.train.loop import _masker  # noqa: E402
from training.train.step import forward_terms, setup_state  # noqa: E402

TERMS = ("ppcl", "inc_vt", "inc_masked_t", "vib_t")


def trained_state(run: str, seed: int, tok: TextTokenizer):
    """The scorer preset's training state with the track scorer's final weights, logit scale and bias."""
    cfg = seeded_config(TRACK_PRESETS["demo"].scorer, seed, [])
    state = setup_state(cfg, tok, torch.device("cpu"), 0)
    ckpt = sorted(p for p in Path(run, "train", "scorer").glob("checkpoint_*") if p.is_dir())[-1]
    model, _, _ = load_checkpoint(ckpt)
    state.module.model.load_state_dict(model.state_dict())
    loss = torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=True)["loss"]
    with torch.no_grad():
        state.module.loss.log_scale.copy_(loss["log_scale"])
        state.module.loss.bias.copy_(loss["bias"])
    return cfg, state


def caption_kinds(run: str, uids: list[str]) -> np.ndarray:
    import pyarrow.parquet as pq

    truth = pq.read_table(f"{run}/pool/truth.parquet").to_pandas().set_index("uid").loc[uids]
    english = truth["language"].to_numpy() == "en"
    mismatched, level = truth["is_mismatched"].to_numpy(), truth["level"].to_numpy()
    return np.where(
        mismatched,
        "mismatched",
        np.where(~english, "non_english", np.where(level == 0, "clean_level0", "clean_level1-3")),
    )


def main() -> None:
    ap = replica_parser(__doc__.splitlines()[0], "(unused)", 1, "sigma2_terms.jsonl")
    ap.add_argument("--batches", type=int, default=150)
    args = ap.parse_args()
    cpu_as_train_loop(args.threads)
    tok = TextTokenizer.load(f"{args.run}/tokenizer")
    cfg, state = trained_state(args.run, args.seed, tok)
    pool = read_tars(f"{args.run}/shards/*.tar")
    rows = decode_pool(state, cfg, tok, pool)
    by_key = {r["key"]: r for r in pool}
    kind = caption_kinds(args.run, [json.loads(by_key[k]["json"])["uid"] for k in rows["key"]])
    masker, b = _masker(state, tok), cfg.global_batch_size
    sums: dict[str, dict[str, list[float]]] = {k: {} for k in set(kind)}
    rng = np.random.default_rng(7)
    for it in range(args.batches):
        idx = rng.permutation(len(kind))[:b]
        batch = TrainCollate(masker, it, tok.pad_id)({k: v[idx] for k, v in rows.items()})
        terms, feats = forward_terms(state, batch)  # as training computes them, salient masks included
        per: dict[str, np.ndarray] = {}
        for name in TERMS:
            if terms[name].requires_grad:
                g = torch.autograd.grad(terms[name], feats["logvar_t"], retain_graph=True, allow_unused=True)[
                    0
                ]
                per[name] = np.zeros(b) if g is None else g.sum(1).numpy() * b
        with torch.no_grad():
            loss = state.module.loss
            logits = ppcl_logits(
                feats["mu_v"], feats["logvar_v"], feats["mu_t"], feats["logvar_t"], loss.log_scale, loss.bias
            )
            per["sum_p"] = torch.sigmoid(logits).sum(0).numpy()
            per["sigma2_t"] = feats["logvar_t"].exp().sum(1).numpy()
        for j, i in enumerate(idx):
            for name, values in per.items():
                sums[kind[i]].setdefault(name, []).append(float(values[j]))
    result = {
        "run": args.run,
        "seed": args.seed,
        "batches": args.batches,
        "by_kind": {
            k: {name: float(np.mean(v)) for name, v in d.items()} | {"n": len(d.get("sum_p", []))}
            for k, d in sorted(sums.items())
        },
    }
    append_result(result, args.out)


if __name__ == "__main__":
    main()
