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

# (y, height, title, left column, right column, face colour); a * marks the modules that import Ray.
PACKAGES = [
    (
        7.9,
        2.35,
        "jobs/  — entry points (python -m jobs.<verb>) and multi-step workflows",
        [
            "build_dataset · train · embed · reshard",
            "evaluate · adapters · demo_pool · import_checkpoint",
            "  one module each: parse the config, call one library function",
        ],
        [
            "track/ {cli, config, run, steps, report, seeds}",
            "  build → scorer → score → filters → reshard → train → evaluate → report",
            "filter/ {cli, run}: score → filters → subset .npy → reshard",
            "common.py: --preset → --config → flags → --set; Ray start",
        ],
        "#fde9c9",
    ),
    (
        4.35,
        2.95,
        "training/  — model plane (torch)",
        [
            "config.py (TrainConfig)",
            "model/ {config, towers, two_tower, param_groups, checkpoint}",
            "losses/ {registry, spec, contrastive, prolip, inclusion, pcmepp}",
            "losses/fused/ {pairwise, per_sample}: hand-derived CPU kernels",
            "train/ {step (no Ray), loop*, trainer*, distributed, salient_masking}",
        ],
        [
            "infer/ {encode, scoring, batch_inference*}",
            "eval/ {sets, hf_sets, metrics, results, run,",
            "       analyses, uncertainty, bprw, calibration}",
            "adapters/ {probvlm, asymvlm, fit, compare}",
            "imports/ {open_clip, prolip_official, load, common}",
        ],
        "#dbe9f7",
    ),
    (
        0.2,
        3.55,
        "pipeline/  — data plane (the build, storage, config machinery, ingest)",
        [
            "build.py* · config.py (BuildConfig) · schema.py",
            "common/ {storage, config machinery, manifest, placement, hashing}",
            "source/ {metadata, row_checks, run_state, status_table}",
            "download/ {fetch, part, phase*, resize, netguard,",
            "           politeness, pixel_budget}",
            "dedup/ {decisions, phash, urlnorm}",
        ],
        [
            "filters/ {base, datacomp, text_based, wordnet, language,",
            "          centroids, scores, registry, specs, rerun_cache}",
            "subsets/ {uid_files, eligibility, reshard}",
            "shards/ {tar_format, writer, reader, ray_reader*}",
            "ingest/ {transforms, augment, masking, tokenizer, dataset*}",
            "demo/ {plan, images, render, captions, faults,",
            "       eval_sets, pool, server, source}",
        ],
        "#e3f1de",
    ),
]

DATA_FLOW = (
    "metadata parquet → build → shards (tar + stats + status) + subsets (.npy) → ingest → Ray Train → checkpoint"
    " → score → filters → subset → reshard → train → evaluate → report.md"
)
RAY_NOTE = (
    "Direction: jobs → training → pipeline; nothing imports jobs; no file cycles (tests/test_architecture.py).\n"
    "Ray only in jobs and the modules marked *: pipeline.build, pipeline.download.phase, pipeline.shards.ray_reader,\n"
    "pipeline.ingest.dataset, training.infer.batch_inference, training.train.loop, training.train.trainer"
)
BOX_X, BOX_W = 0.3, 14.6  # the import arrows run to the right of the boxes, clear of their text


def draw(out_stem: Path) -> None:
    fig, ax = plt.subplots(figsize=(16, 12.4))
    fig.subplots_adjust(left=0, right=1, bottom=0, top=1)
    ax.set_xlim(0, 16)
    ax.set_ylim(-2.0, 10.4)
    ax.axis("off")
    for y, h, title, left, right, colour in PACKAGES:
        ax.add_patch(FancyBboxPatch((BOX_X, y), BOX_W, h, boxstyle="round,pad=0.05", fc=colour, ec="#333333"))
        ax.text(BOX_X + 0.2, y + h - 0.25, title, fontsize=14, weight="bold", va="top")
        for column, lines in ((BOX_X + 0.35, left), (BOX_X + 0.35 + BOX_W / 2, right)):
            for i, line in enumerate(lines):
                ax.text(column, y + h - 0.85 - 0.4 * i, line, fontsize=10.5, va="top", family="monospace")
    (jobs_y, _, *_), (train_y, train_h, *_), (pipe_y, pipe_h, *_) = PACKAGES
    arrows = (
        (15.2, jobs_y, train_y + train_h, "imports"),
        (15.2, train_y, pipe_y + pipe_h, "imports"),
        (15.65, jobs_y, pipe_y + pipe_h, ""),
    )
    for x, y0, y1, label in arrows:
        ax.add_patch(FancyArrowPatch((x, y0), (x, y1), arrowstyle="-|>", mutation_scale=22, lw=2))
        if label:
            ax.text(x - 0.1, (y0 + y1) / 2, label, fontsize=10, va="center", ha="right")
    ax.text(8.0, -0.2, RAY_NOTE, fontsize=11, ha="center", va="top", linespacing=1.5)
    ax.text(8.0, -1.45, "Data flow: " + DATA_FLOW, fontsize=10, ha="center", va="top", style="italic")
    for ext in ("png", "svg"):
        fig.savefig(out_stem.with_suffix(f".{ext}"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(HERE / "architecture")
