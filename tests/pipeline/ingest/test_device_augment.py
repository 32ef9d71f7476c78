"""The device half of the augmentation against a float64 reference written from torchvision's definitions.

The reference below applies torchvision's tensor ColorJitter and RandomGrayscale per image, in float64,
with scikit-image's HSV conversion for the hue (an independent implementation of the colour wheel); the
batched torch version (pipeline/ingest/device_augment.py) must agree image by image for the parameters
the decode tasks draw (pipeline/ingest/augment.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from skimage.color import hsv2rgb, rgb2hsv

from pipeline.ingest import augment as A
from pipeline.ingest.device_augment import (
    DeviceAugment,
    color_jitter,
    hsv_to_rgb,
    hue_rows_by_position,
    rgb_to_hsv,
)

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _luma(x: np.ndarray) -> np.ndarray:
    return x[..., 0] * 0.299 + x[..., 1] * 0.587 + x[..., 2] * 0.114


def reference(img: np.ndarray, factors: np.ndarray, order: np.ndarray, gray: bool) -> np.ndarray:
    """One uint8 (H, W, 3) image → normalised float64 (3, H, W), torchvision's operations in ``order``."""
    x = img.astype(np.float64) / 255.0
    for op in order:
        f = float(factors[op])
        if op == 0:
            x = np.clip(f * x, 0, 1)
        elif op == 1:
            x = np.clip(f * x + (1 - f) * _luma(x).mean(), 0, 1)
        elif op == 2:
            x = np.clip(f * x + (1 - f) * _luma(x)[..., None], 0, 1)
        else:
            hsv = rgb2hsv(x)
            hsv[..., 0] = (hsv[..., 0] + f) % 1.0
            x = hsv2rgb(hsv)
    if gray:
        x = np.repeat(_luma(x)[..., None], 3, axis=-1)
    return ((x - np.asarray(MEAN)) / np.asarray(STD)).transpose(2, 0, 1)


