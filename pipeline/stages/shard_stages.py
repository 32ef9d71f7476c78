"""The build's final shards, written by tasks: one task per window of consecutive output shards.

The shards hold the successes part by part, each part's in its tar's (uid) order — what
``subsets.reshard.reshard`` writes from the part tars and the success uids in one process — with
img2dataset's keys ``{shard:08d}{index}`` by output position and each json's ``key`` set to it. The driver
knows each part's success count (pipeline/stages/status_stages.py), so each part's first output position
is a prefix sum; a window task reads the parts that overlap its positions (a part at a window's edge is
read by both windows) and writes its shards with their stats files; the driver writes ``sizes.json`` and
``reshard.json`` from the windows' counts. A window is ``WINDOW_SAMPLES`` samples (whole shards).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from pipeline import schema as S
from pipeline.common import faults, storage
from pipeline.shards.reader import iter_shard
from pipeline.shards.writer import RollingWriter, write_sizes
from pipeline.stages.image_stages import PART
from pipeline.stages.layout import Parts
from pipeline.subsets.reshard import SUMMARY_NAME, output_key, renamed_members, sample_uid_and_meta

WINDOW_SAMPLES = 100_000  # samples a window task writes (rounded to whole shards)


@dataclass(frozen=True)
class Windows:
    parts: Parts
    out: str  # the shards directory
    samples_per_shard: int
    starts: tuple[int, ...]  # output position of part k's first success; the total last

    @property
    def shards_per_window(self) -> int:
        return max(1, WINDOW_SAMPLES // self.samples_per_shard)

    @property
    def total(self) -> int:
        return self.starts[-1]

    @property
    def n_windows(self) -> int:
        return math.ceil(self.total / (self.shards_per_window * self.samples_per_shard))


def _survivors(job: Windows, part: int, cache: dict) -> set[str]:
    p = job.parts
    g = part // p.group_parts
    if g not in cache:
        cache.clear()
        cache[g] = p.store.read_parquet(p.group_survivors(g))
    t = cache[g]
    mask = t.column(PART).to_numpy() == part
    return set(np.asarray(t.column(S.UID).to_pylist(), dtype=object)[mask].tolist())


def write_window(job: Windows, w: int) -> dict:
    """Window ``w``'s shards; → each shard's name and count."""
    per = job.shards_per_window * job.samples_per_shard
    lo, hi = w * per, min(job.total, (w + 1) * per)
    starts = np.asarray(job.starts, np.int64)
    writer = RollingWriter(
        job.out, job.samples_per_shard, job.parts.store, first_shard=w * job.shards_per_window
    )
    cache: dict = {}
    part = int(np.searchsorted(starts, lo, side="right") - 1)
    try:
        while part < len(starts) - 1 and starts[part] < hi:
            if starts[part + 1] > lo:
                _copy_part(job, part, (lo, hi), writer, cache)
            part += 1
        writer.close(sizes=False)
    except BaseException:
        writer.abort()
        raise
    faults.point("stage.shards")
    return {"shards": {s.rsplit("/", 1)[-1]: c for s, c in zip(writer.shards, writer.counts, strict=True)}}


def _copy_part(job: Windows, part: int, window: tuple[int, int], writer: RollingWriter, cache: dict) -> None:
    """Part ``part``'s successes whose output position falls in ``window``, in tar order."""
    keep = _survivors(job, part, cache)
    at = job.starts[part]
    lo, hi = window
    for sample in iter_shard(job.parts.part_file(part, "tar"), job.parts.store, decode=False):
        uid, meta = sample_uid_and_meta(sample)
        if uid not in keep:
            continue
        if at >= hi:
            break
        if at >= lo:
            meta = dict(meta or {})
            meta.setdefault(S.UID, uid)
            key = output_key(at, job.samples_per_shard)
            writer.write(key, renamed_members(sample, meta, key))
        at += 1


_OUTPUT = re.compile(r"^(\d{8})(\.tar|_stats\.json)$")


def is_output(path: str) -> bool:
    """A shard or a shard's stats file of the build's shards directory."""
    return bool(_OUTPUT.match(path.rsplit("/", 1)[-1]))


def shard_of(path: str) -> str:
    """The shard a shard or stats file belongs to, as ``{i:08d}.tar``."""
    return _OUTPUT.match(path.rsplit("/", 1)[-1]).group(1) + ".tar"


def write_summary(out: str, sizes: dict[str, int], store) -> None:
    """``sizes.json`` (open_clip's) and ``reshard.json`` of the whole set of shards."""
    write_sizes(out, sizes, store)
    total = sum(sizes.values())
    store.write_json(
        {"n_written": total, "shards": sorted(sizes), "n_missing": 0, "source": "build"},
        storage.join(out, SUMMARY_NAME),
    )
