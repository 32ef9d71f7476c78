"""Planted truth for the curation stages: semantic duplicates, eval-set leaks and stand-in CLIP embeddings.

The pool's noise (``pipeline/demo/plan.py``) is left as it is; from a stream of its own this module turns
a few rows whose picture and caption are both clean into

- **semantic duplicates** (``SEMANTIC_RATE`` pairs): the copy shows its source's scene (shape, colour,
  size, texture, background colour) re-rendered at another grid position, picture size and shape scale,
  with fresh lighting and texture phase — a separate picture for the perceptual hash (the generator keeps
  it ≥ 12 bits from every other, ``pipeline/demo/images.py``), the same picture for a semantic embedding;
- **eval leaks** (``LEAK_RATE``): the row shows a picture of one of the demo's eval sets, lightly perturbed
  (brightness ±6%, rescaled ±8%, re-encoded at the row's JPEG quality; its pHash stays within
  ``LEAK_MAX_PHASH`` bits of the eval picture's), with a pool caption of that scene.

The truth file names each (``semantic_dup_of``, ``eval_leak``, ``eval_leak_key``). Every other eval
picture is kept ≥ 12 bits from every pool picture, so a pHash match is a planted leak.

**Stand-in embeddings.** DataComp's metadata ships CLIP L/14 embeddings of every pair; no CLIP runs here,
so the generator writes what such a model is assumed to see, from the scene it drew (768-d, float16, in
DataComp's ``.npz`` layout beside the metadata): an image vector is a weighted sum of random codes for
its shape, colour, size, texture and background colour (weights² 0.30, 0.30, 0.06, 0.04, 0.04), a code
of the picture's identity (0.25: two renders of one scene share it), its position (0.02) and noise
(0.015); a caption vector sums the codes of what it names (level 0: a generic code) plus a text-side
offset (CLIP's modality gap) and noise, and a non-English caption mixes in a language code. Two
different pictures of the same attributes then have a cosine near 0.72, a semantic duplicate near 0.96
and a leak near 0.99 (docs/decisions/0050-demo-stand-in-embeddings.md). The eval reference
(``eval/reference.parquet``: task, key, pHash, stand-in embedding of every eval picture) and NormSim's
target distribution (``target_embeddings.npy``: 4 fresh scenes per shape × colour, the demo's stand-in
for ImageNet-1k's training images) come from the same codes.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageEnhance

from pipeline.demo.plan import COPY_KINDS, noise_count
from pipeline.demo.render import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES, TEXTURES, decode, encode_jpeg

SEMANTIC_RATE = 0.02  # pairs, of the pool's rows
LEAK_RATE = 0.01
LEAK_MAX_PHASH = 2
LEAK_TASKS = ("shapes", "colours", "retrieval", "hierarchy")  # the demo task list's names
DIM = 768  # CLIP L/14's embedding width
PLANT_STREAM, CODE_STREAM = 6, 8  # SeedSequence streams (plan 0, pictures 1, faults 2, eval sets 3)
_ATTRS = ("shape", "colour", "size", "position", "texture", "background")
_VOCABS = dict(zip(_ATTRS, (SHAPES, COLOURS, SIZES, POSITIONS, TEXTURES, BACKGROUNDS), strict=True))
_IMAGE_W = {"shape": 0.55, "colour": 0.55, "size": 0.25, "texture": 0.2, "background": 0.2}
_ID_W, _POS_W, _NOISE_W = 0.5, 0.15, 0.12


@dataclass
class EvalPicture:
    task: str
    key: str
    jpeg: bytes
    scene: dict  # attribute → index


@dataclass
class Planted:
    sem_dup_of: np.ndarray  # (n,) int64: the source row of a semantic copy, −1 elsewhere
    leak_task: np.ndarray  # (n,) object: the eval task a row leaks, ""
    leak_key: np.ndarray  # (n,) object
    leak_jpeg: dict[int, bytes] = field(default_factory=dict)  # row → the bytes it serves
    eval_pictures: list[EvalPicture] = field(default_factory=list)


def read_eval_pictures(eval_dir: Path) -> list[EvalPicture]:
    """Every picture of the demo eval sets with its key and scene, sets in ``LEAK_TASKS`` order."""
    out = []
    for task in LEAK_TASKS:
        for tar_path in sorted((eval_dir / task / "test").glob("*.tar"), key=lambda p: int(p.stem)):
            members: dict[str, dict[str, bytes]] = {}
            with tarfile.open(tar_path) as tar:
                for m in tar.getmembers():
                    key, _, ext = m.name.partition(".")
                    members.setdefault(key, {})[ext] = tar.extractfile(m).read()
            for key, files in members.items():
                scene = json.loads(files["json"])
                idx = {a: _VOCABS[a].index(scene[a]) for a in _ATTRS}
                out.append(EvalPicture(task, key, files["jpg"], idx))
    return out


def _eligible(plan: dict[str, np.ndarray]) -> np.ndarray:
    """Rows whose picture and caption are clean and that no copy, face or duplicate involves."""
    return np.flatnonzero(
        (plan["noise"] == "clean")
        & (plan["caption_noise"] == "clean")
        & ~plan["is_source"]
        & ~plan["face"]
        & (plan["dup_of"] < 0)
    )


def _set_scene(plan: dict[str, np.ndarray], row: int, scene: dict) -> None:
    for a, v in scene.items():
        plan[a][row] = v
        plan["cap_" + a][row] = v  # a clean caption names its own picture


def _perturbed(pic: EvalPicture, quality: int, rng: np.random.Generator) -> bytes | None:
    """A light web copy of an eval picture, its pHash within ``LEAK_MAX_PHASH`` of the original's."""
    from pipeline.demo.images import build_phash

    image = decode(pic.jpeg)
    w, h = image.size
    want = build_phash(pic.jpeg)
    for strength in (1.0, 0.5, 0.25, 0.0):
        f = 1.0 + strength * rng.uniform(-0.08, 0.08)
        f = max(f, 200 / min(w, h))  # stays a "normal" picture (short side ≥ 200)
        copy = image.resize((round(w * f), round(h * f)), Image.Resampling.LANCZOS) if f != 1.0 else image
        copy = ImageEnhance.Brightness(copy).enhance(1.0 + strength * rng.uniform(-0.06, 0.06))
        jpeg = encode_jpeg(copy, quality)
        if int(np.bitwise_count(np.int64(build_phash(jpeg)) ^ np.int64(want))) <= LEAK_MAX_PHASH:
            return jpeg
    return None


