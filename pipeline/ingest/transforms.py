"""Training ingest: shards → shuffle → decode/augment/tokenize → masked variants.

Every stage here is a Ray-free callable over a batch; ``pipeline.ingest.dataset.build_train_dataset`` wires
them into Ray Data.

1. **Read** (pipeline/shards/reader.py, the one shard reader): ``read_webdataset(decoder=None)``'s
   file-based read with a strict tar parser — one task per shard, raw bytes (``key``, ``jpg``,
   ``txt``), shard order shuffled per epoch (``FileShuffleConfig(seed, reseed_after_execution=True)``;
   random without a seed); damaged shards are counted and skipped up to ``DataConfig.max_bad_shards``,
   then the job stops naming the shard.
2. **Windowed shuffle** (``shuffle_window``): a permutation inside windows of raw rows (a few MB of JPEG
   bytes), the webdataset-style shuffle buffer, so no worker holds a large buffer of decoded images.
3. **Decode + crop + tokenize** (``DecodeAugment``, in Ray Data tasks): simplejpeg with DCT
   downscaling to the smallest size that still covers the crop (Pillow for other formats); a sample that
   fails to decode is dropped and counted (``on_bad_images``), never fatal. The crop is the recipe's
   RandomResizedCrop (ProLIP App. B.1: area (0.8, 1.0); DataComp/open_clip: (0.9, 1.0)), bicubic, kept as
   uint8 (B, S, S, 3); without augmentation, resize the short side and centre-crop (open_clip's eval
   transform). The colour jitter and grayscale are only *drawn* here (small per-image columns); they,
   the float conversion and the mean/std normalisation run batched on the training device
   (pipeline/ingest/device_augment.py, called by the train step). Tokenize with
   ``TextTokenizer.encode_batch``.
4. **Masked variants** (``MaskedVariants``), run in ``iter_torch_batches``' collate step (``TrainCollate``,
   wrapped as Ray Data's ``NumpyBatchCollateFn`` in pipeline/ingest/dataset.py) on the exact training batch:
   12.5% of the batch selected by ``pipeline.ingest.masking.select_for_masking`` (hash of uid and epoch), 75%
   of their content tokens → [MASK], 25% of patches kept. Output: fixed-shape arrays ``images (B,H,W,3)
   u8`` (+ the pixel parameters), ``tokens (B,L) i64, masked_tokens (B,L) i64, keep_idx (B,K) i64,
   selected (B,) bool`` plus ``masked_index (M,)``, so the loop does no per-sample work. Why the collate step rather than a
   ``map_batches`` stage: Ray Data re-batches (and splits across workers) after every stage, so only
   here is "per batch" the training batch, and only here is the epoch known (the dataset plan is the
   same object for every epoch).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.ingest.augment import (
    center_resize,
    decode_for_size,
    draw_grayscale,
    draw_jitter,
    random_resized_crop_box,
)
from pipeline.ingest.device_augment import hue_rows_by_position
from pipeline.ingest.masking import choose_kept_patches, mask_text_tokens, sample_hash, select_for_masking

log = logging.getLogger(__name__)

BadImageReport = Callable[[list[str], list[str]], None]  # (keys dropped, a few "key: error" examples)
PIXEL_PARAMS = ("jitter", "jitter_order", "gray")  # per-image draws applied on the training device
# Samples per CPU second of the decode tasks inside the Ray Data ingest (read, window shuffle, decode, crop,
# tokenize; uint8 out at 224 px; bench/ingest_224.py on photos, datacomp-small, 2-core x86 VM; one core
# alone, without the pipeline, reaches ~440): what the trainer sizes the decode cores of a GPU run by.
DECODE_SAMPLES_PER_CORE_224 = 344.0


# --- 2. windowed shuffle ------------------------------------------------------------------------------


def window_shuffle(table: pa.Table, seed: int | None = None) -> pa.Table:
    """Rows of one window in random order; seeded by (seed, the window's keys) when ``seed`` is given."""
    if seed is None:
        rng = np.random.default_rng()
    else:
        keys = table.column("key").to_numpy(zero_copy_only=False)
        rng = np.random.default_rng([seed, int(np.bitwise_xor.reduce(sample_hash(keys, 0, seed)))])
    return table.take(pa.array(rng.permutation(table.num_rows)))


# --- 3. decode, augment, tokenize ---------------------------------------------------------------------


class DecodeAugment:
    """Ray Data stage: {key, jpg, txt} → {key, image (B,S,S,3) uint8, tokens (B,L) i64} plus, with
    augmentation, the drawn pixel parameters ``jitter`` (B,4) f32, ``jitter_order`` (B,4) i8 and ``gray``
    (B,) bool, applied on the training device (pipeline/ingest/device_augment.py).

    Undecodable images are dropped (the row disappears) and counted in ``self.bad_images`` and through
    ``on_bad_images`` when given (in a Ray job, the shared counters actor: pipeline/ingest/dataset.py).
    """

    def __init__(
        self,
        image_size: int,
        context_length: int,
        tokenizer: Any,
        data: Any,
        on_bad_images: BadImageReport | None = None,
        seed: int | None = None,
    ) -> None:
        from pipeline.ingest.tokenizer import TextTokenizer

        if isinstance(tokenizer, dict):  # {"json": str, "ids": {...}}: what travels to remote actors
            tokenizer = tokenizer_from_state(tokenizer)
        assert isinstance(tokenizer, TextTokenizer)
        self.tokenizer = tokenizer
        self.size, self.context_length = image_size, context_length
        self.cfg = data
        self.on_bad_images = on_bad_images
        self.rng = np.random.default_rng(seed)
        self.bad_images = 0

    def _crop(self, arr: np.ndarray) -> np.ndarray:
        from PIL import Image

        if not self.cfg.augment:
            return center_resize(arr, self.size)  # the encoders' preprocessing (training/infer/encode.py)
        box = random_resized_crop_box(*arr.shape[:2], self.cfg.crop_scale, self.cfg.crop_ratio, self.rng)
        return np.asarray(Image.fromarray(arr).resize((self.size, self.size), Image.BICUBIC, box=box))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        keep, images, errors, bad_keys = [], [], [], []
        for i, data in enumerate(batch["jpg"]):
            try:
                arr = decode_for_size(bytes(data), self.size)
                if arr.ndim != 3 or arr.shape[2] != 3 or min(arr.shape[:2]) < 1:
                    raise ValueError(f"unexpected decoded shape {arr.shape}")
                images.append(self._crop(arr))
                keep.append(i)
            except Exception as exc:  # any decoder error: a bad image must never stop training
                errors.append(f"{batch['key'][i]}: {type(exc).__name__}: {exc}"[:200])
                bad_keys.append(str(batch["key"][i]))
        if errors:
            self._count_bad(bad_keys, errors)
        n = len(keep)
        texts = [str(batch["txt"][i]) for i in keep]
        out = {
            "key": np.asarray([str(batch["key"][i]) for i in keep], dtype=object),
            "image": np.stack(images) if n else np.zeros((0, self.size, self.size, 3), np.uint8),
            "tokens": self.tokenizer.encode_batch(texts, self.context_length)
            if n
            else np.zeros((0, self.context_length), np.int64),
        }
        return {**out, **self._pixel_params(n)}

    def _pixel_params(self, n: int) -> dict[str, np.ndarray]:
        """The jitter and grayscale draws of ``n`` images (no columns when the config has neither)."""
        cfg, out = self.cfg, {}
        if cfg.augment and cfg.color_jitter_p > 0 and any(s > 0 for s in cfg.color_jitter):
            out["jitter"], out["jitter_order"] = draw_jitter(
                n, cfg.color_jitter, cfg.color_jitter_p, self.rng
            )
        if cfg.augment and cfg.grayscale_p > 0:
            out["gray"] = draw_grayscale(n, cfg.grayscale_p, self.rng)
        return out

    def _count_bad(self, keys: list[str], errors: list[str]) -> None:
        self.bad_images += len(errors)
        log.warning("dropped %d undecodable image(s), e.g. %s", len(errors), errors[0])
        if self.on_bad_images is not None:
            self.on_bad_images(keys, errors[:3])  # by key: the counters count each image once, every epoch


_STAGE_CACHE: dict[tuple, DecodeAugment] = {}


def decode_augment_batch(batch: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
    """``DecodeAugment`` as a function for Ray Data *tasks*: one instance per worker process and settings.

    Tasks reuse Ray's worker processes, so the instance (tokenizer included) is built once per process;
    an actor pool would be re-created — seconds each time — at every epoch's re-execution.
    """
    key = (kwargs["image_size"], kwargs["context_length"], hash(kwargs["tokenizer"]["json"]),
           repr(kwargs["tokenizer"]["ids"]), repr(kwargs["data"]), repr(kwargs.get("on_bad_images")), kwargs.get("seed"))  # fmt: skip
    stage = _STAGE_CACHE.get(key)
    if stage is None:
        _STAGE_CACHE.clear()  # one configuration at a time per process is the common case
        stage = _STAGE_CACHE[key] = DecodeAugment(**kwargs)
    return stage(batch)


def tokenizer_state(tokenizer: Any) -> dict[str, Any]:
    """A plain-data form of a ``TextTokenizer`` (JSON string + special ids) for Ray configs and actors."""
    return tokenizer.to_state()


def tokenizer_from_state(state: dict[str, Any]) -> Any:
    from pipeline.ingest.tokenizer import TextTokenizer

    return TextTokenizer.from_state(state)


# --- 4. masked variants -------------------------------------------------------------------------------


class MaskedVariants:
    """Adds the masked variants to a training batch (see module docstring, stage 4).

    Reproducible: the selection depends on (uid, epoch, seed) and the batch's membership; the masks of
    the selected samples come from one generator seeded by (seed, epoch, their hashes), assigned in hash
    order, so a rerun with the same batch — in any row order — gives the same variants.
    """

    def __init__(
        self,
        n_patches: int,
        pad_id: int,
        end_id: int,
        mask_id: int,
        fraction: float = 0.125,
        text_ratio: float = 0.75,
        keep_ratio: float = 0.25,
        seed: int = 0,
        protected_ids: Sequence[int] = (),
    ) -> None:
        self.n_patches, self.fraction = n_patches, fraction
        self.ids = dict(pad_id=pad_id, end_id=end_id, mask_id=mask_id)
        self.text_ratio, self.keep_ratio, self.seed = text_ratio, keep_ratio, seed
        self.protected_ids = tuple(protected_ids)
        self.n_keep = max(1, int(math.floor(keep_ratio * n_patches + 0.5)))

    def __call__(self, batch: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
        keys, tokens = np.asarray(batch["key"]), np.asarray(batch["tokens"])
        b = len(keys)
        selected = select_for_masking(keys, epoch, batch_size=None, fraction=self.fraction, seed=self.seed)
        rows = np.flatnonzero(selected)
        hashes = sample_hash(keys[rows], epoch, self.seed)
        order = np.argsort(hashes, kind="stable")
        rows, hashes = rows[order], hashes[order]
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, *map(int, hashes)]))
        masked = tokens.copy()  # (B, L); unselected rows keep their tokens (unused)
        keep_idx = np.broadcast_to(np.arange(self.n_keep, dtype=np.int64), (b, self.n_keep)).copy()  # (B, K)
        if rows.size:
            masked[rows] = mask_text_tokens(
                tokens[rows], ratio=self.text_ratio, rng=rng, protected_ids=self.protected_ids, **self.ids
            )
            keep_idx[rows] = choose_kept_patches(self.n_patches, rows.size, self.keep_ratio, rng=rng)
        return {**batch, "masked_tokens": masked, "keep_idx": keep_idx, "selected": selected}


