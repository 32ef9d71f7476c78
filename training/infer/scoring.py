"""Scoring pool pairs with a trained checkpoint (CSD / cosine per uid) and embedding extraction: the
per-use post-processing of the one batch encoder (``training.infer.encode.Encoder``). No Ray here: the Ray
builders (``score_shards``, ``embed_shards``) are in training/infer/batch_inference.py.

- ``pair_scores(mu_v, logvar_v, mu_t, logvar_t)``: the per-pair numbers, in float64 —
  ``dot`` = μ_v·μ_t, ``image_unc`` = Σ_d σ²_v,d, ``text_unc`` = Σ_d σ²_t,d (tr Σ, the uncertainty of an
  input in ProLIP), ``csd`` = ‖μ_v − μ_t‖² + Σ_d (σ²_v,d + σ²_t,d) (ProLIP Eq. 1; = 2 − 2·dot + image_unc
  + text_unc for unit μ), ``cosine`` = dot / (‖μ_v‖‖μ_t‖) (DataComp's "CLIP score"). Deterministic
  models have no σ²: uncertainties are NaN and csd = ‖μ_v − μ_t‖² = 2 − 2·cosine. ``inclusion`` =
  H(Z_v ⊂ Z_t), ProLIP's inclusion hypothesis (Eq. 4, > 0 when the image is included in its caption;
  ``training.losses.inclusion.inclusion_hypothesis`` with ε = 1); ``csd_std`` = the standard deviation of
  ‖z_v − z_t‖² for z_v ~ Z_v, z_t ~ Z_t, whose mean is CSD: √(Σ_d 2 s_d² + 4 m_d² s_d) with m = μ_v − μ_t,
  s = σ²_v + σ²_t (a Gaussian's squared norm). Both NaN for deterministic models.
- ``score_columns``: an encoded ``{uid | key | __key__ [+ json], jpg, txt}`` batch → ``SCORE_COLUMNS``
  (``Encoder(checkpoint, output=score_columns)`` is the scoring stage). ``text_len`` counts the
  caption's tokens after truncation to the context, special tokens excluded. An image that does not
  decode gives ``ok = False`` and NaN scores; it never raises.
- ``embedding_columns``: the same input → ``EMBED_COLUMNS`` (μ and log σ² per tower), the frozen
  embeddings the post-hoc adapters (ProbVLM, AsymVLM) train on. Deterministic checkpoints write no
  logvar columns.

The uid of a sample is its ``.json`` ``uid`` (img2dataset/DataComp shards key samples by position), else
its key.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from training.infer.encode import as_text, localize_checkpoint
from training.model.checkpoint import load_checkpoint
from training.model.config import ModelConfig

SCORE_COLUMNS = (
    "uid", "ok", "dot", "image_unc", "text_unc", "csd", "cosine", "inclusion", "csd_std", "text_len",
)  # fmt: skip
_FLOATS = SCORE_COLUMNS[2:9]
EMBED_COLUMNS = ("uid", "ok", "text", "image_mu", "text_mu", "image_logvar", "text_logvar")


# --- pure pieces --------------------------------------------------------------------------------------


def pair_scores(
    mu_v: np.ndarray, logvar_v: np.ndarray | None, mu_t: np.ndarray, logvar_t: np.ndarray | None
) -> dict[str, np.ndarray]:
    """Per-row dot, cosine, Σσ² per tower and CSD (Eq. 1), computed in float64; shapes (n, D) → (n,)."""
    mv, mt = np.asarray(mu_v, np.float64), np.asarray(mu_t, np.float64)
    dot = (mv * mt).sum(-1)
    norms = np.linalg.norm(mv, axis=-1) * np.linalg.norm(mt, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = dot / norms
    dist = np.square(mv - mt).sum(-1)
    if logvar_v is None or logvar_t is None:
        nan = np.full(len(dot), np.nan)
        unc = {name: nan.copy() for name in ("image_unc", "text_unc", "inclusion", "csd_std")}
        return {"dot": dot, "csd": dist, "cosine": cosine, **unc}
    lv, lt = np.asarray(logvar_v, np.float64), np.asarray(logvar_t, np.float64)
    var_v, var_t = np.exp(lv), np.exp(lt)
    image_unc, text_unc = var_v.sum(-1), var_t.sum(-1)
    s = var_v + var_t
    spread = np.sqrt((2 * s * s + 4 * np.square(mv - mt) * s).sum(-1))
    return {
        "dot": dot,
        "image_unc": image_unc,
        "text_unc": text_unc,
        "csd": dist + image_unc + text_unc,
        "cosine": cosine,
        "inclusion": _inclusion(mv, lv, mt, lt),
        "csd_std": spread,
    }


def _inclusion(mu_v: np.ndarray, logvar_v: np.ndarray, mu_t: np.ndarray, logvar_t: np.ndarray) -> np.ndarray:
    """H(Z_v ⊂ Z_t) per row in float64, through the loss module's one implementation of Eq. 4."""
    import torch

    from training.losses.inclusion import inclusion_hypothesis

    args = [torch.from_numpy(np.ascontiguousarray(a, np.float64)) for a in (mu_v, logvar_v, mu_t, logvar_t)]
    with torch.no_grad():
        return inclusion_hypothesis(*args).double().numpy()


