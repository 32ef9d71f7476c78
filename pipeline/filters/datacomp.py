"""DataComp's baseline filters as pure mask functions with drop reasons (``pipeline.filters.base``).

Filters never drop rows: each returns ``FilterResult(keep, reason)`` over the rows of a metadata table
(a ``pyarrow.Table`` or a dict of arrays), reason "" where kept; the score filters
(``pipeline.filters.scores``) return the same type, and ``pipeline.filters.specs`` holds the one registry and
spec syntax that the build, the filter job and the track run them through. Rules follow DataComp's baselines code
(``baselines/apply_filter.py``) and paper (Gadre et al. 2023, §3.4, App. G):

- ``english``: fastText lid.176 top-1 label == "en", no threshold (``pipeline.filters.language``).
- ``basic``: english AND caption > 2 whitespace words AND > 5 characters AND min(original w, h) ≥ 200
  AND max/min ≤ 3.0, on the metadata sizes.
- ``text_based`` (``pipeline.filters.text_based``): english AND, for some ``str.split()`` word, the first
  WordNet synset (nltk's ``synsets(word)[0]``, ``pipeline.filters.wordnet``) is an ImageNet-21k synset.
- ``clip_score``: score ≥ threshold, compared in the column's float type; for a fraction, the threshold
  is DataComp's ``get_threshold``: the ``int(N·f)``-th largest score over *all* N rows (nulls count in N
  and sort last; a cut among them keeps nothing).
- ``laion2b``: B/32 score ≥ 0.28 AND english by the language model given (DataComp: CLD3).
- ``image_based``: DataComp's caption pre-filter (english, > 1 fastText token, > 5 chars) AND the
  pool centroid with the largest dot product lies in the target set (``pipeline.filters.embedding``).
- ``random``: exactly round(f·n) rows, the ones with the smallest hash of (seed, uid).

The embedding, centroid and target-id file formats for ``image_based`` are in ``pipeline.filters.embedding``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.common.hashing import splitmix64
from pipeline.filters import embedding as C
from pipeline.filters.base import (
    LANG,
    FilterError,
    FilterResult,
    Table,
    float_column,
    from_drops,
    intersect,
    num_rows,
    table_column,
)


def language_labels(table: Table, lang: Any, filt: str) -> np.ndarray:
    """fastText labels per row: the ``lang`` argument (labels, or a LanguageId), else a ``lang`` column."""
    if lang is None:
        names = table.column_names if isinstance(table, pa.Table) else list(table)
        if LANG not in names:
            raise FilterError(
                f"filter {filt!r} needs language labels: a {LANG!r} column or lang= (labels or a LanguageId)"
            )
        labels = table_column(table, LANG, filt)
    elif callable(lang):
        labels = list(lang(table_column(table, S.TEXT, filt))[0])
    elif isinstance(lang, (pa.Array, pa.ChunkedArray)):
        labels = lang
    else:
        labels = [None if v is None else str(v) for v in lang]
    if len(labels) != num_rows(table):
        raise FilterError(f"filter {filt!r}: {len(labels)} language labels for {num_rows(table)} rows")
    if isinstance(labels, pa.ChunkedArray):
        labels = labels.combine_chunks()
    labels = labels.cast(pa.string()) if isinstance(labels, pa.Array) else pa.array(labels, pa.string())
    return pc.fill_null(labels, "").to_numpy(zero_copy_only=False)


def _words_and_chars(table: Table, filt: str) -> tuple[np.ndarray, np.ndarray]:
    """Python ``len(text.split())`` and ``len(text)`` (DataComp's counts), vectorised; null text → 0, 0."""
    text = table_column(table, S.TEXT, filt).cast(pa.string())
    trimmed = pc.utf8_trim_whitespace(text)
    words = pc.list_value_length(pc.utf8_split_whitespace(trimmed))
    words = pc.if_else(pc.equal(trimmed, ""), 0, words)
    words = pc.fill_null(words, 0).to_numpy(zero_copy_only=False)
    chars = pc.fill_null(pc.utf8_length(text), 0).to_numpy(zero_copy_only=False)
    return words, chars


# fastText's word separators (Dictionary::readWord): only these ASCII bytes; each newline is also a token.
_FASTTEXT_WORD = r"[^ \n\r\t\x0b\x0c\x00]+"


def fasttext_token_counts(texts: pa.Array | list[str | None]) -> np.ndarray:
    """``len(fasttext.tokenize(text))`` per row, vectorised: runs of bytes other than space, \\n, \\r,
    \\t, \\v, \\f and NUL, plus one end-of-line token per "\\n" (so "a\\nb" is 3 tokens and a
    non-ASCII space such as U+00A0 joins words). Null text → 0."""
    text = texts if isinstance(texts, pa.Array) else pa.array(texts, type=pa.string())
    text = text.cast(pa.string())
    runs = pc.count_substring_regex(text, _FASTTEXT_WORD)
    newlines = pc.count_substring(text, "\n")
    return pc.fill_null(pc.add(runs, newlines), 0).to_numpy(zero_copy_only=False).astype(np.int64)


# --- the rules ----------------------------------------------------------------------------------------


def no_filter(table: Table) -> FilterResult:
    return from_drops(num_rows(table), [])


def _byte_words(strings: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(n, w) uint64 view of each string's UTF-8 bytes, zero-padded, and the byte lengths. Copy-free
    when all lengths match (32-hex uids): no Python object per row."""
    strings = pc.fill_null(strings.cast(pa.string()), "")
    n = len(strings)
    lengths = pc.binary_length(strings).to_numpy(zero_copy_only=False).astype(np.int64)
    width = int(lengths.max()) if n else 0
    if n and (lengths == width).all():
        offsets = np.frombuffer(strings.buffers()[1], np.int32)[strings.offset : strings.offset + n + 1]
        rows = np.frombuffer(strings.buffers()[2], np.uint8)[offsets[0] : offsets[0] + n * width]
        rows = rows.reshape(n, width)
    else:
        rows = np.array([v.encode() for v in strings.to_pylist()], dtype=f"S{max(width, 1)}")
        rows = rows.view(np.uint8).reshape(n, -1)
    padded = np.zeros((n, -(-max(rows.shape[1], 1) // 8) * 8), dtype=np.uint8)
    padded[:, : rows.shape[1]] = rows
    return padded.view(np.uint64), lengths


def uid_hash(uids: pa.Array | list[str | None], seed: int) -> np.ndarray:
    """A 64-bit hash of each uid string and ``seed`` (splitmix64 over its bytes), vectorised; depends on
    the string alone, not on the other rows. Null hashes like ""."""
    words, lengths = _byte_words(uids if isinstance(uids, pa.Array) else pa.array(uids, pa.string()))
    h = splitmix64(np.uint64(seed % (1 << 64)) ^ lengths.astype(np.uint64))
    for k in range(words.shape[1]):
        h = np.where(lengths > 8 * k, splitmix64(h ^ words[:, k]), h)
    return h


def random_count(fraction: float, n: int) -> int:
    """How many of ``n`` rows the random baseline keeps: ``round(fraction·n)``, halves up."""
    return int(np.floor(fraction * n + 0.5))


def random_order(uids: pa.Array, seed: int) -> np.ndarray:
    """Rows by (hash of seed and uid, uid bytes): the random baseline keeps a prefix of this order."""
    key = uid_hash(uids, seed)
    order = np.argsort(key, kind="stable")
    if len(key) > 1 and (key[order][1:] == key[order][:-1]).any():  # a 64-bit tie: break it by the uid bytes
        words = _byte_words(uids)[0]
        order = np.lexsort([words[:, c] for c in reversed(range(words.shape[1]))] + [key])
    return order


def random_subset(table: Table, fraction: float, seed: int) -> FilterResult:
    """Exactly ``round(fraction·n)`` rows, chosen by the smallest hash of (seed, uid): the same uids
    whatever the row order, and nested as the fraction grows."""
    if not 0.0 <= fraction <= 1.0:
        raise FilterError(f"filter 'random': fraction must be in [0, 1], got {fraction}")
    uids = table_column(table, S.UID, "random")
    n = len(uids)
    k = random_count(fraction, n)
    order = random_order(uids, seed)
    chosen = np.zeros(n, dtype=bool)
    chosen[order[:k]] = True
    return from_drops(n, [(~chosen, "random_not_selected")])


def english(table: Table, lang: Any = None) -> FilterResult:
    labels = language_labels(table, lang, "english")
    return from_drops(len(labels), [(labels != "en", "not_english")])


def basic(table: Table, lang: Any = None) -> FilterResult:
    labels = language_labels(table, lang, "basic")
    words, chars = _words_and_chars(table, "basic")
    w = float_column(table, S.ORIGINAL_WIDTH, "basic")
    h = float_column(table, S.ORIGINAL_HEIGHT, "basic")
    short, long = np.fmin(w, h), np.fmax(w, h)
    with np.errstate(divide="ignore", invalid="ignore"):
        aspect = long / short
    missing = np.isnan(w) | np.isnan(h)
    return from_drops(
        len(labels),
        [
            (labels != "en", "not_english"),
            (words <= 2, "too_few_words"),
            (chars <= 5, "too_short"),
            (missing, "missing_size"),
            (~(short >= 200), "too_small"),
            (~(aspect <= 3.0), "too_elongated"),
        ],
    )


def column_threshold(table: Table, column: str, threshold: float, filt: str) -> float:
    """``threshold`` as the column's own float type holds it: DataComp compares ``df[key] >= t`` in the
    column's dtype (a float32 column against float32(t)), so a row equal to float32(t) is kept even where
    float32(t) < t. Returned as a float64 that compares with the widened column exactly as that does."""
    typ = table_column(table, column, filt).type
    if pa.types.is_floating(typ) and typ.bit_width < 64:
        return float(np.asarray(threshold, dtype=typ.to_pandas_dtype()))
    return float(threshold)


def clip_score_threshold(
    table: Table, column: str, threshold: float, filt: str = "clip_score"
) -> FilterResult:
    s = float_column(table, column, filt)
    t = column_threshold(table, column, threshold, filt)
    below = "clip_score_cut_among_missing" if np.isnan(t) else "clip_score_below_threshold"
    return from_drops(len(s), [(np.isnan(s), "missing_clip_score"), (~(s >= t), below)])


NAN_CUTS = ("datacomp", "all_scored")


def clip_fraction_threshold(scores: np.ndarray, fraction: float, nan_cut: str = "datacomp") -> float:
    """DataComp's ``get_threshold``: the ``int(N·fraction)``-th largest score (0-based), N = all rows
    incl. nulls, which sort last. ``≥`` it keeps that many rows plus one, plus ties, as DataComp does.

    When the index lands among the nulls DataComp's threshold is NaN and it keeps no row: ``nan_cut=
    "datacomp"`` returns NaN; ``"all_scored"`` returns the smallest score instead (every scored row
    kept). An index past the end (fraction 1, or no rows) is where DataComp's code fails: FilterError.
    """
    if not 0.0 <= fraction <= 1.0:
        raise FilterError(f"filter 'clip_score': fraction must be in [0, 1], got {fraction}")
    if nan_cut not in NAN_CUTS:
        raise FilterError(f"filter 'clip_score': nan_cut must be one of {NAN_CUTS}, got {nan_cut!r}")
    scores = np.asarray(scores, dtype=np.float64)
    k = int(len(scores) * fraction)
    if k >= len(scores):
        raise FilterError(
            f"filter 'clip_score': fraction={fraction} over {len(scores)} rows asks for score number "
            f"{k + 1} of {len(scores)}; DataComp's rule has no threshold there (use no_filter to keep all)"
        )
    valid = np.sort(scores[~np.isnan(scores)])[::-1]
    if k < len(valid):
        return float(valid[k])
    if nan_cut == "datacomp" or len(valid) == 0:
        return float("nan")
    return float(valid[-1])


def clip_score_fraction(
    table: Table,
    column: str,
    fraction: float,
    pool_scores: np.ndarray | None = None,
    nan_cut: str = "datacomp",
) -> FilterResult:
    """Top ``fraction`` by score; the threshold comes from ``pool_scores`` (all metadata rows) when the
    table is only part of the pool, else from the table itself."""
    scores = float_column(table, column, "clip_score") if pool_scores is None else pool_scores
    return clip_score_threshold(table, column, clip_fraction_threshold(scores, fraction, nan_cut))


def laion2b(table: Table, threshold: float, lang: Any = None) -> FilterResult:
    return intersect(english(table, lang), clip_score_threshold(table, S.CLIP_B32, threshold, "laion2b"))


# --- image-based (nearest centroid) -------------------------------------------------------------------


def centroid_membership(
    table: Table, embeddings: C.Embeddings | np.ndarray, centroids: np.ndarray, target_ids: np.ndarray
) -> FilterResult:
    n = num_rows(table)
    if isinstance(embeddings, C.Embeddings):
        idx = pc.index_in(
            table_column(table, S.UID, "image_based").cast(pa.string()), value_set=pa.array(embeddings.uids)
        )
        present = idx.is_valid().to_numpy(zero_copy_only=False)
        rows = embeddings.vectors[pc.fill_null(idx, 0).to_numpy(zero_copy_only=False)[present]]
    else:
        if len(embeddings) != n:
            raise FilterError(f"filter 'image_based': {len(embeddings)} embeddings for {n} rows")
        present, rows = np.ones(n, dtype=bool), np.asarray(embeddings)
    inside = np.zeros(n, dtype=bool)
    inside[present] = np.isin(C.nearest_centroid(rows, np.asarray(centroids, np.float32)), target_ids)
    return from_drops(n, [(~present, "missing_embedding"), (~inside, "not_in_centroid")])


def image_based(
    table: Table,
    embeddings: C.Embeddings | np.ndarray,
    centroids: np.ndarray,
    target_ids: np.ndarray,
    lang: Any = None,
) -> FilterResult:
    return intersect(
        image_caption(table, lang), centroid_membership(table, embeddings, centroids, target_ids)
    )


def image_caption(table: Table, lang: Any = None) -> FilterResult:
    """The caption half of ``image_based`` (DataComp's ``caption_filter``): English, two words, six chars."""
    labels = language_labels(table, lang, "image_based")
    text = table_column(table, S.TEXT, "image_based")
    words = fasttext_token_counts(text)  # DataComp's caption_filter counts with fasttext.tokenize
    chars = pc.fill_null(pc.utf8_length(text.cast(pa.string())), 0).to_numpy(zero_copy_only=False)
    return from_drops(
        len(labels),
        [(labels != "en", "not_english"), (words <= 1, "too_few_words"), (chars <= 5, "too_short")],
    )
