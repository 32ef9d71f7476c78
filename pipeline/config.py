"""Typed configuration: frozen dataclasses, named presets, YAML files and ``--set a.b=value`` overrides.

Every job resolves its config the same way: preset → optional YAML file → ``--set`` overrides, each layer
checked against the dataclass fields so an unknown key or a wrong type fails at start naming the key.
This module holds that machinery plus the dataset-build config; the training side reuses the machinery.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key is unknown or has a value of the wrong type; the message names the key."""


# --- validation on construction: every config class checks its fields in ``__post_init__`` -----------


@contextlib.contextmanager
def _named(prefix: str) -> Iterator[None]:
    """Prefix a construction error with the path of the nested config it came from (``download.``)."""
    try:
        yield
    except ConfigError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ConfigError(f"{prefix}{exc}") from None
        raise


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    """Raise ``ConfigError("key rule, got value")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} {rule}, got {value!r}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive(cfg: Any, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        require(_finite(v) and v > 0, n, "must be a finite number > 0", v)


def non_negative(cfg: Any, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        require(_finite(v) and v >= 0, n, "must be a finite number >= 0", v)


def fraction(cfg: Any, *names: str, open_low: bool = False) -> None:
    """Each field in [0, 1], or (0, 1] with ``open_low``."""
    for n in names:
        v = getattr(cfg, n)
        ok = _finite(v) and (0 < v if open_low else 0 <= v) and v <= 1
        require(ok, n, "must be in (0, 1]" if open_low else "must be in [0, 1]", v)


def check_types(cfg: Any) -> None:
    """Every field holds a value of its declared type (no silent coercion on direct construction), and every
    seed field (``seed``, ``*_seed``, ``seeds``) is non-negative."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        coerced = _coerce(value, hints[f.name], f.name)
        same_kind = isinstance(value, bool) == isinstance(coerced, bool)
        equal = coerced == value or (isinstance(value, float) and math.isnan(value))  # ranges judge NaN
        require(equal and same_kind, f.name, f"must be of type {hints[f.name]}", value)
        if f.name == "seed" or f.name.endswith("_seed") or f.name == "seeds":
            check_seed(value, f.name)


