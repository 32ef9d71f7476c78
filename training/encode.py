"""Inference-time encoding with a trained checkpoint: the one place that turns bytes and strings into
(μ, logvar) outside training. Scoring (``training/scoring.py``), evaluation and embedding extraction all
hold an ``Encoder``, so a checkpoint is preprocessed exactly one way.

- Checkpoint: a directory written by ``training.model.save_checkpoint`` (a Ray Train checkpoint of
  ``jobs.train``), local or ``s3://`` (copied once to a private temporary directory). Loading never
  unpickles (``weights_only=True``); a missing, corrupt or wrong-kind checkpoint raises
  ``CheckpointError`` naming the file.
- Images: decoded (simplejpeg / Pillow), centre crop, bicubic resize to the model's side, the pixel
  mean/std the run trained with (``extra.json``; OpenAI CLIP's when absent) — the eval transform of
  open_clip. An undecodable image gives a row of NaN and ``ok = False``, never an exception.
- Deterministic models (``probabilistic=False``) return ``logvar = None``; callers fall back to cosine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline import storage
from training.model import CONFIG_FILE, CheckpointError, load_checkpoint, load_extra

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def localize_checkpoint(path: str, s3_endpoint: str = "") -> tuple[str, str | None]:
    """(local directory, temporary directory to delete or None). Copies an ``s3://`` checkpoint."""
    if not storage.is_s3(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint directory missing: {path}")
        return path, None
    files = storage.list_files(path, s3_endpoint=s3_endpoint)
    if not any(f.endswith("/" + CONFIG_FILE) for f in files):
        raise CheckpointError(f"checkpoint file missing: {storage.join(path, CONFIG_FILE)}")
    tmp = tempfile.mkdtemp(prefix="prolip-ckpt-")
    prefix = path.rstrip("/") + "/"
    for f in files:
        rel = f[len(prefix) :] if f.startswith(prefix) else os.path.basename(f)
        target = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as out:
            out.write(storage.read_bytes(f, s3_endpoint))
    return tmp, tmp


class Encoder:
    """Holds one model on one device; ``images``/``texts`` return float32 numpy (μ, logvar | None)."""

    def __init__(
        self,
        checkpoint: str,
        s3_endpoint: str = "",
        device: str = "cpu",
        batch_size: int = 256,
        threads: int = 0,
    ) -> None:
        if threads > 0:
            torch.set_num_threads(threads)
        local, tmp = localize_checkpoint(checkpoint, s3_endpoint)
        try:
            self.model, self.config, self.tokenizer = load_checkpoint(local)
            extra = load_extra(local)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        if self.tokenizer is None:
            raise CheckpointError(f"checkpoint {checkpoint} has no tokenizer (tokenizer.json)")
        self.checkpoint = checkpoint
        self.extra = extra
        self.loss_name = str(extra.get("loss", "prolip" if self.config.probabilistic else "clip"))
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        self.mean = np.asarray(extra.get("pixel_mean", OPENAI_MEAN), np.float32)
        self.std = np.asarray(extra.get("pixel_std", OPENAI_STD), np.float32)

    @property
    def probabilistic(self) -> bool:
        return bool(self.config.probabilistic)

    @property
    def embed_dim(self) -> int:
        return int(self.config.embed_dim)

    def preprocess(self, data: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(n, 3, S, S) normalised float32 pixels and the (n,) decode-success mask."""
        from PIL import Image

        from pipeline.augment import center_crop_box, decode_image

        size = self.config.image_size
        out = np.zeros((len(data), size, size, 3), np.float32)
        ok = np.zeros(len(data), bool)
        for i, item in enumerate(data):
            try:
                arr = decode_image(bytes(item), size)
                if arr.ndim != 3 or arr.shape[2] != 3:
                    raise ValueError(f"decoded shape {arr.shape}")
                box = center_crop_box(*arr.shape[:2])
                img = Image.fromarray(arr).resize((size, size), Image.BICUBIC, box=box)
                out[i] = np.asarray(img, np.float32) / 255.0
                ok[i] = True
            except Exception:  # one bad image must not stop a scoring or eval job: flagged via ``ok``
                continue
        out = (out - self.mean) / self.std
        return np.ascontiguousarray(out.transpose(0, 3, 1, 2)), ok

    @torch.inference_mode()
    def _run(self, fn: Any, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
        mus, logvars = [], []
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
        return self._run(self.model.encode_image, torch.from_numpy(pixels))

    def images(self, data: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(μ (n, D), logvar (n, D) | None, ok (n,)): rows whose image failed to decode are NaN."""
        pixels, ok = self.preprocess(data)
        mu, logvar = self.encode_pixels(pixels)
        mu[~ok] = np.nan
        if logvar is not None:
            logvar[~ok] = np.nan
        return mu, logvar, ok

    def texts(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray | None]:
        tokens = self.tokenizer.encode_batch([str(t) for t in texts], self.config.context_length)
        return self._run(self.model.encode_text, torch.as_tensor(tokens, dtype=torch.long))
