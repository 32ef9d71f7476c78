"""Where the build's stages keep their per-file and per-bucket datasets, and how many buckets there are.

Everything below ``work/stages/<digest>/`` of a run directory (local or ``s3://``), the digest covering
what the stages before download read (the metadata files by name, size and modification time, the
caption limit, the served hosts, the columns carried, the bucket size), so an output whose pool or
settings changed never resumes into another pool's stages; the stages after download sit under a
second digest of the committed parts and the dedupe settings. A task reads its inputs and writes its
outputs through one ``Pool`` (the pre-download half) or ``Parts`` object, which travels to every task.

Buckets: ``n_buckets`` ranges of uids of about ``bucket_rows`` rows each (the unit of every per-uid
decision, of the status table's files and of the filters), ``n_url`` hash buckets of normalised URLs.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from pipeline.common import storage
from pipeline.common.storage import Storage

VERSION = 2  # bump when a stage's output format changes: earlier stage files are then not reused


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def bucket_count(rows: int, bucket_rows: int) -> int:
    return max(1, math.ceil(rows / bucket_rows))


@dataclass(frozen=True)
class Pool:
    """The pre-download stages' view of a run: the metadata files and where each stage writes."""

    root: str  # work/stages/<digest>
    files: tuple[str, ...]
    file_rows: tuple[int, ...]
    n_buckets: int
    n_url: int
    max_caption_bytes: int
    served: tuple[str, ...]
    columns: tuple[str, ...]  # metadata columns carried to the per-uid stages (the filters' inputs)
    store: Storage = field(default_factory=Storage)

    def at(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def scan(self, f: int) -> str:
        """File ``f``'s rows, bucketed by uid."""
        return self.at("scan", f"{f:05d}.bkt")

    def order(self, f: int) -> str:
        """File ``f``'s per-row content digests in file order."""
        return self.at("order", f"{f:05d}.parquet")

    def rows(self, b: int) -> str:
        """Every row of uid bucket ``b`` with its pre-download status (URL dedupe aside)."""
        return self.at("rows", f"{b:05d}.parquet")

    def urls(self, b: int) -> str:
        """Bucket ``b``'s rows still going on, bucketed by URL."""
        return self.at("urls", f"{b:05d}.bkt")

    def decided(self, b: int) -> str:
        """Bucket ``b``'s rows decided before download, bucketed by file."""
        return self.at("decided", f"{b:05d}.bkt")

    def url_dups(self, c: int, by: str) -> str:
        """URL bucket ``c``'s duplicate rows, bucketed ``by`` "file" or "uid"."""
        return self.at(f"url_dups_by_{by}", f"{c:05d}.bkt")

    def live(self, f: int) -> str:
        """File ``f``'s live row numbers, raw little-endian int64 (ranged reads by the download actors)."""
        return self.at("live", f"{f:05d}.i64")


@dataclass(frozen=True)
class Parts:
    """The post-download stages' view: the committed parts, grouped, and where each stage writes."""

    root: str  # <pool root>/post-<digest>
    pool: Pool
    parts_dir: str
    tokens: tuple[str, ...]  # committed token of part k
    group_parts: int  # parts per group
    n_sha: int  # buckets of image sha256
    n_band: int  # buckets of pHash band values
    phash_threshold: int
    near: bool

    @property
    def store(self) -> Storage:
        return self.pool.store

    @property
    def n_groups(self) -> int:
        return math.ceil(len(self.tokens) / self.group_parts)

    def group(self, g: int) -> range:
        return range(g * self.group_parts, min(len(self.tokens), (g + 1) * self.group_parts))

    def at(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def part_file(self, part: int, ext: str) -> str:
        return storage.join(self.parts_dir, f"part-{part:06d}.{self.tokens[part]}.{ext}")

    def by_uid(self, g: int) -> str:
        return self.at("part_rows", f"{g:05d}.bkt")

    def by_sha(self, g: int) -> str:
        return self.at("by_sha", f"{g:05d}.bkt")

    def exact(self, e: int) -> str:
        return self.at("exact", f"{e:05d}.bkt")

    def by_band(self, b: int) -> str:
        return self.at("by_band", f"{b:05d}.bkt")

    def pairs(self, n: int) -> str:
        return self.at("pairs", f"{n:05d}.parquet")

    def near_dups(self) -> str:
        return self.at("near", "dups.bkt")

    def curated(self) -> str:
        return self.at("curated", "relabels.bkt")

    def survivors(self, b: int) -> str:
        """Bucket ``b``'s successes, bucketed by part group."""
        return self.at("survivors", f"{b:05d}.bkt")

    def group_survivors(self, g: int) -> str:
        """Group ``g``'s successes, by part and uid."""
        return self.at("group_survivors", f"{g:05d}.parquet")
