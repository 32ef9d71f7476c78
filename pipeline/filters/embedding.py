"""Filters over embeddings alone (no download needed): DataComp's nearest-centroid rule, negCLIPLoss and
NormSim, and the embedding files they read.

**Nearest centroid** (DataComp's ``image_based``; Gadre et al. 2023, §3.4; ``baselines/apply_filter.py``)
clusters the pool's CLIP L/14 image embeddings with k-means (100k centroids at small scale), marks the
centroids nearest to some ImageNet-1k training image as targets, and keeps pool images whose nearest
centroid is a target. "Nearest" is DataComp's: the argmax of the raw dot product of the float32 embedding
with the centroids as given. DataComp's centroids come from plain (L2) k-means and are not unit length, so
this is neither cosine similarity nor Euclidean distance; normalising them would move assignments.

**negCLIPLoss** (Wang, Chen, Hu, Du, "CLIPLoss and Norm-Based Data Selection Methods for Multimodal
Contrastive Learning", NeurIPS 2024, Eq. 1–2): with unit image/text embeddings f_v, f_l, s_ij = ⟨f_v(x_i),
f_l(x_j)⟩ and K random batches B_k ∋ i of size b drawn from the pool,

    negCLIPLoss(i) = (1/K) Σ_k −τ·ℓ_{B_k}(i) = s_ii − (1/K) Σ_k R_{B_k}(i),
    ℓ_B(i) = −½ [ log( e^{s_ii/τ} / Σ_{j∈B} e^{s_ij/τ} ) + log( e^{s_ii/τ} / Σ_{j∈B} e^{s_ji/τ} ) ],
    R_B(i) = (τ/2) [ log Σ_{j∈B} e^{s_ij/τ} + log Σ_{j∈B} e^{s_ji/τ} ],

i.e. the CLIP score minus a normalisation R that is large for pairs similar to many others (the paper's
τ = 0.01, the teacher CLIP's; b = 32,768; K = 10). The batches are drawn by uid within uid ranges of at
least 4·b rows (``neg_clip_batches``; decision 0098), so a task holding one range forms them. Computed
in float64, batch rows in chunks, the column sums carried along (``neg_clip_loss``).

**NormSim** (same paper, Eq. 3): with target embeddings g_1..g_m (the paper's targets: ImageNet-1k train
images, or the downstream tasks' training sets),

    NormSim_p(i) = ‖ (⟨f_v(x_i), g_t⟩)_{t=1..m} ‖_p = ( Σ_t |⟨f_v(x_i), g_t⟩|^p )^{1/p},

p = 2 (computed as √(fᵀ GᵀG f) with the d×d second moment of the targets) or p = ∞ (the best match,
max_t |⟨f, g_t⟩|). The paper keeps the top 30% by negCLIPLoss, then by NormSim (``negclip+normsim``
as a spec of two parts). Both rules keep exactly round(fraction · n) rows among those with embeddings
(ties by uid); rows without are ``missing_embedding``.

Files (local or ``s3://``, read through the run's ``pipeline.common.storage.Storage``; nothing is unpickled):

- embeddings: DataComp's metadata shards, each ``X.parquet`` (with ``uid``) and ``X.npz`` beside it with
  row-aligned arrays (``l14_img``, ``l14_txt``, ``b32_img``, ``b32_txt``) — give the directory or one
  ``.parquet``; or ``.npz`` with arrays ``uid`` (32-hex strings or DataComp ``u8,u8`` pairs) and the named
  arrays (``embedding`` by default); or ``.parquet`` with columns ``uid`` and list-of-float columns (the
  ``image_mu``/``text_mu`` of ``jobs.embed``); or ``X.npy`` (n, d) with the uids in ``X.uid.npy``.
- NormSim targets: ``.npy`` (m, d), or any embeddings file above (its vectors, uids ignored).
- centroids: ``.npy`` (k, d) floats.
- target centroid ids: ``.npy`` of ints, or text with ints separated by newlines, spaces or commas.
"""

from __future__ import annotations

import contextlib
import io
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.common.hashing import splitmix64
from pipeline.common.storage import LOCAL, Storage
from pipeline.filters.base import FilterError, FilterResult, Table, num_rows, table_column
from pipeline.schema import UID_DTYPE, u8pairs_to_uids