def sample_uid(key: str, meta: Any) -> str:
    """The json's ``uid`` when it is a 32-hex uid, else the key (lower-cased when it is a uid)."""
    if isinstance(meta, (bytes, bytearray, memoryview, str)):
        try:
            meta = json.loads(bytes(meta) if not isinstance(meta, str) else meta)
        except ValueError:
            meta = None
    if isinstance(meta, dict) and S.is_valid_uid(meta.get(S.UID)):
        return meta[S.UID].lower()
    key = as_text(key)
    return key.lower() if S.is_valid_uid(key) else key


def batch_uids(batch: dict[str, Any]) -> np.ndarray:
    if "uid" in batch:
        return np.asarray([as_text(u) for u in batch["uid"]], dtype=object)
    keys = batch["key"] if "key" in batch else batch["__key__"]
    metas = batch.get("json", [None] * len(keys))
    return np.asarray([sample_uid(k, m) for k, m in zip(keys, metas, strict=True)], dtype=object)


def score_columns(e: dict[str, Any]) -> dict[str, np.ndarray]:
    """An ``Encoder.encode_batch`` output → ``SCORE_COLUMNS`` (see the module docstring)."""
    scores = pair_scores(e["image_mu"], e.get("image_logvar"), e["text_mu"], e.get("text_logvar"))
    out: dict[str, np.ndarray] = {"uid": batch_uids(e), "ok": e["ok"]}
    for name in _FLOATS:
        values = scores[name].astype(np.float32)
        values[~e["ok"]] = np.nan
        out[name] = values
    out["text_len"] = np.asarray(e["text_len"], np.int32)
    return out


def embedding_columns(e: dict[str, Any]) -> dict[str, np.ndarray]:
    """An ``Encoder.encode_batch`` output → uid, ok, text, image_mu, text_mu (n, D) float32
    [+ image/text_logvar for probabilistic checkpoints]."""
    out = {
        "uid": batch_uids(e),
        "ok": e["ok"],
        "text": np.asarray([as_text(t) for t in e["txt"]], dtype=object),
    }
    out.update({name: e[name].astype(np.float32) for name in EMBED_COLUMNS[3:] if name in e})
    return out


def verify_checkpoint(checkpoint: str, store: Storage = LOCAL) -> ModelConfig:
    """Load ``checkpoint`` once (CheckpointError naming the file if it is missing or corrupt) and return
    its config: jobs call this on the driver so a bad checkpoint stops them before any actor starts."""
    local, tmp = localize_checkpoint(checkpoint, store)
    try:
        _, config, _ = load_checkpoint(local)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return config


