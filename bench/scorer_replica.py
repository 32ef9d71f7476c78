"""The demo track's scorer without Ray: train it on a built demo run's shards, then measure its σ² claims.

Drives ``training.train.step.setup_state`` / ``train_step`` on the run's shards (decoded once, kept in memory and
reshuffled every epoch like ``data.cache_decoded``; masked variants as the training loop makes them), with
the track's ``demo`` scorer preset plus any ``--set key=value``, then measures what the report's
uncertainty section measures (training/eval/uncertainty/measures.py) on the run's eval sets: Σσ² text vs image and
image ⊂ own caption (retrieval set), Spearman(caption words, Σσ²_t) (retrieval and hierarchy captions),
adjacent hierarchy levels ordered; also colour and shape zero-shot accuracy, ROC AUC on the pool's ground truth
(CSD for mismatched captions, Σσ²_t for non-English and level-0 captions), and PPCL's push on each caption's
σ²: Σ_v p_vt over random batches (> 1: PPCL raises that caption's σ², < 1: lowers it).
Recipe trials use it; the choices they led to are in docs/decisions/.
Not a timing benchmark: the batches differ from a Ray run's, so figures match the track's in distribution,
not digit for digit. Appends one JSON line per run to ``--out``.

Usage: python bench/scorer_replica.py --run runs/demo --seed 1 [--set data.text_mask_mode=mask ...]
       [--train-rows matched]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from scipy.stats import rankdata

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.track.config import TRACK_PRESETS  # noqa: E402
from pipeline.common.config import merge, parse_set  # noqa: E402
from pipeline.ingest.tokenizer import TextTokenizer  # noqa: E402
from pipeline.ingest.transforms import DecodeAugment, TrainCollate  # noqa: E402
from pipeline.shards.reader import iter_shard  # noqa: E402
from training.eval.metrics import gaussian_mean, score_matrix  # noqa: E402
from training.eval.uncertainty import measures as U  # noqa: E402
from training.infer.encode import Encoder  # noqa: E402
from training.model.checkpoint import save_checkpoint  # noqa: E402
from training.train.loop import _masker  # noqa: E402
from training.train.step import setup_state, train_step  # noqa: E402


def read_tars(pattern: str) -> list[dict]:
    """Every sample of the shards matching ``pattern`` (raw bytes per extension, ``key``), in order."""
    shards = sorted(glob.glob(pattern), key=lambda p: (len(p), p))
    return [s | {"key": s["__key__"]} for p in shards for s in iter_shard(p, decode=False)]


def captions(row: dict) -> list[str]:
    return [c for c in row["txt"].decode().splitlines() if c.strip()]


def auc(positive: np.ndarray, score: np.ndarray) -> float:
    r, pos = rankdata(score), np.asarray(positive, bool)
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((r[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def decode_pool(state, cfg, tok, pool: list[dict]) -> dict[str, np.ndarray]:
    """The pool's samples as the training decoder makes them (rows it cannot decode left out)."""
    dec = DecodeAugment(state.mcfg.image_size, state.mcfg.context_length, tok, cfg.data)
    raw = {"key": np.array([r["key"] for r in pool], dtype=object), "jpg": [r["jpg"] for r in pool]}
    return dec({**raw, "txt": np.array([r["txt"].decode() for r in pool], dtype=object)})


def train(cfg, tok, pool: list[dict]):
    state = setup_state(cfg, tok, torch.device("cpu"), 0)
    rows = decode_pool(state, cfg, tok, pool)
    masker = _masker(state, tok)
    n, b = len(rows["key"]), cfg.global_batch_size
    while state.step < cfg.total_steps:
        order = np.random.default_rng([cfg.data.shuffle_seed, state.epoch, 0]).permutation(n)
        collate = TrainCollate(masker, state.epoch, tok.pad_id)
        for s in range(0, n - b + 1, b):
            if state.step < cfg.total_steps:
                train_step(state, collate({k: v[order[s : s + b]] for k, v in rows.items()}))
        state.epoch += 1
    return state, rows