@dataclass(frozen=True)
class Embeddings:
    uids: list[str]
    vectors: np.ndarray  # (n, d) float32


def _read(path: str, store: Storage) -> io.BytesIO:
    return io.BytesIO(store.read_bytes(path))


def _npy(path: str, store: Storage) -> np.ndarray:
    return np.load(_read(path, store), allow_pickle=False)


def _uid_strings(arr: np.ndarray) -> list[str]:
    return u8pairs_to_uids(arr) if arr.dtype == UID_DTYPE else [str(u) for u in arr.tolist()]


def load_embeddings(path: str, store: Storage = LOCAL, key: str = "embedding") -> Embeddings:
    """One array of an embeddings file (module docstring), with its uids."""
    uids, arrays = load_embedding_set(path, (key,), store)
    return Embeddings(uids, arrays[key])


def load_embedding_set(path: str, keys: tuple[str, ...], store: Storage = LOCAL) -> tuple[list[str], dict]:
    """uids and the arrays ``keys`` (float32, row-aligned with the uids) of an embeddings file or of a
    directory of DataComp metadata shards (module docstring)."""
    if path.endswith(".npz"):
        with np.load(_read(path, store), allow_pickle=False) as z:
            missing = [k for k in keys if k not in z.files]
            if missing:
                raise ValueError(f"{path}: no array {missing[0]!r} (arrays: {sorted(z.files)})")
            if "uid" not in z.files:
                raise ValueError(f"{path}: no 'uid' array (give the metadata .parquet beside it)")
            return _uid_strings(z["uid"]), {k: np.asarray(z[k], dtype=np.float32) for k in keys}
    if path.endswith(".npy"):
        if len(keys) != 1:
            raise ValueError(f"{path}: a .npy holds one array, {len(keys)} asked for")
        uids = _npy(path[: -len(".npy")] + ".uid.npy", store)
        return _uid_strings(uids), {keys[0]: _npy(path, store).astype(np.float32)}
    files = [path] if path.endswith(".parquet") else store.list_files(path, suffix=".parquet")
    if not files:
        raise ValueError(f"embeddings must be .npz, .parquet, .npy or a directory of shards, got {path}")
    uids: list[str] = []
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for f in files:
        u, arrays = _parquet_embeddings(f, keys, store)
        uids += u
        for k in keys:
            parts[k].append(arrays[k])
    return uids, {k: np.concatenate(v) if v else np.zeros((0, 0), np.float32) for k, v in parts.items()}


def iter_embedding_blocks(
    path: str, keys: tuple[str, ...], store: Storage = LOCAL, rows: int = 1 << 16
) -> Iterator[tuple[list[str], dict]]:
    """``load_embedding_set``'s uids and arrays in blocks of at most ``rows`` rows: a ``.npz`` or ``.npy``
    is read from its stream a block at a time (a block's memory, not the file's); the other layouts
    one metadata shard at a time."""
    if not path.endswith((".npz", ".npy")):
        files = [path] if path.endswith(".parquet") else store.list_files(path, suffix=".parquet")
        for f in files:
            yield _parquet_embeddings(f, keys, store)
        return
    with contextlib.ExitStack() as stack:
        if path.endswith(".npz"):
            z = zipfile.ZipFile(stack.enter_context(store.open_input(path)))
            have = {n[: -len(".npy")] for n in z.namelist() if n.endswith(".npy")}
            missing = [k for k in keys if k not in have]
            if missing:
                raise ValueError(f"{path}: no array {missing[0]!r} (arrays: {sorted(have)})")
            if "uid" not in have:
                raise ValueError(f"{path}: no 'uid' array (give the metadata .parquet beside it)")
            opened = {k: stack.enter_context(z.open(k + ".npy")) for k in ("uid", *keys)}
        else:
            if len(keys) != 1:
                raise ValueError(f"{path}: a .npy holds one array, {len(keys)} asked for")
            uid_path = path[: -len(".npy")] + ".uid.npy"
            opened = {"uid": stack.enter_context(store.open_input(uid_path)),
                      keys[0]: stack.enter_context(store.open_input(path))}  # fmt: skip
        arrays = {k: _NpyStream(fh, f"{path}:{k}") for k, fh in opened.items()}
        n = arrays["uid"].shape[0]
        bad = [k for k in keys if arrays[k].shape[0] != n]
        if bad:
            raise ValueError(f"{path}: {arrays[bad[0]].shape[0]} rows of {bad[0]!r} for {n} uids")
        for _ in range(0, n, rows):
            uids = _uid_strings(arrays["uid"].read(rows))
            yield uids, {k: arrays[k].read(rows).astype(np.float32) for k in keys}


