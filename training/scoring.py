"""Scoring pool pairs with a trained checkpoint: CSD / cosine per uid, and embedding extraction.

Pure pieces (no Ray, testable on a hand-written batch):

- ``pair_scores(mu_v, logvar_v, mu_t, logvar_t)``: the per-pair numbers, in float64 —
  ``dot`` = μ_v·μ_t, ``image_unc`` = Σ_d σ²_v,d, ``text_unc`` = Σ_d σ²_t,d (tr Σ, MATH.md "Uncertainty
  of an input"), ``csd`` = ‖μ_v − μ_t‖² + Σ_d (σ²_v,d + σ²_t,d) (ProLIP Eq. 1; = 2 − 2·dot + image_unc +
  text_unc for unit μ), ``cosine`` = dot / (‖μ_v‖‖μ_t‖) (DataComp's "CLIP score"). Deterministic models
  have no σ²: uncertainties are NaN and csd = ‖μ_v − μ_t‖² = 2 − 2·cosine.
- ``PairScorer`` (a callable class for ``map_batches``): holds one ``training.encode.Encoder`` and turns
  ``{uid | __key__ [+ json], jpg, txt}`` batches into ``SCORE_COLUMNS``. ``text_len`` counts the caption's
  tokens after truncation to the context, special tokens excluded. An image that does not decode gives
  ``ok = False`` and NaN scores; it never raises.
- ``PairEmbedder``: the same input → ``EMBED_COLUMNS`` (μ and log σ² per tower), the frozen embeddings the
  post-hoc adapters (ProbVLM, AsymVLM) train on. Deterministic checkpoints write no logvar columns.

The uid of a sample is its ``.json`` ``uid`` (img2dataset/DataComp shards key samples by position), else
its key. On CUDA both towers run under bf16 autocast (``amp``); outputs are float32. ``decode_threads``
splits a batch's JPEG decoding over threads (the Ray builders use one per CPU of the actor).

Ray builders (``score_shards``, ``embed_shards``): a file-based read of the shards with the strict tar
parser of ``pipeline.shards`` (as the training ingest does; damaged shards keep their intact samples and
are logged), ``map_batches(PairScorer, compute=ActorPoolStrategy(size=num_actors), num_gpus=...)``, and
the rows streamed to the driver and written as ONE parquet file: scores sorted by uid (≈60 B per row in
driver memory), embeddings written batch by batch in arrival order (memory: one batch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline import schema as S
from pipeline import shards as shard_io
from pipeline import storage
from training.encode import Encoder, localize_checkpoint
from training.model import ModelConfig, load_checkpoint

log = logging.getLogger(__name__)

SCORE_COLUMNS = ("uid", "ok", "dot", "image_unc", "text_unc", "csd", "cosine", "text_len")
EMBED_COLUMNS = ("uid", "ok", "text", "image_mu", "text_mu", "image_logvar", "text_logvar")
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
READ_CHUNK_ROWS = 256


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
        return {"dot": dot, "image_unc": nan, "text_unc": nan.copy(), "csd": dist, "cosine": cosine}
    image_unc = np.exp(np.asarray(logvar_v, np.float64)).sum(-1)
    text_unc = np.exp(np.asarray(logvar_t, np.float64)).sum(-1)
    return {
        "dot": dot,
        "image_unc": image_unc,
        "text_unc": text_unc,
        "csd": dist + image_unc + text_unc,
        "cosine": cosine,
    }


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def sample_uid(key: str, meta: Any) -> str:
    """The json's ``uid`` when it is a 32-hex uid, else the key (lower-cased when it is a uid)."""
    if isinstance(meta, (bytes, bytearray, memoryview, str)):
        try:
            meta = json.loads(bytes(meta) if not isinstance(meta, str) else meta)
        except ValueError:
            meta = None
    if isinstance(meta, dict) and S.is_valid_uid(meta.get(S.UID)):
        return meta[S.UID].lower()
    key = _text(key)
    return key.lower() if S.is_valid_uid(key) else key