def check_seed(value: Any, name: str) -> None:
    """A seed (or a tuple of them) is a non-negative int or None: numpy's generators take no negative seed,
    and a run that fails on it would fail after the work before it (a build, a scorer)."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        require(v is None or (isinstance(v, int) and v >= 0), name, "must be a non-negative integer", v)


def one_of(cfg: Any, name: str, choices: Any) -> None:
    v = getattr(cfg, name)
    require(v in choices, name, f"must be one of {sorted(choices)}", v)


# --- generic machinery --------------------------------------------------------------------------------


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}: {value!r} does not fit {tp}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed arity, e.g. Adam's two betas
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {list(value)!r}")
            return tuple(
                _coerce(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, args, strict=True))
            )
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an int, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
            try:  # "1e6": YAML reads a float without a dot as a string
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (possibly partial) mapping; unknown keys raise naming the key."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key {prefix}{key} (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    with _named(prefix):
        return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def merge(cfg: T, updates: Mapping[str, Any], prefix: str = "") -> T:
    """A copy of ``cfg`` with nested ``updates`` applied, type-checked field by field."""
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    changes: dict[str, Any] = {}
    for key, value in updates.items():
        if key not in names:
            raise ConfigError(f"unknown config key {prefix}{key} (known: {', '.join(sorted(names))})")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[key] = merge(current, value, prefix=f"{prefix}{key}.")
        else:
            changes[key] = _coerce(value, hints[key], prefix + key)
    with _named(prefix):
        return dataclasses.replace(cfg, **changes)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line from a PyYAML error: what it expected and where (1-based line and column)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def parse_set(items: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` → nested dict; values parsed as YAML scalars so ``true``/``0.5``/``[1,2]`` work."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key.strip()}: value is not valid YAML ({yaml_problem(exc)})") from None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def resolve(
    presets: Mapping[str, T], preset: str, config_file: str | None = None, sets: list[str] | None = None
) -> T:
    """preset → YAML file → ``--set`` overrides."""
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(sorted(presets))})")
    cfg = presets[preset]
    if config_file:
        try:
            with open(config_file) as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as exc:
            raise ConfigError(f"{config_file}: cannot read the config file ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{config_file}: not UTF-8 text (byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{config_file}: not valid YAML ({yaml_problem(exc)})") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{config_file}: top level must be a mapping")
        try:
            cfg = merge(cfg, data)
        except ConfigError as exc:
            raise ConfigError(f"{config_file}: {exc}") from None
    if sets:
        cfg = merge(cfg, parse_set(sets))
    return cfg


# --- dataset build ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DownloadConfig:
    """DataComp's download settings (img2dataset as called by DataComp's ``download_upstream.py``)."""

    image_size: int = 512  # longest side; downscale only
    jpeg_quality: int = 95
    timeout_s: float = 10.0
    retries: int = 2
    threads_per_actor: int = 16
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 89_478_485  # Pillow's decompression-bomb limit
    verify_sha256: bool = True
    blur_faces: bool = True
    honor_robots: bool = True
    allow_hosts: list[str] = field(default_factory=list)  # private/loopback hosts explicitly allowed
    user_agent: str = "prolip-ray/0.1 (+https://github.com/prolip-ray)"
    # Hard limit of one part's download call; 0 = 10 · (retries + 1) · timeout_s (docs/download.md).
    part_deadline_s: float = 0.0
    per_host_connections: int = 4  # per actor: N actors may open N times this to one host
    retry_backoff_s: float = 1.0  # exponential backoff base, full jitter
    retry_after_max_s: float = 30.0  # longest Retry-After honoured by waiting; longer → no early retry
    decode_pixel_budget: int = 89_478_485  # decoded pixels an actor's threads hold at once
    # JPEGs decode at the smallest libjpeg scale (1/2, 1/4, 1/8) still ≥ this × the output size, then
    # area-resize; 0 = always the full decode (img2dataset's bytes). docs/download.md, "Where the time goes".
    jpeg_dct_margin: float = 3.0

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "image_size", "timeout_s", "threads_per_actor", "max_bytes", "max_pixels")
        positive(self, "per_host_connections", "decode_pixel_budget")
        from pipeline.download.netguard import parse_allow_entry  # the guard's own parser: one rule for both

        for entry in self.allow_hosts:
            try:
                parse_allow_entry(entry)
            except ValueError as exc:
                raise ConfigError(f"allow_hosts {exc}") from None
        non_negative(self, "retries", "part_deadline_s", "retry_backoff_s", "retry_after_max_s")
        require(1 <= self.jpeg_quality <= 100, "jpeg_quality", "must be in 1..100", self.jpeg_quality)
        require(
            self.jpeg_dct_margin == 0 or 1 <= self.jpeg_dct_margin < math.inf,
            "jpeg_dct_margin",
            "must be 0 (full decode) or a finite number ≥ 1",
            self.jpeg_dct_margin,
        )


@dataclass(frozen=True)
class DedupeConfig:
    near_duplicates: bool = False
    phash_threshold: int = 4  # max Hamming distance (of 64 bits) to call two images near-duplicates

    def __post_init__(self) -> None:
        check_types(self)
        require(0 <= self.phash_threshold <= 64, "phash_threshold", "must be in 0..64", self.phash_threshold)


SUBSET_SCOPES = ("metadata", "downloaded")


@dataclass(frozen=True)
class FilterConfig:
    """Which DataComp baseline filters write a subset, and their parameters."""

    names: list[str] = field(default_factory=lambda: ["no_filter", "basic"])
    random_fraction: float = 0.3
    random_seed: int = 0
    clip_threshold: float = 0.3
    clip_fraction: float = 0.3
    clip_column: str = "clip_l14_similarity_score"
    laion_threshold: float = 0.28
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
    subset_scope: str = "metadata"

    def __post_init__(self) -> None:
        check_types(self)
        one_of(self, "subset_scope", SUBSET_SCOPES)
        fraction(self, "random_fraction", open_low=True)
        fraction(self, "clip_fraction")  # 0 = select by clip_threshold instead
        # DataComp's get_threshold indexes past the end at 1: it has no top-100% threshold.
        require(
            self.clip_fraction < 1.0,
            "clip_fraction",
            "must be < 1 (no_filter keeps every row)",
            self.clip_fraction,
        )
        for name in ("clip_threshold", "laion_threshold"):
            v = getattr(self, name)
            require(math.isfinite(v), name, "must be a finite number", v)
        require(all(n.strip() for n in self.names), "names", "must not hold an empty filter name", self.names)
        require(len(set(self.names)) == len(self.names), "names", "must not repeat a filter", self.names)


@dataclass(frozen=True)
class BuildConfig:
    metadata: str = ""  # local dir, glob, single parquet, or s3://; empty = generate the demo pool
    output: str = "runs/demo"  # run directory, local or s3://
    samples_per_shard: int = 10_000
    part_size: int = 1_000  # input rows per download task (the unit of resume)
    download_actors: int = 2
    download_cpus: float = 0.5  # Ray CPUs reserved per download actor (I/O-bound; see build.py)
    num_cpus: int = 0  # local Ray: 0 = all cores
    s3_endpoint: str = ""  # e.g. http://127.0.0.1:8333 for a local S3 server
    keep_parts: bool = False
    # Captions longer than this (UTF-8 bytes) are ``invalid_caption:too_long`` before download: a bound on
    # what one row can put into a shard and into the driver; 16 KiB is ~50× a 77-token CLIP caption.
    max_caption_bytes: int = 16_384
    # Actions, not settings (outside the run fingerprint): discard an earlier run's outputs in ``output``
    # first; download again the rows whose status is transient (schema.is_transient).
    overwrite: bool = False
    retry_failed: bool = False
    tokenizer_vocab: int = 0  # >0: train a BPE tokenizer on the successful captions into <output>/tokenizer
    # Node labels every Ray Data task/actor of the build must match, e.g. {prolip-role: data} on the
    # clusters in cluster/ (pipeline/common/placement.py); empty = no constraint.
    data_label_selector: dict[str, str] = field(default_factory=dict)
    demo_n: int = 2000
    demo_seed: int = 0
    download: DownloadConfig = field(default_factory=DownloadConfig)
    dedupe: DedupeConfig = field(default_factory=DedupeConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)

    def __post_init__(self) -> None:
        check_types(self)
        positive(
            self, "samples_per_shard", "part_size", "download_actors", "download_cpus", "max_caption_bytes"
        )
        non_negative(self, "num_cpus", "tokenizer_vocab", "demo_n")
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