class _NpyStream:
    """A ``.npy`` read from a stream a block of rows at a time (C order, no objects)."""

    def __init__(self, fh, name: str) -> None:
        fmt = np.lib.format
        header = fmt.read_array_header_1_0 if fmt.read_magic(fh) == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = header(fh)
        if fortran or dtype.hasobject:
            raise ValueError(f"{name}: a C-ordered array of plain values is needed")
        self.fh, self.shape, self.dtype = fh, shape, dtype
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize

    def read(self, rows: int) -> np.ndarray:
        data = self.fh.read(rows * self.row_bytes)
        return np.frombuffer(data, self.dtype).reshape(-1, *self.shape[1:])


def _parquet_embeddings(path: str, keys: tuple[str, ...], store: Storage) -> tuple[list[str], dict]:
    """A parquet holding the ``keys`` as list columns, or a DataComp metadata shard with its ``.npz``."""
    t = pq.read_table(_read(path, store))
    uids = [str(u) for u in t.column("uid").to_pylist()]
    if all(k in t.column_names for k in keys):
        out = {}
        for k in keys:
            values = pc.list_flatten(t.column(k).combine_chunks()).to_numpy(zero_copy_only=False)
            out[k] = values.astype(np.float32).reshape(t.num_rows, -1) if t.num_rows else np.zeros((0, 0))
        return uids, out
    npz = path[: -len(".parquet")] + ".npz"
    if not store.exists(npz):
        raise ValueError(f"{path}: no columns {list(keys)} and no {npz} beside it")
    with np.load(_read(npz, store), allow_pickle=False) as z:
        missing = [k for k in keys if k not in z.files]
        if missing:
            raise ValueError(f"{npz}: no array {missing[0]!r} (arrays: {sorted(z.files)})")
        out = {k: np.asarray(z[k], dtype=np.float32) for k in keys}
    bad = [k for k in keys if len(out[k]) != len(uids)]
    if bad:
        raise ValueError(f"{npz}: {len(out[bad[0]])} rows of {bad[0]!r} for {len(uids)} rows of {path}")
    return uids, out


def load_targets(path: str, store: Storage = LOCAL, key: str = "embedding") -> np.ndarray:
    """NormSim's target embeddings (m, d): a plain ``.npy``, or the vectors of any embeddings file."""
    if path.endswith(".npy") and not store.exists(path[: -len(".npy")] + ".uid.npy"):
        targets = _npy(path, store)
        if targets.ndim != 2:
            raise ValueError(f"{path}: targets must be an (m, d) array, got shape {targets.shape}")
        return targets.astype(np.float32)
    return load_embeddings(path, store, key).vectors


def aligned(table: Table, emb: Embeddings, filt: str) -> tuple[np.ndarray, np.ndarray]:
    """(present mask over the table's rows, their positions in ``emb``) by uid."""
    idx = pc.index_in(table_column(table, S.UID, filt).cast(pa.string()), value_set=pa.array(emb.uids))
    present = idx.is_valid().to_numpy(zero_copy_only=False)
    return present, pc.fill_null(idx, 0).to_numpy(zero_copy_only=False)[present]


def load_centroids(path: str, store: Storage = LOCAL) -> np.ndarray:
    centroids = _npy(path, store)
    if centroids.ndim != 2:
        raise ValueError(f"{path}: centroids must be a (k, d) array, got shape {centroids.shape}")
    return centroids.astype(np.float32)


def load_centroid_ids(path: str, store: Storage = LOCAL) -> np.ndarray:
    data = _read(path, store)
    if path.endswith(".npy"):
        return np.load(data, allow_pickle=False).astype(np.int64).ravel()
    return np.array([int(t) for t in data.read().decode().replace(",", " ").split()], dtype=np.int64)


