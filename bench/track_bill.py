"""The bill of a whole filtering track on AWS (docs/cluster.md, "The bill"), at DataComp's small and medium
scales, from the project's own counts and measured rates; every other number is an assumption, named here
and marked in the table.

Counted or measured (this project): the FLOPs of a training sample, of an image and of a caption
(training/model/flops.py, on the meta device); the build's CPU per image (8.0 CPU-ms, the whole build on plain
Ray actors, bench/results/download_actor_cpu.json); the decode rate of one core at 224 px (344 samples per
CPU-second inside the Ray Data ingest, pipeline.ingest.transforms.DECODE_SAMPLES_PER_CORE_224, which the
scoring and evaluation actors' decode threads are assumed to match); the presets' actors, threads and GPUs.

Assumed (marked ``*`` in the table): prices, the real web's time per row, the share of rows that download
and of rows retried late, the GPU's MFU, start-up times, the evaluation sets' size.

    python -m bench.track_bill            # prints the two tables docs/cluster.md shows
    python -m bench.track_bill --check    # exit 1 when docs/cluster.md shows other figures
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# --- assumptions (*) ---------------------------------------------------------------------------------------
PRICE = {
    "c6in.8xlarge": 1.81,
    "m7i.2xlarge": 0.40,
    "p5.48xlarge": 55.04,
}  # $/h on demand, us-east-1, 2026-11-21
ROW_S = (1.0, 2.4, 4.0)  # mean wall time of a row on the real web, fetch to resize (low, mid, high)
DOWNLOADED = 0.85  # share of the pool's URLs that still give an image (scored, trained on)
LATE = 0.10  # share of rows fetched again in the late retry pass
MFU = (0.15, 0.30, 0.40)  # training on an H100 (high, mid, low cost)
TRAIN_START_MIN = (5.0, 10.0, 15.0)  # a training's worker start, first batches and last checkpoint
NODE_START_MIN = 10.0  # a node's boot and image pull, each time the autoscaler brings one
EVAL_IMAGES = 600_000  # the 38 evaluation sets' test images (published sizes, summed)
EVAL_TEXTS = 150_000  # their prompts (classes × templates) and captions
H100_TF32 = 494.7e12  # dense TF32 peak (NVIDIA's datasheet): the evaluation runs its towers in fp32
# --- measured --------------------------------------------------------------------------------------------
BUILD_CPU_S = 0.0080  # CPU-seconds an image, the whole build (bench/results/download_actor_cpu.json)

SCALES = {"small": 12_800_000, "medium": 128_000_000}  # pool rows = samples seen per training (DataComp)


@dataclass
class Line:
    what: str
    takes: str
    cost: tuple[float, float]  # low, high $


def counts() -> dict[str, float]:
    """FLOPs (counted) and the presets' shapes."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.config import BUILD_PRESETS
    from pipeline.ingest.transforms import DECODE_SAMPLES_PER_CORE_224
    from training.config import TRAIN_PRESETS
    from training.infer.batch_inference import GPU_ACTOR_CPUS
    from training.model.config import model_config
    from training.model.flops import H100_BF16_DENSE, train_flops_per_sample
    from training.model.two_tower import ProLIP

    name = TRAIN_PRESETS["datacomp-small"].model
    prolip = train_flops_per_sample(model_config(name), masked=True)["total"]
    clip = train_flops_per_sample(model_config(name, probabilistic=False), masked=False)["total"]
    with torch.device("meta"):
        model = ProLIP(model_config(name))
        images, tokens = torch.empty(8, 3, 224, 224), torch.zeros(8, 77, dtype=torch.long)
    fwd = {}
    for key, run in (
        ("image", lambda: model.encode_image(images)),
        ("text", lambda: model.encode_text(tokens)),
    ):
        counter = FlopCounterMode(display=False)
        with counter:
            run()
        fwd[key] = counter.get_total_flops() / 8
    build = BUILD_PRESETS["datacomp-small"]
    train = TRAIN_PRESETS["datacomp-small"]
    return {
        "prolip": prolip, "clip": clip, "image": fwd["image"], "text": fwd["text"], "peak": H100_BF16_DENSE,
        "decode": DECODE_SAMPLES_PER_CORE_224, "gpu_actor_cpus": GPU_ACTOR_CPUS,
        "in_flight": build.download_actors * build.download.threads_per_actor,
        "data_nodes": math.ceil(build.download_actors * build.download_cpus / 32), "gpus": train.scaling.num_workers,
        "cpus_per_worker": train.scaling.cpus_per_worker,
    }  # fmt: skip


