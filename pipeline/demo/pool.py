"""The demo pool: a seeded, DataComp-shaped image-text pool with web-like noise and a ground-truth file.

``generate_pool(out_dir, n, seed)`` writes, independent of any port:

- ``images/``, ``pages/``, ``bomb.png``: the bodies the demo server sends (pipeline/demo/server.py);
- ``routes.json``: URL path → body file and fault kind, which the server obeys;
- ``truth.parquet``: per row what the picture shows, which noise was injected and the status the build
  must end in (``expected_status``) — the pipeline never reads it;
- ``eval/``: clean zero-shot and retrieval sets (pipeline/demo/eval_sets.py);
- ``pool.json``: parameters and counts; a later call with the same parameters reuses the directory.

``write_metadata(out_dir, base_url)`` then writes ``metadata/part-00000.parquet`` (DataComp columns) with
full URLs once the server's port is known.

Noise rates are chosen to look like web data at DataComp scale (≈30% mismatched captions, 5% non-English, 5% small or elongated,
3% duplicate URLs, 2% identical bytes, 2% near-duplicates, each failure kind ≈0.75%). Image-level noise
labels (``noise``) are mutually exclusive and never touch the source rows of duplicates, so each fault
is the only thing wrong with its row; caption noise (``caption_noise``) is an independent column.
``expected_status`` replays the build's rules on the generated data (URL dedupe on normalised URLs,
then per-URL fate, then exact-bytes dedupe, then pHash near-duplicates, smallest uid kept each time).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.dedup.urlnorm import normalize_url
from pipeline.demo.captions import caption, english_mask, n_variants
from pipeline.demo.eval_sets import EvalSizes, write_eval_sets
from pipeline.demo.faults import BOMB_SIDE, OVERSIZE_BYTES
from pipeline.demo.images import close_pairs, render_pool
from pipeline.demo.plan import FAULT_STATUS, plan_pool
from pipeline.demo.planted import eval_hash_groups, plant, write_curation_files
from pipeline.demo.render import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES, TEXTURES

GENERATOR_VERSION = 1
NEAR_DUP_THRESHOLD = 4  # DedupeConfig.phash_threshold


@dataclass
class PoolInfo:
    pool_dir: str
    n: int
    seed: int
    noise_counts: dict[str, int]
    caption_noise_counts: dict[str, int]
    expected_status_counts: dict[str, int]
    oversize_bytes: int = OVERSIZE_BYTES
    bomb_side: int = BOMB_SIDE
    eval_sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    reused: bool = False

    @property
    def truth_path(self) -> str:
        return os.path.join(self.pool_dir, "truth.parquet")

    @property
    def routes_path(self) -> str:
        return os.path.join(self.pool_dir, "routes.json")

    @property
    def eval_dir(self) -> str:
        return os.path.join(self.pool_dir, "eval")


def expected_statuses(
    uids: list[str],
    urls: list[str],
    fates: list[str],
    served_sha: list[str | None],
    phashes: np.ndarray,
    threshold: int = NEAR_DUP_THRESHOLD,
) -> list[str]:
    """The status the build gives each row, replaying its rules in its order.

    ``fates`` is what fetching the row's URL alone would end in (``success`` or a failure status);
    ``served_sha`` the sha256 of the bytes a successful fetch gets; ``phashes`` the build's hash of them.
    1. URL dedupe: among rows with the same normalised URL the smallest uid keeps its fate, the others
       are ``duplicate_url``. 2. Exact bytes: among successes sharing ``served_sha`` the smallest uid stays,
       the others are ``duplicate_image``. 3. Near-duplicates: successes linked by Hamming distance ≤
       ``threshold`` form groups; the smallest uid of each stays, the others are ``near_duplicate``.
    """
    n = len(uids)
    status = list(fates)
    first: dict[str, int] = {}
    for i in sorted(range(n), key=lambda k: uids[k]):
        key = normalize_url(urls[i])
        if key in first:
            status[i] = S.STATUS_DUPLICATE_URL
        else:
            first[key] = i
    seen: dict[str, int] = {}
    for i in sorted(range(n), key=lambda k: uids[k]):
        if status[i] != S.STATUS_SUCCESS:
            continue
        if served_sha[i] in seen:
            status[i] = S.STATUS_DUPLICATE_IMAGE
        else:
            seen[served_sha[i]] = i
    ok = np.array([i for i in range(n) if status[i] == S.STATUS_SUCCESS], dtype=np.int64)
    parent = list(range(len(ok)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    h = np.asarray(phashes, dtype=np.int64)[ok]
    for a, b in close_pairs(h, np.arange(len(ok)), threshold + 1):
        parent[root(int(b))] = root(int(a))
    groups: dict[int, list[int]] = {}
    for k in range(len(ok)):
        groups.setdefault(root(k), []).append(int(ok[k]))
    for members in groups.values():
        keep = min(members, key=lambda i: uids[i])
        for i in members:
            if i != keep:
                status[i] = S.STATUS_NEAR_DUPLICATE
    return status


def _captions(plan: dict[str, np.ndarray]) -> tuple[list[str], list[str]]:
    texts, true = [], []
    for i in range(len(plan["uid"])):
        lang, level = str(plan["language"][i]), int(plan["level"][i])
        v = int(plan["variant"][i])
        shown = [
            int(plan["cap_" + a][i]) for a in ("shape", "colour", "size", "position", "texture", "background")
        ]
        real = [int(plan[a][i]) for a in ("shape", "colour", "size", "position", "texture", "background")]
        texts.append(caption(lang, level, v % n_variants(lang, level), *shown))
        true.append(caption("en", level, v % n_variants("en", level), *real))
    return texts, true


def code_fingerprint() -> str:
    """Version + hash of the generator's sources: a cached pool is reused only if it would come out the same."""
    pipeline_dir = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(str(GENERATOR_VERSION).encode())
    for name in _GENERATOR_MODULES:
        h.update((pipeline_dir / f"{name}.py").read_bytes())
    return h.hexdigest()[:16]


