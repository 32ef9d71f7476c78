"""Load open_clip's own modules (tokenizer, loss, transformer, model) from the installed wheel's files.

``import open_clip`` fails here: the package ``__init__`` pulls in its image transforms and factory,
which import torchvision, and PyPI's torchvision is a CUDA build that will not load beside the CPU torch
(docs/environment.md). The modules the tests compare against do not need torchvision to *run*:

- ``tokenizer.py``, ``loss.py``, ``pos_embed.py`` import only torch, numpy, ftfy, regex;
- ``transformer.py`` and ``model.py`` import ``utils.py``, whose only torchvision use is the top-level
  ``from torchvision.ops.misc import FrozenBatchNorm2d``, called solely by ``freeze_batch_norm_2d``
  (ResNet/timm towers being frozen) — never on the ViT/text forward the tests run.

So the files are executed unmodified, each as a submodule of a synthetic parent package (so their relative
imports resolve to each other and not to ``open_clip/__init__``), and the one torchvision symbol is a
stand-in class that raises if ever instantiated. It exists in ``sys.modules`` only while ``utils.py``
executes. Nothing that a test checks passes through it: the code compared (BPE, cleaning, losses,
attention blocks, the CLIP forward) is open_clip's own, byte for byte from the installed wheel.
No installed file is edited.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

PARENT = "_open_clip_src"
_STANDIN_MODULES = ("torchvision", "torchvision.ops", "torchvision.ops.misc")


class FrozenBatchNorm2dStandIn:
    """Stand-in for ``torchvision.ops.misc.FrozenBatchNorm2d``; only ResNet/timm freezing would build one."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("torchvision's FrozenBatchNorm2d is not available in this test environment")


def package_dir() -> Path | None:
    """The installed ``open_clip`` directory (from the open_clip_torch distribution), or None."""
    try:
        dist = importlib.metadata.distribution("open_clip_torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file("open_clip"))
    return path if (path / "model.py").is_file() else None


def _parent() -> types.ModuleType:
    if PARENT in sys.modules:
        return sys.modules[PARENT]
    root = package_dir()
    if root is None:
        raise ImportError("open_clip_torch is not installed")
    parent = types.ModuleType(PARENT)
    parent.__path__ = [str(root)]  # submodules resolve to the wheel's files
    parent.__package__ = PARENT
    sys.modules[PARENT] = parent
    return parent


def _exec(name: str) -> types.ModuleType:
    full = f"{PARENT}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    parent = _parent()
    spec = importlib.util.spec_from_file_location(full, Path(parent.__path__[0]) / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    setattr(parent, name, module)
    return module


def _exec_with_torchvision_standin(name: str) -> types.ModuleType:
    """Execute ``name`` with the stand-in torchvision modules present, and remove them afterwards."""
    if any(m in sys.modules for m in _STANDIN_MODULES):
        return _exec(name)  # a real torchvision (or another stand-in) is already loaded: use it
    tv, ops, misc = (types.ModuleType(m) for m in _STANDIN_MODULES)
    misc.FrozenBatchNorm2d = FrozenBatchNorm2dStandIn
    tv.ops, ops.misc = ops, misc
    sys.modules.update(dict(zip(_STANDIN_MODULES, (tv, ops, misc), strict=True)))
    try:
        return _exec(name)
    finally:
        for m in _STANDIN_MODULES:
            sys.modules.pop(m, None)


def load(name: str) -> types.ModuleType:
    """open_clip's ``tokenizer``, ``loss``, ``transformer`` or ``model`` module from the installed wheel."""
    if name in ("model", "transformer"):
        _exec_with_torchvision_standin("utils")
    return _exec(name)


def load_or_skip(name: str) -> types.ModuleType:
    """``load`` for tests: skip (naming the install step) when the open_clip_torch wheel is absent."""
    import pytest

    if package_dir() is None:
        pytest.skip("open_clip_torch not installed (make install adds it with --no-deps)")
    return load(name)
