"""How much a generic word moves a trained scorer's caption mean, against the words it stands for.

For each demo track run given, at its scorer's last checkpoint: the leave-one-out shift ‖μ(caption without
the word) − μ(caption)‖₂ that the salient masking ranks words by (``training/train/salient_masking.py``), of the last
word of "a photo of a {colour} {word}", averaged over the eight colours, for the generic words of the
level-1 captions ("shape", "object") and for each shape's name; the same captions' mean tr(Σ_t); and the
run's adjacent-level ordering from its ``eval/scorer/analyses.json``. A scorer that reads "shape" as "any
shape" moves its mean little for it: the seeds whose scorer moves it least order "a red shape" above "a
red circle" most often (docs/decisions/0001-demo-scorer-model.md). A diagnostic, not a timing benchmark;
appends one JSON line per run to ``--out``.

Usage: python bench/word_shift.py runs/demo runs/demo-seed1 runs/demo-seed2 [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scorer_replica import append_result  # noqa: E402
from pipeline.demo.captions import _a  # noqa: E402  the pool's own article rule
from pipeline.demo.render import COLOURS, SHAPES  # noqa: E402
from training.infer.encode import Encoder  # noqa: E402
from training.train.salient_masking import SalientDrop  # noqa: E402

GENERIC = ("shape", "object")


def last_word(enc: Encoder, words: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """word → (mean shift of the last word, mean tr(Σ_t)) over "a photo of a {colour} {word}"."""
    tok = enc.tokenizer
    start = getattr(tok, "start_id", None)
    salience = SalientDrop(tok.pad_id, tok.end_id, 0.5, () if start is None else (start,))
    out = {}
    for word in words:
        caps = [f"a photo of {_a(c)} {word}" for c in COLOURS]
        tokens = torch.from_numpy(np.asarray(enc.tokenize(caps))).long()
        with torch.no_grad():
            shift = salience.shifts(enc.model.encode_text, tokens)  # NaN off the content tokens
        last = [row[~torch.isnan(row)][-1].item() for row in shift]
        trace = np.exp(enc.texts(caps)[1]).sum(1)
        out[word] = (float(np.mean(last)), float(trace.mean()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="demo track run directories (make demo / demo-seeds output)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "word_shift.jsonl"))
    args = ap.parse_args()
    for run in args.runs:
        checkpoint = sorted(Path(run, "train", "scorer").glob("checkpoint_0*"))[-1]
        enc = Encoder(str(checkpoint), threads=args.threads)
        found = last_word(enc, GENERIC + SHAPES)
        order = json.loads(Path(run, "eval", "scorer", "analyses.json").read_text())["hierarchy_order"]
        above = sum(found[s][0] > found["shape"][0] for s in SHAPES)
        result = {
            "run": run,
            "checkpoint": checkpoint.name,
            "shift": {w: round(v[0], 4) for w, v in found.items()},
            "trace": {w: round(v[1], 4) for w, v in found.items()},
            "shape_names_shifting_more_than_shape": above,
            "ordered_fraction": order["ordered_fraction"],
            "ordered_fraction_per_pair": order["ordered_fraction_per_pair"],
        }
        print(
            f"{run}: 'shape' {found['shape'][0]:.3f}, 'object' {found['object'][0]:.3f}, shape names "
            f"{min(found[s][0] for s in SHAPES):.3f}–{max(found[s][0] for s in SHAPES):.3f} ({above}/8 above "
            f"'shape'); levels ordered {order['ordered_fraction']:.3f} "
            f"({'/'.join(f'{x:.3f}' for x in order['ordered_fraction_per_pair'])})"
        )
        append_result(result, args.out)


if __name__ == "__main__":
    main()