class TrainCollate:
    """The training batch's collate step: masked variants for ``epoch``, then CPU torch tensors.

    With ``pad_id``, token columns that are padding in every row are cut off (the batch keeps its
    longest caption): the text tower encodes a trimmed batch exactly as the padded one (its UNC/CLS sit
    at fixed positional rows and padding is never attended to, training/model/towers.py), and short captions
    stop paying for the full context — for CLIP and ProLIP alike.
    """

    def __init__(
        self,
        masker: MaskedVariants | None,
        epoch: int,
        pad_id: int | None = None,
        cache: DecodedCache | None = None,
    ) -> None:
        self.masker, self.epoch, self.pad_id, self.cache = masker, epoch, pad_id, cache

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        if self.cache is not None:
            self.cache.keep(batch)
        out = self.masker(batch, self.epoch) if self.masker is not None else dict(batch)
        tokens = np.asarray(out["tokens"], dtype=np.int64)
        width = tokens.shape[1]
        if self.pad_id is not None and tokens.size:
            width = max(1, int((tokens != self.pad_id).sum(axis=1).max()))  # content is a prefix
        tensors = {
            "images": torch.from_numpy(np.ascontiguousarray(out["image"])),  # uint8 (B, S, S, 3) as decoded
            "tokens": torch.from_numpy(np.ascontiguousarray(tokens[:, :width])),
        }
        for name in PIXEL_PARAMS:
            if name in out:
                tensors[name] = torch.from_numpy(np.ascontiguousarray(out[name]))
        if "jitter" in out:  # which rows rotate their hue at each position: sizes the device need not ask for
            for pos, rows in enumerate(hue_rows_by_position(out["jitter"], out["jitter_order"])):
                tensors[f"hue_rows_{pos}"] = torch.from_numpy(rows)
        if "selected" in out:
            masked = np.asarray(out["masked_tokens"], dtype=np.int64)[:, :width]
            tensors["masked_tokens"] = torch.from_numpy(np.ascontiguousarray(masked))
            tensors["keep_idx"] = torch.from_numpy(out["keep_idx"])
            tensors["selected"] = torch.from_numpy(out["selected"])
            tensors["masked_index"] = torch.from_numpy(np.flatnonzero(out["selected"]).astype(np.int64))
        return tensors


