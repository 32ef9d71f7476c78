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

import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any

from jobs.common import job_main, parse_job_config, print_table
from pipeline.common import storage
from pipeline.common.config import Names, NonNegative, Positive, PositiveFloat, Seed, config_class, require
from pipeline.common.errors import InputError, UsageError
from pipeline.common.manifest import redacted
from pipeline.common.preflight import input_files, output_location
from pipeline.common.storage import Storage
from pipeline.common.storage_config import StorageConfig


@config_class
class AdaptersConfig:
    train: str = ""  # embedding parquet (file, dir or glob) to fit on
    eval: str = ""  # embedding parquet of the eval pairs
    out: str = ""  # output directory (local or s3://)
    native: Names = field(default_factory=list)  # NAME=PARQUET: a model's own Σσ²
    heads: str = "vmf,ps"  # AsymVLM families to fit (vmf, ps)
    probvlm_epochs: Positive = 100  # ProbVLM §4: 100
    probvlm_lr: PositiveFloat = 1e-4  # ProbVLM §4: 1e-4
    probvlm_batch: Positive = 256  # ProbVLM's minibatch of pairs
    asymvlm_epochs: Positive = 200  # AsymVLM App. B.4: 200
    asymvlm_lr: PositiveFloat = 1e-2  # AsymVLM Table A.1: 1e-2
    asymvlm_batch: Positive = 2048  # AsymVLM Table A.1: 2048
    mc_passes: Positive = 10  # MC-dropout passes for ProbVLM's epistemic term
    seed: Seed = 0  # of the adapters' initialisation, minibatch order and dropout
    threads: NonNegative = 0  # torch CPU threads (0: torch's default)
    checkpoint: str = ""  # the frozen model, for the none-of-the-above test
    zeroshot: str = ""  # clip_benchmark classification set dir (e.g. eval/shapes)
    unseen: NonNegative = 2  # last N classes are held out as unseen
    dummy: str = "a photo"  # the none-of-the-above prompt (AsymVLM Table 2)
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment

    def __post_init__(self) -> None:
        bad = [h for h in self.heads.split(",") if h and h not in ("vmf", "ps")]
        require(not bad, "heads", "must list AsymVLM families from vmf, ps", self.heads)


PRESETS = {"demo": AdaptersConfig()}
FLAGS = {f"--{f.name.replace('_', '-')}": f.name for f in fields(AdaptersConfig) if f.name != "storage"}
FLAGS["--s3-endpoint"] = "storage.s3_endpoint"


SUMMARY = """\
Fit the post-hoc ProbVLM and AsymVLM adapters on frozen embeddings (jobs.embed's parquet) and compare
their uncertainty calibration with a probabilistic model's own σ², on CPU, without Ray."""
EXAMPLE = "python -m jobs.adapters --train emb_train.parquet --eval emb_eval.parquet --out runs/adapters"


def _read_classification_set(root: str, store: Storage) -> tuple[list[bytes], Any, list[str], list[str]]:
    import numpy as np

    from pipeline.shards.reader import iter_shard

    classes = store.read_bytes(storage.join(root, "classnames.txt")).decode().split("\n")
    templates = store.read_bytes(storage.join(root, "zeroshot_classification_templates.txt")).decode()
    images, labels = [], []
    for path in store.list_files(storage.join(root, "test"), suffix=".tar"):
        for s in iter_shard(path, store):
            cls = s["cls"].decode() if isinstance(s["cls"], bytes) else str(s["cls"])
            images.append(s["jpg"])
            labels.append(int(cls.strip()))
    return images, np.asarray(labels), [c for c in classes if c], [t for t in templates.split("\n") if t]


def run_nota(args: AdaptersConfig, asym: dict[str, Any], store: Storage) -> dict[str, Any]:
    """Zero-shot over the seen classes + the dummy prompt; frozen cosine vs each AsymVLM head."""
    import numpy as np

    from training.adapters.compare import none_of_the_above, nota_scores
    from training.infer.encode import Encoder

    images, labels, classes, templates = _read_classification_set(args.zeroshot, store)
    enc = Encoder(args.checkpoint, store)
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


def _inputs(args: AdaptersConfig, store: Storage) -> tuple[dict, dict, dict]:
    """The train, eval and native embeddings, checked (before torch loads) and read."""
    natives = {}
    for spec in args.native:
        name, sep, path = spec.partition("=")
        if not sep:
            raise UsageError(f"native: expected NAME=PARQUET, got {spec!r}")
        natives[name] = path
    for what, path in (("train", args.train), ("eval", args.eval), *natives.items()):
        input_files(store, path, what, "parquet", ".parquet")
    output_location(store, args.out, "out")
    from training.adapters.fit import load_embeddings

    try:
        train, evald = load_embeddings(args.train, store), load_embeddings(args.eval, store)
        read = {name: load_embeddings(path, store) for name, path in natives.items()}
    except ValueError as exc:  # the file is a parquet, but not jobs.embed's
        raise InputError(str(exc)) from None
    for name, emb in read.items():
        if "image_logvar" not in emb:
            raise InputError(f"native {name}: {natives[name]} has no image_logvar/text_logvar columns")
    return train, evald, read


@job_main
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_job_config(
        argv, SUMMARY, PRESETS, FLAGS, required=("train", "eval", "out"), prog="jobs.adapters",
        example=EXAMPLE,
    )  # fmt: skip
    t0 = time.perf_counter()
    store = args.storage.store()
    train, evald, natives = _inputs(args, store)
    import torch

    from training.adapters.compare import evaluate_methods, markdown_table
    from training.adapters.fit import describe, fit_asymvlm, fit_probvlm

    if args.threads:
        torch.set_num_threads(args.threads)
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
        "config": redacted(dataclasses.asdict(args)),  # the endpoint may carry userinfo
        "n_train": len(train["uid"]),
        "n_eval": len(evald["uid"]),
        "training": {"probvlm": describe(hist_p), **{f"asymvlm_{h}": describe(v) for h, v in hist_a.items()}},
        "histories": {"probvlm": hist_p, **{f"asymvlm_{h}": v for h, v in hist_a.items()}},
        "rows": rows,
    }
    if args.checkpoint and args.zeroshot:
        result["none_of_the_above"] = run_nota(args, asym, store)
    result["timings_s"] = {"fit": round(t_fit, 2), "total": round(time.perf_counter() - t0, 2)}
    store.makedirs(args.out)
    table = markdown_table(rows)
    store.write_json(result, storage.join(args.out, "adapters.json"))
    store.write_bytes(table.encode(), storage.join(args.out, "adapters.md"))
    for name, model in [("probvlm", probvlm), *[(f"asymvlm_{h}", m) for h, m in asym.items()]]:
        with store.open_output(storage.join(args.out, f"{name}.pt")) as f:
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
