"""Procedural pictures for the demo pool: one coloured shape on a textured, unevenly lit background.

The visual vocabulary is 8 shapes × 8 colours × 2 sizes × 3×3 positions × 5 textures × 4 background
colours. Captions (pipeline/demo/captions.py) name the first three; position and background vary unnamed.
The zero-shot eval sets classify shapes and colours. Choices that matter:

- Shapes are large (radius ≈ 0.19 or 0.33 of the short side) with distinct silhouettes, because the demo
  models see 32 px images and learn shapes much later than colours
  (docs/decisions/0002-demo-subset-model.md).
- Every picture gets a random smooth lighting ramp and a random texture phase: the low DCT frequencies
  that the perceptual hash (pipeline/dedup/phash.py) looks at then differ between unrelated pictures, which the
  generator needs to promise "unrelated images are ≥ 12 bits apart".
- A few pictures get a cartoon "face" blob, whose box becomes a DataComp ``face_bboxes`` entry.

Rendering is numpy for the background and Pillow for the shape masks (drawn at 2× and box-downsampled for
smooth edges); one 256 px picture costs about a millisecond.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image, ImageDraw, ImageFilter

SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "diamond", "heart")
COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")
SIZES = ("small", "large")
POSITIONS = (
    "top left",
    "top",
    "top right",
    "left",
    "center",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
TEXTURES = ("plain", "striped", "dotted", "checkered", "noisy")
BACKGROUNDS = ("grey", "beige", "brown", "teal")

COLOUR_RGB = {
    "red": (215, 35, 35),
    "green": (40, 165, 55),
    "blue": (35, 75, 215),
    "yellow": (240, 215, 35),
    "purple": (135, 50, 175),
    "orange": (245, 135, 25),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
# Mid-tone backgrounds so that both the white and the black shapes stand out.
BACKGROUND_RGB = {
    "grey": (128, 128, 128),
    "beige": (196, 180, 146),
    "brown": (120, 90, 66),
    "teal": (58, 122, 122),
}
SKIN_RGB = (232, 192, 160)

_RADIUS = {"small": (0.17, 0.22), "large": (0.30, 0.36)}  # fraction of the short side


@dataclass(frozen=True)
class Scene:
    """What a picture shows, by index into the vocabularies above, and its pixel size."""

    shape: int
    colour: int
    size: int
    position: int
    texture: int
    background: int
    width: int
    height: int
    face: bool = False


@dataclass(frozen=True)
class Rendered:
    image: Image.Image
    face_bbox: tuple[float, float, float, float] | None  # [x0, y0, x1, y1] in [0, 1]


def _unit_polygon(shape: str) -> list[tuple[float, float]]:
    """Outline on a unit radius, centred at 0 (y down)."""
    if shape == "square":
        s = 0.82
        return [(-s, -s), (s, -s), (s, s), (-s, s)]
    if shape == "triangle":
        return [(math.cos(a), math.sin(a) + 0.15) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if shape == "star":
        pts = []
        for k in range(10):
            r = 1.0 if k % 2 == 0 else 0.45
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((r * math.cos(a), r * math.sin(a)))
        return pts
    if shape == "cross":
        t = 0.3  # half arm width: wide arms survive downscaling to 64 px
        return [
            (-t, -1),
            (t, -1),
            (t, -t),
            (1, -t),
            (1, t),
            (t, t),
            (t, 1),
            (-t, 1),
            (-t, t),
            (-1, t),
            (-1, -t),
            (-t, -t),
        ]
    if shape == "diamond":
        return [(0, -1), (0.62, 0), (0, 1), (-0.62, 0)]
    if shape == "heart":
        ts = np.linspace(0, 2 * math.pi, 48, endpoint=False)
        x = 16 * np.sin(ts) ** 3
        y = -(13 * np.cos(ts) - 5 * np.cos(2 * ts) - 2 * np.cos(3 * ts) - np.cos(4 * ts))
        return list(zip((x / 17).tolist(), (y / 17 + 0.1).tolist(), strict=True))
    raise ValueError(shape)


_POLYGONS = {s: _unit_polygon(s) for s in SHAPES if s not in ("circle", "ring")}


def _shape_mask(shape: str, w: int, h: int, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """Anti-aliased coverage in [0, 1], (h, w) float32: drawn at 2× then box-downsampled."""
    ss = 2
    im = Image.new("L", (w * ss, h * ss), 0)
    draw = ImageDraw.Draw(im)
    X, Y, R = cx * ss, cy * ss, r * ss
    if shape in ("circle", "ring"):
        draw.ellipse((X - R, Y - R, X + R, Y + R), fill=255)
        if shape == "ring":
            ri = 0.52 * R
            draw.ellipse((X - ri, Y - ri, X + ri, Y + ri), fill=0)
    else:
        c, s = math.cos(angle), math.sin(angle)
        pts = [(X + R * (c * px - s * py), Y + R * (s * px + c * py)) for px, py in _POLYGONS[shape]]
        draw.polygon(pts, fill=255)
    im = im.reduce(ss)
    return np.asarray(im, dtype=np.float32) * (1.0 / 255.0)


def _texture(scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """(h, w) float32 grey-level offsets of the background texture (separable where possible: speed)."""
    w, h = scene.width, scene.height
    xx = np.arange(w, dtype=np.float32)
    yy = np.arange(h, dtype=np.float32)
    texture = TEXTURES[scene.texture]
    if texture == "plain":
        return np.zeros((h, w), np.float32)
    if texture == "striped":
        a = rng.uniform(0, math.pi)
        period = rng.uniform(14, 30)
        u = np.add.outer(
            yy * np.float32(math.sin(a) / period), xx * np.float32(math.cos(a) / period) + rng.uniform(0, 1)
        )
        return np.where(u % 1.0 < 0.5, np.float32(24), np.float32(-24))
    if texture == "dotted":
        step = rng.uniform(14, 24)
        rad = rng.uniform(2.5, 4.5)
        ox, oy = rng.uniform(0, step, size=2)
        dx = (xx + ox) % step - step / 2
        dy = (yy + oy) % step - step / 2
        return np.where(np.add.outer(dy * dy, dx * dx) < rad * rad, np.float32(40), np.float32(0))
    if texture == "checkered":
        cell = rng.uniform(14, 30)
        ox, oy = rng.uniform(0, 2 * cell, size=2)
        px = np.floor((xx + ox) / cell).astype(np.int32) & 1
        py = np.floor((yy + oy) / cell).astype(np.int32) & 1
        return np.where(np.bitwise_xor.outer(py, px) == 0, np.float32(20), np.float32(-20))
    return rng.standard_normal(size=(h, w), dtype=np.float32) * np.float32(20)  # noisy


_LIGHT_FREQS = 6


def _lighting(w: int, h: int, rng: np.random.Generator, strength: float = 1.0) -> np.ndarray:
    """Uneven lighting, (h, w) float32: random low-frequency cosine components (those the 8×8 DCT of
    the perceptual hash sees), largest at the lowest frequencies, ~±40 grey levels peak."""
    k = np.arange(_LIGHT_FREQS, dtype=np.float32)
    coef = rng.standard_normal((_LIGHT_FREQS, _LIGHT_FREQS)).astype(np.float32)
    coef *= np.float32(14.0 * strength) / (1.0 + 0.35 * (k[:, None] + k[None, :]))
    coef[0, 0] = 0.0  # overall brightness stays the background colour's
    cy = np.cos(np.pi * k[:, None] * (np.arange(h, dtype=np.float32)[None, :] + 0.5) / h)  # (F, h)
    cx = np.cos(np.pi * k[:, None] * (np.arange(w, dtype=np.float32)[None, :] + 0.5) / w)  # (F, w)
    rows = (coef.T @ cy).astype(np.float32)  # (F, h): tiny; the (h, w) product below avoids BLAS, whose
    out = np.multiply.outer(rows[0], cx[0])  # thread start-up costs more than this whole sum
    for f in range(1, _LIGHT_FREQS):
        out += np.multiply.outer(rows[f], cx[f])
    return out


def layout(scene: Scene, rng: np.random.Generator) -> tuple[float, float, float]:
    """Centre and radius in pixels: the named grid cell of the free area, jittered."""
    w, h = scene.width, scene.height
    lo, hi = _RADIUS[SIZES[scene.size]]
    r = rng.uniform(lo, hi) * min(w, h)
    row, col = divmod(scene.position, 3)
    margin = 0.03 * min(w, h)
    centres = []
    for idx, extent in ((col, w), (row, h)):
        free = extent - 2 * (r + margin)
        c = r + margin + free * idx / 2 + rng.uniform(-0.06, 0.06) * free
        centres.append(float(np.clip(c, r + margin, extent - r - margin)))
    return centres[0], centres[1], float(r)


def _face(
    w: int, h: int, cx: float, cy: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Skin and feature masks for a cartoon face in the image corner farthest from the shape."""
    side = 0.24 * min(w, h)
    fx = 0.04 * w if cx > w / 2 else w - 0.04 * w - side
    fy = 0.04 * h if cy > h / 2 else h - 0.04 * h - side
    fx += rng.uniform(-0.01, 0.01) * w
    fy += rng.uniform(-0.01, 0.01) * h
    skin = Image.new("L", (w, h), 0)
    feat = Image.new("L", (w, h), 0)
    ds, df = ImageDraw.Draw(skin), ImageDraw.Draw(feat)
    ds.ellipse((fx, fy, fx + side, fy + side * 1.0), fill=255)
    e = side * 0.09
    for ex in (0.33, 0.67):
        df.ellipse(
            (fx + ex * side - e, fy + 0.38 * side - e, fx + ex * side + e, fy + 0.38 * side + e), fill=255
        )
    df.arc(
        (fx + 0.28 * side, fy + 0.45 * side, fx + 0.72 * side, fy + 0.78 * side),
        20,
        160,
        fill=255,
        width=max(2, int(e)),
    )
    bbox = (fx / w, fy / h, (fx + side) / w, (fy + side) / h)
    bbox = tuple(float(np.clip(b, 0.0, 1.0)) for b in bbox)
    to_f = 1.0 / 255.0
    return np.asarray(skin, np.float32) * to_f, np.asarray(feat, np.float32) * to_f, bbox


