"""Nearest-centroid assignment and the files behind DataComp's image-based filter.

DataComp's ``image_based`` baseline (Gadre et al. 2023, §3.4; ``baselines/apply_filter.py``) clusters the
pool's CLIP L/14 image embeddings with k-means (100k centroids at small scale), marks the centroids nearest
to some ImageNet-1k training image as targets, and keeps pool images whose nearest centroid is a target.
"Nearest" is DataComp's: the argmax of the raw dot product of the float32 embedding with the centroids as
given. DataComp's centroids come from plain (L2) k-means and are not unit length, so this is neither
cosine similarity nor Euclidean distance; normalising them would move assignments.

Files (local or ``s3://``, read through the run's ``pipeline.common.storage.Storage``; nothing is unpickled):

- embeddings: ``.npz`` with arrays ``uid`` (32-hex strings or DataComp ``u8,u8`` pairs) and
  ``embedding`` (n, d); or ``.parquet`` with columns ``uid`` (string) and ``embedding`` (list of floats);
  or ``X.npy`` (n, d) with the uids in ``X.uid.npy`` beside it (same two uid encodings).
- centroids: ``.npy`` (k, d) floats.
- target centroid ids: ``.npy`` of ints, or text with ints separated by newlines, spaces or commas.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.common.storage import LOCAL, Storage
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


def load_embeddings(path: str, store: Storage = LOCAL) -> Embeddings:
    if path.endswith(".npz"):
        with np.load(_read(path, store), allow_pickle=False) as z:
            return Embeddings(_uid_strings(z["uid"]), np.asarray(z["embedding"], dtype=np.float32))
    if path.endswith(".parquet"):
        t = pq.read_table(_read(path, store), columns=["uid", "embedding"])
        values = pc.list_flatten(t.column("embedding").combine_chunks()).to_numpy(zero_copy_only=False)
        vectors = values.astype(np.float32).reshape(t.num_rows, -1) if t.num_rows else np.zeros((0, 0))
        return Embeddings(t.column("uid").to_pylist(), vectors)
    if path.endswith(".npy"):
        uids = _npy(path[: -len(".npy")] + ".uid.npy", store)
        return Embeddings(_uid_strings(uids), _npy(path, store).astype(np.float32))
    raise ValueError(f"embeddings must be .npz, .parquet or .npy, got {path}")


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