def bill(rows: int, c: dict[str, float]) -> list[Line]:
    gpu_h, cpu_h, head = PRICE["p5.48xlarge"], PRICE["c6in.8xlarge"], PRICE["m7i.2xlarge"]
    node_start = NODE_START_MIN / 60
    out = []
    # build: latency-bound on the real web (the CPU it needs, 8 ms an image, is a few % of its nodes)
    hours = [rows * (1 + LATE) * s / c["in_flight"] / 3600 for s in (ROW_S[0], ROW_S[2])]
    cpu_floor = rows * BUILD_CPU_S / (c["data_nodes"] * 32) / 3600
    cost = [max(h, cpu_floor) * c["data_nodes"] * cpu_h for h in hours]
    out.append(Line(f"build: {rows / 1e6:.1f}M URLs, {c['in_flight']:.0f} fetches in flight on {c['data_nodes']:.0f} "
                    f"c6in.8xlarge", f"{hours[0]:.1f}–{hours[1]:.1f} h at {ROW_S[0]:g}–{ROW_S[2]:g} s a row*", tuple(cost)))  # fmt: skip
    # trainings: the scorer (ProLIP) and 6 subset models (CLIP), each `rows` samples seen, one 8-GPU node;
    # the decode cores a GPU needs cap the MFU a p5's 24 vCPUs per GPU can feed
    spare = 24 - c["cpus_per_worker"]
    mfu_cap = spare * c["decode"] * c["prolip"] / c["peak"]
    flops = rows * (c["prolip"] + 6 * c["clip"])
    node_h = [flops / (min(m, mfu_cap) * c["peak"]) / 3600 / c["gpus"] + 7 * s / 60
              for m, s in ((MFU[2], TRAIN_START_MIN[0]), (MFU[0], TRAIN_START_MIN[2]))]  # fmt: skip
    out.append(Line(f"7 trainings ({rows / 1e6:.1f}M samples seen each, ViT-B/32) on one p5.48xlarge",
                    f"{node_h[0]:.1f}–{node_h[1]:.1f} node-h at {MFU[0]:.0%}–{min(MFU[2], mfu_cap):.0%} MFU*",
                    tuple(h * gpu_h for h in node_h)))  # fmt: skip
    # scoring: every downloaded pair, 7 actors of 1 GPU and GPU_ACTOR_CPUS decode threads
    pairs = rows * DOWNLOADED
    rate = 7 * min(c["gpu_actor_cpus"] * c["decode"], MFU[1] * c["peak"] / (c["image"] + c["text"]))
    h = pairs / rate / 3600 + node_start
    out.append(Line(f"scoring {pairs / 1e6:.1f}M pairs*, 7 GPUs", f"{h:.2f} node-h", (h * gpu_h, h * gpu_h)))
    # evaluations: 7 models × the 38 tasks, one GPU each, 6 at once (the scorer's beside the scoring)
    per = EVAL_IMAGES / (c["gpu_actor_cpus"] * c["decode"]) + (
        EVAL_IMAGES * c["image"] + EVAL_TEXTS * c["text"]
    ) / (MFU[1] * H100_TF32)
    h = 2 * per / 3600 + node_start  # two rounds: the scorer's, then the six at once
    out.append(
        Line("7 evaluations × 38 tasks*, one GPU each, 6 at once", f"{h:.2f} node-h", (h * gpu_h, h * gpu_h))
    )
    # the head: the whole session, every step above one after the other and an hour more
    session = [hours[0] + node_h[0] + 2 * h + 1, hours[1] + node_h[1] + 2 * h + 1]
    head_cost = (session[0] * head, session[1] * head)
    out.append(Line("head m7i.2xlarge, the whole session", f"{session[0]:.0f}–{session[1]:.0f} h", head_cost))
    return out


def render() -> str:
    c = counts()
    parts = []
    for scale, rows in SCALES.items():
        lines = bill(rows, c)
        lo, hi = sum(x.cost[0] for x in lines), sum(x.cost[1] for x in lines)
        table = ["| step | takes | $ on demand* |", "| --- | --- | --- |"]
        table += [f"| {x.what} | {x.takes} | {x.cost[0]:,.0f}–{x.cost[1]:,.0f} |" if round(x.cost[0]) != round(x.cost[1])
                  else f"| {x.what} | {x.takes} | {x.cost[0]:,.0f} |" for x in lines]  # fmt: skip
        table.append(f"| **{scale} track** | | **{lo:,.0f}–{hi:,.0f}** |")
        parts.append("\n".join(table))
    return "\n\n".join(parts) + "\n"


BEGIN, END = "<!-- bill: python -m bench.track_bill -->\n", "<!-- end of bill -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/cluster.md")
    args = ap.parse_args()
    text = render()
    if not args.check:
        print(text, end="")
        return 0
    doc = (ROOT / "docs" / "cluster.md").read_text()
    shown = doc.split(BEGIN, 1)[1].split(END, 1)[0] if BEGIN in doc else ""
    print(
        "docs/cluster.md's bill is current"
        if shown.strip() == text.strip()
        else "docs/cluster.md's bill is stale"
    )
    return 0 if shown.strip() == text.strip() else 1


if __name__ == "__main__":
    sys.exit(main())
