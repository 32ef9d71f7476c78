"""Turning planned scenes into served JPEG bytes with the hash guarantees the demo truth relies on.

The build decides near-duplicates by the perceptual hash of each downloaded picture after its resize step
(pipeline/dedup/phash.py; longest side ≤ 512, downscale only; faces blurred first), with a Hamming threshold of 4
(DedupeConfig.phash_threshold). For the truth to predict that decision exactly the generator promises:

- each near-duplicate copy is within ``MAX_NEAR_DUP_DISTANCE`` (2) of its source, and
- any two pictures not meant to be duplicates are at least ``MIN_UNRELATED_DISTANCE`` (12) apart,

measured the way the build measures them: decode the served JPEG (simplejpeg here; Pillow and OpenCV
decode the same pixels), downscale if larger than 512, hash; for pictures with a face box also after an
approximation of the build's face blur. A build that hashes its q95 re-encoded output instead sees hashes
up to 4 bits off (measured with imagehash's reduction: 0 bits for 84%, 2 for 16%, 4 for 0.3% of pictures;
with the OpenCV area reduction on the 600-row test pool: 0 for 89.5%, 2 for 10.5%), so near-duplicate pairs
are also checked after a q95 re-encode, and unrelated pictures are kept 12 bits apart (rather than
10): even two 4-bit shifts towards each other leave them above the threshold of 4.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.dedup.phash import phash64
from pipeline.demo.faults import BOMB_SIDE, OVERSIZE_BYTES, bomb_png, corrupt_jpeg, html_page, oversize_body
from pipeline.demo.render import Scene, approx_face_blur, decode, encode_jpeg, render

MAX_NEAR_DUP_DISTANCE = 2
MIN_UNRELATED_DISTANCE = 12
BUILD_MAX_SIDE = 512  # DownloadConfig.image_size: DataComp's resize target


@dataclass(frozen=True)
class UnitJob:
    """One picture to render (a "unit"), with the near-duplicate copy derived from it, if any."""

    unit: int  # row index of the picture's own row
    scene: Scene
    seed: tuple[int, ...]  # SeedSequence entropy: (pool seed, stream, row, attempt)
    quality: int
    near_dup: bool = False


@dataclass(frozen=True)
class UnitResult:
    unit: int
    jpeg: bytes
    phash: int
    blurred_phash: int | None  # hash after the face blur, for pictures with a face box
    face_bbox: tuple[float, float, float, float] | None
    copy_jpeg: bytes | None = None  # the near-duplicate copy
    copy_phash: int | None = None
    copy_size: tuple[int, int] | None = None
    copy_quality: int | None = None
    ok: bool = True  # False: no copy within MAX_NEAR_DUP_DISTANCE was found; re-render with a new seed


def as_built(image: Image.Image, max_side: int = BUILD_MAX_SIDE) -> Image.Image:
    """The picture the build hashes: downscaled so the longest side is ``max_side`` (never upscaled)."""
    w, h = image.size
    if max(w, h) <= max_side:
        return image
    scale = max_side / max(w, h)
    return image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BOX)


def build_phash(jpeg: bytes, face_bbox: tuple | None = None) -> int:
    image = as_built(decode(jpeg))
    if face_bbox is not None:
        image = approx_face_blur(image, [face_bbox])
    return phash64(image)


def _hamming(a: int, b: int) -> int:
    return int(np.bitwise_count(np.int64(a) ^ np.int64(b)))


def _near_duplicate(
    source: Image.Image, quality: int, rng: np.random.Generator
) -> tuple[bytes, tuple[int, int], int]:
    """A web-like copy: re-encoded at another quality, rescaled, or both. Sizes stay in the pool's normal
    range (short side ≥ 200, long side ≤ 400) so the copy is no "small" image and needs no resize."""
    w, h = source.size
    mode = rng.choice(["quality", "rescale", "both"])
    image = source
    if mode != "quality":
        lo, hi = max(0.8, 200 / min(w, h)), min(1.25, 400 / max(w, h))
        f = rng.uniform(lo, hi) if hi > lo else 1.0
        size = (round(w * f), round(h * f))
        if size != (w, h):
            image = source.resize(size, Image.Resampling.LANCZOS)
    q = quality
    if mode != "rescale" or image is source:
        q = int(rng.integers(55, 72)) if quality >= 80 else int(rng.integers(88, 96))
    return encode_jpeg(image, q), image.size, q


def render_unit(job: UnitJob) -> UnitResult:
    """Render, encode and hash one picture (and derive its near-duplicate copy). Pure: same job, same bytes."""
    rendered = render(job.scene, np.random.SeedSequence(job.seed))
    jpeg = encode_jpeg(rendered.image, job.quality)
    served = decode(jpeg)
    h = phash64(as_built(served))
    blurred = None
    if rendered.face_bbox is not None:
        blurred = phash64(approx_face_blur(as_built(served), [rendered.face_bbox]))
    if not job.near_dup:
        return UnitResult(job.unit, jpeg, h, blurred, rendered.face_bbox)
    h95 = _reencoded_phash(served)
    rng = np.random.default_rng(np.random.SeedSequence((*job.seed, 1)))
    for _ in range(6):
        copy, size, q = _near_duplicate(served, job.quality, rng)
        copy_image = decode(copy)
        ch = phash64(copy_image)
        close = _hamming(ch, h) <= MAX_NEAR_DUP_DISTANCE
        if close and _hamming(_reencoded_phash(copy_image), h95) <= MAX_NEAR_DUP_DISTANCE:
            return UnitResult(job.unit, jpeg, h, blurred, rendered.face_bbox, copy, ch, size, q)
    return UnitResult(job.unit, jpeg, h, blurred, rendered.face_bbox, ok=False)


def _reencoded_phash(image: Image.Image) -> int:
    """The hash of the picture as the build stores it (JPEG q95, DownloadConfig.jpeg_quality)."""
    return phash64(decode(encode_jpeg(image, 95)))


def close_pairs(hashes: np.ndarray, groups: np.ndarray, min_distance: int, block: int = 1024) -> np.ndarray:
    """Index pairs (i < j) of hashes closer than ``min_distance`` whose groups differ, as an (k, 2) array.

    Blocked all-pairs XOR + popcount: 8,000 hashes are 32M pairs, a fraction of a second in numpy.
    """
    h = np.ascontiguousarray(hashes, dtype=np.int64).view(np.uint64)
    g = np.asarray(groups)
    out = []
    for a in range(0, len(h), block):
        d = np.bitwise_count(h[a : a + block, None] ^ h[None, :])  # (B, m) uint8
        i, j = np.nonzero(d < min_distance)
        i += a
        keep = (j > i) & (g[i] != g[j])
        out.append(np.stack([i[keep], j[keep]], axis=1))
    return np.concatenate(out) if out else np.empty((0, 2), dtype=np.int64)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the whole pool -------------------------------------------------------------------------------------


def map_threads(fn, jobs: list, workers: int | None = None) -> list:
    """``[fn(j) for j in jobs]``, on ``workers`` threads (default: one per core) when worth it."""
    workers = workers or os.cpu_count() or 1
    if workers <= 1 or len(jobs) < 64:
        return [fn(j) for j in jobs]
    from concurrent.futures import ThreadPoolExecutor

    # Threads, not processes: Pillow and numpy release the GIL in the heavy calls, and threads are safe
    # inside a Ray driver or beside a running server, where fork is not.
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, jobs, chunksize=1))


def map_processes(fn, jobs: list, workers: int | None = None, chunksize: int = 64) -> list:
    """``[fn(j) for j in jobs]`` for a module-level ``fn``, on ``workers`` spawned processes (default: one
    per core) when worth it. Rendering holds the GIL for much of a picture: on 2 cores two threads rendered
    2,000 pictures only 1.2–1.6× as fast as one (docs/decisions/0018-demo-pool-on-processes.md). Spawn, not
    fork, because the caller may be a Ray driver or serve HTTP."""
    workers = workers or os.cpu_count() or 1
    if workers <= 1 or len(jobs) < 4 * chunksize:
        return [fn(j) for j in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, jobs, chunksize=chunksize))


def render_units(
    plan: dict[str, np.ndarray],
    seed: int,
    workers: int | None = None,
    fixed: dict[int, bytes] | None = None,
    avoid: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[int, UnitResult]:
    """Render every picture of the pool, re-rendering (new seed) until the hash guarantees hold.

    ``fixed``: rows whose served bytes are given (the planted eval leaks, pipeline/demo/planted.py), never
    re-rendered; ``avoid``: (hashes, groups) of pictures outside the pool (the eval sets) that every pool
    picture of another group must also stay ``MIN_UNRELATED_DISTANCE`` from."""
    from pipeline.demo.plan import COPY_KINDS

    fixed = fixed or {}
    noise, dup_of = plan["noise"], plan["dup_of"]
    units = np.flatnonzero(~np.isin(noise, COPY_KINDS))
    near_sources = set(dup_of[noise == "near_duplicate"].tolist())
    attempt: dict[int, int] = {int(u): 0 for u in units}

    def job(i: int) -> UnitJob:
        scene = Scene(
            *(int(plan[a][i]) for a in ("shape", "colour", "size", "position", "texture", "background")),
            width=int(plan["width"][i]), height=int(plan["height"][i]), face=bool(plan["face"][i]),
        )  # fmt: skip
        return UnitJob(i, scene, (int(seed), 1, i, attempt[i]), int(plan["quality"][i]), i in near_sources)

    rendered = [int(u) for u in units if int(u) not in fixed]
    results = {r.unit: r for r in map_processes(render_unit, [job(u) for u in rendered], workers)}
    results.update({u: UnitResult(u, jpeg, build_phash(jpeg), None, None) for u, jpeg in fixed.items()})
    for _ in range(50):
        bad = {u for u, r in results.items() if not r.ok}
        hashes, groups = [], []
        for u in sorted(results):
            r = results[u]
            for h in (r.phash, r.blurred_phash, r.copy_phash):
                if h is not None:
                    hashes.append(h)
                    groups.append(u)
        if avoid is not None:
            hashes += avoid[0].tolist()
            groups += avoid[1].tolist()
        g = np.array(groups)
        pairs = close_pairs(np.array(hashes, dtype=np.int64), g, MIN_UNRELATED_DISTANCE)
        close = zip(g[pairs[:, 0]].tolist(), g[pairs[:, 1]].tolist(), strict=True)
        bad |= {u for u in (_to_rerender(a, b, fixed) for a, b in close) if u is not None}
        if not bad:
            return results
        for u in bad:
            attempt[u] += 1
        results.update(
            {r.unit: r for r in map_processes(render_unit, [job(u) for u in sorted(bad)], workers)}
        )
    raise RuntimeError("could not separate the pool's perceptual hashes in 50 rounds")


def _to_rerender(a: int, b: int, fixed: dict[int, bytes]) -> int | None:
    """Of two pictures too close, the one to draw again: the later pool unit, never a given one (two
    given ones, e.g. two eval pictures, are not the pool's to separate: the planted leaks are chosen
    among eval pictures far from every other, pipeline/demo/planted.py)."""
    movable = [u for u in (max(a, b), min(a, b)) if u >= 0 and u not in fixed]
    return movable[0] if movable else None


def _serving(
    kind: str,
    token: str,
    src_token: str,
    jpeg: bytes,
    size: tuple[int, int],
    rng: np.random.Generator,
    n_opted: int,
) -> tuple[str | None, bytes | None, dict | None, tuple[int, int]]:
    """How the server treats one row of noise ``kind``: (body file, body bytes, route, original size).

    ``route`` None means no route of its own (a duplicate URL reuses its source's; a blocked or invalid
    URL is never requested); ``n_opted`` counts the opted-out rows before this one (alternating headers).
    """
    file, body = f"images/{token}.jpg", jpeg
    route: dict | None = {"fault": "ok", "type": "image/jpeg"}
    original = size
    if kind == "duplicate_url":
        route = None  # same path as its source: the source's route serves it
    elif kind == "duplicate_image":
        file = f"images/{src_token}.jpg"  # the very same file, under another URL
    elif kind in ("http_404", "http_500", "blocked", "invalid_url"):
        route = {"fault": kind} if kind.startswith("http_") else None
        file, body = None, None
    elif kind == "html":
        file, body, route["type"] = f"pages/{token}.html", html_page(token), "text/html; charset=utf-8"
    elif kind == "corrupt":
        body = corrupt_jpeg(jpeg, rng)
    elif kind == "bomb":
        file, body, route["type"] = "bomb.png", bomb_png(), "image/png"
        original = (BOMB_SIDE, BOMB_SIDE)
    elif kind == "oversize":
        route.update(fault="oversize", pad_to=OVERSIZE_BYTES)
    elif kind in ("slow", "truncated"):
        route["fault"] = kind
    elif kind == "opted_out":
        route.update(fault="opted_out", robots=("noai", "noimageai")[n_opted % 2])
    return file, body, route, original


def _shas(kind: str, body: bytes | None, jpeg: bytes) -> tuple[str, str | None]:
    """(sha256 the metadata lists, sha256 of the bytes actually served — None when nothing is)."""
    served = None
    if body is not None:
        served = sha256_hex(oversize_body(body) if kind == "oversize" else body)
    meta_sha = served if served is not None else sha256_hex(jpeg)
    if kind == "wrong_sha256":
        meta_sha = sha256_hex(b"stale copy of " + body)  # the crawl saw other bytes
    return meta_sha, served


def render_pool(
    plan: dict[str, np.ndarray],
    seed: int,
    out: Path,
    workers: int | None = None,
    fixed: dict[int, bytes] | None = None,
    avoid: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, list]:
    """Render the pictures, write every body the server sends under ``out``, and return per-row columns
    (path, sizes, hashes, sha256s) plus ``routes`` (URL path → what the server does); ``fixed`` and
    ``avoid`` as ``render_units``."""
    results = render_units(plan, seed, workers, fixed, avoid)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2]))
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "pages").mkdir(parents=True, exist_ok=True)
    routes: dict[str, dict] = {}
    cols: dict[str, list] = {k: [] for k in _ROW_COLUMNS}
    n_opted = 0
    for i in range(len(plan["uid"])):
        kind, token, path = str(plan["noise"][i]), str(plan["token"][i]), str(plan["path"][i])
        src = int(plan["dup_of"][i])
        r = results[src] if src >= 0 else results[i]
        jpeg, ph, size = r.jpeg, r.phash, (int(plan["width"][i]), int(plan["height"][i]))
        quality = int(plan["quality"][i])
        if kind == "near_duplicate":
            jpeg, ph, size, quality = r.copy_jpeg, r.copy_phash, r.copy_size, r.copy_quality
        src_token = str(plan["token"][src]) if src >= 0 else token
        file, body, route, original = _serving(kind, token, src_token, jpeg, size, rng, n_opted)
        n_opted += kind == "opted_out"
        if route is not None:
            routes[path] = dict(route, file=file)
        owns_file = body is not None and (src < 0 or kind == "near_duplicate")  # copies share the source's
        if owns_file and not (kind == "bomb" and (out / file).exists()):
            (out / file).write_bytes(body)
        meta_sha, served = _shas(kind, body, jpeg)
        for k, v in zip(
            _ROW_COLUMNS,
            (path, size[0], size[1], quality, ph, None if src >= 0 else r.blurred_phash,
             None if src >= 0 else r.face_bbox, meta_sha, served, original[0], original[1]),
            strict=True,
        ):  # fmt: skip
            cols[k].append(v)
    cols["routes"] = routes
    return cols


_ROW_COLUMNS = (
    "path", "width", "height", "quality", "phash", "phash_blurred", "face_bbox", "sha256", "served_sha256",
    "original_width", "original_height",
)  # fmt: skip