def render(scene: Scene, seed: int | np.random.SeedSequence) -> Rendered:
    """Draw ``scene``; the same (scene, seed) always gives the same pixels."""
    rng = np.random.default_rng(seed)
    w, h = scene.width, scene.height
    light = _lighting(w, h, rng)
    grey = _texture(scene, rng)
    grey += light
    cx, cy, r = layout(scene, rng)
    angle = math.radians(rng.uniform(-12, 12))
    mask = _shape_mask(SHAPES[scene.shape], w, h, cx, cy, r, angle)
    base = BACKGROUND_RGB[BACKGROUNDS[scene.background]]
    rgb = np.array(COLOUR_RGB[COLOURS[scene.colour]], np.float32) + rng.uniform(-10, 10, size=3).astype(
        np.float32
    )
    face = _face(w, h, cx, cy, rng) if scene.face else None
    # Per channel c: bg_c = grey + base_c, shape_c = light / 2 + rgb_c (the shape gets half the lighting so
    # its colour stays nameable), pixel = bg_c + mask · (shape_c − bg_c) = shared + base_c + mask · (rgb_c −
    # base_c), with the channel-independent part computed once. Planar (h, w) arithmetic: (h, w, 3)
    # broadcasting runs several times slower.
    shared = grey
    shared += mask * (0.5 * light - grey)
    shared += 0.5  # rounding
    planes = []
    for c in range(3):
        plane = mask * np.float32(rgb[c] - base[c])
        plane += shared
        plane += np.float32(base[c])
        if face is not None:
            skin, feat, _ = face
            plane += skin * (SKIN_RGB[c] - plane)
            plane += feat * (40.0 - plane)
        np.clip(plane, 0, 255, out=plane)
        planes.append(Image.fromarray(plane.astype(np.uint8), "L"))
    return Rendered(Image.merge("RGB", planes), face[2] if face is not None else None)