class DecodedCache:
    """``DataConfig.cache_decoded``: the decoded rows one worker received in its first epoch, served again
    in a fresh order every later epoch, in full batches, through the same collate step (so the masked
    variants are still those of each epoch). Small datasets only: the rows live in the worker's memory.
    """

    def __init__(self) -> None:
        self._parts: list[dict[str, np.ndarray]] = []
        self._rows: dict[str, np.ndarray] | None = None
        self._lock = threading.Lock()  # Ray may collate prefetched batches in threads

    def keep(self, batch: dict[str, np.ndarray]) -> None:
        part = {k: np.array(v, copy=True) for k, v in batch.items()}  # not views of object-store blocks
        with self._lock:
            self._parts.append(part)

    @property
    def n_rows(self) -> int:
        if self._rows is not None:
            return len(self._rows["key"])
        return sum(len(p["key"]) for p in self._parts)

    def seal(self) -> None:
        """The first epoch is over: later epochs come from here."""
        if not self._parts:
            raise RuntimeError("data.cache_decoded: the first epoch delivered no rows to keep")
        with self._lock:
            rows = {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]}
            # In key order: the first epoch arrives in whatever order Ray Data's tasks finished, and the
            # later epochs' seeded permutations should not depend on that.
            order = np.argsort(rows["key"].astype(str), kind="stable")
            self._rows = {k: v[order] for k, v in rows.items()}
            self._parts = []

    @property
    def sealed(self) -> bool:
        return self._rows is not None

    def batches(
        self, batch_size: int, rng: np.random.Generator, collate: Callable[[dict[str, np.ndarray]], Any]
    ) -> Iterator[Any]:
        """One epoch: a permutation of the kept rows in full batches (the remainder waits for the next)."""
        assert self._rows is not None, "seal() first"
        order = rng.permutation(self.n_rows)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield collate({k: v[idx] for k, v in self._rows.items()})
