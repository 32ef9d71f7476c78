"""Clean evaluation sets for the demo pool, in clip_benchmark's webdataset layout.

Under ``OUT/eval/``:

- ``shapes/`` and ``colours/``: zero-shot classification. ``test/{i}.tar`` hold ``{key}.jpg`` +
  ``{key}.cls`` (class index as text) + ``{key}.json`` (the scene); beside them ``test/nshards.txt``,
  ``classnames.txt`` (one class per line), ``zeroshot_classification_templates.txt`` (one template per
  line, ``{c}`` is the class name) and ``dataset_type.txt`` — the files clip_benchmark's
  ``build_wds_dataset`` reads.
- ``retrieval/``: ``{key}.jpg`` + ``{key}.txt`` with three English descriptions, one per line, shortest
  and least detailed first (``captions.paraphrases``)
  (``dataset_type.txt`` = retrieval).
- ``hierarchy/``: ``{key}.jpg`` + ``{key}.txt`` whose lines are the caption levels 0..3, general to
  specific (read as a retrieval set by clip_benchmark; line k is level k). Each image draws its own
  wording per level, and the wordings' word counts overlap across levels, so ordering the levels by
  σ² tests specificity rather than caption length.

Pictures come from their own seed stream (never the pool's), with no noise, faces or duplicates, and
classes balanced and interleaved so any prefix of a set is balanced too.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.demo.captions import all_levels, n_variants, paraphrases
from pipeline.demo.images import map_threads
from pipeline.demo.render import (
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    TEXTURES,
    Scene,
    encode_jpeg,
    render,
)

SAMPLES_PER_TAR = 1000
EVAL_STREAM = 3  # SeedSequence stream id; the pool plan uses 0, its pictures 1, fault bodies 2
EVAL_QUALITY = 90

SHAPE_TEMPLATES = (
    "a photo of a {c}.",
    "a {c}.",
    "a picture of a {c}.",
    "an image of a {c}.",
    "a drawing of a {c}.",
    "a photo of the {c}.",
)
# "the" keeps the article right for every colour ("an orange", "a red").
COLOUR_TEMPLATES = (
    "a photo of the {c} shape.",
    "the {c} shape.",
    "a picture of the {c} object.",
    "an image of the {c} shape.",
    "the {c} object.",
)


@dataclass(frozen=True)
class EvalSizes:
    # Images per class in shapes/ and colours/: 800 per set, so a top-1 near 0.25 carries a binomial
    # standard error of ±0.015 (±0.024 at 40 per class; docs/decisions/0008-demo-captions-and-eval-sets.md).
    per_class: int = 100
    retrieval: int = 200
    hierarchy: int = 200


_ATTRS = ("shape", "colour", "size", "position", "texture", "background")
_VOCABS = (SHAPES, COLOURS, SIZES, POSITIONS, TEXTURES, BACKGROUNDS)


def _scenes(n: int, rng: np.random.Generator, fixed: dict[str, np.ndarray] | None = None) -> list[Scene]:
    cols = {a: rng.integers(0, len(v), n) for a, v in zip(_ATTRS, _VOCABS, strict=True)}
    cols.update(fixed or {})
    w, h = rng.integers(200, 321, n), rng.integers(200, 321, n)
    return [Scene(*(int(cols[a][i]) for a in _ATTRS), width=int(w[i]), height=int(h[i])) for i in range(n)]


def _render_all(scenes: list[Scene], seed: int, set_id: int) -> list[bytes]:
    def one(k: int) -> bytes:
        ss = np.random.SeedSequence([seed, EVAL_STREAM, set_id, k])
        return encode_jpeg(render(scenes[k], ss).image, EVAL_QUALITY)

    return map_threads(one, list(range(len(scenes))))


def _scene_json(scene: Scene) -> bytes:
    d = {a: v[getattr(scene, a)] for a, v in zip(_ATTRS, _VOCABS, strict=True)}
    d.update(width=scene.width, height=scene.height)
    return json.dumps(d, sort_keys=True).encode()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: same seed, same tar bytes
    tar.addfile(info, io.BytesIO(data))


def _write_wds(root: Path, samples: list[dict[str, bytes]], dataset_type: str) -> None:
    test = root / "test"
    test.mkdir(parents=True, exist_ok=True)
    shards = [samples[i : i + SAMPLES_PER_TAR] for i in range(0, len(samples), SAMPLES_PER_TAR)] or [[]]
    for s, chunk in enumerate(shards):
        with tarfile.open(test / f"{s}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for k, sample in enumerate(chunk):
                key = f"{s * SAMPLES_PER_TAR + k:06d}"
                for ext, data in sample.items():  # members of one sample stay contiguous
                    _add(tar, f"{key}.{ext}", data)
    (test / "nshards.txt").write_text(f"{len(shards)}\n")
    (root / "count.txt").write_text(f"{len(samples)}\n")
    (root / "dataset_type.txt").write_text(dataset_type + "\n")


def _classification(
    root: Path, seed: int, set_id: int, attr: str, classes: tuple, templates: tuple, per_class: int
):
    rng = np.random.default_rng(np.random.SeedSequence([seed, EVAL_STREAM, set_id]))
    # Each run of len(classes) samples holds every class once, in a random order.
    labels = np.array([c for _ in range(per_class) for c in rng.permutation(len(classes))], dtype=np.int64)
    scenes = _scenes(len(labels), rng, {attr: labels})
    jpegs = _render_all(scenes, seed, set_id)
    samples = [
        {"jpg": j, "cls": f"{int(c)}".encode(), "json": _scene_json(s)}
        for j, c, s in zip(jpegs, labels, scenes, strict=True)
    ]
    _write_wds(root, samples, "classification")
    (root / "classnames.txt").write_text("\n".join(classes) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")


def _captioned(root: Path, seed: int, set_id: int, n: int, captions) -> None:
    rng = np.random.default_rng(np.random.SeedSequence([seed, EVAL_STREAM, set_id]))
    scenes = _scenes(n, rng)
    jpegs = _render_all(scenes, seed, set_id)
    samples = []
    for j, s in zip(jpegs, scenes, strict=True):
        lines = captions(*(getattr(s, a) for a in _ATTRS), rng=rng)
        samples.append({"jpg": j, "txt": "\n".join(lines).encode(), "json": _scene_json(s)})
    _write_wds(root, samples, "retrieval")


def _paraphrases(*attrs: int, rng: np.random.Generator) -> list[str]:
    return paraphrases(*attrs)


def _levels(*attrs: int, rng: np.random.Generator) -> list[str]:
    return all_levels(*attrs, variants=tuple(int(rng.integers(n_variants("en", k))) for k in range(4)))


def write_eval_sets(
    out_dir: str | Path, seed: int = 0, sizes: EvalSizes | None = None, reuse_key: str | None = None
) -> dict[str, str]:
    """Write the four eval sets under ``out_dir``; returns name → directory.

    With ``reuse_key`` (the generator's code fingerprint), sets already written with the same key, seed and
    sizes are kept as they are: they do not depend on the pool's size, so a pool of another n reuses them.
    """
    sizes = sizes or EvalSizes()
    out = Path(out_dir)
    dirs = {name: out / name for name in ("shapes", "colours", "retrieval", "hierarchy")}
    stamp = {"key": reuse_key, "seed": int(seed), "sizes": asdict(sizes)}
    marker = out / "eval.json"
    if reuse_key is not None and marker.exists() and json.loads(marker.read_text()) == stamp:
        return {k: str(v) for k, v in dirs.items()}
    marker.unlink(missing_ok=True)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    _classification(dirs["shapes"], seed, 0, "shape", SHAPES, SHAPE_TEMPLATES, sizes.per_class)
    _classification(dirs["colours"], seed, 1, "colour", COLOURS, COLOUR_TEMPLATES, sizes.per_class)
    _captioned(dirs["retrieval"], seed, 2, sizes.retrieval, _paraphrases)
    _captioned(dirs["hierarchy"], seed, 3, sizes.hierarchy, _levels)
    marker.write_text(json.dumps(stamp, sort_keys=True))
    return {k: str(v) for k, v in dirs.items()}
