"""Draws docs/architecture.png and docs/architecture.svg: the packages, their import direction and the data flow.

Run ``python docs/architecture_figure.py`` after a change of layout; docs/architecture.md shows the result.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent

# (x, y, width, height, title, body lines, face colour)
PACKAGES = [
    (
        0.3,
        6.6,
        13.4,
        2.0,
        "jobs/  — entry points (python -m jobs.<verb>) and multi-step workflows",
        [
            "build_dataset · train · embed · reshard · evaluate · adapters · demo_pool   (one file each: parse config, call one library function)",
            "track/ {cli, config, run, steps, report}: build → scorer → score → filters → reshard → train per subset → evaluate → report",
            "filter/ {cli, run}: score a pool with a checkpoint → filters → subset .npy → reshard        common: --preset → --config → --set, Ray start",
        ],
        "#fde9c9",
    ),
    (
        0.3,
        3.45,
        13.4,
        2.55,
        "training/  — model plane (torch)",
        [
            "config (TrainConfig, ModelConfig, presets) · model, towers · losses, pcmepp → objectives (LossSpec registry)",
            "step (TrainState, train_step: no Ray) · loop (Ray Train worker loop) · trainer (TorchTrainer) · distributed (gathers)",
            "encode (the one batch Encoder) · scoring (CSD / cosine columns) · inference (Ray batch inference: score, embed, eval)",
            "eval/ {metrics, sets, run, analyses, uncertainty, bprw, calibration}      adapters/ {probvlm, asymvlm, fit, compare}",
        ],
        "#dbe9f7",
    ),
    (
        0.3,
        0.3,
        13.4,
        2.55,
        "pipeline/  — data plane (Ray Data stages, storage, config machinery)",
        [
            "storage (Storage: one filesystem object) · config (machinery + BuildConfig) · schema · manifest · tokenizer",
            "build (Ray builder) · download, netguard, resize, urlnorm, dedupe, phash, langid · shards (writer) · reshard · subset",
            "filters, score_filters → filtering (one registry, one spec syntax) · centroids · shard_source (the one shard reader)",
            "datasets (Ray builders: shard reads, train ingest, counters) · ingest_train, augment, masking · demo/ (pool generator)",
        ],
        "#e3f1de",
    ),
]

DATA_FLOW = (
    "metadata parquet → build → shards (tar + stats + status) + subsets (.npy) → ingest → Ray Train → checkpoint"
    " → score → filters → subset → reshard → train → evaluate → report.md"
)


def draw(out_stem: Path) -> None:
    fig, ax = plt.subplots(figsize=(14, 10))
    ax.set_xlim(0, 14)
    ax.set_ylim(-1.2, 8.9)
    ax.axis("off")
    for x, y, w, h, title, lines, colour in PACKAGES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#333333"))
        ax.text(x + 0.15, y + h - 0.3, title, fontsize=12.5, weight="bold", va="top")
        for i, line in enumerate(lines):
            ax.text(x + 0.3, y + h - 0.85 - 0.45 * i, line, fontsize=9.2, va="top", family="monospace")
    for y0, y1, label in ((6.6, 6.0, "imports"), (3.45, 2.85, "imports")):
        ax.add_patch(FancyArrowPatch((12.6, y0), (12.6, y1), arrowstyle="-|>", mutation_scale=22, lw=2))
        ax.text(12.75, (y0 + y1) / 2, label, fontsize=10, va="center")
    ax.add_patch(FancyArrowPatch((13.2, 6.6), (13.2, 2.85), arrowstyle="-|>", mutation_scale=22, lw=2))
    ax.text(
        7.0,
        -0.35,
        "Direction: jobs → training → pipeline; nothing imports jobs; no file cycles; Ray only in named modules\n"
        "(pipeline.build, pipeline.ingest.dataset, training.infer.batch_inference, training.train.loop, training.train.trainer) and jobs — "
        "tests/test_architecture.py",
        fontsize=10,
        ha="center",
        va="top",
    )
    ax.text(7.0, -1.05, "Data flow: " + DATA_FLOW, fontsize=8.6, ha="center", va="top", style="italic")
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(out_stem.with_suffix(f".{ext}"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(HERE / "architecture")