def plant(plan: dict[str, np.ndarray], seed: int, eval_dir: Path) -> Planted:
    """Choose and apply the planted rows (module docstring); ``plan`` is changed in place."""
    n = len(plan["uid"])
    rng = np.random.default_rng(np.random.SeedSequence([seed, PLANT_STREAM]))
    pool = rng.permutation(_eligible(plan))
    n_sem, n_leak = noise_count(SEMANTIC_RATE, n), max(len(LEAK_TASKS), noise_count(LEAK_RATE, n))
    if len(pool) < 2 * n_sem + n_leak:
        raise ValueError(f"the demo pool of {n} rows has too few clean rows to plant curation truth")
    sources, copies, leaks = pool[:n_sem], pool[n_sem : 2 * n_sem], pool[2 * n_sem : 2 * n_sem + n_leak]
    out = Planted(np.full(n, -1, np.int64), np.full(n, "", object), np.full(n, "", object))
    for src, dst in zip(sources.tolist(), copies.tolist(), strict=True):
        scene = {a: int(plan[a][src]) for a in _ATTRS if a != "position"}
        others = [p for p in range(len(POSITIONS)) if p != int(plan["position"][src])]
        scene["position"] = int(rng.choice(others))
        _set_scene(plan, dst, scene)
        out.sem_dup_of[dst] = src
    pictures = read_eval_pictures(eval_dir)
    isolated = _isolated(pictures)
    by_task = {
        t: [p for p, ok in zip(pictures, isolated, strict=True) if ok and p.task == t] for t in LEAK_TASKS
    }
    for k, row in enumerate(leaks.tolist()):
        candidates = by_task[LEAK_TASKS[k % len(LEAK_TASKS)]]
        for pick in rng.permutation(len(candidates)).tolist():
            pic = candidates[pick]
            if pic.key in out.leak_key[out.leak_task == pic.task]:
                continue
            jpeg = _perturbed(pic, int(plan["quality"][row]), rng)
            if jpeg is not None:
                break
        else:
            raise RuntimeError(f"no eval picture of {pic.task} survives a light perturbation")
        _set_scene(plan, row, pic.scene)
        plan["width"][row], plan["height"][row] = decode(jpeg).size
        out.leak_task[row], out.leak_key[row], out.leak_jpeg[row] = pic.task, pic.key, jpeg
    out.eval_pictures = pictures
    return out


def _isolated(pictures: list[EvalPicture]) -> np.ndarray:
    """Eval pictures ≥ 12 bits (the generator's separation) from every other: only those are leaked, so a
    leak's pHash names its own picture and no other."""
    from pipeline.demo.images import MIN_UNRELATED_DISTANCE, build_phash, close_pairs

    hashes = np.array([build_phash(p.jpeg) for p in pictures], dtype=np.int64)
    pairs = close_pairs(hashes, np.arange(len(pictures)), MIN_UNRELATED_DISTANCE)
    ok = np.ones(len(pictures), dtype=bool)
    ok[pairs.ravel()] = False
    return ok


