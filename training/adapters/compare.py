"""One calibration table for every way of getting an uncertainty, on one set of image–caption pairs.

A *method* is a retrieval rule plus a scalar uncertainty per query. Each method is reduced to
``Method(image_u, text_u, correct_i2t, correct_t2i)`` and the shared metrics of ``training/eval/uncertainty/calibration.py``
are computed per direction, binning the queries by their own uncertainty (image queries for i2t, caption
queries for t2i) — except AsymVLM, whose images have no uncertainty: its i2t bins use the uncertainty of
the top-1 retrieved caption (AsymVLM §5; docs/math.md).

Retrieval rules (row i of the eval set is image i with its caption i):
- deterministic CLIP: cosine; ProLIP / PCME++ (their own Σσ²): CSD, i.e. the largest
  ``μ_v·μ_t − ½(Σσ²_v + Σσ²_t)`` (docs/math.md "Zero-shot");
- ProbVLM: the frozen model's cosine — the adapter adds uncertainty and leaves the ranking alone
  (a user keeps the retrieval they had; ProbVLM's ẑ is not trained for retrieval);
- AsymVLM: maximum likelihood ``argmax L(m, n)`` (App. A.2).

Correctness: i2t is right when the top-1 caption is the image's own (same uid) or the identical string
(a demo caption can be shared verbatim by several images and cannot be told apart); t2i is right only when
the top-1 image is the caption's own image (same uid).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from training.adapters.asymvlm import AsymVLM, loglik_matrix, text_distributions
from training.adapters.probvlm import ProbVLM, head_uncertainty
from training.eval.uncertainty.calibration import N_LEVELS, calibration_summary


@dataclass(frozen=True)
class Method:
    """Per-query uncertainties (ascending = more certain) and top-1 correctness, both directions."""

    image_u: np.ndarray  # (n_images,) binning of the i2t queries
    text_u: np.ndarray  # (n_texts,) binning of the t2i queries
    correct_i2t: np.ndarray | None = None  # (n_images,) bool; None → the shared default
    correct_t2i: np.ndarray | None = None  # (n_texts,) bool


def cosine_scores(image_mu: np.ndarray, text_mu: np.ndarray) -> np.ndarray:
    """(n_images, n_texts) cosine similarity of unit vectors."""
    return np.asarray(image_mu, np.float64) @ np.asarray(text_mu, np.float64).T


def csd_scores(
    image_mu: np.ndarray, image_logvar: np.ndarray, text_mu: np.ndarray, text_logvar: np.ndarray
) -> np.ndarray:
    """(n_images, n_texts) ``μ_v·μ_t − ½(Σσ²_v + Σσ²_t)`` = ``1 − CSD/2`` for unit μ (ProLIP Eq. 1)."""
    sv = np.exp(np.asarray(image_logvar, np.float64)).sum(-1)
    st = np.exp(np.asarray(text_logvar, np.float64)).sum(-1)
    return cosine_scores(image_mu, text_mu) - 0.5 * (sv[:, None] + st[None, :])


def retrieval_correct(
    scores: np.ndarray, uids: Sequence[str], texts: Sequence[str] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(correct_i2t (n,), correct_t2i (n,), top-1 caption index per image) from an (images × texts) score
    matrix whose row i and column i are one pair. Ties go to the lowest index (numpy's argmax)."""
    uid = np.asarray(uids)
    top_caption = scores.argmax(axis=1)
    top_image = scores.argmax(axis=0)
    correct_i2t = uid[top_caption] == uid
    if texts is not None:
        t = np.asarray(texts, dtype=object)
        correct_i2t |= t[top_caption] == t
    correct_t2i = uid[top_image] == uid
    return correct_i2t, correct_t2i, top_caption


def native_method(
    image_mu: np.ndarray,
    image_logvar: np.ndarray,
    text_mu: np.ndarray,
    text_logvar: np.ndarray,
    uids: Sequence[str],
    texts: Sequence[str] | None = None,
) -> Method:
    """A probabilistic model's own uncertainty tr(Σ) = Σ_d σ²_d, retrieval by CSD (ProLIP, PCME++)."""
    ci, ct, _ = retrieval_correct(csd_scores(image_mu, image_logvar, text_mu, text_logvar), uids, texts)
    return Method(
        image_u=np.exp(np.asarray(image_logvar, np.float64)).sum(-1),
        text_u=np.exp(np.asarray(text_logvar, np.float64)).sum(-1),
        correct_i2t=ci,
        correct_t2i=ct,
    )


def probvlm_methods(
    model: ProbVLM,
    image_mu: np.ndarray,
    text_mu: np.ndarray,
    uids: Sequence[str],
    texts: Sequence[str] | None = None,
    n_passes: int = 10,
    seed: int = 0,
) -> dict[str, Method]:
    """ProbVLM's aleatoric and total (aleatoric + MC-dropout epistemic) uncertainty; cosine retrieval."""
    ci, ct, _ = retrieval_correct(cosine_scores(image_mu, text_mu), uids, texts)
    ui = head_uncertainty(model.image, torch.tensor(np.asarray(image_mu, np.float32)), n_passes, seed)
    ut = head_uncertainty(model.text, torch.tensor(np.asarray(text_mu, np.float32)), n_passes, seed)
    return {
        "ProbVLM (aleatoric)": Method(ui.aleatoric.numpy(), ut.aleatoric.numpy(), ci, ct),
        "ProbVLM (total)": Method(ui.total.numpy(), ut.total.numpy(), ci, ct),
    }


def asymvlm_method(
    model: AsymVLM,
    image_mu: np.ndarray,
    text_mu: np.ndarray,
    uids: Sequence[str],
    texts: Sequence[str] | None = None,
) -> Method:
    """u = 1/κ per caption; retrieval by max likelihood; i2t binned by the top-1 caption's u."""
    mu, kappa = text_distributions(model, torch.tensor(np.asarray(text_mu, np.float32)))
    with torch.no_grad():
        z = torch.nn.functional.normalize(torch.tensor(np.asarray(image_mu, np.float32)), dim=-1)
        L = loglik_matrix(mu, kappa, z, model.family).double().numpy()  # (texts, images)
    ci, ct, top_caption = retrieval_correct(L.T, uids, texts)
    text_u = 1.0 / kappa.double().numpy()
    return Method(image_u=text_u[top_caption], text_u=text_u, correct_i2t=ci, correct_t2i=ct)


def compare_uncertainty(
    methods: Mapping[str, Method | tuple[np.ndarray, np.ndarray]],
    correct_i2t: np.ndarray | None = None,
    correct_t2i: np.ndarray | None = None,
    n_levels: int = N_LEVELS,
) -> list[dict[str, Any]]:
    """One row per method: R@1, S, R², −S·R² and R@1 per level, for i2t and t2i.

    A method given as a plain ``(image_u, text_u)`` tuple, or a ``Method`` without its own correctness,
    uses the shared ``correct_i2t`` / ``correct_t2i``.
    """
    rows = []
    for name, m in methods.items():
        if not isinstance(m, Method):
            m = Method(np.asarray(m[0]), np.asarray(m[1]))
        row: dict[str, Any] = {"method": name}
        for direction, u, correct in (
            ("i2t", m.image_u, m.correct_i2t if m.correct_i2t is not None else correct_i2t),
            ("t2i", m.text_u, m.correct_t2i if m.correct_t2i is not None else correct_t2i),
        ):
            if correct is None:
                raise ValueError(f"{name}: no {direction} correctness given")
            s = calibration_summary(correct, u, n_levels)
            row[direction] = {k: s[k] for k in ("recall_at_1", "S", "R2", "score", "r1")}
        rows.append(row)
    return rows


def _fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """GitHub markdown: per method R@1, S (↓, ideal −1), R² (↑), −S·R² (↑, ideal 1) for i2t and t2i."""
    head = (
        "| method | i2t R@1 | i2t S ↓ | i2t R² ↑ | i2t −S·R² ↑ | t2i R@1 | t2i S ↓ | t2i R² ↑ | t2i −S·R² ↑ |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        cells = [r["method"]]
        for direction in ("i2t", "t2i"):
            d = r[direction]
            cells += [_fmt(d["recall_at_1"]), _fmt(d["S"]), _fmt(d["R2"]), _fmt(d["score"])]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def none_of_the_above(
    scores: np.ndarray, labels: np.ndarray, candidate_classes: Sequence[int], dummy_column: int
) -> dict[str, float]:
    """AsymVLM §5.4: zero-shot classification where one candidate is a dummy prompt ("a photo").

    ``scores`` (n_images, n_candidates): higher is better; column ``dummy_column`` is the dummy and the
    others are the classes ``candidate_classes`` (in column order, the dummy skipped). Images whose label
    is a candidate are *positives* (seen classes), the rest *negatives* (unseen classes).
    ``pos_acc``: positives given their own class; ``neg_acc``: negatives that pick the dummy;
    ``pos_dummy_rate``: positives that pick the dummy (a false rejection).
    """
    labels = np.asarray(labels)
    cols = [c for c in range(scores.shape[1]) if c != dummy_column]
    col_class = np.full(scores.shape[1], -1)
    col_class[cols] = np.asarray(candidate_classes)
    pred = scores.argmax(axis=1)
    pos = np.isin(labels, np.asarray(candidate_classes))
    chose_dummy = pred == dummy_column
    mean = lambda x: float(x.mean()) if x.size else float("nan")  # noqa: E731
    return {
        "pos_acc": mean(col_class[pred[pos]] == labels[pos]),
        "neg_acc": mean(chose_dummy[~pos]),
        "pos_dummy_rate": mean(chose_dummy[pos]),
        "n_pos": int(pos.sum()),
        "n_neg": int((~pos).sum()),
    }


def nota_scores(
    image_mu: np.ndarray, class_text_mu: np.ndarray, dummy_text_mu: np.ndarray, model: AsymVLM | None = None
) -> np.ndarray:
    """(n_images, n_classes + 1) scores with the dummy prompt last: cosine for the frozen model, the
    log-likelihood ``L(class, image)`` for AsymVLM (the dummy's low κ is what lets it win on unseen images)."""
    texts = np.concatenate(
        [np.asarray(class_text_mu, np.float32), np.asarray(dummy_text_mu, np.float32)[None]]
    )
    if model is None:
        return cosine_scores(image_mu, texts)
    mu, kappa = text_distributions(model, torch.as_tensor(texts))
    with torch.no_grad():
        z = torch.nn.functional.normalize(torch.tensor(np.asarray(image_mu, np.float32)), dim=-1)
        return loglik_matrix(mu, kappa, z, model.family).double().numpy().T


def evaluate_methods(
    data: Mapping[str, np.ndarray],
    *,
    probvlm: ProbVLM | None = None,
    asymvlm: Mapping[str, AsymVLM] | None = None,
    natives: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    n_passes: int = 10,
    seed: int = 0,
    n_levels: int = N_LEVELS,
) -> list[dict[str, Any]]:
    """The comparison rows for one eval set ``data`` (``load_embeddings`` output) and the fitted adapters.

    ``natives`` maps a name to another model's embeddings of (possibly other) eval pairs with logvar
    columns; ``data`` itself is used as a native entry "own Σσ²" when it carries logvar. The frozen
    model's cosine retrieval with no uncertainty is not a row (nothing to bin by)."""
    uids, texts = data["uid"], data["text"]
    methods: dict[str, Method] = {}
    sources = dict(natives or {})
    if "image_logvar" in data and "text_logvar" in data:
        sources = {"own Σσ²": data, **sources}
    for name, emb in sources.items():
        methods[name] = native_method(
            emb["image_mu"], emb["image_logvar"], emb["text_mu"], emb["text_logvar"], emb["uid"], emb["text"]
        )
    if probvlm is not None:
        methods.update(
            probvlm_methods(probvlm, data["image_mu"], data["text_mu"], uids, texts, n_passes, seed)
        )
    for family, model in (asymvlm or {}).items():
        methods[f"AsymVLM ({family})"] = asymvlm_method(model, data["image_mu"], data["text_mu"], uids, texts)
    return compare_uncertainty(methods, n_levels=n_levels)
