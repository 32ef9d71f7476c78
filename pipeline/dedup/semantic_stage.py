"""SemDeDup's candidate pairs on Ray, over every row of the embeddings files (the curation stage's half
that compares vectors: ``curation_stage`` decides on what it finds).

The files are read in place, a block at a time, by one task per file over all its rows (``semantic_files``;
docs/decisions/0097 and 0102): a count, then the k-means sample drawn by uid hash (at most ``_FIT_BYTES`` of
float32, whatever the pool's size: docs/decisions/0106) that one task fits k-means, the guests' screen
basis and each cluster's two sub-directions on (docs/decisions/0111), and where it saw fewer than 256 rows
a centroid, one Lloyd step over a sample that size, one task a file (docs/decisions/0108); then the
assignment of each row to its nearest cluster and as a guest to the clusters whose border it is near and
whose members it can reach (``semantic.assign_with_guests``, after a pass for each cluster's extents about
its centroid and its sub-directions), written to bucket files by cluster group (``_GROUP_BYTES`` of
members and guests as a sample estimates them; a wide cluster's guests shared over several groups: docs/decisions/0104),
on ``scratch``. One task per group reads its bucket and returns the pairs above the threshold (guests
screened in the basis: docs/decisions/0096) as positions in the uids they name, merged over the union of
those uids (docs/decisions/0107).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from pipeline.common import storage
from pipeline.common.process_memory import release_free_memory
from pipeline.common.storage import Storage
from pipeline.config import DedupeConfig
from pipeline.dedup import curation_rules as CR
from pipeline.dedup import semantic as SD
from pipeline.dedup import semantic_files as SF

_GROUP_BYTES = 44 << 20  # bucket bytes of one task's memberships (members and guests), as estimated
_MEMBERSHIP_BYTES = 48  # a membership's bytes besides its float16 vector (uid, home, cluster, bucket)
_ESTIMATE_ROWS = 1 << 17  # sample rows each cluster's members and guests are estimated on
_FIT_BYTES = 512 << 20  # float32 sample that k-means and the screen's basis see (decision 0106)


def since(t0: float) -> str:
    """Seconds since ``t0`` as the stage's progress lines print them."""
    return f"{time.perf_counter() - t0:.1f} s"


def ray_task(fn: Callable):
    """``fn`` as a one-CPU Ray task that hands its worker's freed memory back when it ends, so the next
    task on that worker starts from what the worker holds, not from the largest task before it."""
    import ray

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            release_free_memory()

    return ray.remote(num_cpus=1)(run)