def eval_hash_groups(planted: Planted) -> tuple[np.ndarray, np.ndarray]:
    """pHashes of every eval picture and, per picture, the row that leaks it (or a negative id): the
    generator keeps every other pool picture ≥ 12 bits from them."""
    from pipeline.demo.images import build_phash

    leaked = {
        (t, k): r for r, (t, k) in enumerate(zip(planted.leak_task, planted.leak_key, strict=True)) if t
    }
    hashes = np.array([build_phash(p.jpeg) for p in planted.eval_pictures], dtype=np.int64)
    groups = np.array(
        [leaked.get((p.task, p.key), -1 - i) for i, p in enumerate(planted.eval_pictures)], dtype=np.int64
    )
    return hashes, groups


# --- stand-in embeddings -------------------------------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class Codes:
    """The random codes of the stand-in embedding space (one set per pool seed)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(np.random.SeedSequence([seed, CODE_STREAM]))
        self.attr = {a: _unit(rng.standard_normal((len(v), DIM))) for a, v in _VOCABS.items()}
        self.generic, self.shape_word, self.gap = _unit(rng.standard_normal((3, DIM)))
        self.language = _unit(rng.standard_normal((5, DIM)))
        self.seed = seed

    def _stream(self, *ids: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, CODE_STREAM, *ids]))

    def images(self, scenes: dict[str, np.ndarray], identity: np.ndarray, noise: np.ndarray) -> np.ndarray:
        """(m, DIM) unit image vectors of scenes (attribute → index arrays) with identity and noise codes."""
        v = sum(w * self.attr[a][scenes[a]] for a, w in _IMAGE_W.items())
        v = v + _ID_W * identity + _POS_W * self.attr["position"][scenes["position"]] + _NOISE_W * noise
        return _unit(v)

    def texts(
        self, cap: dict[str, np.ndarray], level: np.ndarray, language: np.ndarray, noise: np.ndarray
    ) -> np.ndarray:
        """(m, DIM) unit caption vectors: the codes of what each caption names (pipeline/demo/captions.py)."""
        level = level[:, None]
        named = np.where(level >= 1, 0.75 * self.attr["colour"][cap["colour"]], 0.6 * self.generic)
        named = named + np.where(level >= 2, 0.55 * self.attr["shape"][cap["shape"]], 0.3 * self.shape_word)
        named = named + np.where(level >= 3, 0.25 * self.attr["size"][cap["size"]], 0.0)
        foreign = (language != "en")[:, None]
        lang_code = self.language[np.searchsorted(np.array(["de", "en", "es", "fr", "it"]), language)]
        v = np.where(foreign, 0.6 * named + 0.5 * lang_code, named) + 0.35 * self.gap + 0.15 * noise
        return _unit(v)


def pool_embeddings(
    plan: dict[str, np.ndarray], planted: Planted, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in (image, text) vectors of every pool row: copies of one picture share its identity (a
    near/exact duplicate its noise too), a semantic copy its source's identity, a leak its eval picture's."""
    codes = Codes(seed)
    n = len(plan["uid"])
    identity = codes._stream(1).standard_normal((n, DIM)) / np.sqrt(DIM)
    noise = codes._stream(2).standard_normal((n, DIM)) / np.sqrt(DIM)
    picture = np.where(np.isin(plan["noise"], COPY_KINDS), plan["dup_of"], np.arange(n))
    identity, noise = identity[picture], noise[picture]
    sem = planted.sem_dup_of >= 0
    identity[sem] = identity[planted.sem_dup_of[sem]]
    eval_id, eval_noise, index = _eval_codes(codes, planted)
    for row in np.flatnonzero(planted.leak_task != "").tolist():
        k = index[(planted.leak_task[row], planted.leak_key[row])]
        identity[row] = eval_id[k]
        noise[row] = 0.3 * noise[row] + eval_noise[k]  # a light perturbation of the eval picture's vector
    image = codes.images({a: plan[a] for a in _ATTRS}, identity, noise)
    text_noise = codes._stream(3).standard_normal((n, DIM)) / np.sqrt(DIM)
    cap = {a: plan["cap_" + a] for a in ("shape", "colour", "size")}
    text = codes.texts(cap, plan["level"], plan["language"].astype(str), text_noise)
    return image.astype(np.float32), text.astype(np.float32)


def _eval_codes(codes: Codes, planted: Planted) -> tuple[np.ndarray, np.ndarray, dict]:
    m = len(planted.eval_pictures)
    eval_id = codes._stream(4).standard_normal((m, DIM)) / np.sqrt(DIM)
    eval_noise = codes._stream(5).standard_normal((m, DIM)) / np.sqrt(DIM)
    index = {(p.task, p.key): i for i, p in enumerate(planted.eval_pictures)}
    return eval_id, eval_noise, index