@dataclass
class ScoreResult:
    path: str
    n_rows: int
    n_failed: int  # rows whose image did not decode (ok False)
    wall_s: float
    pairs_per_s: float


def score_schema() -> pa.Schema:
    floats = [pa.field(n, pa.float32()) for n in _FLOATS]
    return pa.schema(
        [pa.field("uid", pa.string()), pa.field("ok", pa.bool_()), *floats, pa.field("text_len", pa.int32())]
    )


def embedding_table(batch: dict[str, np.ndarray]) -> pa.Table:
    """An ``embedding_columns`` batch as Arrow: vectors become ``fixed_size_list<float32>[D]`` columns."""
    cols: dict[str, pa.Array] = {
        "uid": pa.array([str(u) for u in batch["uid"]], pa.string()),
        "ok": pa.array(np.asarray(batch["ok"], bool)),
        "text": pa.array([str(t) for t in batch["text"]], pa.string()),
    }
    for name in EMBED_COLUMNS[3:]:
        if name in batch:
            arr = np.ascontiguousarray(batch[name], np.float32)
            cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), arr.shape[1])
    return pa.table(cols)


# --- scores written where they are computed -----------------------------------------------------------

SCORES_INDEX = "_scores.json"  # hidden (leading "_"): directory readers skip it


class ScorePartWriter:
    """``Encoder`` output stage of scoring: an encoded batch → ``score_columns`` → one parquet part
    (sorted by uid) written *by the encoding actor* into ``out``; the batch becomes one summary row
    (``file``, ``rows``, ``failed``). The driver only collects those rows, so it holds ~100 bytes per
    batch, not one row per pair. ``token`` names this run's parts: files of a killed run are never
    listed in the index (``write_score_index``) and are removed by the next run."""

    def __init__(self, out: str, store: Storage, token: str) -> None:
        self.out, self.store, self.token = out, store, token

    def __call__(self, e: dict[str, Any]) -> dict[str, np.ndarray]:
        cols = score_columns(e)
        table = pa.table({k: cols[k] for k in SCORE_COLUMNS}).cast(score_schema()).sort_by("uid")
        name = f"part-{self.token}-{uuid.uuid4().hex[:12]}.parquet"
        self.store.write_parquet(table, storage.join(self.out, name))
        failed = int((~np.asarray(cols["ok"], bool)).sum())
        return {"file": np.array([name]), "rows": np.array([table.num_rows]), "failed": np.array([failed])}


def write_score_index(out: str, files: list[str], rows: int, failed: int, store: Storage) -> None:
    """The run's list of parts, written last: scores count as complete only once it exists."""
    store.write_json(
        {"files": sorted(files), "rows": rows, "failed": failed}, storage.join(out, SCORES_INDEX)
    )


def scores_complete(out: str, store: Storage = LOCAL) -> bool:
    """A finished scoring's output: an index over its parts, or a single parquet file."""
    return store.exists(storage.join(out, SCORES_INDEX)) or (store.exists(out) and not store.isdir(out))


def read_scores(out: str, store: Storage = LOCAL, columns: list[str] | None = None) -> pa.Table:
    """The scores at ``out`` (the parts its index lists, or one parquet file), sorted by uid."""
    index = storage.join(out, SCORES_INDEX)
    if store.exists(index):
        files = [storage.join(out, f) for f in store.read_json(index)["files"]]
        table = store.read_parquet(files, columns) if files else score_schema().empty_table()
    else:
        table = store.read_parquet(out, columns)
    return table.sort_by("uid")


def clear_scores(out: str, store: Storage) -> None:
    """Remove what an earlier scoring left at ``out`` (its index first, then its parts or file)."""
    if store.isdir(out):
        store.remove(storage.join(out, SCORES_INDEX))
        store.remove_files(store.list_files(out))
    elif store.exists(out):
        store.remove(out)
