"""How the track report is drawn: its figures (each subset's metrics side by side, every model's loss
curve) and ``report.html``, the Markdown report as one self-contained file with every figure inline.

Every figure carries a title naming the run and the models it shows, its axes say what they measure, and
its legend sits outside the data. The HTML file embeds its pictures as ``data:`` URIs and holds no link
to another file or site, so it can be mailed or opened anywhere; the Markdown report beside it links the
same PNGs and JSON files by relative path.
"""

from __future__ import annotations

import base64
import io
import re
import statistics
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import Storage

FIGURES = ("results.png", "loss_curves.png")  # under <output>/figures/


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def results_figure(
    title: str, subsets: list[str], tasks: list[str], values: dict[str, dict[str, list[float]]]
) -> Any:
    """Grouped bars: per task (and the average), one bar per subset = the mean over seeds, with the
    seeds' standard deviation as an error bar when there are several and each mean written on its bar."""
    plt = _plt()
    cols = [*tasks, "average"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(cols) * max(len(subsets), 2) / 3), 4.6))
    width = 0.8 / max(len(subsets), 1)
    top = 0.0
    for i, name in enumerate(subsets):
        per = [values.get(name, {}).get(c, []) for c in cols]
        means = [statistics.fmean(v) if v else 0.0 for v in per]
        sds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per]
        x = [k + (i - (len(subsets) - 1) / 2) * width for k in range(len(cols))]
        bars = ax.bar(x, means, width, yerr=sds if any(sds) else None, capsize=3, label=name)
        shown = [f"{m:.3f}" if v else "–" for m, v in zip(means, per, strict=True)]
        ax.bar_label(bars, labels=shown, fontsize=7, padding=2, rotation=90 if len(subsets) > 2 else 0)
        top = max(top, *[m + s for m, s in zip(means, sds, strict=True)])
    ax.set_xticks(range(len(cols)), cols)
    ax.set_ylim(0, min(1.05, top * 1.25 + 0.02) if top > 0 else 1.0)
    ax.set_ylabel("main metric (accuracy or recall)")
    ax.set_title(title, fontsize=10)
    ax.legend(title="subset", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def loss_figure(title: str, panels: list[tuple[str, dict[str, list[tuple[int, float]]]]]) -> Any:
    """One panel per group of models that share a loss (the scorer; the subset models): training loss
    against samples seen, one line per model."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (label, curves) in zip(axes[0], panels, strict=True):
        for name, points in curves.items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=name, lw=1.2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("samples seen")
        ax.set_ylabel("training loss (total)")
        ax.grid(alpha=0.3)
        if len(curves) > 1:
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return fig


def loss_curve(checkpoint: str, store: Storage) -> list[tuple[int, float]]:
    """(samples seen, total loss) of every logged step, from the final checkpoint's metrics history."""
    from training.model.checkpoint import EXTRA_FILE

    path = storage.join(checkpoint, EXTRA_FILE)
    if not store.exists(path):
        return []
    history = store.read_json(path).get("metrics") or []
    return [
        (int(m["samples_seen"]), float(m["loss/total"]))
        for m in history
        if isinstance(m.get("loss/total"), (int, float)) and "samples_seen" in m
    ]


def write_figures(
    cfg: Any, values: dict[str, dict[str, list[float]]], models: dict[str, Any], scorer: dict[str, Any],
    store: Storage,
) -> dict[str, str]:  # fmt: skip
    """``figures/results.png`` and ``figures/loss_curves.png`` under the run; name → path."""
    tasks = sorted({t for v in values.values() for t in v if t != "average"})
    seeds = ", ".join(map(str, cfg.seeds))
    over = f"mean ± sd over seeds {seeds}" if len(cfg.seeds) > 1 else f"seed {seeds}"
    train = f"{cfg.train.loss.name}, {cfg.train.model}, {cfg.train.samples_seen} samples seen"
    title = f"{cfg.output}: each subset's model ({train}; {over})"
    out = {}
    path = storage.join(cfg.output, "figures", "results.png")
    store.write_bytes(_png(results_figure(title, list(cfg.subsets), tasks, values)), path)
    out["results"] = path
    panels = [(f"scorer: {scorer.get('loss', cfg.scorer.loss.name)}, {cfg.scorer.model}, on the unfiltered pool",
               {"scorer": loss_curve(scorer["checkpoint"], store)})]  # fmt: skip
    panels.append(
        (f"subset models: {train}", {n: loss_curve(m["checkpoint"], store) for n, m in models.items()})
    )
    path = storage.join(cfg.output, "figures", "loss_curves.png")
    store.write_bytes(
        _png(loss_figure(f"{cfg.output}: training loss of the scorer and every subset model", panels)), path
    )
    out["loss_curves"] = path
    return out


_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem;
       line-height: 1.45; color: #222; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; display: block; margin: 0.8rem 0; }
code { background: #f4f4f4; padding: 0 0.2rem; }
"""


def html_report(markdown_text: str, output: str, store: Storage, title: str) -> str:
    """``markdown_text`` as one HTML page: images read through ``store`` (paths relative to ``output``)
    and inlined as data URIs; links to the run's other files shown as their paths, not followed."""
    import html

    import markdown

    def inline(m: re.Match[str]) -> str:
        path = (
            m.group(2)
            if "://" in m.group(2) or m.group(2).startswith("/")
            else storage.join(output, m.group(2))
        )
        if not store.exists(path):
            return f"*(figure {m.group(2)} missing)*"
        data = base64.b64encode(store.read_bytes(path)).decode()
        return f"![{m.group(1)}](data:image/png;base64,{data})"

    def link(m: re.Match[str]) -> str:
        where = f"`{m.group(2)}` beside this report"
        return where if m.group(1) == m.group(2) else f"{m.group(1)} ({where})"

    text = _LINK.sub(link, markdown_text)
    body = markdown.markdown(_IMAGE.sub(inline, text), extensions=["tables"], output_format="html")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )
