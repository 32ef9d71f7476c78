"""DataComp's ``text_based`` baseline, and a WordNet-free approximation of it.

- ``text_based``: english AND, for some ``str.split()`` word of the caption, the first WordNet synset
  (nltk's ``synsets(word)[0]``; ``pipeline.filters.wordnet``) has an offset in the ImageNet-21k list — DataComp's
  ``does_contain_text_entity``.
- ``text_based_lemmas`` (``text_based:method=lemmas``): english AND a lemma from a file as whole
  lower-cased words or phrases (``load_concepts``, ``concept_match``): no lemmatisation, no sense choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.filters import base
from pipeline.filters import datacomp as F
from pipeline.filters import wordnet as WN

Table = base.Table


def load_concepts(source: str | list[str] | BinaryIO) -> list[str]:
    """Lemmas from a file (path or binary file) or lines: one per line, or comma-separated synonyms per
    line (ImageNet-21k's ``lemmas`` style); blank lines and ``#`` comments skipped."""
    if isinstance(source, list):
        lines = source
    elif isinstance(source, str):
        with open(source, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    else:
        lines = source.read().decode("utf-8").splitlines()
    out = [t.strip() for line in lines if not line.lstrip().startswith("#") for t in line.split(",")]
    return [t for t in out if t]


def _tokens(text: pa.Array) -> pa.Array:
    """Lower-cased words: runs of letters/digits; '_' '-' and punctuation separate ('hot_dog' = 'hot dog')."""
    norm = pc.replace_substring_regex(pc.utf8_lower(text.cast(pa.string())), r"[^\p{L}\p{N}]+", " ")
    return pc.utf8_split_whitespace(pc.utf8_trim_whitespace(norm))


def concept_match(texts: pa.Array | list[str | None], concepts: list[str]) -> np.ndarray:
    """True where the text contains a concept as a whole word sequence (case-insensitive)."""
    text = texts if isinstance(texts, pa.Array) else pa.array(texts, type=pa.string())
    n = len(text)
    by_len: dict[int, set[str]] = {}
    for toks in _tokens(pa.array(concepts, type=pa.string())).to_pylist():
        toks = [t for t in toks if t]
        if toks:
            by_len.setdefault(len(toks), set()).add(" ".join(toks))
    tokens = _tokens(text)
    flat = pc.list_flatten(tokens)
    parent = pc.list_parent_indices(tokens).to_numpy(zero_copy_only=False)
    hit = np.zeros(n, dtype=bool)
    for size, grams in by_len.items():
        if len(flat) < size:
            continue
        m = len(flat) - size + 1
        same_row = parent[:m] == parent[size - 1 :]
        pieces = [flat.slice(k, m) for k in range(size)]
        joined = pieces[0] if size == 1 else pc.binary_join_element_wise(*pieces, " ")
        found = pc.fill_null(pc.is_in(joined, value_set=pa.array(sorted(grams))), False)
        found = found.to_numpy(zero_copy_only=False) & same_row
        hit[parent[:m][found]] = True
    return hit


def _english_and(
    table: Table, lang: Any, match: Callable[[pa.Array], np.ndarray], why: str
) -> base.FilterResult:
    """english AND ``match`` over the captions; only English rows can pass, so only they are matched."""
    labels = F.language_labels(table, lang, "text_based")
    english_rows = np.flatnonzero(labels == "en")
    hit = np.zeros(len(labels), dtype=bool)
    hit[english_rows] = match(base.table_column(table, S.TEXT, "text_based").take(english_rows))
    return base.from_drops(len(labels), [(labels != "en", "not_english"), (~hit, why)])


def text_based_lemmas(table: Table, concepts: list[str], lang: Any = None) -> base.FilterResult:
    """english AND a concept lemma as whole lower-cased words (``concept_match``): no WordNet needed,
    not DataComp's rule (``text_based:method=lemmas``)."""
    return _english_and(table, lang, lambda text: concept_match(text, concepts), "no_concept_match")


def synset_match(texts: pa.Array | list[str | None], wordnet: WN.WordNet, synset_ids: set[int]) -> np.ndarray:
    """DataComp's ``does_contain_text_entity``: some ``str.split()`` word's first WordNet synset has an
    offset in ``synset_ids`` (``pipeline.filters.wordnet``). Null text → False."""
    text = texts.to_pylist() if isinstance(texts, pa.Array) else list(texts)
    hit: dict[str, bool] = {}

    def word_hits(word: str) -> bool:
        if word not in hit:
            hit[word] = wordnet.first_offset(word) in synset_ids
        return hit[word]

    return np.array([isinstance(t, str) and any(word_hits(w) for w in t.split()) for t in text], dtype=bool)


def text_based(
    table: Table, wordnet: WN.WordNet, synset_ids: set[int], lang: Any = None
) -> base.FilterResult:
    """DataComp's text_based: english AND some word's first WordNet sense is an ImageNet-21k synset."""
    return _english_and(table, lang, lambda text: synset_match(text, wordnet, synset_ids), "no_in21k_synset")
