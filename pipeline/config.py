"""The dataset build's configuration: ``BuildConfig`` and its parts, and the build presets.

Declared in the one config dialect (``pipeline.common.config``): frozen pydantic dataclasses, strict when
built in code, lax for YAML and ``--set``, every range in the field's type and the few cross-field rules in
``__post_init__``; an error is one line naming the key path.
"""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field

from pipeline.common.components import SpecsOf
from pipeline.common.config import (
    Names,
    NonNegative,
    NonNegativeFloat,
    OpenFraction,
    Positive,
    PositiveFloat,
    Seed,
    config_class,
    require,
)
from pipeline.common.storage_config import StorageConfig
from pipeline.filters.registry import Filter

SUBSET_SCOPES = ("metadata", "downloaded")


@config_class
class DownloadConfig:
    """DataComp's download settings (img2dataset as called by DataComp's ``download_upstream.py``)."""

    image_size: Positive = 512  # longest side; downscale only
    jpeg_quality: Annotated[int, Field(ge=1, le=100)] = 95  # of the re-encoded JPEG (img2dataset's 95)
    timeout_s: PositiveFloat = 10.0  # per request (DataComp's 10 s)
    retries: NonNegative = 2  # further attempts after a transient failure (timeout, 429, 5xx)
    # Passes over the transient rows once every part is done, when an outage or a host cut off the
    # network has had time to pass (docs/download.md, "Late retries"); 0 = none.
    late_retries: Annotated[int, Field(ge=0, le=5)] = 1
    threads_per_actor: Positive = 16  # concurrent downloads per download actor
    max_bytes: Positive = 20 * 1024 * 1024  # a larger body is refused as image_too_large
    max_pixels: Positive = 89_478_485  # Pillow's decompression-bomb limit
    verify_sha256: bool = True  # refuse a body whose sha256 differs from the metadata's
    blur_faces: bool = True  # blur the metadata's face boxes (img2dataset 1.40's strength)
    honor_robots: bool = True  # an X-Robots-Tag noai/noimageai opt-out refuses the image
    allow_hosts: Names = field(default_factory=list)  # private/loopback hosts explicitly allowed
    user_agent: str = "prolip-ray/0.1 (+https://github.com/prolip-ray)"  # sent with every request
    # Hard limit of one part's download call; 0 = what its rows take when each uses its whole row deadline,
    # (⌈rows / threads⌉ + 1) · ((retries + 2) · timeout_s + retries · retry_after_max_s) (docs/download.md).
    part_deadline_s: NonNegativeFloat = 0.0
    per_host_connections: Positive = 4  # per actor: N actors may open N times this to one host
    retry_backoff_s: NonNegativeFloat = 1.0  # exponential backoff base, full jitter
    retry_after_max_s: NonNegativeFloat = (
        30.0  # longest Retry-After honoured by waiting; longer → no early retry
    )
    decode_pixel_budget: Positive = 89_478_485  # decoded pixels an actor's threads hold at once
    # JPEGs decode at the smallest libjpeg scale (1/2, 1/4, 1/8) still ≥ this × the output size, then
    # area-resize; 0 = always the full decode (img2dataset's bytes). docs/download.md, "Where the time goes".
    jpeg_dct_margin: NonNegativeFloat = 3.0

    def __post_init__(self) -> None:
        from pipeline.download.netguard import parse_allow_entry  # the guard's own parser: one rule for both

        for entry in self.allow_hosts:
            try:
                parse_allow_entry(entry)
            except ValueError as exc:
                raise ValueError(f"allow_hosts {exc}") from None
        require(
            self.jpeg_dct_margin == 0 or self.jpeg_dct_margin >= 1,
            "jpeg_dct_margin",
            "must be 0 (full decode) or a finite number ≥ 1",
            self.jpeg_dct_margin,
        )


@config_class
class DedupeConfig:
    """Exact (sha256 of the downloaded bytes) and near-duplicate (64-bit pHash) image dedupe."""

    near_duplicates: bool = False  # also drop near-duplicates by pHash (exact duplicates always go)
    # Max Hamming distance (of 64 bits) to call two images near-duplicates.
    phash_threshold: Annotated[int, Field(ge=0, le=64)] = 4
    # SemDeDup on image embeddings (pipeline/dedup/semantic.py): cosine above which two images are one
    # picture, every pair above it found (k-means clusters plus guests across their borders).
    semantic: bool = False  # run SemDeDup after the image dedupe
    semantic_threshold: OpenFraction = 0.9  # cosine above which two images are one picture
    semantic_cluster_rows: Positive = (
        1000  # about this many rows per k-means cluster (bounds a task's memory)
    )
    semantic_seed: Seed = 0  # k-means initialisation
    # Where the image embeddings are: empty = DataComp's ``.npz`` beside each metadata parquet, array
    # ``embedding_key``; else a uid-keyed file (.npz uid+embedding, .parquet, .npy + .uid.npy).
    embeddings: str = ""
    embedding_key: str = "l14_img"  # the array of DataComp's .npz that holds the image embeddings


@config_class
class DecontamConfig:
    """Eval-set decontamination: pool rows that are near-copies of an evaluation picture (DataComp removed
    them from its pool) end as ``eval_leak:<task>``; ``reference`` = a parquet of the eval pictures
    (task, key, phash[, embedding]; training/eval/reference.py writes one from a task list); empty = off,
    "demo" = the demo pool's own (pool/eval/reference.parquet), "eval" (``jobs.track`` only) = the track's
    own task list, written before the build."""

    reference: str = ""  # eval pictures' parquet; empty = off, "demo" = the demo pool's, "eval" = the track's
    phash_threshold: Annotated[int, Field(ge=0, le=64)] = 4  # max Hamming distance to an eval picture
    embedding_threshold: OpenFraction = 0.95  # cosine to an eval picture's embedding that counts as a leak