def eval_embeddings(planted: Planted, seed: int) -> np.ndarray:
    codes = Codes(seed)
    eval_id, eval_noise, _ = _eval_codes(codes, planted)
    scenes = {a: np.array([p.scene[a] for p in planted.eval_pictures], dtype=np.int64) for a in _ATTRS}
    return codes.images(scenes, eval_id, eval_noise).astype(np.float32)


def target_embeddings(seed: int, per_class: int = 4) -> np.ndarray:
    """NormSim's target distribution: ``per_class`` fresh scenes of each shape × colour."""
    codes = Codes(seed)
    rng = codes._stream(6)
    m = len(SHAPES) * len(COLOURS) * per_class
    scenes = {a: rng.integers(0, len(v), m) for a, v in _VOCABS.items()}
    scenes["shape"] = np.repeat(np.arange(len(SHAPES)), len(COLOURS) * per_class)
    scenes["colour"] = np.tile(np.repeat(np.arange(len(COLOURS)), per_class), len(SHAPES))
    ident = rng.standard_normal((m, DIM)) / np.sqrt(DIM)
    noise = rng.standard_normal((m, DIM)) / np.sqrt(DIM)
    return codes.images(scenes, ident, noise).astype(np.float32)


def write_curation_files(
    out: Path, plan: dict[str, np.ndarray], planted: Planted, seed: int, eval_phash: np.ndarray
) -> None:
    """``embeddings.npz`` (uid, l14_img, l14_txt), ``eval/reference.parquet``, ``target_embeddings.npy``."""
    image, text = pool_embeddings(plan, planted, seed)
    uids = np.array([str(u) for u in plan["uid"]], dtype="<U32")
    buf = io.BytesIO()
    np.savez(buf, uid=uids, l14_img=image.astype(np.float16), l14_txt=text.astype(np.float16))
    (out / "embeddings.npz").write_bytes(buf.getvalue())
    ev = eval_embeddings(planted, seed)
    ref = pa.table(
        {
            "task": [p.task for p in planted.eval_pictures],
            "key": [p.key for p in planted.eval_pictures],
            "phash": pa.array(eval_phash, pa.int64()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(ev.reshape(-1)), DIM),
        }
    )
    pq.write_table(ref, out / "eval" / "reference.parquet")
    np.save(out / "target_embeddings.npy", target_embeddings(seed), allow_pickle=False)


# --- how well a build found them -----------------------------------------------------------------------


def curation_figures(truth: pa.Table, status: pa.Table) -> dict[str, float | int]:
    """A build's curation against the planted truth: semantic duplicates found (recall over the planted
    pairs that both downloaded; precision over the rows marked ``semantic_duplicate``) and eval leaks found
    (recall over the planted leaks that downloaded; false leaks: rows marked as a leak of a picture no row
    was planted to copy, i.e. of a clean eval picture, or of another picture than the planted one)."""
    t = truth.to_pydict()
    st = status.to_pydict()
    got = dict(zip(st["uid"], st["status"], strict=True))
    dup_of = dict(zip(st["uid"], st.get("duplicate_of", [None] * len(st["uid"])), strict=True))
    leak_of = dict(zip(st["uid"], st.get("leak_of", [None] * len(st["uid"])), strict=True))
    downloaded = {u for u, s in zip(t["uid"], t["expected_status"], strict=True) if s == "success"}
    planted = {
        frozenset((u, s))
        for u, s in zip(t["uid"], t["semantic_dup_of"], strict=True)
        if s and {u, s} <= downloaded
    }
    marked = {u for u, s in got.items() if s == "semantic_duplicate"}
    pairs = {frozenset((u, dup_of[u])) for u in marked}
    found = pairs & planted
    leaks = {
        u: f"{task}/{key}"
        for u, task, key in zip(t["uid"], t["eval_leak"], t["eval_leak_key"], strict=True)
        if task and u in downloaded
    }
    flagged = {u for u, s in got.items() if s and s.startswith("eval_leak:")}
    true_leaks = {u for u in flagged if leaks.get(u) == leak_of.get(u)}
    return {
        "semantic_planted_pairs": len(planted),
        "semantic_marked": len(marked),
        "semantic_recall": len(found) / len(planted) if planted else float("nan"),
        "semantic_precision": sum(frozenset((u, dup_of[u])) in planted for u in marked) / len(marked)
        if marked
        else float("nan"),
        "leaks_planted": len(leaks),
        "leaks_flagged": len(flagged),
        "leak_recall": len(true_leaks) / len(leaks) if leaks else float("nan"),
        "false_leaks": len(flagged - true_leaks),
    }
