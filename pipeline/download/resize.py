"""Decode, bound, resize, face-blur and re-encode one downloaded image, with DataComp's semantics.

DataComp's ``download_upstream.py`` calls img2dataset with ``image_size=512``,
``resize_mode="keep_ratio_largest"``, ``resize_only_if_bigger=True`` and img2dataset's defaults
(``downscale_interpolation="area"``, ``encode_quality=95``, JPEG), blurring ``face_bboxes``. We reproduce:

- longest side ≤ ``image_size``, downscale only, aspect kept; output size ``round(side · scale)`` as
  albumentations' ``LongestMaxSize`` (img2dataset 1.47's resizer) computes it; OpenCV ``INTER_AREA``;
- alpha composited on white, as img2dataset's resizer does; every other mode converted to RGB;
- face blur *after* the resize, on the output-size image (img2dataset blurs whichever image it returns),
  pixel for pixel as img2dataset 1.40's ``BoundingBoxBlurrer`` (``blur_boxes``): σ = 0.1 · the longest
  side of the largest box in pixels, kernel 2·⌈4σ⌉+1 — not 1.46+'s kernel-derived σ' (docs/download.md);
- JPEG quality 95 with OpenCV's encoder (4:2:0), as img2dataset: for the same pixels, the same bytes.

Deviations, each deliberate (docs/download.md): the pixel count is checked from the header *before*
decoding (img2dataset decodes fully first); EXIF orientation is applied (OpenCV's ``IMREAD_UNCHANGED``
ignores it) *after* blurring, because DataComp's boxes were detected on unrotated images; JPEGs with
recoverable decode errors (truncated scans) are rejected as corrupt rather than kept half-grey; a face box
that is not four finite numbers is skipped (img2dataset fails the whole image on it). Large JPEGs are
decoded with libjpeg's DCT-domain downscale by a power of two while staying ≥ ``dct_margin`` × the target
size (``DownloadConfig.jpeg_dct_margin``; 0 = full decode, img2dataset's bytes), then area-resized.
Pixels are kept in OpenCV's BGR order from the decoder to the encoder: every step is per channel.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from pipeline.dedup.phash import phash64
from pipeline.download.pixel_budget import PixelBudget
from pipeline.schema import STATUS_SUCCESS, failed_download, failed_resize

# What Pillow may open. Excludes formats that shell out (EPS → Ghostscript) or are rarely images on the web.
# (MPO, the multi-picture JPEG of phones, is opened by the JPEG plugin; AVIF only where Pillow has it.)
Image.init()
ALLOWED_FORMATS = tuple(
    f for f in ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF", "ICO", "AVIF") if f in Image.OPEN
)
_MAGIC = (
    b"\xff\xd8\xff",
    b"\x89PNG\r\n\x1a\n",
    b"GIF87a",
    b"GIF89a",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
    b"\x00\x00\x01\x00",
)
DCT_MARGIN = 3.0  # DownloadConfig.jpeg_dct_margin's default (docs/download.md, "Where the time goes")


@dataclass(frozen=True)
class ImageResult:
    status: str
    jpg: bytes | None = None
    width: int | None = None
    height: int | None = None
    original_width: int | None = None
    original_height: int | None = None
    phash: int | None = None
    error: str = ""


def looks_like_image(data: bytes) -> bool:
    head = data[:16]
    if any(head.startswith(m) for m in _MAGIC):
        return True
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    return head[4:8] == b"ftyp" and head[8:12] in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1")


def output_size(width: int, height: int, image_size: int) -> tuple[int, int]:
    """(w, h) after keep_ratio_largest + resize_only_if_bigger, rounded like albumentations."""
    longest = max(width, height)
    if longest <= image_size:
        return width, height
    scale = image_size / longest
    return max(1, round(width * scale)), max(1, round(height * scale))


def dct_factor(width: int, height: int, out_w: int, out_h: int, margin: float = DCT_MARGIN) -> int:
    """Largest power-of-two JPEG scale-down (≤ 8) keeping the decoded image ≥ ``margin`` × the output;
    1 for ``margin`` 0 (always the full decode)."""
    f = 1
    while (
        margin > 0
        and f < 8
        and math.ceil(width / (2 * f)) >= margin * out_w
        and math.ceil(height / (2 * f)) >= margin * out_h
    ):
        f *= 2
    return f


# --- face blur ------------------------------------------------------------------------------------------

# img2dataset's blur strengths: DataComp pinned 1.40 (σ = 0.1·d, kernel 2·⌈4σ⌉+1); 1.46+ keeps only the
# kernel 2·⌈σ⌉+1 and lets OpenCV derive a weaker σ from it (docs/download.md).
BLUR_VARIANTS = ("img2dataset_1.40", "img2dataset_1.47")


def _gaussian(variant: str, sigma: float) -> tuple[int, float]:
    """(kernel size, σ handed to OpenCV; 0 = derive it from the kernel) for the largest box's σ."""
    if variant == "img2dataset_1.40":
        return int(2 * np.ceil(4 * sigma)) + 1, sigma
    if variant == "img2dataset_1.47":
        return max(3, int(2 * np.ceil(sigma) + 1)), 0.0
    raise ValueError(f"face blur variant must be one of {BLUR_VARIANTS}, got {variant!r}")