def nearest_centroid(vectors: np.ndarray, centroids: np.ndarray, batch_size: int = 65536) -> np.ndarray:
    """Per row, the index of the centroid with the largest raw float32 dot product (first on a tie), in
    batches to bound the (B, k) score matrix."""
    c = np.asarray(centroids, dtype=np.float32)
    out = np.empty(len(vectors), dtype=np.int64)
    for a in range(0, len(vectors), batch_size):
        rows = np.asarray(vectors[a : a + batch_size], dtype=np.float32)
        out[a : a + batch_size] = np.argmax(rows @ c.T, axis=1)  # (B, k)
    return out


def target_centroid_ids(target_vectors: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """DataComp's target set: the centroids nearest to some target embedding (ImageNet-1k train images)."""
    return np.unique(nearest_centroid(target_vectors, centroids))


# --- negCLIPLoss and NormSim -------------------------------------------------------------------------

_ROWS = 1024  # batch rows per chunk: a (1024, b) float64 block, 268 MB at b = 32,768


def _unit64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


def _log_sum_ratio(m: np.ndarray, off: np.ndarray) -> np.ndarray:
    """log(e^{−m} + off) + m with off = Σ_{j≠i} e^{d_j − m}, m ≥ 0: log1p where m = 0, so a pair that
    dominates its batch (the sum barely above 1) keeps its relative precision."""
    return np.where(m == 0, np.log1p(off), m + np.log(np.exp(-m) + off))


def _batch_log_ratios(v: np.ndarray, t: np.ndarray, tau: float) -> np.ndarray:
    """ρ_row(i) + ρ_col(i) for one batch, ρ_row(i) = log Σ_j e^{(s_ij − s_ii)/τ} (and over j of s_ji):
    −½ρ is each direction's log-softmax of the matched pair. Rows in chunks, column sums carried along."""
    b = len(v)
    diag = np.einsum("ij,ij->i", v, t) / tau
    row = np.empty(b)
    col_max, col_off = np.zeros(b), np.zeros(b)
    for a in range(0, b, _ROWS):
        z = (v[a : a + _ROWS] @ t.T) / tau  # (c, b)
        c = len(z)
        own = (np.arange(c), a + np.arange(c))
        d = z - diag[a : a + c, None]
        d[own] = -np.inf
        m = np.maximum(d.max(axis=1), 0.0)
        row[a : a + c] = _log_sum_ratio(m, np.exp(d - m[:, None]).sum(axis=1))
        d = z - diag[None, :]
        d[own] = -np.inf
        new_max = np.maximum(col_max, d.max(axis=0))
        col_off = col_off * np.exp(col_max - new_max) + np.exp(d - new_max).sum(axis=0)
        col_max = new_max
    return row + _log_sum_ratio(col_max, col_off)


GROUP_BATCHES = 4  # a group holds at least this many batches' rows: each task's memory, not the pool's


def neg_clip_groups(n_rows: int, batch_size: int) -> int:
    """How many uid ranges a pool of ``n_rows`` draws its batches within: each holds ≥ 4 batches' rows."""
    return max(1, n_rows // (GROUP_BATCHES * batch_size))


def neg_clip_group_of(uids: np.ndarray, groups: int) -> np.ndarray:
    """The range, of ``groups`` equal ranges of the uid's high 64 bits, each ``u8,u8`` uid falls in
    (``stages.buckets.range_bucket``'s arithmetic)."""
    if groups <= 1:
        return np.zeros(len(uids), np.int64)
    step = np.uint64(((1 << 64) + groups - 1) // groups)
    return (np.asarray(uids["f0"], np.uint64) // step).astype(np.int64)


def neg_clip_batches(uids: np.ndarray, batch_size: int, seed: int, k: int) -> list[np.ndarray]:
    """Round ``k``'s batches of one group's rows (``u8,u8`` uids): the rows in ascending (hash of seed, k
    and uid; uid) cut into ⌈n / batch_size⌉ consecutive batches of near-equal size. A pure function of
    the rows' uids, so a task holding a group forms the batches one process holding the pool forms."""
    n = len(uids)
    if n == 0:
        return []
    hi, lo = np.asarray(uids["f0"], np.uint64), np.asarray(uids["f1"], np.uint64)
    salt = splitmix64(np.array([seed % (1 << 64), k + 1], np.uint64))
    key = splitmix64(splitmix64(hi ^ salt[0]) ^ lo ^ salt[1])
    order = np.lexsort((lo, hi, key))
    return np.array_split(order, -(-n // batch_size))


def neg_clip_loss_scores(
    image: np.ndarray,
    text: np.ndarray,
    uids: np.ndarray,
    tau: float = 0.01,
    batch_size: int = 32768,
    batches: int = 10,
    seed: int = 0,
    groups: int = 1,
) -> np.ndarray:
    """negCLIPLoss of every row (module docstring) in float64, as −τ/2 · (ρ_row + ρ_col) averaged over
    ``batches`` rounds of random batches of at most ``batch_size`` rows drawn within each of ``groups``
    uid ranges (``neg_clip_batches`` over ``u8,u8`` ``uids``; decision 0098); equal to s_ii − R but
    without its cancellation when the pair dominates its batch."""
    total = np.zeros(len(image))
    group = neg_clip_group_of(uids, groups)
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        for k in range(batches):
            for part in neg_clip_batches(uids[members], batch_size, seed, k):
                rows = members[part]
                total[rows] += _batch_log_ratios(_unit64(image[rows]), _unit64(text[rows]), tau)
    return -0.5 * tau * total / max(batches, 1)


def norm_sim_scores(image: np.ndarray, targets: np.ndarray, p: float = 2.0, block: int = 65536) -> np.ndarray:
    """NormSim_p of every row against the target embeddings (module docstring), float64."""
    v, g = _unit64(image), _unit64(targets)
    if p == 2:
        second = g.T @ g  # (d, d): Σ_t g_t g_tᵀ
        return np.sqrt(np.maximum(np.einsum("ij,ij->i", v @ second, v), 0.0))
    out = np.empty(len(v))
    for a in range(0, len(v), block):
        s = np.abs(v[a : a + block] @ g.T)  # (B, m)
        out[a : a + block] = s.max(axis=1) if math.isinf(p) else (s**p).sum(axis=1) ** (1.0 / p)
    return out


def top_fraction(
    table: Table, score: np.ndarray, present: np.ndarray, fraction: float, why: str
) -> FilterResult:
    """Keep the round(fraction · n_present) rows with the largest ``score`` (ties by uid); the others are
    ``why`` and the rows without embeddings ``missing_embedding``."""
    n = num_rows(table)
    uids = table_column(table, S.UID, why).cast(pa.string()).to_numpy(zero_copy_only=False).astype(str)
    reason = np.full(n, "", dtype=object)
    reason[~present] = "missing_embedding"
    rows = np.flatnonzero(present)
    order = rows[np.lexsort((uids[rows], -score[rows]))]
    n_keep = int(math.floor(fraction * len(rows) + 0.5))
    reason[order[n_keep:]] = why
    return FilterResult(reason == "", reason)


def neg_clip_loss(
    table: Table, emb: tuple[Embeddings, Embeddings], fraction: float = 0.3, **params: float
) -> FilterResult:
    """The top ``fraction`` by negCLIPLoss; ``emb`` = (image, text) embeddings keyed by uid."""
    image, text = emb
    if image.uids != text.uids:
        raise FilterError("filter 'neg_clip_loss': image and text embeddings list different uids")
    present, at = aligned(table, image, "neg_clip_loss")
    valid = np.array([S.is_valid_uid(image.uids[i]) for i in at], dtype=bool)  # batches are drawn by uid
    present[np.flatnonzero(present)[~valid]] = False
    first, inverse = np.unique(at[valid], return_inverse=True)  # a uid's rows share its one score
    uids = S.uids_to_u8pairs([image.uids[i] for i in first])
    groups = neg_clip_groups(num_rows(table), int(params.get("batch_size", 32768)))
    score = np.full(num_rows(table), np.nan)
    scores = neg_clip_loss_scores(image.vectors[first], text.vectors[first], uids, groups=groups, **params)
    score[present] = scores[inverse]
    return top_fraction(table, score, present, fraction, f"neg_clip_loss_not_in_top_{100 * fraction:g}%")


def norm_sim(
    table: Table, emb: Embeddings, targets: np.ndarray, fraction: float = 0.3, p: float = 2.0
) -> FilterResult:
    """The top ``fraction`` by NormSim_p against ``targets``."""
    present, at = aligned(table, emb, "norm_sim")
    score = np.full(num_rows(table), np.nan)
    score[present] = norm_sim_scores(emb.vectors[at], targets, p)
    return top_fraction(table, score, present, fraction, f"norm_sim_not_in_top_{100 * fraction:g}%")