def semantic_pairs(
    sources: Sequence[str],
    key: str,
    cfg: DedupeConfig,
    store: Storage,
    scratch: str | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> tuple[tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray], int, int]:
    """SemDeDup's candidates over every row of ``sources``, by tasks: the pairs above the threshold with
    their cosines (docs/decisions/0087) as (the sorted uids they name, positions i, j in them, cosine:
    ``curation_rules.merge_pairs``); the number of clusters; the number of rows the files hold."""
    import ray

    t0 = time.perf_counter()
    none = CR.merge_pairs([])
    count = ray_task(SF.count_file)
    n = int(sum(ray.get([count.remote(s, store) for s in sources])))
    if n < 2:
        return none, min(n, 1), n
    k = max(1, -(-n // cfg.semantic_cluster_rows))
    width = max(ray.get([ray_task(SF.width_file).remote(s, key, store) for s in sources]))
    m = max(k, min(n, 256 * k, _FIT_BYTES // (4 * max(1, width))))
    sample_task = ray_task(SF.sample_file)
    outs = [sample_task.remote(src, key, _cut(m, n), cfg.semantic_seed, store) for src in sources]
    own = scratch is None
    root = tempfile.mkdtemp(prefix="prolip-semdedup-") if own else scratch
    try:
        centroids, basis, subs = ray.get(ray_task(_fit_files).remote(m, k, cfg.semantic_seed, *outs))
        log(f"semantic dedup: {n} rows in {len(sources)} files, {k} clusters fitted on {m} ({since(t0)})")
        want = min(n, 256 * k)  # 256 rows a centroid, faiss's own cap
        if want > m:
            centroids = _lloyd_step(sources, key, centroids, _cut(want, n), cfg.semantic_seed, store)
            log(f"semantic dedup: a Lloyd step over ~{want} rows ({since(t0)})")
        pairs = _pairs(sources, key, centroids, subs, basis, cfg, root, store, log, outs, n)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return pairs, len(centroids), n


def _cut(m: int, n: int) -> int:
    """The uid-hash cut that samples a little more than ``m`` of ``n`` rows (1% more than m/n asks; the
    fit trims to the m smallest hashes)."""
    return 1 << 64 if m >= n else min(int(min(1.0, 1.01 * m / n + 64 / n) * float(1 << 64)), (1 << 64) - 1)


def _lloyd_step(
    sources: Sequence[str], key: str, centroids: np.ndarray, cut: int, seed: int, store: Storage
) -> np.ndarray:
    """The fit's centroids moved to the mean direction of their rows in a sample of 256 a centroid, one
    task a file (docs/decisions/0108); a centroid no sampled row is nearest stays. The sums are added
    in file order: the pairs never depend on the centroids, only the cost does."""
    import ray

    sums = ray_task(SF.centroid_sums)
    cen = ray.put(centroids)
    total, count = np.zeros(centroids.shape, np.float64), np.zeros(len(centroids), np.int64)
    for s, c in _in_order([sums.remote(src, key, cut, seed, cen, store) for src in sources]):
        total += s
        count += c
    moved = SD.normalize(total).astype(np.float32)
    return np.where(count[:, None] > 0, moved, centroids).astype(np.float32)


def _in_order(refs: list) -> Iterator:
    """The tasks' results in submission order, each released from the object store once the next is asked
    for: the store holds the results not yet reached, not every file's (k·d float64 a file for the Lloyd
    step: 2 GiB at 16M rows of 256-d, ~400 GB at 128M of 768-d)."""
    import ray

    refs.reverse()
    while refs:
        yield ray.get(refs.pop())


def _pairs(
    sources: Sequence[str],
    key: str,
    centroids: np.ndarray,
    subs: np.ndarray,
    basis: np.ndarray | None,
    cfg: DedupeConfig,
    root: str,
    store: Storage,
    log: Callable[[str], None],
    sample: Sequence,
    n_rows: int,
) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
    """Assignment in one task per file into bucket files of cluster groups (``SF.plan_groups`` over the
    ``sample``'s estimate of each cluster's members and guests among ``n_rows``: ``_GROUP_BYTES`` of
    bucket a group, whatever the vectors' width), then one task per group → the union of their pairs."""
    import ray

    t0 = time.perf_counter()
    t = cfg.semantic_threshold
    paths = [storage.join(root, "assign", f"{f:05d}.bkt") for f in range(len(sources))]
    cen, sub = ray.put(centroids), ray.put(subs)
    cosines = ray_task(SF.cosines_file)
    member_cos = None
    for c in _in_order([cosines.remote(src, key, cen, store, sub) for src in sources]):
        member_cos = c if member_cos is None else np.minimum(member_cos, c)
    est = ray_task(_cluster_loads).remote(_ESTIMATE_ROWS, cen, member_cos, t, sub, *sample)
    members, guests = ray.get(est)  # on a sample: scaled to the pool
    scale = n_rows / max(1.0, members.sum())
    members, guests = members * scale, guests * scale
    budget = _GROUP_BYTES / (2 * centroids.shape[1] + _MEMBERSHIP_BYTES)  # float16 vectors
    plan = SF.plan_groups(members, guests, budget)
    log(
        f"semantic dedup: ~{(members.sum() + guests.sum()) / max(1.0, n_rows):.1f} memberships a row in a sample, "
        f"{plan.n_buckets} groups ({int((plan.slices > 1).sum())} clusters over several)"
    )
    log(f"semantic dedup: the clusters' extents measured ({since(t0)})")
    bucket_space(root, members.sum() + guests.sum() + members @ (plan.slices - 1), centroids.shape[1])
    t0 = time.perf_counter()
    assign = ray_task(SF.assign_file)
    n = ray.get(
        [
            assign.remote(s, key, cen, member_cos, t, plan, p, store, sub)
            for s, p in zip(sources, paths, strict=True)
        ]
    )
    log(f"semantic dedup: {sum(n)} cluster memberships (homes and guests) written ({since(t0)})")
    t0 = time.perf_counter()
    pairs = ray_task(SF.group_pairs)
    groups = range(plan.n_buckets)
    first = ray.put(plan.first)
    found = ray.get([pairs.remote(paths, g, first, cen, t, basis, store) for g in groups])
    store.remove_files(paths)
    log(
        f"semantic dedup: {sum(len(f[1]) for f in found)} pairs above the threshold in {len(groups)} groups ({since(t0)})"
    )
    pairs = CR.merge_pairs(found)
    del found
    release_free_memory()  # the merge's sort, freed but kept by the allocators
    return pairs


def bucket_space(root: str, memberships: float, width: int) -> None:
    """Refuse before the assignment when a local ``root`` has not the room for the bucket files the
    sample predicts (float16 vectors and ``_MEMBERSHIP_BYTES`` a membership): an error now names the
    need, a full disk an hour later names none. Storage on S3 is not checked."""
    if storage.is_s3(root):
        return
    each = 2 * width + _MEMBERSHIP_BYTES
    path = os.path.abspath(root)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    if memberships * each > free:
        raise OSError(
            f"semantic dedup: the cluster buckets need ~{memberships * each / 1e9:.1f} GB under {root} "
            f"(~{memberships:,.0f} memberships of {each} B, estimated on a sample) and it has "
            f"{free / 1e9:.1f} GB free: give it more room (the build's storage) or use storage on S3"
        )


def _cluster_loads(
    m: int, centroids: np.ndarray, member_cos: np.ndarray, threshold: float, subs: np.ndarray, *sample
) -> tuple[np.ndarray, np.ndarray]:
    """One task: per cluster, the members and the guests the first ``m`` rows of the fit's sample give it."""
    x = SF.fit_sample(sample, m)
    primary, _, g_cl = SD.assign_with_guests(x, centroids, threshold, member_cos=member_cos, subs=subs)
    k = len(centroids)
    return np.bincount(primary, minlength=k) * 1.0, np.bincount(g_cl, minlength=k) * 1.0


def _fit_files(m: int, k: int, seed: int, *sample: tuple) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """One task: the files' samples trimmed to ``m`` rows, then ``_fit``."""
    return _fit(SF.fit_sample(sample, m), k, seed)


def _fit(sample: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """One task: k-means centroids, the guests' screen basis and each cluster's sub-directions from the
    bounded sample."""
    centroids = SD.kmeans_centroids(sample, k, seed, unit=True)
    basis = SD.screen_basis(sample[SD.screen_sample(len(sample), seed)])
    return centroids, basis, SD.sub_directions(sample, centroids, unit=True)