def encode_jpeg(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=int(quality))
    return buf.getvalue()


def decode(data: bytes) -> Image.Image:
    """RGB pixels of an encoded picture. JPEGs go through simplejpeg (libjpeg-turbo, accurate IDCT and
    upsampling: the same pixels as Pillow's decoder at about half the cost)."""
    if data[:3] == b"\xff\xd8\xff":
        return Image.fromarray(
            simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False)
        )
    im = Image.open(io.BytesIO(data))
    im.load()
    return im.convert("RGB")


def approx_face_blur(image: Image.Image, bboxes: list[tuple[float, float, float, float]]) -> Image.Image:
    """The build's face blur, approximately (DataComp / img2dataset ≤ 1.45: σ = 0.1 × the largest box side
    in pixels, box grown by 10%, feathered mask). Only used to check hash separation after blurring."""
    w, h = image.size
    boxes = [(x0 * w, y0 * h, x1 * w, y1 * h) for x0, y0, x1, y1 in bboxes]
    diag = max(max(b[2] - b[0], b[3] - b[1]) for b in boxes)
    sigma = max(0.1 * diag, 0.5)
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    for x0, y0, x1, y1 in boxes:
        d = max(x1 - x0, y1 - y0)
        draw.rectangle((x0 - 0.1 * d, y0 - 0.1 * d, x1 + 0.1 * d, y1 + 0.1 * d), fill=255)
    # Blur only the region the feathered mask can reach (the whole picture costs ~10× more).
    pad = 3 * sigma
    region = (
        max(0, int(min(b[0] for b in boxes) - 0.1 * diag - 2 * pad)),
        max(0, int(min(b[1] for b in boxes) - 0.1 * diag - 2 * pad)),
        min(w, int(max(b[2] for b in boxes) + 0.1 * diag + 2 * pad) + 1),
        min(h, int(max(b[3] for b in boxes) + 0.1 * diag + 2 * pad) + 1),
    )
    crop = image.crop(region)
    blurred = crop.filter(ImageFilter.GaussianBlur(sigma))
    soft = mask.crop(region).filter(ImageFilter.GaussianBlur(sigma))
    out = image.copy()
    out.paste(Image.composite(blurred, crop, soft), region[:2])
    return out