def _grown_rects(boxes: Sequence[Sequence[float]], w: int, h: int) -> tuple[list[tuple[int, ...]], int]:
    """img2dataset's mask rectangles and the largest box side ``d`` (its "diagonal"): corners scaled with
    ``int()``, grown by 0.1·d, then clipped to [0, W−1] × [0, H−1] as slice bounds — so the mask never
    reaches the last column or row. Boxes are used as given: no clamping, an inverted box adds nothing."""
    rects, side = [], 0
    for box in boxes:
        x0, y0, x1, y1 = int(box[0] * w), int(box[1] * h), int(box[2] * w), int(box[3] * h)
        d = max(x1 - x0, y1 - y0)
        side = max(side, d)
        grown = (int(x0 - 0.1 * d), int(y0 - 0.1 * d), int(x1 + 0.1 * d), int(y1 + 0.1 * d))
        rects.append(tuple(min(max(v, 0), lim - 1) for v, lim in zip(grown, (w, h, w, h), strict=True)))
    return rects, side


def blur_boxes(
    img: np.ndarray, boxes: Sequence[Sequence[float]], variant: str = "img2dataset_1.40"
) -> np.ndarray:
    """Blur ``boxes`` ([x0, y0, x1, y1], relative) of an (H, W, 3) uint8 image exactly as img2dataset's
    ``BoundingBoxBlurrer`` of ``variant`` does: float32 pixels/255, a box mask blurred by the same
    Gaussian (reflect-101 border) as the image, ``img·(1−M̃) + G(img)·M̃``, back to uint8 by truncation.

    Only the band of full-width rows the blurred mask can reach is computed (plus one more kernel radius
    of context): outside it the result equals the input exactly, and whole rows keep OpenCV's arithmetic
    per pixel the same as on the whole image.
    """
    h, w = img.shape[:2]
    rects, side = _grown_rects(boxes, w, h)
    ksize, sigma = _gaussian(variant, 0.1 * side)
    rects = [r for r in rects if r[2] > r[0] and r[3] > r[1]]
    if not rects or ksize <= 1:
        return img  # an empty mask or a 1-tap kernel leaves every pixel as it was
    radius = ksize // 2
    top = max(0, min(r[1] for r in rects) - 2 * radius)
    bottom = min(h, max(r[3] for r in rects) + 2 * radius)
    band = np.ascontiguousarray(img[top:bottom]).astype(np.float32) / 255.0
    mask = np.zeros_like(band)
    for x0, y0, x1, y1 in rects:
        mask[y0 - top : y1 - top, x0:x1] = 1
    blurred = cv2.GaussianBlur(band, (ksize, ksize), sigma)
    soft = cv2.GaussianBlur(mask, (ksize, ksize), sigma)
    out = img.copy()
    out[top:bottom] = ((band * (1 - soft) + blurred * soft) * 255.0).astype(np.uint8)
    return out


def _valid_boxes(face_bboxes: object) -> list[list[float]]:
    """Boxes img2dataset can compute with (4 finite numbers), unchanged; others are skipped (there they
    raise and fail the whole image)."""
    boxes = []
    for box in face_bboxes if face_bboxes is not None else ():
        try:
            vals = [float(v) for v in box]
        except (TypeError, ValueError):
            continue
        if len(vals) == 4 and all(math.isfinite(v) for v in vals):
            boxes.append(vals)
    return boxes


