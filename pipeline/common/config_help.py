"""Every key of a config class with its type, value and meaning, read from the class itself: ``--help-config``.

The meaning of a key is its field's comment in the class's source, the project's one convention for
documenting a key (docs/jobs.md, "Configuration"): the comment on the field's own lines, else the block
of comment lines directly above it. Types come from the annotations (ranges from their ``Annotated``
constraints: ``Positive`` reads "int > 0"), values from the preset the job would start from. Nested
config classes become dotted sections, titled by their docstring's first line. Only ``ast``/``tokenize``
run over the source: nothing is imported to document a key.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal

_NOISE = ("fmt: skip", "fmt: off", "fmt: on", "noqa", "type: ignore")


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted path, as --set takes it
    type: str  # e.g. "int > 0", "one of mask, drop, salient"
    value: Any  # the preset's value
    meaning: str  # the field's comment ("" when it has none)


@functools.cache
def _module_source(module: str) -> tuple[ast.Module, dict[int, str]] | None:
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if not path:
        return None
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            body = tok.string.lstrip("#").strip()
            if not any(body.startswith(n) for n in _NOISE):
                comments[tok.start[0]] = body
    return ast.parse(text), comments


def _code_lines(tree: ast.Module) -> set[int]:
    """Lines that hold code (a comment there is a trailing one, not a block above a field)."""
    compound = (
        ast.ClassDef,
        ast.FunctionDef,
        ast.AsyncFunctionDef,
        ast.If,
        ast.For,
        ast.While,
        ast.With,
        ast.Try,
    )
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, compound):
            lines.add(node.lineno)
        elif isinstance(node, ast.stmt):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name → its comment in ``cls``'s source, joined into one line (``{}`` if no source)."""
    found = _module_source(cls.__module__)
    if found is None:
        return {}
    tree, comments = found
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    if node is None:
        return {}
    code = _code_lines(tree)
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        own = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
        above: list[str] = []
        line = stmt.lineno - 1
        while line in comments and line not in code:
            above.insert(0, comments[line])
            line -= 1
        out[stmt.target.id] = " ".join(own or above)
    return out


def key_meaning(cls: type, key: str) -> str:
    """The meaning of the dotted ``key`` of config class ``cls`` ("" when its field has no comment)."""
    *parents, name = key.split(".")
    for part in parents:
        cls = _unwrap(typing.get_type_hints(cls, include_extras=True)[part])
        if typing.get_origin(cls) in (typing.Union, types.UnionType):
            cls = next(a for a in typing.get_args(cls) if a is not type(None))
    return field_comments(cls).get(name, "")


def _bounds(metadata: list[Any]) -> str:
    lo = hi = ""
    for m in metadata:
        for attr, text in (("gt", "> {}"), ("ge", ">= {}")):
            if getattr(m, attr, None) is not None:
                lo = text.format(getattr(m, attr))
        for attr, text in (("lt", "< {}"), ("le", "<= {}")):
            if getattr(m, attr, None) is not None:
                hi = text.format(getattr(m, attr))
        if getattr(m, "min_length", None):
            lo = f"at least {m.min_length} item{'s' if m.min_length > 1 else ''}"
    if lo.startswith(">") and hi.startswith("<"):
        left = "[" if lo.startswith(">=") else "("
        right = "]" if hi.startswith("<=") else ")"
        return f"in {left}{lo.split()[-1]}, {hi.split()[-1]}{right}"
    return " ".join(t for t in (lo, hi) if t)


def type_text(tp: Any) -> str:
    """An annotation as a reader would say it: ``Annotated[int, Field(gt=0)]`` → ``int > 0``."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *extra = typing.get_args(tp)
        metadata = [m for e in extra for m in (getattr(e, "metadata", None) or [e])]
        bounds = _bounds(metadata)
        return f"{type_text(base)} {bounds}".strip()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) if a == "" else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return "[" + ", ".join(type_text(a) for a in args) + "]"
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping {type_text(args[0])} → {type_text(args[1])}" if args else "mapping"
    return getattr(tp, "__name__", str(tp))


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def key_docs(cfg: Any, prefix: str = "") -> Iterator[KeyDoc | tuple[str, str]]:
    """Every key of the config instance ``cfg``, depth first; a nested config first yields
    ``(section key, its docstring's first line)``."""
    cls = type(cfg)
    hints = typing.get_type_hints(cls, include_extras=True)
    meanings = field_comments(cls)
    for f in dataclasses.fields(cls):
        key, value = prefix + f.name, getattr(cfg, f.name)
        if f.name == "name" and hasattr(cfg, "members"):  # a component: its name picks the class
            yield KeyDoc(key, "one of " + ", ".join(cfg.members()), value, meanings.get(f.name, ""))
        elif dataclasses.is_dataclass(value):
            doc = (type(value).__doc__ or "").strip().splitlines()
            yield key, meanings.get(f.name) or (doc[0] if doc else type(value).__name__)
            yield from key_docs(value, key + ".")
        else:
            yield KeyDoc(key, type_text(hints[f.name]), value, meanings.get(f.name, ""))


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:59] + "…"


def _families(cfg: Any) -> dict[str, type]:
    """Family name → base class of every component (``pipeline/common/components.py``) ``cfg`` holds."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        for mark in (
            typing.get_args(hints[f.name])[1:] if typing.get_origin(hints[f.name]) is Annotated else ()
        ):
            if hasattr(mark, "base"):  # a field of shorthand strings (pipeline.common.components.SpecsOf)
                out.setdefault(mark.base.family, mark.base)
        if hasattr(value, "family") and hasattr(value, "members"):  # a component: its family's base
            out.setdefault(value.family, next(c for c in type(value).__mro__ if "family" in c.__dict__))
        if dataclasses.is_dataclass(value):
            out.update({k: v for k, v in _families(value).items() if k not in out})
    return out


def component_docs(base: type) -> Iterator[tuple[str, list[KeyDoc]]]:
    """Every member of a component family: (its name and docstring's first line, its parameters)."""
    for name, cls in base.members().items():  # type: ignore[attr-defined]
        doc = (cls.__doc__ or "").strip().splitlines()
        params = [d for d in key_docs(cls()) if isinstance(d, KeyDoc) and d.key != "name"]
        yield f"{name}: {doc[0] if doc else cls.__name__}", params


def _lines(doc: KeyDoc, width: int) -> list[str]:
    lines = [f"  {doc.key} = {_shown(doc.value)}  ({doc.type})"]
    if doc.meaning:
        lines += textwrap.wrap(doc.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def render_keys(cfg: Any, title: str, width: int = 100) -> str:
    """``--help-config``'s text: a title, then per key ``key = value  (type)`` and its meaning below; then
    every member of each component family the config holds (a filter, a loss) with its parameters."""
    lines = [title, ""]
    for doc in key_docs(cfg):
        if isinstance(doc, tuple):
            lines += ["", f"[{doc[0]}] {doc[1]}"]
            continue
        lines += _lines(doc, width)
    for family, base in _families(cfg).items():
        lines += ["", f"[every {family}: NAME[:key=value,…]]"]
        for head, params in component_docs(base):
            lines += [f"  {head}"] + [
                ln for p in params for ln in _lines(dataclasses.replace(p, key="  " + p.key), width)
            ]
    return "\n".join(lines) + "\n"