def ppcl_push(state, mv, lvv, mt, lvt, rng, rounds=20, b=128) -> np.ndarray:
    """Mean Σ_v p_vt per caption over ``rounds`` random batches of ``b`` pool rows (NaN if never drawn)."""
    a, bias = state.module.loss.log_scale.exp().item(), state.module.loss.bias.item()
    sv, st = np.exp(lvv).sum(1), np.exp(lvt).sum(1)
    total, count = np.zeros(len(mt)), np.zeros(len(mt))
    for _ in range(rounds):
        idx = rng.permutation(len(mt))[:b]
        logits = a * (mv[idx] @ mt[idx].T - 0.5 * (sv[idx, None] + st[None, idx])) + bias
        total[idx] += (1 / (1 + np.exp(-logits))).sum(0)
        count[idx] += 1
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def measure(enc: Encoder, state, run: str, images: np.ndarray, texts: list[str], uids: list[str]) -> dict:
    ev, out = f"{run}/pool/eval", {}
    ret, hier = read_tars(f"{ev}/retrieval/test/*.tar"), read_tars(f"{ev}/hierarchy/test/*.tar")
    r_mu, r_lv, _ = enc.images([r["jpg"] for r in ret])
    r_caps = [captions(r) for r in ret]
    t_mu, t_lv = enc.texts([c for cs in r_caps for c in cs])
    own = np.repeat(np.arange(len(ret)), [len(c) for c in r_caps])
    out["sigma2"] = U.modality_sigma2(r_lv, t_lv)
    out["image_in_caption"] = U.inclusion_rate(r_mu[own], r_lv[own], t_mu, t_lv)["rate"]
    h_caps = [captions(r) for r in hier]
    _, h_lv = enc.texts([c for cs in h_caps for c in cs])
    starts = np.concatenate([[0], np.cumsum([len(c) for c in h_caps])[:-1]])
    levels = min(len(c) for c in h_caps)
    by_level = [cs[:levels] for cs in h_caps]
    out["hierarchy"] = U.hierarchy_order(
        U.trace(h_lv)[starts[:, None] + np.arange(levels)[None, :]], by_level
    )
    every = [c for cs in r_caps + h_caps for c in cs]
    out["spearman"] = U.length_correlation(every, np.concatenate([t_lv, h_lv]))["spearman_words_vs_trace"]
    out["spearman_per_set"] = {
        name: U.length_correlation([c for cs in caps for c in cs], lv)["spearman_words_vs_trace"]
        for name, caps, lv in (("retrieval", r_caps, t_lv), ("hierarchy", h_caps, h_lv))
    }
    out["colours"] = zero_shot(enc, f"{ev}/colours", means_only=True)[0]
    out["shapes"], out["shapes_probe"] = zero_shot(enc, f"{ev}/shapes", means_only=True)
    truth = pq.read_table(f"{run}/pool/truth.parquet").to_pandas().set_index("uid").loc[uids]
    with torch.no_grad():
        mv, lvv = (x.numpy() for x in state.module.model.encode_image(torch.from_numpy(images)))
    mt, lvt = enc.texts(texts)
    st = np.exp(lvt.astype(np.float64)).sum(1)
    mismatched, level = truth["is_mismatched"].to_numpy(), truth["level"].to_numpy()
    english = truth["language"].to_numpy() == "en"
    csd = ((mv - mt) ** 2).sum(1) + np.exp(lvv).sum(1) + st
    out["auc"] = {"csd_mismatched": auc(mismatched, csd), "s2t_non_english": auc(~english, st)}
    out["auc"]["s2t_level0"] = auc(level == 0, st)
    clean = ~mismatched & english
    push = ppcl_push(state, mv, lvv, mt, lvt, np.random.default_rng(123))
    out["pool_s2t_per_level"] = [float(st[clean & (level == k)].mean()) for k in range(4)]
    out["ppcl_push_per_level"] = [float(np.nanmean(push[clean & (level == k)])) for k in range(4)]
    return out


def zero_shot(enc: Encoder, root: str, means_only: bool = False) -> tuple[float, float]:
    """(zero-shot top-1 with the set's prompt ensemble, nearest-class-mean probe top-1) on one set.

    Classes are the prompts' Gaussian mean scored by CSD, as the report does; ``means_only`` scores the
    cosine to the mean of the prompts' means instead, leaving σ² out."""
    rows = read_tars(f"{root}/test/*.tar")
    names = [x for x in Path(f"{root}/classnames.txt").read_text().splitlines() if x.strip()]
    tpls = [x for x in Path(f"{root}/zeroshot_classification_templates.txt").read_text().splitlines() if x]
    labels = np.array([int(r["cls"].decode()) for r in rows])
    mu, logvar, _ = enc.images([r["jpg"] for r in rows])
    p_mu, p_lv = enc.texts([t.replace("{c}", c) for c in names for t in tpls])
    p_mu = p_mu.reshape(len(names), len(tpls), -1)
    p_lv = None if p_lv is None else p_lv.reshape(len(names), len(tpls), -1)
    c_mu, c_lv = gaussian_mean(p_mu, p_lv)
    c_mu = c_mu / np.linalg.norm(c_mu, axis=1, keepdims=True)
    scores = mu @ c_mu.T if means_only else score_matrix(mu, logvar, c_mu, c_lv)
    acc = float((scores.argmax(1) == labels).mean())
    m, h = mu / np.linalg.norm(mu, axis=1, keepdims=True), len(mu) // 2
    means = np.stack([m[:h][labels[:h] == k].mean(0) for k in range(len(names))])
    return acc, float(((m[h:] @ means.T).argmax(1) == labels[h:]).mean())


