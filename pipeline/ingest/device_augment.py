"""The pixel half of the training augmentation, batched in torch on the training device.

The decode tasks (pipeline/ingest/transforms.py) stop at a uint8 crop (B, S, S, 3) and draw the per-image
ColorJitter/RandomGrayscale parameters (pipeline/ingest/augment.py); what costs arithmetic per pixel runs
here, on the whole batch at once, where the batch already is (the GPU in a GPU run, the worker's CPU
otherwise): uint8 → float in [0, 1], colour jitter, grayscale, mean/std normalisation, HWC → CHW. A uint8
crop is a quarter of the float32 tensor it becomes, in the object store, on the network and in the
host-to-device copy.

The operations follow torchvision's tensor ColorJitter (``torchvision.transforms.functional``):

- brightness f: ``clamp(f·x)``; contrast f: blend with the image's mean luma; saturation f: blend with
  the image's luma; hue h: rotate the HSV hue by h (a fraction of the colour wheel);
- the four in the per-image order drawn on the host; an image without jitter carries the identity factors
  (1, 1, 1, 0), so every image takes the same code path — no data-dependent shapes, no host sync;
- grayscale: ITU-R 601-2 luma (0.299, 0.587, 0.114) in all three channels.

Shapes never depend on the data on the device: the three blends run on the whole batch at each of the four
positions (the identity factor where an image does something else), and the hue, which costs most, on
the rows that the collate step listed on the host (``hue_rows_by_position``), so the gather's size is a
shape the host already knows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

_LUMA = (0.299, 0.587, 0.114)


def _luma(x: Tensor) -> Tensor:
    """(B, 3, H, W) → (B, 1, H, W)."""
    return x[:, 0:1] * _LUMA[0] + x[:, 1:2] * _LUMA[1] + x[:, 2:3] * _LUMA[2]


def _blend(x: Tensor, other: Tensor, f: Tensor) -> Tensor:
    return (f * x + (1.0 - f) * other).clamp_(0.0, 1.0)


def rgb_to_hsv(x: Tensor) -> Tensor:
    """(B, 3, H, W) RGB in [0, 1] → HSV in [0, 1] (hue as a fraction of the wheel)."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    delta = maxc - minc
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    h = torch.where(r == maxc, bc - gc, torch.where(g == maxc, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.where(delta > 0, torch.remainder(h / 6.0, 1.0), torch.zeros_like(h))
    s = torch.where(
        maxc > 0, delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc)), torch.zeros_like(maxc)
    )
    return torch.stack([h, s, maxc], 1)


def hsv_to_rgb(hsv: Tensor) -> Tensor:
    """(B, 3, H, W) HSV in [0, 1] → RGB, branch-free: channel n ∈ (5, 3, 1) is v − v·s·clamp(min(k, 4 − k), 0, 1)
    with k = (n + 6h) mod 6 (the closed form of the six-sector rule)."""
    h, s, v = hsv.unbind(1)
    vs = v * s
    channels = []
    for n in (5.0, 3.0, 1.0):  # Python constants: no tensor built from host data on the device
        k = torch.remainder(n + 6.0 * h, 6.0)
        channels.append(v - vs * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0))
    return torch.stack(channels, 1)


def _hue(x: Tensor, shift: Tensor) -> Tensor:
    hsv = rgb_to_hsv(x)
    hue = torch.remainder(hsv[:, 0] + shift.view(-1, 1, 1), 1.0)
    return hsv_to_rgb(torch.stack([hue, hsv[:, 1], hsv[:, 2]], 1))


def color_jitter(
    x: Tensor, factors: Tensor, order: Tensor, hue_rows: Sequence[Tensor] | None = None
) -> Tensor:
    """ColorJitter on (B, 3, H, W) floats in [0, 1]: ``factors`` (B, 4) (brightness, contrast, saturation,
    hue shift), ``order`` (B, 4) the operation index at each position.

    Brightness, contrast and saturation are all blends ``clamp(f·x + (1 − f)·other)`` (other = 0, the mean
    luma, the luma), so each position costs one blend for the whole batch, f = 1 for an image whose
    operation there is the hue. The hue (the costly HSV round trip) runs on the rows ``hue_rows[pos]``
    that rotate their hue at ``pos`` (from ``hue_rows_by_position``, computed on the host by the collate
    step, so the gather's size is a known shape); without them, on every image at every position.
    """
    factors, order = factors.to(x.dtype), order.long()
    for pos in range(4):
        op = order[:, pos : pos + 1]  # (B, 1)
        f = torch.where(op == 3, 1.0, factors.gather(1, op.clamp(max=2))).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        luma = _luma(x)  # (B, 1, H, W)
        other = torch.where((op == 1).view(-1, 1, 1, 1), luma.mean(dim=(2, 3), keepdim=True), luma)
        other = torch.where((op == 0).view(-1, 1, 1, 1), 0.0, other)
        x = _blend(x, other, f)
        if hue_rows is None:
            x = torch.where((op == 3).view(-1, 1, 1, 1), _hue(x, factors[:, 3]), x)
        elif hue_rows[pos].numel():  # a shape: no device sync
            rows = hue_rows[pos]
            x = x.index_copy(0, rows, _hue(x.index_select(0, rows), factors[:, 3].index_select(0, rows)))
    return x


def hue_rows_by_position(factors: np.ndarray, order: np.ndarray) -> list[np.ndarray]:
    """Host side of ``color_jitter``: per position, the int64 rows whose hue rotates there (a zero shift, the
    identity of an image without jitter, is skipped)."""
    turns = (np.asarray(order) == 3) & (np.asarray(factors)[:, 3:4] != 0)  # (B, 4)
    return [np.flatnonzero(turns[:, pos]).astype(np.int64) for pos in range(4)]


def random_grayscale(x: Tensor, gray: Tensor) -> Tensor:
    """(B, 3, H, W): the images where ``gray`` (B,) is True replaced by their luma in all three channels."""
    return torch.where(gray.view(-1, 1, 1, 1), _luma(x).expand_as(x), x)


class DeviceAugment:
    """uint8 crops (B, S, S, 3) plus the drawn parameters → normalised float32 (B, 3, S, S) on their device.

    The batch's ``jitter``/``jitter_order``/``gray`` columns (absent when the recipe has no such step) and
    ``hue_rows_0..3`` (the collate step's) drive the pixel operations. Float images (B, 3, S, S) pass
    through unchanged: they are already the model's input.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = tuple(map(float, mean)), tuple(map(float, std))
        self._stats: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _mean_std(self, device: torch.device) -> tuple[Tensor, Tensor]:
        # Built once per device: a tensor made from host values is a blocking copy on CUDA.
        if device not in self._stats:
            mean = torch.tensor(self.mean, dtype=torch.float32).view(1, 3, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32).view(1, 3, 1, 1)
            self._stats[device] = (mean.to(device), std.to(device))
        return self._stats[device]

    @torch.no_grad()
    def __call__(self, batch: Mapping[str, Tensor]) -> Tensor:
        images = batch["images"]
        if images.dtype != torch.uint8:
            return images
        x = images.permute(0, 3, 1, 2).float().div_(255.0)  # (B, 3, S, S), channels-last strides
        if "jitter" in batch:
            hue_rows = [batch[f"hue_rows_{p}"] for p in range(4)] if "hue_rows_0" in batch else None
            x = color_jitter(x, batch["jitter"], batch["jitter_order"], hue_rows)
        if "gray" in batch:
            x = random_grayscale(x, batch["gray"])
        mean, std = self._mean_std(x.device)
        return ((x - mean) / std).contiguous()
