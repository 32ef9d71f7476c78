"""Small training shards built in code: one coloured shape per JPEG and a caption naming it.

``write_demo_shards(dir, n_shards, per_shard)`` writes ``{i:08d}.tar`` with ``pipeline.shards.write_shard``
(keys are 32-hex uids, members jpg/txt/json) and returns the paths. Colour and shape are drawn from a
seeded generator, so captions are informative and the loss can fall within a few dozen steps.
Fixture ``demo_shards``: 4 shards × 96 samples at 64 px in a session temp directory.
"""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from pipeline.shards import write_shard

COLOURS = {
    "red": (215, 35, 35),
    "green": (40, 165, 55),
    "blue": (35, 75, 215),
    "yellow": (240, 215, 35),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")


def render(colour: str, shape: str, size: int, rng: np.random.Generator) -> bytes:
    bg = tuple(int(v) for v in rng.integers(90, 170, 3))
    img = Image.new("RGB", (size, size), bg)
    draw = ImageDraw.Draw(img)
    r = size * rng.uniform(0.25, 0.4)
    cx, cy = size / 2 + rng.uniform(-0.1, 0.1) * size, size / 2 + rng.uniform(-0.1, 0.1) * size
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def demo_samples(n: int, size: int = 64, seed: int = 0, start: int = 0) -> list[dict]:
    rng = np.random.default_rng([seed, start])
    out = []
    for i in range(n):
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        key = uuid.UUID(int=(seed << 64) + start + i).hex
        out.append(
            {
                "__key__": key,
                "jpg": render(colour, shape, size, rng),
                "txt": f"a photo of a {colour} {shape}",
                "json": {"uid": key, "colour": colour, "shape": shape},
            }  # fmt: skip
        )
    return out


def write_demo_shards(
    directory: str | Path, n_shards: int, per_shard: int, size: int = 64, seed: int = 0
) -> list[str]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(n_shards):
        path = str(directory / f"{s:08d}.tar")
        write_shard(path, demo_samples(per_shard, size, seed, start=s * per_shard))
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_demo_shards(tmp_path_factory.mktemp("train_shards"), n_shards=4, per_shard=96)
