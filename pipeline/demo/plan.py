"""Which demo-pool row gets which scene, caption and noise: a seeded plan, before any pixel is drawn.

Rates are web-like noise at DataComp scale (see ``pipeline/demo/pool.py``): image/transport noise labels are
mutually exclusive, and duplicate copies always point at a clean source row, so a fault is the only thing
wrong with its row. Counts are ``round(rate × n)`` (at least one of each kind), so a pool of n rows holds
exactly predictable numbers of each label.
"""

from __future__ import annotations

import numpy as np

from pipeline import schema as S
from pipeline.demo.render import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES, TEXTURES

# Image / transport noise (column ``noise``; the rest is "clean").
NOISE_RATES = {
    "small": 0.025,  # min side < 200 (DataComp's basic filter threshold)
    "elongated": 0.025,  # aspect ratio > 3
    "duplicate_url": 0.03,  # another row's URL, spelled differently (fragment / upper-case scheme)
    "duplicate_image": 0.02,  # identical bytes under another URL
    "near_duplicate": 0.02,  # re-encoded and/or rescaled copy under another URL
    "http_404": 0.0075,
    "http_500": 0.0075,
    "slow": 0.0075,  # the server sleeps longer than the client's timeout
    "truncated": 0.0075,  # Content-Length larger than the bytes sent
    "html": 0.0075,  # 200 text/html
    "corrupt": 0.0075,  # JPEG header, then garbage
    "bomb": 0.0075,  # tiny PNG declaring 30000×30000
    "oversize": 0.0075,  # 3 MiB body (the demo build caps downloads at 2 MiB)
    "wrong_sha256": 0.0075,  # metadata sha256 differs from the served bytes
    "opted_out": 0.0075,  # X-Robots-Tag: noai / noimageai
    "blocked": 0.0075,  # loopback address other than the allow-listed 127.0.0.1
    "invalid_url": 0.0075,  # not http(s)
}
COPY_KINDS = ("duplicate_url", "duplicate_image", "near_duplicate")
CAPTION_NOISE_RATES = {"mismatched": 0.30, "non_english": 0.05}
LEVEL_P = (0.15, 0.20, 0.30, 0.35)  # caption levels 0..3
FACE_RATE = 0.08
OTHER_LANGUAGES = ("de", "fr", "es", "it")

# The status each fault kind ends in when its URL is fetched (the build's vocabulary, pipeline/schema.py).
FAULT_STATUS = {
    "http_404": S.failed_download("http_404"),
    "http_500": S.failed_download("http_500"),
    "slow": S.failed_download("timeout"),
    "truncated": S.failed_download("truncated"),
    "html": S.failed_resize("not_an_image"),
    "corrupt": S.failed_resize("corrupt"),
    "bomb": S.failed_resize("too_many_pixels"),
    "oversize": S.failed_download("too_large"),
    "wrong_sha256": S.STATUS_HASH_MISMATCH,
    "opted_out": S.STATUS_OPTED_OUT,
    "blocked": S.STATUS_BLOCKED_ADDRESS,
    "invalid_url": S.STATUS_INVALID_URL,
}
MIN_ROWS = 100


def noise_count(rate: float, n: int) -> int:
    return max(1, round(rate * n))


