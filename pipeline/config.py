"""The dataset build's configuration: ``BuildConfig`` and its parts, and the build presets.

Declared in the one config dialect (``pipeline.common.config``): frozen pydantic dataclasses, strict when
built in code, lax for YAML and ``--set``, every range in the field's type and the few cross-field rules in
``__post_init__``; an error is one line naming the key path.
"""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field

from pipeline.common.config import (
    Finite,
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

SUBSET_SCOPES = ("metadata", "downloaded")


@config_class
class DownloadConfig:
    """DataComp's download settings (img2dataset as called by DataComp's ``download_upstream.py``)."""

    image_size: Positive = 512  # longest side; downscale only
    jpeg_quality: Annotated[int, Field(ge=1, le=100)] = 95
    timeout_s: PositiveFloat = 10.0
    retries: NonNegative = 2
    threads_per_actor: Positive = 16
    max_bytes: Positive = 20 * 1024 * 1024
    max_pixels: Positive = 89_478_485  # Pillow's decompression-bomb limit
    verify_sha256: bool = True
    blur_faces: bool = True
    honor_robots: bool = True
    allow_hosts: Names = field(default_factory=list)  # private/loopback hosts explicitly allowed
    user_agent: str = "prolip-ray/0.1 (+https://github.com/prolip-ray)"
    # Hard limit of one part's download call; 0 = 10 · (retries + 1) · timeout_s (docs/download.md).
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
    near_duplicates: bool = False
    # Max Hamming distance (of 64 bits) to call two images near-duplicates.
    phash_threshold: Annotated[int, Field(ge=0, le=64)] = 4


@config_class
class FilterConfig:
    """Which DataComp baseline filters write a subset, and their parameters."""

    names: Names = field(default_factory=lambda: ["no_filter", "basic"])
    random_fraction: OpenFraction = 0.3
    random_seed: Seed = 0
    clip_threshold: Finite = 0.3
    # 0 = select by clip_threshold instead; DataComp's get_threshold indexes past the end at 1: it has no
    # top-100% threshold (no_filter keeps every row).
    clip_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.3
    clip_column: str = "clip_l14_similarity_score"
    laion_threshold: Finite = 0.28
    # text_based: a WordNet 3.0 dict directory or nltk's wordnet.zip, and DataComp's ImageNet-21k id list
    text_wordnet: str = ""
    text_synsets_file: str = ""
    text_concepts_file: str = ""  # text_based:method=lemmas only
    language_model: str = ""  # fastText lid.176 model (.bin or .ftz); empty = the wheel's lid.176.ftz
    image_embeddings_file: str = ""
    image_centroids_file: str = ""
    image_centroid_ids_file: str = ""
    # Which uids a build subset lists: "metadata" = every pool uid that passes the filter, downloaded or
    # not (DataComp's filter outputs); "downloaded" = only those that downloaded. Training reads the
    # shards, so it sees the downloaded ones either way.
    subset_scope: Literal["metadata", "downloaded"] = "metadata"

    def __post_init__(self) -> None:
        require(all(n.strip() for n in self.names), "names", "must not hold an empty filter name", self.names)
        require(len(set(self.names)) == len(self.names), "names", "must not repeat a filter", self.names)


@config_class
class BuildConfig:
    metadata: str = ""  # local dir, glob, single parquet, or s3://; empty = generate the demo pool
    output: str = "runs/demo"  # run directory, local or s3://
    samples_per_shard: Positive = 10_000
    part_size: Positive = 1_000  # input rows per download task (the unit of resume)
    download_actors: NonNegative = 2  # 0: the parts run in the driver's process, without Ray
    download_cpus: PositiveFloat = 0.5  # Ray CPUs reserved per download actor (I/O-bound; see build.py)
    num_cpus: NonNegative = 0  # local Ray: 0 = all cores
    s3_endpoint: str = ""  # e.g. http://127.0.0.1:8333 for a local S3 server
    keep_parts: bool = False
    # Captions longer than this (UTF-8 bytes) are ``invalid_caption:too_long`` before download: a bound on
    # what one row can put into a shard and into the driver; 16 KiB is ~50× a 77-token CLIP caption.
    max_caption_bytes: Positive = 16_384
    # Actions, not settings (outside the run fingerprint): discard an earlier run's outputs in ``output``
    # first; download again the rows whose status is transient (schema.is_transient); the changed rows.
    overwrite: bool = False
    retry_failed: bool = False
    # download again the rows whose URL, caption, sha256 or face boxes changed since their part was made
    # (a pool that changed only so is refused without it: pipeline/source/run_state.py)
    refresh_changed: bool = False
    tokenizer_vocab: NonNegative = (
        0  # >0: train a BPE tokenizer on the successful captions into <output>/tokenizer
    )
    # Node labels every Ray Data task/actor of the build must match, e.g. {prolip-role: data} on the
    # clusters in cluster/ (pipeline/common/placement.py); empty = no constraint.
    data_label_selector: dict[str, str] = field(default_factory=dict)
    demo_n: NonNegative = 2000
    demo_seed: Seed = 0
    download: DownloadConfig = field(default_factory=DownloadConfig)
    dedupe: DedupeConfig = field(default_factory=DedupeConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)

    def __post_init__(self) -> None:
        require(bool(self.output), "output", "must name a run directory", self.output)


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
            # deadline that a loaded 2-core machine does not reach (the derived one is 20 s here).
            per_host_connections=16,
            part_deadline_s=600.0,
        ),
        dedupe=DedupeConfig(near_duplicates=True),
        filters=FilterConfig(names=["no_filter", "basic", "english", "random"]),
    ),
    "datacomp-small": BuildConfig(
        output="s3://my-bucket/datacomp-small",
        samples_per_shard=10_000,
        part_size=2_000,  # ~100 MB of JPEGs per actor call
        download_actors=64,
        filters=FilterConfig(names=["no_filter", "basic", "english", "clip_score", "laion2b"]),
    ),
}
