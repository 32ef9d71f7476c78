"""The one config dialect: pydantic dataclasses, strict when built in code, lax for YAML files and ``--set``.

Every config class of the project is declared with ``@config_class``: a frozen pydantic dataclass that
forbids unknown keys and validates on construction, so ``DownloadConfig(retries="2")`` and
``DataConfig(decode_tasks="2")`` are both refused, and ranges live in the field types (``Positive``,
``Fraction``, ``Seed``, ...; pydantic's ``Annotated`` constraints) rather than in hand-written checks.
Values that come from text — a YAML file, a ``--set key=value``, a job's flag, a checkpoint's JSON — go
through ``load``/``merge``, which validate the same classes in pydantic's lax mode (``"2"`` → 2,
``"true"`` → True, ``[0.8, 1.0]`` → a tuple, ``basic,english`` → a list of names).

Every failure is one ``ConfigError`` line naming the key path (``download.retries``) and, through
``resolve``, the YAML file it came from. A job resolves its config in one order: preset → ``--config``
file → its flags → ``--set`` (``resolve``), the last layer winning.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo
from pydantic.dataclasses import dataclass as pydantic_dataclass

from pipeline.common.errors import UsageError

T = TypeVar("T")


class ConfigError(UsageError, ValueError):
    """A config key is unknown, or its value has the wrong type or lies out of range; the message names it."""


_PYDANTIC = ConfigDict(extra="forbid", strict=True, coerce_numbers_to_str=True, revalidate_instances="never")
_LAX = {"lax": True}  # validation context of values read from text
COMPONENT_ERROR = "component: "  # a component field's message, whose leading key continues the field's


def config_class(cls: type[T]) -> type[T]:
    """``cls`` as a frozen, strict pydantic dataclass whose construction errors are one ``ConfigError``."""
    cls = pydantic_dataclass(frozen=True, config=_PYDANTIC)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as exc:  # built in code: name the class, e.g. DataConfig.text_mask_mode
            raise ConfigError(describe(exc, cls, f"{cls.__name__}.")) from None

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


# --- field types: the ranges every config shares ------------------------------------------------------


def names_from_text(value: Any, info: ValidationInfo) -> Any:
    """In text (``--set filters.names=basic,english``) a comma-separated string is a list."""
    if isinstance(value, str) and info.context and info.context.get("lax"):
        return [s.strip() for s in value.split(",") if s.strip()]
    return value


Names = Annotated[list[str], BeforeValidator(names_from_text)]
Positive = Annotated[int, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0)]  # numpy's generators take no negative seed
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1)]  # [0, 1]
OpenFraction = Annotated[float, Field(gt=0, le=1)]  # (0, 1]


def require(ok: bool, key: str, rule: str, value: Any) -> None:
    """A cross-field rule: raise ``ConfigError("key rule, got value")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} {rule}, got {value!r}")


# --- errors as one line -------------------------------------------------------------------------------