def _images(n: int, size: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _batch(images: np.ndarray, factors, order, gray) -> dict[str, torch.Tensor]:
    """A collated batch as TrainCollate makes it (hue rows listed on the host)."""
    rows = {f"hue_rows_{p}": torch.from_numpy(r) for p, r in enumerate(hue_rows_by_position(factors, order))}
    return {
        "images": torch.from_numpy(images),
        "jitter": torch.from_numpy(factors),
        "jitter_order": torch.from_numpy(order),
        "gray": torch.from_numpy(gray),
        **rows,
    }


def test_batched_jitter_and_grayscale_match_the_per_image_reference() -> None:
    rng = np.random.default_rng(3)
    n = 24
    images = _images(n)
    factors, order = A.draw_jitter(n, (0.32, 0.32, 0.32, 0.08), 0.8, rng)
    gray = A.draw_grayscale(n, 0.3, rng)
    assert gray.any() and not gray.all() and (factors != np.float32(A.IDENTITY_FACTORS)).any(1).sum() > n // 2
    out = DeviceAugment(MEAN, STD)(_batch(images, factors, order, gray))
    assert out.shape == (n, 3, 12, 12) and out.dtype == torch.float32 and out.is_contiguous()
    for i in range(n):
        want = reference(images[i], factors[i], order[i], bool(gray[i]))
        np.testing.assert_allclose(out[i].numpy(), want, atol=2e-5, err_msg=f"image {i}")


def test_strong_hue_shifts_and_every_order_match_the_reference() -> None:
    """Large hue shifts (either way round the wheel), saturated and grey pixels, each of the 24 orders."""
    import itertools

    orders = np.array(list(itertools.permutations(range(4))), dtype=np.int8)  # (24, 4)
    n = len(orders)
    images = _images(n, seed=5)
    images[0] = 128  # a flat grey image: hue undefined, saturation 0
    images[1, :, :, 0], images[1, :, :, 1:] = 255, 0  # pure red
    rng = np.random.default_rng(0)
    factors = np.stack(
        [
            rng.uniform(0.5, 1.5, n),
            rng.uniform(0.5, 1.5, n),
            rng.uniform(0.0, 2.0, n),
            rng.uniform(-0.5, 0.5, n),
        ],
        1,
    ).astype(np.float32)
    out = DeviceAugment(MEAN, STD)(_batch(images, factors, orders, np.zeros(n, bool)))
    for i in range(n):
        np.testing.assert_allclose(
            out[i].numpy(), reference(images[i], factors[i], orders[i], False), atol=3e-5
        )


def test_identity_parameters_only_normalise() -> None:
    images = _images(6)
    factors = np.tile(np.float32(A.IDENTITY_FACTORS), (6, 1))
    order = np.tile(np.arange(4, dtype=np.int8), (6, 1))
    jittered = DeviceAugment(MEAN, STD)(_batch(images, factors, order, np.zeros(6, bool)))
    plain = DeviceAugment(MEAN, STD)({"images": torch.from_numpy(images)})
    torch.testing.assert_close(jittered, plain, atol=5e-6, rtol=0)  # float32 HSV round trip
    want = (images / 255.0 - np.asarray(MEAN)) / np.asarray(STD)
    np.testing.assert_allclose(plain.numpy(), want.transpose(0, 3, 1, 2), atol=1e-6)
    already = torch.randn(2, 3, 4, 4)
    assert DeviceAugment(MEAN, STD)({"images": already}) is already  # float input is the model's already


def test_hsv_conversions_round_trip_and_agree_with_scikit_image() -> None:
    x = torch.from_numpy(_images(4, seed=9)).permute(0, 3, 1, 2).double() / 255.0
    hsv = rgb_to_hsv(x)
    np.testing.assert_allclose(
        hsv.permute(0, 2, 3, 1).numpy(), rgb2hsv(x.permute(0, 2, 3, 1).numpy()), atol=1e-12
    )
    torch.testing.assert_close(hsv_to_rgb(hsv), x, atol=1e-12, rtol=0)


def test_drawn_parameters_follow_the_recipe() -> None:
    rng = np.random.default_rng(1)
    factors, order = A.draw_jitter(20_000, (0.32, 0.32, 0.32, 0.08), 0.8, rng)
    jittered = (factors != np.float32(A.IDENTITY_FACTORS)).any(1)
    assert 0.79 < jittered.mean() < 0.81
    on = factors[jittered]
    assert on[:, :3].min() >= 0.68 and on[:, :3].max() <= 1.32 and np.abs(on[:, 3]).max() <= 0.08
    assert (np.sort(order, 1) == np.arange(4)).all()  # a permutation per image
    f0, _ = A.draw_jitter(100, (0.0, 0.4, 0.0, 0.0), 1.0, rng)  # zero strength: the identity factor
    assert (f0[:, 0] == 1).all() and (f0[:, 2] == 1).all() and (f0[:, 3] == 0).all() and (f0[:, 1] != 1).all()
    assert 0.19 < A.draw_grayscale(20_000, 0.2, rng).mean() < 0.21


def test_hue_on_the_listed_rows_equals_hue_everywhere() -> None:
    """The collate step's per-position hue rows (host side) give what the all-rows path gives."""
    images = _images(16)
    rng = np.random.default_rng(4)
    factors, order = A.draw_jitter(16, (0.3, 0.3, 0.3, 0.1), 0.7, rng)
    rows = hue_rows_by_position(factors, order)
    assert sum(len(r) for r in rows) == int((factors[:, 3] != 0).sum()) > 0
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    f, o = torch.from_numpy(factors), torch.from_numpy(order)
    listed = color_jitter(x, f, o, [torch.from_numpy(r) for r in rows])
    torch.testing.assert_close(listed, color_jitter(x, f, o), atol=2e-6, rtol=0)


@pytest.mark.gpu
def test_device_augment_on_cuda_matches_cpu() -> None:
    rng = np.random.default_rng(2)
    images = _images(16)
    factors, order = A.draw_jitter(16, (0.32, 0.32, 0.32, 0.08), 0.8, rng)
    batch = _batch(images, factors, order, A.draw_grayscale(16, 0.2, rng))
    cpu = DeviceAugment(MEAN, STD)(batch)
    cuda = DeviceAugment(MEAN, STD)({k: v.cuda() for k, v in batch.items()})
    torch.testing.assert_close(cuda.cpu(), cpu, atol=1e-5, rtol=0)