def batch_uids(batch: dict[str, Any]) -> np.ndarray:
    if "uid" in batch:
        return np.asarray([_text(u) for u in batch["uid"]], dtype=object)
    keys = batch["__key__"]
    metas = batch.get("json", [None] * len(keys))
    return np.asarray([sample_uid(k, m) for k, m in zip(keys, metas, strict=True)], dtype=object)


class _PairEncoder:
    """Shared by the scorer and the embedder: one Encoder, images and captions → (μ, logvar) per tower."""

    def __init__(
        self,
        checkpoint: str,
        s3_endpoint: str = "",
        device: str = "cpu",
        batch_size: int = 256,
        threads: int = 0,
        amp: bool | None = None,
        env: dict[str, str] | None = None,
        decode_threads: int = 1,
    ) -> None:
        storage.adopt_env(env or {})  # Ray workers may start without the driver's S3 credentials
        self.decode_threads = max(1, int(decode_threads))
        self._pool = ThreadPoolExecutor(self.decode_threads) if self.decode_threads > 1 else None
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.encoder = Encoder(checkpoint, s3_endpoint, device=device, batch_size=batch_size, threads=threads)
        self.device = self.encoder.device
        self.amp = (self.device.type == "cuda") if amp is None else bool(amp)
        tok = self.encoder.tokenizer
        self._special = np.asarray(
            sorted({i for i in (tok.pad_id, tok.end_id, tok.mask_id, tok.start_id) if i is not None})
        )

    def _autocast(self) -> Any:
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    @torch.inference_mode()
    def encode_tokens(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Text tower on pre-tokenized (n, L) int64, in chunks of the encoder's batch size."""
        enc = self.encoder
        mus, logvars = [], []
        with self._autocast():
            for start in range(0, len(tokens), enc.batch_size):
                chunk = torch.from_numpy(np.ascontiguousarray(tokens[start : start + enc.batch_size]))
                mu, logvar = enc.model.encode_text(chunk.to(enc.device))
                mus.append(mu.float().cpu().numpy())
                if logvar is not None:
                    logvars.append(logvar.float().cpu().numpy())
        dim = enc.embed_dim
        mu = np.concatenate(mus) if mus else np.zeros((0, dim), np.float32)
        if not enc.probabilistic:
            return mu, None
        return mu, (np.concatenate(logvars) if logvars else np.zeros((0, dim), np.float32))

    def preprocess(self, images: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The encoder's decode/resize/normalise, split over ``decode_threads`` (Pillow and simplejpeg
        release the GIL): on a GPU, single-threaded decoding, not the towers, bounds the pairs/s."""
        n_chunks = min(self.decode_threads, len(images) // 16)
        if self._pool is None or n_chunks < 2:
            return self.encoder.preprocess(images)
        bounds = np.linspace(0, len(images), n_chunks + 1).astype(int)
        chunks = [images[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        parts = list(self._pool.map(self.encoder.preprocess, chunks))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def encode_pixels(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        with self._autocast():
            return self.encoder.encode_pixels(pixels)

    def encode(self, batch: dict[str, Any]) -> dict[str, Any]:
        """uid, ok, texts, tokens and both towers' (μ, logvar|None); undecodable images give NaN rows."""
        uids = batch_uids(batch)
        images = [b"" if x is None else bytes(x) for x in batch["jpg"]]
        texts = [_text(t) for t in batch["txt"]]
        pixels, ok = self.preprocess(images)
        mu_v, logvar_v = self.encode_pixels(pixels)
        tokens = self.encoder.tokenizer.encode_batch(texts, self.encoder.config.context_length)
        mu_t, logvar_t = self.encode_tokens(tokens)
        mu_v[~ok] = np.nan
        if logvar_v is not None:
            logvar_v[~ok] = np.nan
        return {
            "uid": uids,
            "ok": ok,
            "texts": texts,
            "tokens": tokens,
            "mu_v": mu_v,
            "logvar_v": logvar_v,
            "mu_t": mu_t,
            "logvar_t": logvar_t,
        }


class PairScorer(_PairEncoder):
    """``map_batches`` stage: {uid | __key__ [+json], jpg, txt} → SCORE_COLUMNS (see module doc)."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        e = self.encode(batch)
        scores = pair_scores(e["mu_v"], e["logvar_v"], e["mu_t"], e["logvar_t"])
        out: dict[str, np.ndarray] = {"uid": e["uid"], "ok": e["ok"]}
        for name in SCORE_COLUMNS[2:7]:
            values = scores[name].astype(np.float32)
            values[~e["ok"]] = np.nan
            out[name] = values
        out["text_len"] = (~np.isin(e["tokens"], self._special)).sum(-1).astype(np.int32)
        return out


class PairEmbedder(_PairEncoder):
    """``map_batches`` stage: → uid, ok, text, image_mu, text_mu (n, D) float32 [+ image/text_logvar]."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        e = self.encode(batch)
        out = {
            "uid": e["uid"],
            "ok": e["ok"],
            "text": np.asarray(e["texts"], dtype=object),
            "image_mu": e["mu_v"].astype(np.float32),
            "text_mu": e["mu_t"].astype(np.float32),
        }
        if e["logvar_v"] is not None:
            out["image_logvar"] = e["logvar_v"].astype(np.float32)
            out["text_logvar"] = e["logvar_t"].astype(np.float32)
        return out


def verify_checkpoint(checkpoint: str, s3_endpoint: str = "") -> ModelConfig:
    """Load ``checkpoint`` once (CheckpointError naming the file if it is missing or corrupt) and return
    its config: jobs call this on the driver so a bad checkpoint stops them before any actor starts."""
    local, tmp = localize_checkpoint(checkpoint, s3_endpoint)
    try:
        _, config, _ = load_checkpoint(local)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return config


# --- reading shards with Ray --------------------------------------------------------------------------


def _pairs_table(rows: list[tuple[str, bytes, str]]) -> pa.Table:
    uids, jpgs, txts = zip(*rows, strict=True)
    return pa.table(
        {
            "uid": pa.array(uids, pa.string()),
            "jpg": pa.array(jpgs, pa.binary()),
            "txt": pa.array(txts, pa.string()),
        }
    )


def iter_pairs(path: str, s3_endpoint: str = "", chunk: int = READ_CHUNK_ROWS) -> Iterator[pa.Table]:
    """(uid, jpg, txt) tables of one shard; a damaged shard keeps its intact samples and is logged."""
    rows: list[tuple[str, bytes, str]] = []
    exts = {*IMAGE_EXTS, "txt", "json"}
    try:
        for s in shard_io.iter_shard(path, s3_endpoint, decode=False, extensions=exts):
            img = next((s[e] for e in IMAGE_EXTS if e in s), None)
            if img is None:
                continue  # nothing to score without an image (webdataset skips these too)
            rows.append((sample_uid(s["__key__"], s.get("json")), img, _text(s.get("txt"))))
            if len(rows) >= chunk:
                yield _pairs_table(rows)
                rows = []
    except (shard_io.ShardError, OSError) as exc:
        log.warning("scoring: skipping the rest of damaged shard %s: %s", path, exc)
    if rows:
        yield _pairs_table(rows)


def read_pairs(shards: str | Sequence[str], s3_endpoint: str = "") -> Any:
    """A ``ray.data.Dataset`` of (uid, jpg, txt), one read task per shard (directory, glob, list)."""
    import ray
    from ray.data.datasource import FileBasedDatasource

    from pipeline.shard_source import list_shards

    spec = shards if isinstance(shards, str) else ",".join(shards)
    paths = list_shards(spec, s3_endpoint)
    fs, resolved = storage.ray_filesystem(paths, s3_endpoint)
    is_s3, env = storage.is_s3(paths[0]), storage.forwarded_env()

    class PairSource(FileBasedDatasource):
        _FILE_EXTENSIONS = ["tar"]

        def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
            return pa.BufferReader(b"")  # pipeline.shards opens (and strictly parses) the file itself

        def _read_stream(self, f: Any, path: str) -> Iterator[pa.Table]:
            storage.adopt_env(env)
            yield from iter_pairs(storage.S3_PREFIX + path if is_s3 else path, s3_endpoint)

    return ray.data.read_datasource(PairSource(resolved, filesystem=fs))


# --- Ray builders -------------------------------------------------------------------------------------


@dataclass
class ScoreResult:
    path: str
    n_rows: int
    n_failed: int  # rows whose image did not decode (ok False)
    wall_s: float
    pairs_per_s: float


def _mapped(
    stage: type,
    shards: str | Sequence[str],
    checkpoint: str,
    s3_endpoint: str,
    num_actors: int,
    num_gpus: float,
    batch_size: int,
    cpus_per_actor: float,
) -> Any:
    """read_pairs → ``map_batches(stage)`` on an actor pool, one model per actor."""
    import ray

    threads = max(1, int(cpus_per_actor))
    return read_pairs(shards, s3_endpoint).map_batches(
        stage,
        fn_constructor_kwargs={
            "checkpoint": checkpoint,
            "s3_endpoint": s3_endpoint,
            "device": "cuda" if num_gpus > 0 else "cpu",
            "batch_size": batch_size,
            "threads": threads,
            "decode_threads": threads,
            "env": storage.forwarded_env(),
        },
        compute=ray.data.ActorPoolStrategy(size=max(1, int(num_actors))),
        num_gpus=float(num_gpus),
        num_cpus=float(cpus_per_actor),
        batch_size=int(batch_size),
        batch_format="numpy",
    )


def score_shards(
    shards: str | list[str],
    checkpoint: str,
    out: str,
    *,
    s3_endpoint: str = "",
    num_actors: int = 1,
    num_gpus: float = 0.0,
    batch_size: int = 256,
    cpus_per_actor: float = 1.0,
) -> ScoreResult:
    """Score every pair of ``shards`` and write ``out`` (one parquet, SCORE_COLUMNS, sorted by uid)."""
    t0 = time.perf_counter()
    ds = _mapped(
        PairScorer, shards, checkpoint, s3_endpoint, num_actors, num_gpus, batch_size, cpus_per_actor
    )
    tables = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    if tables:
        table = pa.concat_tables([t.select(list(SCORE_COLUMNS)) for t in tables]).combine_chunks()
    else:
        table = score_schema().empty_table()
    table = table.cast(score_schema()).sort_by([("uid", "ascending")])
    storage.write_parquet(table, out, s3_endpoint)
    wall = time.perf_counter() - t0
    n_failed = int(table.num_rows - np.asarray(table.column("ok")).sum())
    return ScoreResult(out, table.num_rows, n_failed, wall, table.num_rows / max(wall, 1e-9))


def score_schema() -> pa.Schema:
    floats = [pa.field(n, pa.float32()) for n in SCORE_COLUMNS[2:7]]
    return pa.schema(
        [pa.field("uid", pa.string()), pa.field("ok", pa.bool_()), *floats, pa.field("text_len", pa.int32())]
    )


def embedding_table(batch: dict[str, np.ndarray]) -> pa.Table:
    """A PairEmbedder batch as Arrow: vectors become ``fixed_size_list<float32>[D]`` columns."""
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


def embed_shards(
    shards: str | list[str],
    checkpoint: str,
    out: str,
    *,
    s3_endpoint: str = "",
    num_actors: int = 1,
    num_gpus: float = 0.0,
    batch_size: int = 256,
    cpus_per_actor: float = 1.0,
) -> ScoreResult:
    """Write the embeddings parquet (see ``jobs.embed`` for its schema) of every pair of ``shards``."""
    t0 = time.perf_counter()
    ds = _mapped(
        PairEmbedder, shards, checkpoint, s3_endpoint, num_actors, num_gpus, batch_size, cpus_per_actor
    )
    n_rows = n_failed = 0
    writer = None
    with storage.open_output(out, s3_endpoint) as fh:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            table = embedding_table(batch)
            if writer is None:
                meta = {"checkpoint": checkpoint, "columns": ",".join(table.column_names)}
                writer = pq.ParquetWriter(fh, table.schema.with_metadata(meta))
            writer.write_table(table)
            n_rows += table.num_rows
            n_failed += int((~np.asarray(batch["ok"], bool)).sum())
        if writer is None:
            raise FileNotFoundError(f"embed: no samples in {shards!r}")
        writer.close()
    wall = time.perf_counter() - t0
    return ScoreResult(out, n_rows, n_failed, wall, n_rows / max(wall, 1e-9))
