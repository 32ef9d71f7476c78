"""Named components: a family of config classes told apart by their ``name`` (a filter, a loss).

A component is one ``@config_class`` subclass of its family's base (``class ClipScore(Filter)``) whose
``name: Literal["clip_score"] = "clip_score"`` field names it and whose other fields are its typed
parameters, each default written once. Defining the class registers it: a config field typed
``one_of(Base)`` accepts any registered member, so a new component needs no other
file. The field takes an instance, a mapping (``{name: clip_score, fraction: 0.3}``, its ``name`` choosing
the class) or the command-line shorthand ``NAME[:key=value,…]`` (``clip_score:fraction=0.3``), whose
values are read as text like a ``--set`` value. Changing ``name`` in a ``--set`` starts from the new
class's defaults (``pipeline.common.config.merge``). A field of spec strings that several members make up
(the build's filter specs, ``pipeline/filters/specs.py``) is marked ``SpecsOf(Base)`` for ``--help-config``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import PlainSerializer, PlainValidator, ValidationInfo

from pipeline.common.config import COMPONENT_ERROR, ConfigError, load, to_dict


class Component:
    """Base of a family's base class: ``class LossConfig(Component, family="loss")``; members register on
    definition under their ``name`` field's default."""

    family: ClassVar[str] = ""
    default: ClassVar[str] = ""  # the member a mapping without ``name`` means
    _members: ClassVar[dict[str, dict[str, type]]] = {}

    def __init_subclass__(cls, family: str = "", default: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if family:
            cls.family, cls.default = family, default
            Component._members.setdefault(family, {})
            return
        if "name" in cls.__dict__.get("__annotations__", {}):  # else an intermediate base of members
            Component._members[cls.family][cls.__dict__["name"]] = cls

    @classmethod
    def members(cls) -> dict[str, type]:
        """Every registered member of ``cls``'s family, by name, in definition order: the live registry
        (a member defined later joins it), to be read, not written."""
        return Component._members[cls.family]

    @classmethod
    def member(cls, name: str, key: str = "name") -> type:
        known = cls.members()
        if name not in known:
            raise ConfigError(f"{key} must be one of {', '.join(known)}, got {name!r}")
        return known[name]

    @classmethod
    def upgrade(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Older spellings of a member's keys, rewritten before validation (none by default)."""
        return data

    def params(self) -> dict[str, Any]:
        """The parameters (every field but ``name``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}  # type: ignore[arg-type]

    def spec(self) -> str:
        """The shorthand naming only the parameters that differ from the defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        given = [f"{k}={v}" for k, v in self.params().items() if v != defaults.get(k)]
        return self.name + (":" + ",".join(given) if given else "")  # type: ignore[attr-defined]


def parse_spec(text: str) -> dict[str, Any]:
    """``NAME[:key=value,…]`` → ``{"name": NAME, key: value-as-text, …}`` (``;`` may separate too)."""
    name, _, rest = text.strip().partition(":")
    out: dict[str, Any] = {"name": name.strip()}
    for item in (p.strip() for p in rest.replace(";", ",").split(",")):
        if not item:
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise ConfigError(f"expected key=value, got {item!r} in {text!r}")
        out[key] = value
    return out


def build(base: type[Component], value: Any, key: str = "") -> Any:
    """A member of ``base``'s family from an instance, a mapping or a shorthand string (lax types)."""
    if isinstance(value, base):
        return value
    if isinstance(value, str):
        value = parse_spec(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key or base.family}: expected a {base.family} name, mapping or NAME:key=value")
    data = dict(value)
    cls = base.member(str(data.get("name", base.default)), f"{key}.name" if key else "name")
    data = cls.upgrade({**data, "name": cls.__dict__["name"]})
    return load(cls, data, f"{key}." if key else "")


def _validate(base: type[Component], value: Any, info: ValidationInfo) -> Any:
    try:
        return build(base, value)
    except ConfigError as exc:  # pydantic names the field; the message keeps the component's own key
        raise ValueError(f"{COMPONENT_ERROR}{exc}") from None


def _dump(value: Any) -> dict[str, Any]:
    return to_dict(value)


def one_of(base: type[Component]) -> Any:
    """The type of a config field holding one member of ``base``'s family."""
    return Annotated[
        base,
        PlainValidator(lambda v, info: _validate(base, v, info)),
        PlainSerializer(_dump, return_type=dict),
    ]


@dataclass(frozen=True)
class SpecsOf:
    """Marks a field of shorthand strings (``Annotated[list[str], SpecsOf(Filter)]``) whose family
    ``--help-config`` lists with the config's own components."""

    base: type