def replica_parser(description: str, set_help: str, threads: int, out: str) -> argparse.ArgumentParser:
    """The options every replica takes: the run it reads, the seed, ``--set`` overrides, threads and the
    JSON-lines file it appends to."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--run", default="runs/demo", help="a demo track run directory (make demo's output)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help=set_help)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out))
    return ap


def cpu_as_train_loop(threads: int) -> None:
    """The train loop's CPU settings (training/train/loop.py): ``threads`` torch threads and subnormals flushed
    to zero. Without the flush the masked branch's saturated inclusion gradients ran the scorer's steps
    ~1.4x slower, and the replica's numbers then differ from the loop's from the first such step."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def seeded_config(base, seed: int, overrides: list[str]):
    """``base`` with one seed for the model, the shuffle and the masks, then the ``--set`` overrides (after
    the seeds, so that a ``--set data.…`` cannot replace them)."""
    cfg = merge(base, {"seed": seed, "data": {"shuffle_seed": seed, "mask_seed": seed}})
    return merge(cfg, parse_set(overrides))


def save_replica(state, cfg, tok, path: str, loss: str) -> str:
    """The replica's model as a checkpoint the track's Encoder reads (pixel statistics included)."""
    extra = {"loss": loss, "pixel_mean": list(cfg.data.mean), "pixel_std": list(cfg.data.std)}
    save_checkpoint(path, state.module.model, state.mcfg, tok, extra)
    return path


def append_result(result: dict, out: str) -> None:
    """Print one result and append it as a JSON line to ``out`` (one line per run, runs accumulate)."""
    print(json.dumps(result))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(result) + "\n")


def matched_rows(run: str, pool: list[dict]) -> list[dict]:
    """The pool rows whose caption describes their picture by the generator's ground truth: what a scorer
    pretrained on a curated corpus would have seen, as an oracle (no filter knows this)."""
    truth = pq.read_table(f"{run}/pool/truth.parquet", columns=["uid", "is_mismatched"]).to_pandas()
    mismatched = set(truth.loc[truth["is_mismatched"], "uid"])
    return [r for r in pool if json.loads(r["json"])["uid"] not in mismatched]


def main() -> None:
    ap = replica_parser(
        __doc__.splitlines()[0], "scorer overrides, e.g. loss.beta=0", 1, "scorer_replica.jsonl"
    )
    ap.add_argument(
        "--train-rows",
        choices=("all", "matched"),
        default="all",
        help="train on every pool row (the track) or only the matched ones (an oracle curated corpus); "
        "the figures are measured on every row either way",
    )
    args = ap.parse_args()
    cpu_as_train_loop(args.threads)
    cfg = seeded_config(TRACK_PRESETS["demo"].scorer, args.seed, args.set)
    tok = TextTokenizer.load(f"{args.run}/tokenizer")
    pool = read_tars(f"{args.run}/shards/*.tar")
    t0 = time.time()
    state, rows = train(cfg, tok, pool if args.train_rows == "all" else matched_rows(args.run, pool))
    train_s = round(time.time() - t0, 1)
    # One directory per process: replicas of one run and seed side by side must not read each other's model.
    ckpt = save_replica(state, cfg, tok, f"{args.run}/replica/seed{args.seed}-{os.getpid()}", "prolip")
    if args.train_rows != "all":
        rows = decode_pool(state, cfg, tok, pool)
    by_key = {r["key"]: r for r in pool}  # rows the decoder kept, in its order
    texts = [by_key[k]["txt"].decode() for k in rows["key"]]
    uids = [json.loads(by_key[k]["json"])["uid"] for k in rows["key"]]
    result = {"seed": args.seed, "set": args.set, "train_rows": args.train_rows, "train_s": train_s}
    result |= measure(Encoder(ckpt), state, args.run, rows["image"], texts, uids)
    append_result(result, args.out)


if __name__ == "__main__":
    main()
