"""PNG plots of the uncertainty analyses (``measures.py``), drawn with matplotlib's Agg backend.

Every figure says what it shows in its title and, above it, which run and model it belongs to (the
``subject`` ``plot_all`` is given); legends sit outside the data; a bar chart whose bars are close
together zooms its axis on them and writes each value on its bar.
"""

from __future__ import annotations

import os

import numpy as np


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_modality(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    if "image_trace" not in arrays or "text_trace" not in arrays:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.hist([arrays["image_trace"], arrays["text_trace"]], bins=30, label=["images", "captions"])
    ax.set_xlabel("tr(Σ) = Σ_d σ²_d")
    ax.set_ylabel("count")
    ax.set_title("σ² per image and per caption (retrieval set)", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _plot_length(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    if "caption_words" not in arrays:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter(arrays["caption_words"], arrays["caption_trace"], s=6, alpha=0.5)
    ax.set_xlabel("caption length (words)")
    ax.set_ylabel("tr(Σ_text)")
    rho = (analyses.get("sigma2_length") or {}).get("spearman_words_vs_trace")
    shown = f" (Spearman ρ = {rho:.2f})" if isinstance(rho, float) else ""
    ax.set_title(f"caption length against its σ²{shown}", fontsize=9)
    return fig


def _plot_level(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    if "level_traces" not in arrays:
        return None
    lt = arrays["level_traces"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.boxplot([lt[:, k] for k in range(lt.shape[1])])
    ax.set_xticks(range(1, lt.shape[1] + 1), [str(k) for k in range(lt.shape[1])])
    ax.set_xlabel("hierarchy level (0 = general)")
    ax.set_ylabel("tr(Σ_text)")
    frac = (analyses.get("hierarchy_order") or {}).get("ordered_fraction")
    shown = f"; adjacent levels ordered: {frac:.2f}" if isinstance(frac, float) else ""
    ax.set_title(f"caption σ² by hierarchy level{shown}", fontsize=9)
    return fig


def _plot_inclusion(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    inc = {k[len("H_") :]: v for k, v in arrays.items() if k.startswith("H_")}
    if not inc:
        return None
    fig, ax = plt.subplots(figsize=(6.8, 3.6))
    for name, h in inc.items():
        ax.hist(h, bins=30, alpha=0.5, label=name)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_xlabel("H(Z₁ ⊂ Z₂)  (> 0: Z₁ lies inside Z₂)")
    ax.set_ylabel("pairs")
    ax.set_title("inclusion of one embedding in another", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _plot_bprw(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    bp = analyses.get("bprw")
    if not isinstance(bp, dict):
        return None
    labels, before, after = [], [], []
    for mode in ("zero_shot", "few_shot"):
        if isinstance(bp.get(mode), dict):
            labels.append(mode.replace("_", "-"))
            before.append(bp[mode]["acc1_before"])
            after.append(bp[mode]["acc1_after"])
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(6.8, 3.6))
    x = np.arange(len(labels))
    for dx, values, name in ((-0.2, before, "prompt ensemble"), (0.2, after, "BPRW")):
        bars = ax.bar(x + dx, values, 0.4, label=name)
        ax.bar_label(bars, labels=[f"{v:.3f}" for v in values], fontsize=8, padding=2)
    lo, hi = min(before + after), max(before + after)
    pad = max(0.02, 0.6 * (hi - lo))  # zoomed on the bars: their differences are the point
    ax.set_ylim(max(0.0, lo - pad), min(1.0, hi + pad) if hi + pad > lo else hi + 0.05)
    ax.set_xticks(x, labels)
    ax.set_xlabel("zero-shot: the prompts alone · few-shot: with a few labelled pictures")
    ax.set_ylabel("top-1 accuracy" + (" (axis zoomed)" if lo - pad > 0 else ""))
    diffs = ", ".join(f"{m} {a - b:+.3f}" for m, b, a in zip(labels, before, after, strict=True))
    ax.set_title(f"BPRW against the prompt ensemble on {bp.get('task', 'the set')}: {diffs}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _plot_traversal(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    tr = analyses.get("traversal")
    if not isinstance(tr, dict):
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(np.linspace(0, 1, tr["steps"]), tr["mean_level_per_step"])
    ax.set_xlabel("root → nearest caption")
    ax.set_ylabel("mean level of retrieved caption")
    ax.set_title("walking from the root embedding to each image's caption", fontsize=9)
    return fig


def _plot_classes(plt, analyses: dict, arrays: dict[str, np.ndarray]):
    per_task = analyses.get("class_uncertainty")
    if not isinstance(per_task, dict) or not per_task:
        return None
    fig, ax = plt.subplots(figsize=(6.8, 3.6))
    for task, cu in per_task.items():
        keep = [i for i, r in enumerate(cu["recall"]) if r is not None]
        ax.scatter(
            [cu["prompt_trace"][i] for i in keep],
            [cu["recall"][i] for i in keep],
            s=12,
            label=f"{task} (ρ = {cu['spearman_trace_vs_recall']:.2f})",
        )
    ax.set_xlabel("mean tr(Σ) of the class's prompts")
    ax.set_ylabel("zero-shot recall of the class")
    ax.set_title("per class: prompt σ² against zero-shot recall", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


# (file name, drawer): a drawer returns a figure, or None when its analysis is absent.
_PLOTS = (
    ("sigma2_modality.png", _plot_modality),
    ("sigma2_vs_length.png", _plot_length),
    ("sigma2_vs_level.png", _plot_level),
    ("inclusion.png", _plot_inclusion),
    ("bprw.png", _plot_bprw),
    ("traversal.png", _plot_traversal),
    ("class_uncertainty.png", _plot_classes),
)


def draw_all(analyses: dict, arrays: dict[str, np.ndarray], subject: str = "") -> list[tuple[str, object]]:
    """(file name, figure) for whichever analyses are present, each headed by ``subject``."""
    plt = _figure()
    out = []
    for name, draw in _PLOTS:
        fig = draw(plt, analyses, arrays)
        if fig is not None:
            if subject:
                fig.suptitle(subject, fontsize=8, color="0.3")
            out.append((name, fig))
    return out


def plot_all(analyses: dict, arrays: dict[str, np.ndarray], plot_dir: str, subject: str = "") -> list[str]:
    """PNGs for whichever analyses are present; ``arrays`` holds the raw per-sample values plotted;
    ``subject`` (the run and model) heads every figure."""
    plt = _figure()
    os.makedirs(plot_dir, exist_ok=True)
    paths = []
    for name, fig in draw_all(analyses, arrays, subject):
        path = os.path.join(plot_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