_GENERATOR_MODULES = (
    "demo/pool", "demo/plan", "demo/images", "demo/render", "demo/captions", "demo/faults", "demo/eval_sets",
    "demo/planted",
    "dedup/urlnorm", "dedup/phash", "schema",
)  # fmt: skip


def _pool_matches(out: Path, key: dict) -> PoolInfo | None:
    meta = out / "pool.json"
    if not (meta.exists() and (out / "truth.parquet").exists() and (out / "routes.json").exists()):
        return None
    try:
        saved = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    if saved.get("key") != key:
        return None
    info = PoolInfo(**saved["info"])
    info.pool_dir, info.reused = str(out), True
    return info


def generate_pool(
    out_dir: str | os.PathLike, n: int = 2000, seed: int = 0, eval_sizes: EvalSizes | None = None
) -> PoolInfo:
    """Write the pool (port-independent) into ``out_dir``; reuse it when ``pool.json`` matches."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    eval_sizes = eval_sizes or EvalSizes()
    key = {"version": code_fingerprint(), "n": int(n), "seed": int(seed), "eval": asdict(eval_sizes)}
    cached = _pool_matches(out, key)
    if cached is not None:
        return cached
    if (out / "pool.json").exists():  # another pool was generated here: clear its bodies and sets
        for sub in ("images", "pages", "metadata"):  # eval/ checks its own key: it does not depend on n
            shutil.rmtree(out / sub, ignore_errors=True)
        (out / "pool.json").unlink()
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_pool(n, seed)
    write_eval_sets(out / "eval", seed, eval_sizes, reuse_key=key["version"])
    planted = plant(plan, seed, out / "eval")  # semantic copies and eval leaks, before the captions
    eval_phash, eval_groups = eval_hash_groups(planted)
    texts, true_captions = _captions(plan)
    is_en = english_mask(texts)
    # bodies written, routes/hashes/shas per row
    rows = render_pool(plan, seed, out, fixed=planted.leak_jpeg, avoid=(eval_phash, eval_groups))
    (out / "routes.json").write_text(json.dumps(rows["routes"], sort_keys=True))
    uids = [str(u) for u in plan["uid"]]
    fates = [FAULT_STATUS.get(str(k), S.STATUS_SUCCESS) for k in plan["noise"]]
    # URL dedupe only needs URLs up to the port, so any base gives the same decision.
    urls = [_format_url(t, "http://127.0.0.1:8000") for t in plan["url_template"]]
    expected = expected_statuses(uids, urls, fates, rows["served_sha256"], rows["phash"])
    truth = _truth_table(plan, rows, texts, true_captions, is_en, expected)
    truth = _with_planted(truth, plan, planted, expected)
    pq.write_table(truth, out / "truth.parquet")
    write_curation_files(out, plan, planted, seed, eval_phash)
    info = PoolInfo(
        pool_dir=str(out),
        n=int(n),
        seed=int(seed),
        noise_counts=dict(sorted(Counter(plan["noise"].tolist()).items())),
        caption_noise_counts=dict(sorted(Counter(plan["caption_noise"].tolist()).items())),
        expected_status_counts=dict(sorted(Counter(expected).items())),
        eval_sizes=asdict(eval_sizes),
        seconds=round(time.perf_counter() - t0, 3),
    )
    (out / "pool.json").write_text(json.dumps({"key": key, "info": asdict(info)}, indent=1, sort_keys=True))
    return info


def _truth_table(plan, rows, texts, true_captions, is_en, expected) -> pa.Table:
    n = len(plan["uid"])
    dup_of = [str(plan["uid"][j]) if j >= 0 else None for j in plan["dup_of"]]
    names = {
        "shape": SHAPES, "colour": COLOURS, "size": SIZES, "position": POSITIONS, "texture": TEXTURES,
        "background_colour": BACKGROUNDS,
    }  # fmt: skip
    src = {"background_colour": "background"}
    cols: dict[str, object] = {
        "uid": [str(u) for u in plan["uid"]],
        "path": rows["path"],
        "url_template": [str(t) for t in plan["url_template"]],
        "noise": [str(x) for x in plan["noise"]],
        "caption_noise": [str(x) for x in plan["caption_noise"]],
        "is_mismatched": plan["caption_noise"] == "mismatched",
        "dup_of": dup_of,
    }
    for col, vocab in names.items():
        cols[col] = [vocab[int(k)] for k in plan[src.get(col, col)]]
    cols["background"] = [f"{t} {b}" for t, b in zip(cols["texture"], cols["background_colour"], strict=True)]
    cols.update(
        width=rows["width"], height=rows["height"], has_face=[b is not None for b in rows["face_bbox"]],
        level=plan["level"].astype(np.int64), language=[str(x) for x in plan["language"]], text=texts,
        true_caption=true_captions, caption_is_english_fasttext=is_en, jpeg_quality=rows["quality"],
        phash=rows["phash"], phash_blurred=rows["phash_blurred"], sha256=rows["sha256"],
        served_sha256=rows["served_sha256"], original_width=rows["original_width"],
        original_height=rows["original_height"],
        face_bboxes=[[list(b)] if b is not None else [] for b in rows["face_bbox"]],
        expected_status=expected,
    )  # fmt: skip
    table = pa.table(cols)
    assert table.num_rows == n
    return table


def _with_planted(truth: pa.Table, plan, planted, expected: list[str]) -> pa.Table:
    """The curation truth: ``semantic_dup_of`` (the uid a planted copy re-renders), ``eval_leak`` and
    ``eval_leak_key`` (the eval picture a row shows), and ``expected_curated_status``: the status with
    the build's curation stage on (``dedupe.semantic``, ``decontam.reference``): a leak that downloads is
    ``eval_leak:<task>``, and of a planted pair that both download the larger uid is the duplicate."""
    uid = [str(u) for u in plan["uid"]]
    src = planted.sem_dup_of
    curated = list(expected)
    for row in range(len(uid)):
        if planted.leak_task[row] and curated[row] == S.STATUS_SUCCESS:
            curated[row] = S.eval_leak(planted.leak_task[row])
        if src[row] >= 0 and curated[row] == curated[src[row]] == S.STATUS_SUCCESS:
            curated[max(row, src[row], key=lambda i: uid[i])] = S.STATUS_SEMANTIC_DUPLICATE
    return (
        truth.append_column(
            "semantic_dup_of", pa.array([uid[j] if j >= 0 else None for j in src], pa.string())
        )
        .append_column("eval_leak", pa.array([str(t) for t in planted.leak_task], pa.string()))
        .append_column("eval_leak_key", pa.array([str(k) for k in planted.leak_key], pa.string()))
        .append_column("expected_curated_status", pa.array(curated, pa.string()))
    )


def _format_url(template: str, base_url: str) -> str:
    from urllib.parse import urlsplit

    base = base_url.rstrip("/")
    scheme, rest = base.split("://", 1)
    port = urlsplit(base).port
    return (
        template.replace("{base}", base)
        .replace("{BASE}", scheme.upper() + "://" + rest)
        .replace("{port}", str(port) if port is not None else "80")
    )


def stand_in_scores(embeddings: Path, uids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The metadata's CLIP scores from the pool's stand-in embeddings (pipeline/demo/planted.py): L/14's is
    the cosine of the pair's vectors, as DataComp computed its column from CLIP L/14; B/32's the same
    cosine with independent noise (σ 0.03, seeded), a weaker model's view of the same pairs
    (docs/decisions/0050-demo-stand-in-embeddings.md)."""
    with np.load(embeddings) as z:
        order = {str(u): i for i, u in enumerate(z["uid"])}
        image, text = z["l14_img"].astype(np.float32), z["l14_txt"].astype(np.float32)
    rows = np.array([order[u] for u in uids])
    cos = np.sum(image[rows] * text[rows], axis=1) / (
        np.linalg.norm(image[rows], axis=1) * np.linalg.norm(text[rows], axis=1)
    )
    noise = np.random.default_rng(np.random.SeedSequence([len(uids), 32])).normal(0.0, 0.03, len(uids))
    return cos.astype(np.float32).astype(np.float64), (cos + noise).astype(np.float32).astype(np.float64)


