"""``python -m jobs.adapters --train EMB.parquet --eval EMB.parquet --out DIR``: post-hoc adapters + calibration.

Fits ProbVLM and AsymVLM (vMF and Power Spherical) on cached frozen embeddings (the parquet written by
``jobs.embed``), evaluates the uncertainty calibration of every method on the eval embeddings, and writes
``OUT/adapters.json`` (config, training histories, per-method rows with R@1 per level),
``OUT/adapters.md`` (the comparison table) and the adapter weights ``OUT/{probvlm,asymvlm_vmf,
asymvlm_ps}.pt`` (``torch.save(state_dict)``; load with ``torch.load(..., weights_only=True)``).

``--native NAME=EMB.parquet`` adds a probabilistic model's own Σσ² (ProLIP, PCME++) evaluated on its own
embeddings; an eval parquet with logvar columns is included as "own Σσ²" automatically.
``--checkpoint CKPT --zeroshot DIR`` also runs AsymVLM's none-of-the-above test on a clip_benchmark
classification set (docs/adapters.md). Everything runs on CPU; no Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from jobs.common import print_table
from pipeline import storage
from training.adapters.compare import evaluate_methods, markdown_table, none_of_the_above, nota_scores
from training.adapters.fit import describe, fit_asymvlm, fit_probvlm, load_embeddings


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fit ProbVLM/AsymVLM on cached embeddings; compare calibration.")
    p.add_argument("--train", required=True, help="embedding parquet (file, dir or glob) to fit on")
    p.add_argument("--eval", required=True, help="embedding parquet of the eval pairs")
    p.add_argument("--out", required=True, help="output directory (local or s3://)")
    p.add_argument("--native", action="append", default=[], metavar="NAME=PARQUET", help="a model's own Σσ²")
    p.add_argument("--heads", default="vmf,ps", help="AsymVLM families to fit (vmf, ps)")
    p.add_argument("--probvlm-epochs", type=int, default=100, help="ProbVLM §4: 100")
    p.add_argument("--probvlm-lr", type=float, default=1e-4, help="ProbVLM §4: 1e-4")
    p.add_argument("--probvlm-batch", type=int, default=256)
    p.add_argument("--asymvlm-epochs", type=int, default=200, help="AsymVLM App. B.4: 200")
    p.add_argument("--asymvlm-lr", type=float, default=1e-2, help="AsymVLM Table A.1: 1e-2")
    p.add_argument("--asymvlm-batch", type=int, default=2048, help="AsymVLM Table A.1: 2048")
    p.add_argument("--mc-passes", type=int, default=10, help="MC-dropout passes for ProbVLM's epistemic term")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--checkpoint", default="", help="the frozen model, for the none-of-the-above test")
    p.add_argument("--zeroshot", default="", help="clip_benchmark classification set dir (e.g. eval/shapes)")
    p.add_argument("--unseen", type=int, default=2, help="last N classes are held out as unseen")
    p.add_argument("--dummy", default="a photo", help="the none-of-the-above prompt (AsymVLM Table 2)")
    p.add_argument("--s3-endpoint", default="")
    return p.parse_args(argv)


def _read_classification_set(
    root: str, s3_endpoint: str
) -> tuple[list[bytes], np.ndarray, list[str], list[str]]:
    from pipeline.shards import iter_shard

    classes = storage.read_bytes(storage.join(root, "classnames.txt"), s3_endpoint).decode().split("\n")
    templates = storage.read_bytes(
        storage.join(root, "zeroshot_classification_templates.txt"), s3_endpoint
    ).decode()
    images, labels = [], []
    for path in storage.list_files(storage.join(root, "test"), suffix=".tar", s3_endpoint=s3_endpoint):
        for s in iter_shard(path, s3_endpoint):
            cls = s["cls"].decode() if isinstance(s["cls"], bytes) else str(s["cls"])
            images.append(s["jpg"])
            labels.append(int(cls.strip()))
    return images, np.asarray(labels), [c for c in classes if c], [t for t in templates.split("\n") if t]


def run_nota(args: argparse.Namespace, asym: dict[str, Any]) -> dict[str, Any]:
    """Zero-shot over the seen classes + the dummy prompt; frozen cosine vs each AsymVLM head."""
    from training.encode import Encoder

    images, labels, classes, templates = _read_classification_set(args.zeroshot, args.s3_endpoint)
    enc = Encoder(args.checkpoint, s3_endpoint=args.s3_endpoint)
    img_mu, _, ok = enc.images(images)
    img_mu, labels = img_mu[ok], labels[ok]
    seen = list(range(len(classes) - args.unseen))
    class_mu = []
    for c in seen:  # prompt ensemble: mean of the template embeddings, renormalised (CLIP's recipe)
        mu, _ = enc.texts([t.replace("{c}", classes[c]) for t in templates])
        m = mu.mean(0)
        class_mu.append(m / np.linalg.norm(m))
    dummy_mu, _ = enc.texts([args.dummy])
    out: dict[str, Any] = {"dummy": args.dummy, "seen": [classes[c] for c in seen]}
    for name, model in [("frozen cosine", None), *[(f"AsymVLM ({k})", m) for k, m in asym.items()]]:
        scores = nota_scores(img_mu, np.stack(class_mu), dummy_mu[0], model)
        out[name] = none_of_the_above(scores, labels, seen, dummy_column=len(seen))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        train = load_embeddings(args.train, args.s3_endpoint)
        evald = load_embeddings(args.eval, args.s3_endpoint)
        natives = {}
        for spec in args.native:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--native expects NAME=PARQUET, got {spec!r}")
            natives[name] = load_embeddings(path, args.s3_endpoint)
            if "image_logvar" not in natives[name]:
                raise ValueError(f"--native {name}: {path} has no image_logvar/text_logvar columns")
    except (OSError, ValueError) as exc:
        print(f"adapters: {exc}", file=sys.stderr)
        return 2
    heads = [h for h in args.heads.split(",") if h]
    log = print
    probvlm, hist_p = fit_probvlm(
        train["image_mu"], train["text_mu"], epochs=args.probvlm_epochs, lr=args.probvlm_lr,
        batch_size=args.probvlm_batch, seed=args.seed, log=lambda s: log(f"probvlm {s}"),
    )  # fmt: skip
    asym, hist_a = {}, {}
    for h in heads:
        asym[h], hist_a[h] = fit_asymvlm(
            train["image_mu"], train["text_mu"], head=h, epochs=args.asymvlm_epochs, lr=args.asymvlm_lr,
            batch_size=args.asymvlm_batch, seed=args.seed, log=lambda s, h=h: log(f"asymvlm-{h} {s}"),
        )  # fmt: skip
    t_fit = time.perf_counter() - t0
    rows = evaluate_methods(
        evald, probvlm=probvlm, asymvlm=asym, natives=natives, n_passes=args.mc_passes, seed=args.seed
    )
    result: dict[str, Any] = {
        "config": vars(args),
        "n_train": len(train["uid"]),
        "n_eval": len(evald["uid"]),
        "training": {"probvlm": describe(hist_p), **{f"asymvlm_{h}": describe(v) for h, v in hist_a.items()}},
        "histories": {"probvlm": hist_p, **{f"asymvlm_{h}": v for h, v in hist_a.items()}},
        "rows": rows,
    }
    if args.checkpoint and args.zeroshot:
        result["none_of_the_above"] = run_nota(args, asym)
    result["timings_s"] = {"fit": round(t_fit, 2), "total": round(time.perf_counter() - t0, 2)}
    storage.makedirs(args.out, args.s3_endpoint)
    table = markdown_table(rows)
    storage.write_json(result, storage.join(args.out, "adapters.json"), args.s3_endpoint)
    storage.write_bytes(table.encode(), storage.join(args.out, "adapters.md"), args.s3_endpoint)
    for name, model in [("probvlm", probvlm), *[(f"asymvlm_{h}", m) for h, m in asym.items()]]:
        with storage.open_output(storage.join(args.out, f"{name}.pt"), args.s3_endpoint) as f:
            torch.save(model.state_dict(), f)
    summary = [
        (r["method"], *(f"{r[d][k]:.3f}" for d in ("i2t", "t2i") for k in ("recall_at_1", "S", "R2")))
        for r in rows
    ]
    print_table(
        f"calibration on {result['n_eval']} pairs → {args.out}",
        summary,
        ("method", "i2t R@1", "i2t S", "i2t R²", "t2i R@1", "t2i S", "t2i R²"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
