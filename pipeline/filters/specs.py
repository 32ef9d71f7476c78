"""The one filter protocol: a registry of named filters, one spec syntax, and the calls that turn specs
into keep masks, subset files and resharded subsets. The build (DataComp's baselines over the pool's
metadata), the filter job and the track (score filters over ``scores.parquet``) all go through it.

Every filter returns ``pipeline.filters.datacomp.FilterResult`` (a bool keep mask and a reason per row, "" where
kept); the decision (a DataComp uid subset, ``pipeline.subsets.uid_files.write_subsets``) stays apart from
materialising it (``pipeline.subsets.materialize.reshard_subsets``).

Spec syntax (one string per subset)::

    spec   = part ("+" part)*            the intersection of the parts, in this order
    part   = NAME [":" param ("," param)*]
    param  = KEY "=" VALUE               a parameter of that part's filter, typed by its default

A row is kept when every part keeps it; its reason is the first failing part's (DataComp's order of
rules). Two keys belong to the whole spec and may follow any part: ``label=NAME`` names the subset
(default: the part names joined by "+"), and ``of=LABEL`` — for a filter with an ``n_keep`` parameter,
i.e. ``random_same_size`` — sizes it like the subset labelled LABEL: the random control, seeded by
``seed=``. Examples: ``basic``, ``basic+clip_score:fraction=0.3``, ``csd_best:fraction=0.2``,
``csd_best:fraction=0.1,label=csd10``, ``random_same_size:of=csd_best,seed=0``. A comma-separated
string of specs is split where an item is not a bare ``key=value`` (``parse_filter_specs``).

Parameters resolve as: the filter class's default (``pipeline/filters/registry.py``), then the spec's own
``key=value``. ``clip_score`` keeps DataComp's two forms: a ``fraction`` > 0 wins; a spec giving
``threshold=`` but no ``fraction=`` means the threshold rule.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import yaml
from pydantic import TypeAdapter, ValidationError

from pipeline import schema as S
from pipeline.common.config import ConfigError, parse_value
from pipeline.common.storage import LOCAL, Storage
from pipeline.filters import base
from pipeline.filters import datacomp as F
from pipeline.filters.base import FilterResult
from pipeline.filters.registry import FILTERS, METADATA, Context, Filter

# --- spec strings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterSpec:
    label: str  # the subset's name
    parts: tuple[tuple[str, dict[str, Any]], ...]  # (filter name, parameters the spec gave), AND-ed in order
    of: str = ""  # the label whose size ``n_keep`` copies (the random control)
    text: str = ""  # the spec as written

    @property
    def name(self) -> str:
        return "+".join(name for name, _ in self.parts)

    @property
    def params(self) -> dict[str, Any]:
        return {k: v for _, params in self.parts for k, v in params.items()}

    @property
    def filters(self) -> list[Filter]:
        """Each part as its filter object (the class's defaults under the spec's parameters)."""
        return [part(name, given) for name, given in self.parts]


def _typed(settings: type, name: str, text: str, key: str) -> Any:
    """A spec's ``name=text`` as the type its filter declares, read like a ``--set`` value."""
    tp = typing.get_type_hints(settings, include_extras=True)[name]
    try:
        return TypeAdapter(tp).validate_python(text if _is_text(tp) else parse_value(text), strict=False)
    except (ValidationError, yaml.YAMLError) as exc:
        msg = exc.errors(include_url=False)[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        shown = "" if "got" in msg else f", got {text!r}"
        raise ConfigError(f"{key}: {msg[0].lower()}{msg[1:]}{shown}") from None


def _is_text(tp: Any) -> bool:
    """Whether a parameter type takes the text as it is (a string, or a choice of strings)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp is str or (
        typing.get_origin(tp) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(tp))
    )


def _parse_part(piece: str, text: str, key: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """One ``NAME[:k=v,…]`` → (name, its parameters, the spec-level keys ``label``/``of`` it carried)."""
    name, _, rest = piece.partition(":")
    name = name.strip()
    if name not in FILTERS:
        raise ConfigError(f"{key}: unknown filter {name!r} in {text!r} (known: {', '.join(sorted(FILTERS))})")
    allowed = FILTERS[name].defaults()
    params: dict[str, Any] = {}
    spec_keys: dict[str, str] = {}
    for item in (p.strip() for p in rest.replace(";", ",").split(",")):
        if not item:
            continue
        k, eq, v = (s.strip() for s in item.partition("="))
        if not eq:
            raise ConfigError(f"{key}: expected key=value, got {item!r} in {text!r}")
        if k == "label" or (k == "of" and "n_keep" in allowed):
            spec_keys[k] = v
        elif k not in allowed:
            known = ", ".join(sorted([*allowed, "label", *(["of"] if "n_keep" in allowed else [])]))
            raise ConfigError(f"{key}.{k}: unknown parameter of {name} (known: {known})")
        else:
            params[k] = _typed(FILTERS[name], k, v, f"{key}.{k}")
    if "n_keep" in allowed and "n_keep" not in params and "of" not in spec_keys:
        raise ConfigError(f"{key}.n_keep: {name} needs n_keep=… (or of=LABEL)")
    return name, params, spec_keys


def parse_filter_spec(spec: str, key: str = "filters") -> FilterSpec:
    """One spec string (module docstring) → FilterSpec; a bad name, parameter or value raises
    ConfigError naming ``key``."""
    text = spec.strip()
    parts, spec_keys = [], {}
    for piece in text.split("+"):
        name, params, keys = _parse_part(piece, text, key)
        parts.append((name, params))
        spec_keys.update(keys)
    label = spec_keys.get("label") or "+".join(name for name, _ in parts)
    if not label.replace("_", "").replace("-", "").replace(".", "").replace("+", "").isalnum():
        raise ConfigError(f"{key}.label: {label!r} is not a usable subset name")
    return FilterSpec(label, tuple(parts), spec_keys.get("of", ""), text)


def parse_filter_specs(items: Any, key: str = "filters", known: Iterable[str] = ()) -> list[FilterSpec]:
    """Specs from a list, or one comma-separated string (an item that is a bare ``key=value`` continues
    the previous spec, so ``--set filters=csd_best:fraction=0.2,random_same_size:of=csd_best,seed=0``
    works). ``known``: labels of subsets made elsewhere (the build's) that ``of=`` may name."""
    if isinstance(items, str):
        items = items.split(",")
    merged: list[str] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        if merged and "=" in item and not any(c in item.split("=", 1)[0] for c in ":+"):
            merged[-1] += "," + item
        else:
            merged.append(item)
    if not merged:
        raise ConfigError(f"{key}: no filters given")
    specs = [parse_filter_spec(s, f"{key}[{i}]") for i, s in enumerate(merged)]
    labels = [s.label for s in specs]
    for i, s in enumerate(specs):
        if s.label in labels[:i]:
            raise ConfigError(f"{key}[{i}].label: subset name {s.label!r} used twice; add label=…")
        if s.of and s.of not in labels and s.of not in known:
            raise ConfigError(f"{key}[{i}].of: no filter labelled {s.of!r} (labels: {', '.join(labels)})")
        if s.of in labels and specs[labels.index(s.of)].of:
            raise ConfigError(f"{key}[{i}].of: {s.of!r} takes its size from another filter itself")
    return specs


# --- running specs ------------------------------------------------------------------------------------


def part(name: str, given: Mapping[str, Any]) -> Filter:
    """The filter object of one spec part: its class's defaults under the parameters the spec gave."""
    cls = FILTERS[name]
    return cls(**{k: v for k, v in cls.upgrade(dict(given)).items() if k != "name"})


def resolve_params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of a spec part: the filter's defaults under the spec's own."""
    return part(name, given).params()


def required_columns(specs: Sequence[FilterSpec]) -> set[str]:
    return {c for s in specs for f in s.filters for c in f.needs()}


def check_build_filters(cfg: Any, columns: Iterable[str], source: str = "metadata") -> None:
    """Before any download: every filter of the build exists, reads the pool's metadata (not model
    scores), and finds the columns it needs in ``columns`` (the metadata schema of ``source``)."""
    specs = parse_filter_specs(list(cfg.names), "filters.names")
    have = set(columns)
    for spec in specs:
        for name, given in spec.parts:
            if FILTERS[name].table != METADATA:
                raise ConfigError(
                    f"filters.names: {name!r} filters model scores, not the pool's metadata (use jobs.filter)"
                )
            missing = [c for c in part(name, given).needs() if c not in have]
            if missing:
                raise S.SchemaError(
                    f"{source}: filter {spec.label!r} ({name}) needs metadata column {missing[0]!r}, "
                    "which the metadata does not have"
                )


def needs_language(specs: Sequence[FilterSpec]) -> bool:
    return any(f.language for s in specs for f in s.filters)


def run_filters(
    table: pa.Table | Mapping[str, Any],
    specs: Sequence[FilterSpec],
    *,
    lang: Any = None,
    store: Storage = LOCAL,
    sizes: Mapping[str, int] | None = None,
    metadata: Sequence[str] = (),
) -> dict[str, FilterResult]:
    """Every spec over *all* rows of ``table`` (the whole pool, so fraction thresholds are DataComp's),
    by label. Controls (``of=``) run after the filters they copy the size of; ``sizes`` gives the sizes
    of subsets made elsewhere. A filter with the same parameters in several specs runs once."""
    if lang is not None and callable(lang) and needs_language(specs):
        lang = F.language_labels(table, lang, "english")  # predict once, share across filters
    ctx = Context(lang, store, tuple(metadata))
    sizes = dict(sizes or {})
    cache: dict[Filter, FilterResult] = {}
    results: dict[str, FilterResult] = {}
    for spec in sorted(specs, key=lambda s: bool(s.of)):
        parts = []
        for name, given in spec.parts:
            sized = spec.of and "n_keep" in FILTERS[name].defaults()
            rule = part(name, {**given, "n_keep": sizes[spec.of]} if sized else given)
            if rule not in cache:
                cache[rule] = rule.run(table, ctx)
            parts.append(cache[rule])
        results[spec.label] = base.intersect(*parts)
        sizes[spec.label] = int(np.count_nonzero(results[spec.label].keep))
    return {s.label: results[s.label] for s in specs}


def apply_filters(
    table: pa.Table | Mapping[str, Any],
    cfg: Any,
    lang: Any = None,
    store: Storage = LOCAL,
    metadata: Sequence[str] = (),
) -> dict[str, FilterResult]:
    """The build's stage: ``cfg.names`` (a ``FilterConfig``'s specs) over the pool's metadata; ``metadata``:
    its files (embedding filters find DataComp's ``.npz`` beside them)."""
    specs = parse_filter_specs(list(cfg.names), "filters.names")
    return run_filters(table, specs, lang=lang, store=store, metadata=metadata)


def apply(spec: str, table: pa.Table | Mapping[str, Any], **kwargs: Any) -> FilterResult:
    """One spec string over ``table`` (``run_filters``' keyword arguments pass through)."""
    parsed = parse_filter_spec(spec)
    return run_filters(table, [parsed], **kwargs)[parsed.label]


# --- materialising the decision (the subset files: ``pipeline.subsets.uid_files.write_subsets``) ----------------------