def write_metadata(out_dir: str | os.PathLike, base_url: str) -> str:
    """Write ``metadata/part-00000.parquet`` (DataComp columns) for a pool served at ``base_url``."""
    out = Path(out_dir)
    truth = pq.read_table(out / "truth.parquet")
    l14, b32 = stand_in_scores(out / "embeddings.npz", truth["uid"].to_pylist())
    table = pa.table(
        {
            S.UID: truth["uid"],
            S.URL: pa.array(
                [_format_url(t, base_url) for t in truth["url_template"].to_pylist()], pa.string()
            ),
            S.TEXT: truth["text"],
            S.ORIGINAL_WIDTH: truth["original_width"],
            S.ORIGINAL_HEIGHT: truth["original_height"],
            S.SHA256: truth["sha256"],
            S.CLIP_B32: pa.array(b32, pa.float64()),
            S.CLIP_L14: pa.array(l14, pa.float64()),
            S.FACE_BBOXES: truth["face_bboxes"].cast(pa.list_(pa.list_(pa.float64()))),
        },
        schema=S.METADATA_SCHEMA,
    )
    path = out / "metadata" / "part-00000.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    # DataComp's layout: the shard's embeddings in an .npz beside its parquet (pipeline/demo/planted.py)
    shutil.copyfile(out / "embeddings.npz", path.with_suffix(".npz"))
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # a reader never sees half a file (the server may already be up)
    return str(path)