@config_class
class FilterConfig:
    """Which filters write a subset of the build, each with its parameters (pipeline/filters/registry.py)."""

    # filter specs, one subset .npy each (pipeline/filters/specs.py), e.g. [basic, clip_score:fraction=0.3],
    # [text_based:wordnet=DIR,synsets_file=F]: each filter's parameters and defaults are its class's
    names: Annotated[Names, SpecsOf(Filter)] = field(default_factory=lambda: ["no_filter", "basic"])
    language_model: str = ""  # fastText lid.176 model (.bin or .ftz); empty = the wheel's lid.176.ftz
    # Which uids a build subset lists: "metadata" = every pool uid that passes the filter, downloaded or
    # not (DataComp's filter outputs); "downloaded" = only those that downloaded. Training reads the
    # shards, so it sees the downloaded ones either way.
    subset_scope: Literal["metadata", "downloaded"] = "metadata"

    def __post_init__(self) -> None:
        require(all(n.strip() for n in self.names), "names", "must not hold an empty filter name", self.names)
        require(len(set(self.names)) == len(self.names), "names", "must not repeat a filter", self.names)
        from pipeline.filters.specs import parse_filter_specs  # each spec typed by its filters' classes

        parse_filter_specs(list(self.names), "names")


@config_class
class BuildConfig:
    metadata: str = ""  # local dir, glob, single parquet, or s3://; empty = generate the demo pool
    output: str = "runs/demo"  # run directory, local or s3:// (required by jobs.build_dataset)
    samples_per_shard: Positive = 10_000  # samples per output .tar (img2dataset's 10,000)
    part_size: Positive = 1_000  # input rows per download task (the unit of resume)
    download_actors: NonNegative = 2  # Ray actors downloading parts at once; 0: in the driver, no Ray
    download_cpus: PositiveFloat = 0.5  # Ray CPUs reserved per download actor (I/O-bound; see build.py)
    num_cpus: NonNegative = 0  # local Ray: 0 = all cores
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    keep_parts: bool = False  # keep work/parts/ after a finished build (the shards are cut from it)
    # Rows per bucket of the build's per-uid and per-URL stages (and rows per part group): bounds what one
    # task holds (~1 KB a row); the bucket counts follow from the pool's size (pipeline/stages/layout.py).
    bucket_rows: Positive = 500_000
    # Captions longer than this (UTF-8 bytes) are ``invalid_caption:too_long`` before download: a bound on
    # what one row can put into a shard and into the driver; 16 KiB is ~50× a 77-token CLIP caption.
    max_caption_bytes: Positive = 16_384
    # Actions, not settings (outside the run fingerprint): discard an earlier run's outputs in ``output``
    # first; download again the rows whose status is transient (schema.is_transient); the changed rows.
    overwrite: bool = False  # discard an earlier run's parts and outputs in output first
    retry_failed: bool = False  # download again the rows whose status is transient (timeouts, 429, 5xx)
    # download again the rows whose URL, caption, sha256 or face boxes changed since their part was made
    # (a pool that changed only so is refused without it: pipeline/source/run_state.py)
    refresh_changed: bool = False
    tokenizer_vocab: NonNegative = (
        0  # >0: train a BPE tokenizer on the successful captions into <output>/tokenizer
    )
    # Node labels every Ray Data task/actor of the build must match, e.g. {prolip-role: data} on the
    # clusters in cluster/ (pipeline/common/placement.py); empty = no constraint.
    data_label_selector: dict[str, str] = field(default_factory=dict)
    demo_n: NonNegative = 2000  # with no metadata: rows of the generated demo pool
    demo_seed: Seed = 0  # with no metadata: the demo pool's seed
    download: DownloadConfig = field(default_factory=DownloadConfig)
    dedupe: DedupeConfig = field(default_factory=DedupeConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)


BUILD_PRESETS: dict[str, BuildConfig] = {
    "demo": BuildConfig(
        output="runs/demo",
        samples_per_shard=500,
        part_size=250,
        download=DownloadConfig(
            timeout_s=1.0,
            retries=1,
            max_bytes=2 * 1024 * 1024,  # the demo pool serves a 3 MB body to exercise the size bound
            allow_hosts=["127.0.0.1"],
            threads_per_actor=16,
            # The demo server is one host standing in for a web of them: no per-host cap, and a part
            # deadline that a loaded 2-core machine does not reach (the derived one is 561 s for 250 rows).
            per_host_connections=16,
            part_deadline_s=600.0,
            # The generated pool's transient rows (slow, 5xx, truncated) fail by design, and its server is
            # local: a late pass could only repeat them (~5 s of a 600-row build).
            late_retries=0,
        ),
        dedupe=DedupeConfig(near_duplicates=True),
        filters=FilterConfig(names=["no_filter", "basic", "english", "random"]),
    ),
    # No output or metadata of its own: jobs.build_dataset asks for both, so a forgotten flag writes nowhere.
    "datacomp-small": BuildConfig(
        output="",
        samples_per_shard=10_000,
        part_size=2_000,  # ~100 MB of JPEGs per actor call
        # 2,048 fetches in flight (DataComp's img2dataset: 16 processes × 128 threads on one node), spread
        # over four 32-vCPU data nodes: each node brings its own DNS and connection budget, and its actors'
        # memory bounds (16 actors × 3.6 GB, worst case) stay within its 64 GiB (docs/download.md, "Sizing for the web").
        download_actors=64,
        download_cpus=2.0,
        download=DownloadConfig(threads_per_actor=32),
        filters=FilterConfig(names=["no_filter", "basic", "english", "clip_score", "laion2b"]),
    ),
}