def _unwrap(tp: Any) -> Any:
    """The dataclass inside ``Annotated[...]``/``X | None``, else ``tp``."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else tp
    return tp


def _class_at(root: type, path: Sequence[str]) -> type | None:
    cls: Any = root
    for part in path:
        if not dataclasses.is_dataclass(cls):
            return None
        cls = _unwrap(typing.get_type_hints(cls, include_extras=True).get(part))
    return cls if dataclasses.is_dataclass(cls) else None


def _key(loc: Sequence[Any]) -> str:
    """``("filters", "names", 0)`` → ``filters.names[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_BRANCH = re.compile(
    r"^(int|float|str|bool|none|list\[.*\]|tuple\[.*\]|dict\[.*\]|function-\w+\[.*\]|.*\[.*\])$"
)


def describe(exc: ValidationError, root: type, prefix: str = "") -> str:
    """The first error of ``exc`` as one line naming its key (after ``prefix``); ``root`` is the class
    validated."""
    err = exc.errors(include_url=False)[0]
    loc = [p for p in err["loc"] if isinstance(p, int) or not _BRANCH.match(str(p))]
    names = [p for p in loc if isinstance(p, str)]
    key = _key(loc)
    key = prefix + key if key else prefix.rstrip(".")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    kind, msg = err["type"], err["msg"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        parent = _class_at(root, names[:-1])
        known = f" (known: {', '.join(f.name for f in dataclasses.fields(parent))})" if parent else ""
        return f"unknown config key {key}{known}{more}"
    if kind in ("missing_argument", "missing"):
        return f"{key}: required{more}"
    if kind == "value_error" and COMPONENT_ERROR in str(msg):
        text = str(msg).split(COMPONENT_ERROR, 1)[1]
        if text.startswith("unknown config key "):
            return f"unknown config key {key}.{text.removeprefix('unknown config key ')}{more}"
        return (f"{key}.{text}" if re.match(r"^[a-z_][\w.\[\]]*:? ", text) else f"{key}: {text}") + more
    if kind == "value_error":
        text = str(msg).removeprefix("Value error, ")
        return (f"{key}.{text}" if key and re.match(r"^[a-z_][\w.\[\]]*:? ", text) else
                f"{key}: {text}" if key else text) + more  # fmt: skip
    value = err.get("input")
    shown = "" if isinstance(value, Mapping) or " got " in msg else f", got {value!r}"
    return f"{key}: {msg[0].lower()}{msg[1:]}{shown}{more}"


# --- the lax path: text → config ----------------------------------------------------------------------


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


# A flat key that older configs, presets and ``--set`` lines use → its home in a sub-config (decision 0101).
MOVED_KEYS = {"s3_endpoint": ("storage", "s3_endpoint")}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def moved(cls: type, data: Any) -> Any:
    """``data`` (values for config class ``cls``) with every ``MOVED_KEYS`` flat key, at any depth, moved
    into its sub-config; a flat key and its new spelling with different values is an error, and so is a
    key of ``cls.removed_keys`` (it names the new spelling)."""
    if not isinstance(data, Mapping) or not dataclasses.is_dataclass(cls):
        return data
    hints = _hints(cls)
    out = dict(data)
    for old, spelling in getattr(cls, "removed_keys", {}).items():
        if old in out:  # a knob that became part of another setting: say which
            raise ConfigError(f"{old} is no longer a key; set {spelling}")
    for old, (home, key) in MOVED_KEYS.items():
        if old in out and old not in hints and home in hints:
            value, sub = out.pop(old), out.get(home)
            if isinstance(sub, Mapping) and key in sub and sub[key] != value:
                raise ConfigError(f"{old} and {home}.{key} are one setting, given {value!r} and {sub[key]!r}")
            if dataclasses.is_dataclass(sub):
                out[home] = dataclasses.replace(sub, **{key: value})
            else:
                out[home] = {**(sub if isinstance(sub, Mapping) else {}), key: value}
    for name, value in out.items():
        if isinstance(value, Mapping) and name in hints:
            out[name] = moved(_unwrap(hints[name]), value)
    return out


def load(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """``cls`` from a (partial) mapping of values read from text: lax types, unknown keys refused; an error
    names the key after ``prefix``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix}expected a mapping for {cls.__name__}, got {data!r}")
    try:
        return _adapter(cls).validate_python(moved(cls, data), strict=False, context=_LAX)
    except ValidationError as exc:
        raise ConfigError(describe(exc, cls, prefix)) from None


def _overlay(cfg: Any, updates: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg``'s fields with ``updates`` laid over them, recursing into nested configs only."""
    out: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for key, value in updates.items():
        current = out.get(key)
        if (
            getattr(current, "family", "")
            and isinstance(value, Mapping)
            and value.get("name", current.name) != current.name
        ):
            out[key] = dict(value)  # another component (pipeline/common/components.py): its own defaults
        elif dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            out[key] = _overlay(current, value)
        else:
            out[key] = value  # an unknown key is named by the validation
    return out


def merge(cfg: T, updates: Mapping[str, Any]) -> T:
    """A copy of ``cfg`` with nested ``updates`` (values from text) applied and validated."""
    if not updates:
        return cfg
    return load(type(cfg), _overlay(cfg, moved(type(cfg), updates)))


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able dict of ``cfg`` (tuples as lists) that ``load`` turns back into the same config."""
    return _adapter(type(cfg)).dump_python(cfg, mode="json")


def field_type(cls: type, key: str) -> Any:
    """The declared type of a dotted ``key`` of config class ``cls`` (``Annotated``/``| None`` kept)."""
    parts = key.split(".")
    owner = _class_at(cls, parts[:-1])
    hints = typing.get_type_hints(owner, include_extras=True) if owner else {}
    if parts[-1] not in hints:
        raise ConfigError(f"unknown config key {key}")
    return hints[parts[-1]]


def nested(key: str, value: Any) -> dict[str, Any]:
    """``("data.shards", v)`` → ``{"data": {"shards": v}}``."""
    out: dict[str, Any] = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def deep_update(base: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in more.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = value
    return base


# --- YAML and --set -----------------------------------------------------------------------------------


class _TextLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus exponent floats without a dot (``1e6``, YAML 1.2's rule)."""


_TextLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line from a PyYAML error: what it expected and where (1-based line and column)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def parse_value(raw: str) -> Any:
    """A ``--set`` value or a flag's text as a YAML scalar or flow list/map (``true``, ``0.5``, ``[1,2]``)."""
    return yaml.load(raw, Loader=_TextLoader) if raw != "" else ""  # noqa: S506 (a SafeLoader)


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` → nested dict of YAML-parsed values."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = parse_value(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {key.strip()}: value is not valid YAML ({yaml_problem(exc)})") from None
        deep_update(out, nested(key.strip(), value))
    return out


def read_yaml(path: str) -> dict[str, Any]:
    """A YAML config file's top-level mapping; every failure is one line naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_TextLoader) or {}  # noqa: S506 (a SafeLoader)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(exc)})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping")
    return dict(data)


def resolve(
    presets: Mapping[str, T],
    preset: str,
    config_file: str | None = None,
    sets: Sequence[str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> T:
    """preset → YAML file → ``flags`` (dotted key → value) → ``--set`` overrides, each layer validated."""
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(sorted(presets))})")
    cfg = presets[preset]
    if config_file:
        try:
            cfg = merge(cfg, read_yaml(config_file))
        except ConfigError as exc:
            text = str(exc)
            raise ConfigError(
                text if text.startswith(f"{config_file}:") else f"{config_file}: {text}"
            ) from None
    if flags:
        layer: dict[str, Any] = {}
        for key, value in flags.items():
            deep_update(layer, nested(key, value))
        cfg = merge(cfg, layer)
    if sets:
        cfg = merge(cfg, parse_set(sets))
    return cfg