# --- decode ---------------------------------------------------------------------------------------------


STRIP_PIXELS = 1 << 18  # mode conversion runs over strips of about this many pixels (a few MB of temporaries)
# Resident bytes per decoded pixel while an image is converted: Pillow's own buffer (at most 4 B/px for the
# modes we accept) plus our uint8 RGB copy (3 B/px); strips add a bounded constant (docs/download.md).
DECODE_BYTES_PER_PIXEL = 7


def _composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """uint8 RGBA → uint8 RGB on white: round((c·a + 255·(255 − a)) / 255), integers only.

    Equals img2dataset's float formula ``c·(a/255) + 255·(1 − a/255)`` rounded: the exact quotient is never
    a half (255 is odd), and float32 error is far below the 1/510 distance to one.
    """
    a = rgba[..., 3:].astype(np.uint16)
    num = rgba[..., :3] * a + (255 * (255 - a) + 127)
    return (num // 255).astype(np.uint8)


def _strip_converter(im: Image.Image) -> Callable[[Image.Image], np.ndarray]:
    """A function turning one strip of ``im`` into (rows, W, 3) uint8 or (rows, W) grey uint8."""
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        return lambda s: _composite_on_white(np.asarray(s.convert("RGBA")))
    if im.mode.startswith("I;16"):
        return lambda s: (np.asarray(s).astype(np.uint16, copy=False) >> 8).astype(np.uint8)
    if im.mode == "I":
        # 16-bit samples → 8 bits (Pillow's convert would clip them instead); decided on the whole image.
        shift = 8 if (im.getextrema()[1] or 0) > 255 else 0  # type: ignore[index]
        return lambda s: (np.asarray(s) >> shift).clip(0, 255).astype(np.uint8)
    if im.mode == "F":
        return lambda s: np.asarray(s).clip(0, 255).astype(np.uint8)
    return lambda s: np.asarray(s.convert("RGB"))


def _to_rgb(im: Image.Image, bgr: bool = False) -> np.ndarray:
    """Loaded Pillow image of any mode → (H, W, 3) uint8 (channels reversed with ``bgr``); transparency
    composited on white like img2dataset.

    Converted strip by strip into one preallocated array, in integers: no full-size float or wide-int copy.
    """
    w, h = im.size
    out = np.empty((h, w, 3), np.uint8)
    convert = _strip_converter(im)
    rows = max(1, STRIP_PIXELS // max(1, w))
    for y in range(0, h, rows):
        part = convert(im.crop((0, y, w, min(h, y + rows))))
        out[y : y + part.shape[0]] = (part[..., ::-1] if bgr else part) if part.ndim == 3 else part[..., None]
    return out


def decoded_pixels(im: Image.Image, out_w: int, out_h: int, margin: float = DCT_MARGIN) -> int:
    """Pixels ``_decode`` will materialise for ``im`` (after the DCT-domain scale-down for JPEGs)."""
    w, h = im.size
    if im.format in ("JPEG", "MPO"):
        f = dct_factor(w, h, out_w, out_h, margin)
        return math.ceil(w / f) * math.ceil(h / f)
    return w * h


def _decode(data: bytes, im: Image.Image, out_w: int, out_h: int, margin: float = DCT_MARGIN) -> np.ndarray:
    """BGR pixels of ``data`` (header already parsed into ``im``), possibly DCT-downscaled for JPEGs."""
    w, h = im.size
    is_jpeg = im.format in ("JPEG", "MPO")
    f = dct_factor(w, h, out_w, out_h, margin) if is_jpeg else 1
    if is_jpeg and im.mode in ("RGB", "L"):
        try:
            # strict: libjpeg warnings (truncated scan, bad Huffman data) raise instead of grey rows.
            return simplejpeg.decode_jpeg(
                data, colorspace="BGR", min_width=math.ceil(w / f), min_height=math.ceil(h / f), strict=True
            )
        except ValueError:
            pass  # Pillow tolerates benign warnings (extraneous bytes) but still refuses truncated data
    if f > 1:
        im.draft(im.mode, (math.ceil(w / f), math.ceil(h / f)))
    im.load()
    return _to_rgb(im, bgr=True)


def _orientation(im: Image.Image) -> int:
    try:
        return int(im.getexif().get(0x0112, 1) or 1)
    except Exception:
        return 1  # a broken EXIF block should not cost us the image


def _decode_resized(
    data: bytes, im: Image.Image, out_w: int, out_h: int, margin: float
) -> tuple[np.ndarray, int]:
    """BGR pixels area-resized to the output size, and the EXIF orientation; Pillow's buffer closed early.

    The orientation is read after the decode: Pillow's PNG ``getexif`` decodes the whole image to look
    for an ``eXIf`` chunk after the pixel data, which must happen inside the pixel budget, and only once.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pixels = _decode(data, im, out_w, out_h, margin)
            orientation = _orientation(im)
        finally:
            im.close()
    return area_resize(pixels, (out_w, out_h)), orientation


def area_resize(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """OpenCV INTER_AREA to ``size`` (w, h), img2dataset's downscale filter; unchanged when already that size."""
    if pixels.shape[1::-1] == size:
        return pixels
    return cv2.resize(pixels, size, interpolation=cv2.INTER_AREA)


_ORIENT = {  # EXIF orientation → numpy ops turning the stored frame into the displayed one
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: np.swapaxes(a, 0, 1),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: np.rot90(a, -1)[::-1],
    8: lambda a: np.rot90(a, 1),
}


def process_image(
    data: bytes,
    *,
    image_size: int = 512,
    jpeg_quality: int = 95,
    max_pixels: int = 89_478_485,
    face_bboxes: Sequence[Sequence[float]] | None = None,
    blur_faces: bool = True,
    budget: PixelBudget | None = None,
    deadline: float = math.inf,
    dct_margin: float = DCT_MARGIN,
) -> ImageResult:
    """Downloaded bytes → re-encoded JPEG and sizes, or a ``failed_to_resize:<reason>`` status.

    With a ``budget``, the decode waits for its pixels (``decoded_pixels``) to be free; still waiting at
    ``deadline`` (``time.monotonic()``) gives ``failed_to_download:deadline``.
    """
    if not data or not looks_like_image(data):
        return ImageResult(failed_resize("not_an_image"), error="no image signature")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)  # header only
    except Image.DecompressionBombError as exc:
        return ImageResult(failed_resize("too_many_pixels"), error=str(exc))
    except Exception as exc:  # signature ok but the header does not parse
        return ImageResult(failed_resize("corrupt"), error=f"header: {exc}")
    w, h = im.size
    if w <= 0 or h <= 0 or w * h > max_pixels:
        return ImageResult(failed_resize("too_many_pixels"), error=f"{w}x{h} > {max_pixels} pixels")
    out_w, out_h = output_size(w, h, image_size)
    try:
        held = decoded_pixels(im, out_w, out_h, dct_margin)
        with budget.hold(held, deadline) if budget else contextlib.nullcontext():
            pixels, orientation = _decode_resized(data, im, out_w, out_h, dct_margin)
    except TimeoutError as exc:
        return ImageResult(failed_download("deadline"), error=str(exc))
    except Exception as exc:
        return ImageResult(failed_resize("corrupt"), error=f"decode: {exc}")
    finally:
        im.close()
    if blur_faces:
        boxes = _valid_boxes(face_bboxes)
        if boxes:
            pixels = blur_boxes(pixels, boxes)
    if orientation in _ORIENT:
        pixels = np.ascontiguousarray(_ORIENT[orientation](pixels))
        w, h = (h, w) if orientation >= 5 else (w, h)
    pixels = np.ascontiguousarray(pixels)
    # OpenCV's encoder, as img2dataset's: same bytes for the same pixels (TurboJPEG's API, which
    # simplejpeg wraps, quantises chroma slightly differently at the same quality).
    ok, buf = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality])
    if not ok:
        return ImageResult(failed_resize("corrupt"), error="JPEG encode failed")
    jpg = buf.tobytes()
    out_h, out_w = pixels.shape[:2]
    return ImageResult(STATUS_SUCCESS, jpg, out_w, out_h, w, h, phash64(pixels, "BGR"))
