"""The one batch encoder: a trained checkpoint turning image bytes and captions into (μ, logvar).

Scoring and embedding extraction (training/infer/scoring.py), evaluation (training/eval/run.py) and the
adapters' zero-shot check all hold an ``Encoder``, so a checkpoint is preprocessed exactly one way. It is
a callable class for Ray Data's ``map_batches`` (training/infer/batch_inference.py builds the actor pools): the model
is loaded once in ``__init__`` (once per actor), and ``__call__`` encodes one columnar batch. No Ray here.

- Checkpoint: a directory written by ``training.model.two_tower.save_checkpoint`` (a Ray Train checkpoint of
  ``jobs.train``), local or ``s3://`` through a ``Storage`` (copied once to a private temporary
  directory). Loading never unpickles (``weights_only=True``); a missing, corrupt or wrong-kind
  checkpoint raises ``CheckpointError`` naming the file.
- Images: decoded (simplejpeg / Pillow), centre crop, bicubic resize to the model's side, the pixel
  mean/std the run trained with (``extra.json``; OpenAI CLIP's when absent) — the eval transform of
  open_clip. An undecodable image gives a row of NaN and ``ok = False``, never an exception.
  ``decode_threads`` splits a batch's decoding over threads (Pillow and simplejpeg release the GIL): on
  a GPU, single-threaded decoding, not the towers, bounds the pairs/s.
- On CUDA both towers run under bf16 autocast (``amp``); outputs are float32 numpy.
- Deterministic models (``probabilistic=False``) return ``logvar = None``; callers fall back to cosine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from training.model.checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint, load_extra

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_ROWS_PER_DECODE_THREAD = 16  # below this a thread costs more than it saves

BatchOutput = Callable[[dict[str, Any]], dict[str, Any]]  # per-use post-processing of an encoded batch


def localize_checkpoint(path: str, store: Storage = LOCAL) -> tuple[str, str | None]:
    """(local directory, temporary directory to delete or None). Copies an ``s3://`` checkpoint."""
    if not storage.is_s3(path):
        if not os.path.isdir(path):
            what = "a file, not a checkpoint directory" if os.path.exists(path) else "not found"
            raise CheckpointError(f"checkpoint {path}: {what}")
        return path, None
    files = store.list_files(path)
    if not any(f.endswith("/" + CONFIG_FILE) for f in files):
        raise CheckpointError(f"checkpoint file missing: {storage.join(path, CONFIG_FILE)}")
    tmp = tempfile.mkdtemp(prefix="prolip-ckpt-")
    prefix = path.rstrip("/") + "/"
    for f in files:
        rel = f[len(prefix) :] if f.startswith(prefix) else os.path.basename(f)
        target = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as out:
            out.write(store.read_bytes(f))
    return tmp, tmp


