"""The uncertainty-method comparison on a demo pool: ProLIP's own Σσ², PCME++, ProbVLM and AsymVLM.

Reproduces the table of docs/adapters.md "Measured on the demo pool" from a built demo run directory
(``jobs.track`` / ``jobs.build_dataset`` output: ``RUN/shards`` and ``RUN/pool/eval``) and three checkpoints
trained on it (a deterministic CLIP, a ProLIP and a PCME++ model; a run directory stands for its newest
``checkpoint_*``):

1. embeds the training shards with the deterministic CLIP (``training.infer.batch_inference.embed_shards``) — what the
   post-hoc adapters are fitted on;
2. expands the retrieval eval set (``{key}.jpg`` + ``{key}.txt`` with three captions, pipeline/demo/eval_sets.py)
   into one webdataset sample per (image, caption) pair, written to ``OUT/eval_pairs/``; the pairs of one
   image share a uid, so retrieving any of the image's captions counts as right (the rule of
   training/adapters/compare.py);
3. embeds those pairs with each of the three checkpoints;
4. runs ``jobs.adapters`` on them: ProbVLM and AsymVLM fitted on the CLIP training embeddings and evaluated
   on the CLIP eval embeddings, ProLIP and PCME++ as ``--native`` rows, and AsymVLM's none-of-the-above
   test on the shapes set; then the same test on ``--extra-nota`` sets (colours: what the demo captions
   teach first) with the saved heads.

Writes ``OUT/adapters.md`` and ``OUT/adapters.json`` (jobs/adapters.py), the adapter weights, the
embedding parquets ``OUT/emb/*.parquet`` and ``OUT/adapters_demo.json`` (checkpoints, argv, timings).

Usage: python -m bench.research.adapters_demo --run RUN --clip C --prolip C --pcmepp C --out OUT
       [--probvlm-epochs N --asymvlm-epochs N --asymvlm-lr X --asymvlm-batch B] [--extra-nota colours]
       [--reuse]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

RETRIEVAL_PER_TAR = 1000  # pairs per eval shard; the demo's 200 images × 3 captions fit in one


def pair_uid(key: str) -> str:
    """A 32-hex uid for an eval image key: the scorers keep a json uid only when it has DataComp's form
    (training/infer/scoring.py ``sample_uid``), and every caption row of one image must carry the same one."""
    return hashlib.md5(f"retrieval/{key}".encode()).hexdigest()


def retrieval_pairs(samples: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """One sample per (image, caption) of a retrieval set: ``{key}_{j}`` with caption line ``j``.

    Input samples are ``iter_shard`` dicts (``__key__``, ``jpg`` bytes, ``txt`` with one caption per line).
    Blank lines are skipped; an image without captions gives no pair. Output json: ``uid`` (shared by the
    image's pairs, ``pair_uid``), ``key`` (the eval set's key) and ``caption_index``.
    """
    for s in samples:
        txt = s.get("txt") or ""
        if isinstance(txt, bytes):
            txt = txt.decode("utf-8")
        captions = [line.strip() for line in txt.split("\n") if line.strip()]
        key = s["__key__"]
        for j, caption in enumerate(captions):
            meta = {"uid": pair_uid(key), "key": key, "caption_index": j}
            yield {"__key__": f"{key}_{j}", "jpg": s["jpg"], "txt": caption, "json": meta}


def write_retrieval_pairs(eval_dir: Path, out_dir: Path) -> tuple[list[str], int, int]:
    """Write ``retrieval_pairs`` of ``eval_dir/test/*.tar`` as shards under ``out_dir``.

    Returns (shard paths, images, pairs)."""
    from pipeline.shards.reader import iter_shard
    from pipeline.shards.writer import write_shard

    tars = sorted((eval_dir / "test").glob("*.tar"))
    if not tars:
        raise FileNotFoundError(
            f"{eval_dir / 'test'}: no .tar files (expected a clip_benchmark retrieval set)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    images = [s for t in tars for s in iter_shard(str(t))]
    pairs = list(retrieval_pairs(images))
    paths = []
    for i in range(0, len(pairs), RETRIEVAL_PER_TAR):
        path = str(out_dir / f"{i // RETRIEVAL_PER_TAR:06d}.tar")
        write_shard(path, pairs[i : i + RETRIEVAL_PER_TAR])
        paths.append(path)
    return paths, len(images), len(pairs)


def newest_checkpoint(path: str) -> str:
    """``path`` itself when it holds ``weights.pt``, else its last ``checkpoint_*`` subdirectory by name
    (Ray Train numbers them by step, zero-padded)."""
    p = Path(path)
    if (p / "weights.pt").exists():
        return str(p)
    found = sorted(c for c in p.glob("checkpoint_*") if (c / "weights.pt").exists())
    if not found:
        raise FileNotFoundError(f"{path}: neither a checkpoint (weights.pt) nor a run with checkpoint_*")
    return str(found[-1])


def extra_nota(out: Path, eval_root: Path, sets: list[str], checkpoint: str, unseen: int) -> dict[str, Any]:
    """AsymVLM's none-of-the-above test on more classification sets, with the heads ``jobs.adapters``
    saved in ``out`` (``asymvlm_{family}.pt``); the same rule as its ``--zeroshot`` set."""
    import torch

    from jobs.adapters import AdaptersConfig, run_nota
    from pipeline.common.storage import LOCAL
    from training.adapters.asymvlm import AsymVLM

    heads = {}
    for path in sorted(out.glob("asymvlm_*.pt")):
        family = path.stem.removeprefix("asymvlm_")
        state = torch.load(path, weights_only=True)
        hidden, dim = state["head.0.weight"].shape
        heads[family] = AsymVLM(dim, family, hidden)
        heads[family].load_state_dict(state)
        heads[family].eval()
    results = {}
    for name in sets:
        cfg = AdaptersConfig(zeroshot=str(eval_root / name), checkpoint=checkpoint, unseen=unseen)
        results[name] = run_nota(cfg, heads, LOCAL)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Uncertainty-method comparison on a demo pool.")
    p.add_argument("--run", required=True, help="demo run directory with shards/ and pool/eval/")
    p.add_argument("--clip", required=True, help="deterministic CLIP checkpoint (or its run directory)")
    p.add_argument("--prolip", required=True, help="ProLIP checkpoint (or its run directory)")
    p.add_argument("--pcmepp", required=True, help="PCME++ checkpoint (or its run directory)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--probvlm-epochs", type=int, default=100)
    p.add_argument("--asymvlm-epochs", type=int, default=200)
    p.add_argument("--asymvlm-lr", type=float, default=1e-2)
    p.add_argument("--asymvlm-batch", type=int, default=2048)
    p.add_argument("--mc-passes", type=int, default=10)
    p.add_argument("--unseen", type=int, default=2, help="classes held out for none-of-the-above")
    p.add_argument("--extra-nota", default="colours", help="more pool/eval sets for none-of-the-above")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for fitting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="keep embedding parquets already in OUT/emb")
    return p.parse_args(argv)


def _checkpoints(args: argparse.Namespace, run: Path) -> dict[str, str] | None:
    """The three checkpoints (newest of a run directory), or None after saying what is wrong: a missing
    input, or a checkpoint of the wrong kind (CLIP must be deterministic, the others probabilistic)."""
    try:
        ckpts = {name: newest_checkpoint(getattr(args, name)) for name in ("clip", "prolip", "pcmepp")}
        for sub in ("shards", "pool/eval/retrieval", "pool/eval/shapes"):
            if not (run / sub).is_dir():
                raise FileNotFoundError(f"{run / sub}: missing (is --run a built demo run?)")
    except FileNotFoundError as exc:
        print(f"adapters_demo: {exc}", file=sys.stderr)
        return None
    from training.infer.scoring import verify_checkpoint

    for name, c in ckpts.items():
        cfg = verify_checkpoint(c)
        if cfg.probabilistic == (name == "clip"):
            kind = "deterministic" if name != "clip" else "probabilistic"
            print(f"adapters_demo: --{name} {c} is {kind}", file=sys.stderr)
            return None
    return ckpts


def _embed_all(jobs: list[tuple[str, str, str]], emb: Path, reuse: bool, timings: dict[str, float]) -> None:
    """Embed each (name, shards, checkpoint) into ``emb/{name}.parquet`` on a local Ray, skipping the
    parquets already there when ``reuse``; Ray is shut down afterwards to free the cores for fitting."""
    from training.infer.batch_inference import embed_shards

    todo = [j for j in jobs if not (reuse and (emb / f"{j[0]}.parquet").exists())]
    if not todo:
        return
    import ray

    from jobs.common import init_ray

    init_ray()
    try:
        for name, shards, ckpt in todo:
            res = embed_shards(shards, ckpt, str(emb / f"{name}.parquet"))
            timings[f"embed_{name}"] = round(res.wall_s, 2)
            print(f"[adapters_demo] {name}: {res.n_rows} rows ({res.n_failed} failed) in {res.wall_s:.1f} s")
    finally:
        ray.shutdown()


def _adapters_argv(
    args: argparse.Namespace, run: Path, out: Path, emb: Path, ckpts: dict[str, str]
) -> list[str]:
    return [
        "--train", str(emb / "train_clip.parquet"), "--eval", str(emb / "eval_clip.parquet"),
        "--out", str(out),
        "--native", f"ProLIP (own Σσ²)={emb / 'eval_prolip.parquet'}",
        "--native", f"PCME++ (own Σσ²)={emb / 'eval_pcmepp.parquet'}",
        "--probvlm-epochs", str(args.probvlm_epochs),
        "--asymvlm-epochs", str(args.asymvlm_epochs), "--asymvlm-lr", str(args.asymvlm_lr),
        "--asymvlm-batch", str(args.asymvlm_batch), "--mc-passes", str(args.mc_passes),
        "--seed", str(args.seed), "--threads", str(args.threads),
        "--checkpoint", ckpts["clip"], "--zeroshot", str(run / "pool/eval/shapes"),
        "--unseen", str(args.unseen),
    ]  # fmt: skip


def _print_nota(nota: dict[str, Any]) -> None:
    for name, res in nota.items():
        for method in ("frozen cosine", "AsymVLM (vmf)", "AsymVLM (ps)"):
            if method in res:
                r = res[method]
                print(
                    f"[adapters_demo] none-of-the-above {name} {method}: pos_acc {r['pos_acc']:.3f} "
                    f"neg_acc {r['neg_acc']:.3f} pos_dummy_rate {r['pos_dummy_rate']:.3f}"
                )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run, out = Path(args.run), Path(args.out)
    ckpts = _checkpoints(args, run)
    if ckpts is None:
        return 2
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    pair_paths, n_img, n_pairs = write_retrieval_pairs(run / "pool/eval/retrieval", out / "eval_pairs")
    print(f"[adapters_demo] eval pairs: {n_img} images → {n_pairs} pairs in {out / 'eval_pairs'}")
    emb = out / "emb"
    emb.mkdir(parents=True, exist_ok=True)
    jobs = [("train_clip", str(run / "shards"), ckpts["clip"])]
    jobs += [(f"eval_{n}", ",".join(pair_paths), ckpts[n]) for n in ("clip", "prolip", "pcmepp")]
    _embed_all(jobs, emb, args.reuse, timings)
    from jobs.adapters import main as adapters_main

    adapters_argv = _adapters_argv(args, run, out, emb, ckpts)
    t1 = time.perf_counter()
    rc = adapters_main(adapters_argv)
    timings["adapters"] = round(time.perf_counter() - t1, 2)
    sets = [x for x in args.extra_nota.split(",") if x]
    nota = extra_nota(out, run / "pool/eval", sets, ckpts["clip"], args.unseen) if rc == 0 and sets else {}
    _print_nota(nota)
    timings["total"] = round(time.perf_counter() - t0, 2)
    meta = {
        "run": str(run),
        "checkpoints": ckpts,
        "eval_images": n_img,
        "eval_pairs": n_pairs,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "adapters_argv": adapters_argv,
        "none_of_the_above_extra": nota,
        "timings_s": timings,
        "rc": rc,
    }
    (out / "adapters_demo.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[adapters_demo] done in {timings['total']:.1f} s → {out}/adapters.md")
    return rc


if __name__ == "__main__":
    sys.exit(main())