def _sizes(noise: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Picture sizes: normal 200–320 per side (aspect ≤ 1.6); small: short side 100–190; elongated:
    short side 200–230 and aspect 3.1–3.6 (the build then downscales the long side to 512)."""
    n = len(noise)
    w = rng.integers(200, 321, n)
    h = rng.integers(200, 321, n)
    short = np.where(noise == "small", rng.integers(100, 191, n), rng.integers(200, 231, n))
    small_long = np.minimum((short * rng.uniform(1.0, 1.5, n)).astype(np.int64), 320)
    long = np.where(noise == "small", small_long, (short * rng.uniform(3.1, 3.6, n)).astype(np.int64))
    wide = rng.random(n) < 0.5
    special = (noise == "small") | (noise == "elongated")
    w = np.where(special, np.where(wide, long, short), w)
    h = np.where(special, np.where(wide, short, long), h)
    return w.astype(np.int64), h.astype(np.int64)


def _mismatch(plan: dict[str, np.ndarray], rows: np.ndarray, rng: np.random.Generator) -> None:
    """Give ``rows`` the caption attributes of other random rows, differing where the caption can tell:
    colour at level 1, shape or colour at levels 2–3."""
    n = len(plan["uid"])
    attrs = ("shape", "colour", "size", "position", "texture", "background")
    todo = rows
    while len(todo):
        other = rng.integers(0, n, len(todo))
        level = plan["level"][todo]
        colour_differs = plan["colour"][other] != plan["colour"][todo]
        shape_differs = plan["shape"][other] != plan["shape"][todo]
        good = np.where(level == 1, colour_differs, colour_differs | shape_differs)
        for a in attrs:
            plan["cap_" + a][todo[good]] = plan[a][other[good]]
        todo = todo[~good]


def plan_pool(n: int, seed: int) -> dict[str, np.ndarray]:
    """Columnar plan of ``n`` rows: uid, noise labels, scene, caption choice, URL template."""
    if n < MIN_ROWS:
        raise ValueError(f"the demo pool needs at least {MIN_ROWS} rows to hold every noise kind, got {n}")
    # One generator drawn from in a fixed order (uids, image noise, scenes, captions, URLs): reordering the
    # steps would change every pool.
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    plan: dict[str, np.ndarray] = {"uid": _uids(n, rng)}
    plan["noise"], plan["dup_of"] = _image_noise(n, rng)
    _scenes(plan, rng)
    _caption_choices(plan, rng)
    plan["url_template"] = _url_templates(plan, rng)
    return plan


def _uids(n: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.bytes(16 * n)
    uid = np.array([raw[16 * i : 16 * i + 16].hex() for i in range(n)], dtype=object)
    if len(set(uid)) != n:  # 128 random bits: never in practice
        raise RuntimeError("uid collision")
    return uid


def _image_noise(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Mutually exclusive image-level noise labels at NOISE_RATES, and for each copy the clean row it
    copies (``dup_of``, −1 elsewhere; every source is used once)."""
    order = rng.permutation(n)
    noise = np.full(n, "clean", dtype=object)
    at = 0
    for kind, rate in NOISE_RATES.items():
        k = noise_count(rate, n)
        noise[order[at : at + k]] = kind
        at += k
    copies = np.flatnonzero(np.isin(noise, COPY_KINDS))
    dup_of = np.full(n, -1, dtype=np.int64)
    dup_of[copies] = rng.choice(np.flatnonzero(noise == "clean"), size=len(copies), replace=False)
    return noise, dup_of


def _scenes(plan: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    """What each picture shows, its size and JPEG quality, and whether it carries a face."""
    n, noise, dup_of = len(plan["uid"]), plan["noise"], plan["dup_of"]
    copies = np.flatnonzero(np.isin(noise, COPY_KINDS))
    is_source = np.zeros(n, dtype=bool)
    is_source[dup_of[copies]] = True
    for name, vocab in (
        ("shape", SHAPES), ("colour", COLOURS), ("size", SIZES), ("position", POSITIONS),
        ("texture", TEXTURES), ("background", BACKGROUNDS),
    ):  # fmt: skip
        plan[name] = rng.integers(0, len(vocab), n)
    plan["width"], plan["height"] = _sizes(noise, rng)
    plan["quality"] = rng.integers(75, 96, n)
    plan["face"] = (rng.random(n) < FACE_RATE) & ~is_source & (dup_of < 0)
    for name in (
        "shape",
        "colour",
        "size",
        "position",
        "texture",
        "background",
        "width",
        "height",
        "quality",
    ):
        plan[name][copies] = plan[name][dup_of[copies]]  # a copy shows its source's picture
    plan["is_source"] = is_source


def _caption_choices(plan: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    """Caption noise (independent of the image noise), level, language, wording and the attributes the
    caption names (another row's for mismatched captions)."""
    n = len(plan["uid"])
    cap_order = rng.permutation(n)
    caption_noise = np.full(n, "clean", dtype=object)
    k_mis = round(CAPTION_NOISE_RATES["mismatched"] * n)
    k_non = round(CAPTION_NOISE_RATES["non_english"] * n)
    mismatched, non_english = cap_order[:k_mis], cap_order[k_mis : k_mis + k_non]
    caption_noise[mismatched] = "mismatched"
    caption_noise[non_english] = "non_english"
    plan["caption_noise"] = caption_noise
    level = rng.choice(4, size=n, p=LEVEL_P)
    p_named = np.array(LEVEL_P[1:]) / sum(LEVEL_P[1:])
    level[mismatched] = rng.choice([1, 2, 3], size=len(mismatched), p=p_named)  # level 0 cannot mismatch
    plan["level"] = level
    language = np.full(n, "en", dtype=object)
    language[non_english] = rng.choice(OTHER_LANGUAGES, size=len(non_english))
    plan["language"] = language
    plan["variant"] = rng.integers(0, 12, n)
    for a in ("shape", "colour", "size", "position", "texture", "background"):
        plan["cap_" + a] = plan[a].copy()
    _mismatch(plan, mismatched, rng)


def _url_templates(plan: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """``{base}`` is the server's base URL, ``{BASE}`` the same with an upper-case scheme, ``{port}`` its
    port. Every template is unique except duplicate-URL rows, which respell their source's URL."""
    n = len(plan["uid"])
    tokens = set()
    while len(tokens) < n:
        tokens.update(f"{int(t):012x}" for t in rng.integers(0, 2**48, n - len(tokens)))
    token = np.array(sorted(tokens), dtype=object)[rng.permutation(n)]
    noise = plan["noise"]
    ext = np.where(noise == "bomb", ".png", ".jpg")
    path = np.array([f"/img/{t}{e}" for t, e in zip(token, ext, strict=True)], dtype=object)
    plan["token"] = token
    tpl = np.array([f"{{base}}{p}" for p in path], dtype=object)
    for k, i in enumerate(np.flatnonzero(noise == "duplicate_url")):
        src = path[plan["dup_of"][i]]
        path[i] = src
        tpl[i] = (f"{{base}}{src}#photo", f"{{BASE}}{src}", f"{{BASE}}{src}#main")[k % 3]
    for k, i in enumerate(np.flatnonzero(noise == "blocked")):
        host = ("127.0.0.2", "[::1]")[k % 2]
        tpl[i] = f"http://{host}:{{port}}{path[i]}"
    for k, i in enumerate(np.flatnonzero(noise == "invalid_url")):
        tpl[i] = (f"ftp://127.0.0.1:{{port}}{path[i]}", f"not a url {token[i]}")[k % 2]
    plan["path"] = path
    return tpl