def as_text(value: Any) -> str:
    """A caption cell (str, bytes or None) as str."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


class Encoder:
    """Holds one model on one device; see the module docstring. ``images``/``texts`` encode lists,
    ``__call__`` a columnar batch (then ``output``, a per-use post-processing function, if given)."""

    def __init__(
        self,
        checkpoint: str,
        store: Storage = LOCAL,
        *,
        device: str = "cpu",
        batch_size: int = 256,
        threads: int = 0,
        amp: bool | None = None,
        decode_threads: int = 1,
        output: BatchOutput | None = None,
    ) -> None:
        if threads > 0:
            torch.set_num_threads(threads)
        local, tmp = localize_checkpoint(checkpoint, store)
        try:
            self.model, self.config, self.tokenizer = load_checkpoint(local)
            extra = load_extra(local)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        if self.tokenizer is None:
            raise CheckpointError(f"checkpoint {checkpoint} has no tokenizer (tokenizer.json)")
        self.checkpoint, self.extra, self.output = checkpoint, extra, output
        self.loss_name = str(extra.get("loss", "prolip" if self.config.probabilistic else "clip"))
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        self.amp = (self.device.type == "cuda") if amp is None else bool(amp)
        self.mean = np.asarray(extra.get("pixel_mean", OPENAI_MEAN), np.float32)
        self.std = np.asarray(extra.get("pixel_std", OPENAI_STD), np.float32)
        self.decode_threads = max(1, int(decode_threads))
        self._pool = ThreadPoolExecutor(self.decode_threads) if self.decode_threads > 1 else None
        tok = self.tokenizer
        self.special_ids = np.asarray(
            sorted({i for i in (tok.pad_id, tok.end_id, tok.mask_id, tok.start_id) if i is not None})
        )

    @property
    def probabilistic(self) -> bool:
        return bool(self.config.probabilistic)

    @property
    def embed_dim(self) -> int:
        return int(self.config.embed_dim)

    # --- images ---------------------------------------------------------------------------------------

    def _preprocess_chunk(self, data: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        from pipeline.ingest.augment import center_resize, decode_for_size

        size = self.config.image_size
        out = np.zeros((len(data), size, size, 3), np.float32)
        ok = np.zeros(len(data), bool)
        for i, item in enumerate(data):
            try:
                # Training's preprocessing with augmentation off, to the pixel (pipeline/ingest/augment.py).
                arr = decode_for_size(bytes(item), size)
                if arr.ndim != 3 or arr.shape[2] != 3:
                    raise ValueError(f"decoded shape {arr.shape}")
                out[i] = center_resize(arr, size).astype(np.float32) / 255.0
                ok[i] = True
            except Exception:  # one bad image must not stop a scoring or eval job: flagged via ``ok``
                continue
        out = (out - self.mean) / self.std
        return np.ascontiguousarray(out.transpose(0, 3, 1, 2)), ok

    def preprocess(self, data: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(n, 3, S, S) normalised float32 pixels and the (n,) decode-success mask."""
        n_chunks = min(self.decode_threads, len(data) // MIN_ROWS_PER_DECODE_THREAD)
        if self._pool is None or n_chunks < 2:
            return self._preprocess_chunk(data)
        bounds = np.linspace(0, len(data), n_chunks + 1).astype(int)
        chunks = [data[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        parts = list(self._pool.map(self._preprocess_chunk, chunks))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    # --- towers ---------------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    @torch.inference_mode()
    def _run(self, fn: Any, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
        mus, logvars = [], []
        with self._autocast():
            for start in range(0, len(x), self.batch_size):
                mu, logvar = fn(x[start : start + self.batch_size].to(self.device))
                mus.append(mu.float().cpu().numpy())
                if logvar is not None:
                    logvars.append(logvar.float().cpu().numpy())
        dim = self.embed_dim
        mu = np.concatenate(mus) if mus else np.zeros((0, dim), np.float32)
        if not self.probabilistic:
            return mu, None
        return mu, (np.concatenate(logvars) if logvars else np.zeros((0, dim), np.float32))

    def encode_pixels(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return self._run(self.model.encode_image, torch.from_numpy(np.ascontiguousarray(pixels)))

    def encode_tokens(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Text tower on pre-tokenized (n, L) int64."""
        return self._run(self.model.encode_text, torch.as_tensor(np.asarray(tokens), dtype=torch.long))

    def tokenize(self, texts: Sequence[Any]) -> np.ndarray:
        return self.tokenizer.encode_batch([as_text(t) for t in texts], self.config.context_length)

    def images(self, data: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(μ (n, D), logvar (n, D) | None, ok (n,)): rows whose image failed to decode are NaN."""
        pixels, ok = self.preprocess(data)
        mu, logvar = self.encode_pixels(pixels)
        mu[~ok] = np.nan
        if logvar is not None:
            logvar[~ok] = np.nan
        return mu, logvar, ok

    def texts(self, texts: Sequence[Any]) -> tuple[np.ndarray, np.ndarray | None]:
        return self.encode_tokens(self.tokenize(texts))

    # --- a columnar batch -----------------------------------------------------------------------------

    def encode_batch(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """``{jpg?, txt?, has_image?, has_text?, ...}`` → the other columns plus ``ok`` (the image
        decoded; True on rows without one), ``image_mu``, ``text_mu`` (n, D) float32, ``text_len`` (n,)
        int32 (caption tokens after truncation to the context, special tokens excluded) and, for
        probabilistic checkpoints, ``image_logvar``/``text_logvar``. A row is encoded by the image tower
        where ``has_image`` (default: every row, when there is a ``jpg`` column) and by the text tower
        where ``has_text`` (default: every row, when there is a ``txt`` column); other cells are NaN."""
        n = len(next(iter(batch.values())))
        img_rows = self._rows(batch, "has_image", "jpg", n)
        txt_rows = self._rows(batch, "has_text", "txt", n)
        d = self.embed_dim
        out = {k: v for k, v in batch.items() if k not in ("jpg", "has_image", "has_text")}
        out["ok"] = np.ones(n, bool)
        towers = {name: np.full((n, d), np.nan, np.float32) for name in ("image_mu", "text_mu")}
        if self.probabilistic:
            towers.update(
                {name: np.full((n, d), np.nan, np.float32) for name in ("image_logvar", "text_logvar")}
            )
        out["text_len"] = np.zeros(n, np.int32)
        if img_rows.size:
            images = [
                b"" if x is None else bytes(x) for x in np.asarray(batch["jpg"], dtype=object)[img_rows]
            ]
            mu, logvar, out["ok"][img_rows] = self.images(images)
            towers["image_mu"][img_rows] = mu
            if logvar is not None:
                towers["image_logvar"][img_rows] = logvar
        if txt_rows.size:
            tokens = self.tokenize(np.asarray(batch["txt"], dtype=object)[txt_rows])
            mu, logvar = self.encode_tokens(tokens)
            towers["text_mu"][txt_rows] = mu
            if logvar is not None:
                towers["text_logvar"][txt_rows] = logvar
            out["text_len"][txt_rows] = (~np.isin(tokens, self.special_ids)).sum(-1)
        return {**out, **towers}

    @staticmethod
    def _rows(batch: dict[str, Any], flag: str, column: str, n: int) -> np.ndarray:
        if flag in batch:
            return np.flatnonzero(np.asarray(batch[flag], bool))
        return np.arange(n) if column in batch else np.zeros(0, np.int64)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        encoded = self.encode_batch(batch)
        return self.output(encoded) if self.output is not None else encoded
