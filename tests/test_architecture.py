"""The architecture, enforced: one import direction between packages, no file cycles, Ray in named modules.

docs/architecture.md draws the picture; this file is its contract. Imports are read with ``ast`` (function-
local imports included, which is where an upward import would hide), so nothing is imported to check.

- ``pipeline`` (data plane) imports only ``pipeline``;
- ``training`` (model plane) imports ``training`` and ``pipeline``;
- ``jobs`` (entry points and multi-step workflows) imports anything, but a job package imports only its own
  package, ``jobs.common`` and the libraries — never another job; nothing outside ``jobs`` imports ``jobs``;
- no cycle between files;
- inside a package, each concern's folder imports only what ``LAYER_RULES`` lets it (the shared layer
  ``pipeline.common`` imports nothing else of the project; filters and dedup never reach download, shards
  or ingest; the model never imports the losses);
- ``ray`` is imported only by the modules in ``RAY_MODULES`` and by ``jobs``;
- size: no function over ``MAX_FUNCTION_LINES``, no module over ``MAX_MODULE_LINES``, no folder holding
  more than ``MAX_FOLDER_MODULES`` modules; ``__all__`` only in an ``__init__.py``;
- ``bench`` (benchmarks, run as ``python -m bench.<name>``) imports only ``bench``, the product packages and
  ``tests`` (the fixtures and cases the tests use), never edits ``sys.path`` and imports no private name
  (``_x``) from any module; nothing but ``tests`` imports ``bench``.

Every violation is reported with the rule it breaks.
"""

from __future__ import annotations

import ast
import re
import textwrap
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "training", "jobs")

# Which top-level packages each package may import (besides itself).
ALLOWED = {"pipeline": {"pipeline"}, "training": {"training", "pipeline"}, "jobs": set(PACKAGES)}

# (folder, rule, which project modules it may import besides itself). A rule names what it forbids.
_DATA_STAGES = ("pipeline.download", "pipeline.shards", "pipeline.ingest", "pipeline.stages")
_ABOVE_MODEL = ("training.losses", "training.train", "training.infer", "training.eval", "training.config")
LAYER_RULES: tuple[tuple[str, str, Callable[[str], bool]], ...] = (
    ("pipeline.common", "the shared layer imports nothing else of the project",
     lambda dep: dep.startswith("pipeline.common")),
    ("pipeline.filters", "filters never import download, shards, ingest or the build's stages",
     lambda dep: not dep.startswith(_DATA_STAGES)),
    ("pipeline.dedup", "dedup never imports download, shards, ingest or the build's stages (their bucket "
     "files excepted: the curation stage shuffles by cluster as the stages do by uid, decision 0097)",
     lambda dep: not dep.startswith(_DATA_STAGES) or dep == "pipeline.stages.buckets"),
    ("pipeline.source", "the row source never imports download, shards, ingest or the build's stages",
     lambda dep: not dep.startswith(_DATA_STAGES)),
    ("pipeline.shards", "shards never import download, filters, subsets, source or ingest",
     lambda dep: not dep.startswith((*_DATA_STAGES[:1], "pipeline.filters", "pipeline.subsets",
                                     "pipeline.source", "pipeline.ingest"))),
    ("pipeline.stages", "the build's stages never import the download (it plans on their files)",
     lambda dep: not dep.startswith("pipeline.download")),
    ("training.model", "the model never imports the losses, training, inference or evaluation",
     lambda dep: not dep.startswith(_ABOVE_MODEL)),
    ("training.losses", "the losses import no other part of training (pure tensor functions)",
     lambda dep: not dep.startswith("training.") or dep.startswith("training.losses")),
)  # fmt: skip
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400
MAX_FOLDER_MODULES = 10

# Library modules allowed to import Ray: the builders of Ray datasets (the build, its download phase, the
# runner of its stages' tasks and its curation stage with its SemDeDup half, whose clusters run as tasks;
# the shard reads, training ingest and its counters actor), the Ray Train loop and trainer, the one
# batch-inference builder, and the eval reference's pass over the eval sets.
# Everything else is plain Python/numpy/torch, testable without a cluster.
RAY_MODULES = {
    "pipeline.build",
    "pipeline.dedup.curation_stage",
    "pipeline.dedup.semantic_stage",
    "pipeline.common.shared_storage",
    "pipeline.download.phase",
    "pipeline.ingest.dataset",
    "pipeline.shards.ray_reader",
    "pipeline.stages.runner",
    "training.eval.reference_dataset",
    "training.infer.batch_inference",
    "training.train.loop",
    "training.train.trainer",
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module imported anywhere in ``source`` (relative imports resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when one exists.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def project_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the project modules it imports (only names that are real project modules)."""
    files = {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        raw = imports_of(path.read_text(), mod, path.name == "__init__.py")
        graph[mod] = {m for m in raw if m in files and m != mod}
    return graph


def ray_importers(root: Path = ROOT) -> set[str]:
    out = set()
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            mod = module_name(path, root)
            names = imports_of(path.read_text(), mod, path.name == "__init__.py")
            if any(n == "ray" or n.startswith("ray.") for n in names):
                out.add(mod)
    return out


def direction_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        top = mod.split(".")[0]
        for dep in sorted(deps):
            dep_top = dep.split(".")[0]
            if dep_top not in ALLOWED[top]:
                bad.append(f"{mod} imports {dep} ({top} may import only {sorted(ALLOWED[top])})")
            elif top == "jobs" and dep_top == "jobs":
                own = mod.split(".")[:2]
                if dep.split(".")[:2] != own and dep != "jobs.common" and dep != "jobs":
                    bad.append(f"{mod} imports {dep} (a job imports only its own package and jobs.common)")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        for folder, rule, allowed in LAYER_RULES:
            if mod == folder or mod.startswith(folder + "."):
                bad += [f"{mod} imports {dep} ({rule})" for dep in sorted(deps) if not allowed(dep)]
    return bad


def _sources(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def size_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for mod, path in _sources(root).items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            bad.append(f"{mod}: {lines} lines (no module over {MAX_MODULE_LINES} lines)")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    bad.append(f"{mod}.{node.name}: {n} lines (no function over {MAX_FUNCTION_LINES} lines)")
        if path.name != "__init__.py" and any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            for node in tree.body
        ):
            bad.append(f"{mod}: defines __all__ (__all__ only in an __init__.py: no re-export facades)")
    folders = Counter(p.parent for p in _sources(root).values() if p.name != "__init__.py")
    for folder, n in sorted(folders.items()):
        if n > MAX_FOLDER_MODULES:
            rel = folder.relative_to(root)
            bad.append(f"{rel}/: {n} modules (no folder over {MAX_FOLDER_MODULES} modules)")
    return bad


# bench/: what it may import, and the scripts still run by their path (each leaves the set once it runs as
# ``python -m bench.<name>``; test_not_yet_packaged_is_not_stale fails when one no longer needs its entry).
BENCH = "bench"
BENCH_MAY_IMPORT = {BENCH, *PACKAGES, "tests"}
PROJECT_TOPS = {*BENCH_MAY_IMPORT, "cluster"}
NOT_YET_PACKAGED: set[str] = set()
SYS_PATH = re.compile(r"\bsys\.path\b")  # in code, or in a child process's source held in a string


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def bench_file_violations(text: str, mod: str, is_package: bool) -> list[str]:
    bad = [f"{mod} edits sys.path (run it as python -m {mod})"] if SYS_PATH.search(text) else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names = [f"{node.module or ''}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        bad += [f"{mod} imports the private name {n}" for n in names if any(map(_private, n.split(".")))]
    for dep in sorted(imports_of(text, mod, is_package)):
        top = dep.split(".")[0]
        if top in PROJECT_TOPS and top not in BENCH_MAY_IMPORT:
            bad.append(f"{mod} imports {dep} (bench may import only {sorted(BENCH_MAY_IMPORT)})")
    return bad


def bench_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / BENCH).rglob("*.py")):
        if path.relative_to(root).as_posix() not in NOT_YET_PACKAGED:
            bad += bench_file_violations(
                path.read_text(), module_name(path, root), path.name == "__init__.py"
            )
    for mod, path in _sources(root).items():
        deps = imports_of(path.read_text(), mod, path.name == "__init__.py")
        found = sorted(d for d in deps if d.split(".")[0] == BENCH)
        if found:
            bad.append(f"{mod} imports {', '.join(found)} (nothing but tests imports bench)")
    return bad


def test_bench_keeps_the_product_rules() -> None:
    assert bench_violations() == []


def test_not_yet_packaged_is_not_stale() -> None:
    for rel in sorted(NOT_YET_PACKAGED):
        path = ROOT / rel
        assert path.exists() and bench_file_violations(path.read_text(), module_name(path), False), (
            f"{rel} follows the rules now: take it out of NOT_YET_PACKAGED"
        )


def test_import_direction() -> None:
    assert direction_violations(project_graph()) == []


def test_no_file_cycles() -> None:
    assert cycles(project_graph()) == []


def test_each_concern_imports_only_what_its_rule_allows() -> None:
    assert layer_violations(project_graph()) == []


def test_sizes_and_no_reexport_facades() -> None:
    """Code sits where its concern is: a size cap only flags an outlier (a warning); a facade fails."""
    bad = size_violations()
    for outlier in (b for b in bad if "__all__" not in b):
        warnings.warn(outlier, stacklevel=1)
    assert [b for b in bad if "__all__" in b] == []


def test_ray_only_in_named_modules() -> None:
    extra = sorted(m for m in ray_importers() if m not in RAY_MODULES and not m.startswith("jobs"))
    assert extra == [], f"Ray imported outside the named modules: {extra}"


def test_named_ray_modules_exist() -> None:
    # A stale entry would let a later module import Ray under an old name's cover.
    graph = project_graph()
    assert sorted(RAY_MODULES - set(graph)) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    "files, expected",
    [
        # a function-local upward import is found
        ({"pipeline/a.py": "def f():\n    from training import m\n", "training/m.py": ""}, "pipeline.a"),
        # a relative import is resolved
        ({"pipeline/sub/__init__.py": "", "pipeline/sub/a.py": "from ...training import m\n",
          "training/m.py": ""}, "pipeline.sub.a"),
        # a library importing a job
        ({"training/a.py": "import jobs.track\n", "jobs/track.py": ""}, "training.a"),
        # one job importing another
        ({"jobs/x/__init__.py": "", "jobs/x/run.py": "from jobs.y import run\n",
          "jobs/y/__init__.py": "", "jobs/y/run.py": ""}, "jobs.x.run"),
    ],
)  # fmt: skip
def test_forbidden_imports_are_caught(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    bad = direction_violations(project_graph(_tree(tmp_path, files)))
    assert bad and all(b.startswith(expected + " imports") for b in bad), bad


def test_cycles_and_ray_are_caught(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "training/a.py": "from training import b\n",
            "training/b.py": "def f():\n    import training.a\n",
            "pipeline/c.py": "def f():\n    import ray.data\n",
        },
    )
    assert cycles(project_graph(root)) == [["training.a", "training.b"]]
    assert ray_importers(root) == {"pipeline.c"}


@pytest.mark.parametrize(
    "files, rule",
    [
        ({"pipeline/common/__init__.py": "", "pipeline/common/a.py": "from pipeline.schema import X\n",
          "pipeline/schema.py": ""}, "the shared layer imports nothing else"),
        ({"pipeline/filters/__init__.py": "", "pipeline/download/__init__.py": "",
          "pipeline/filters/a.py": "def f():\n    from pipeline.download import fetch\n",
          "pipeline/download/fetch.py": ""}, "filters never import download"),
        ({"training/model/__init__.py": "", "training/losses/__init__.py": "",
          "training/model/a.py": "from training.losses import registry\n",
          "training/losses/registry.py": ""}, "the model never imports the losses"),
    ],
)  # fmt: skip
def test_layer_rules_are_caught(tmp_path: Path, files: dict[str, str], rule: str) -> None:
    bad = layer_violations(project_graph(_tree(tmp_path, files)))
    assert bad and all(rule in b for b in bad), bad


def test_size_rules_are_caught(tmp_path: Path) -> None:
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    files = {
        "pipeline/a.py": long_function,
        "pipeline/b.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
        "pipeline/c.py": "__all__ = ['x']\nx = 1\n",
        **{f"training/many/m{i}.py": "" for i in range(MAX_FOLDER_MODULES + 1)},
    }
    bad = size_violations(_tree(tmp_path, files))
    assert any("pipeline.a.f: 81 lines (no function over 80" in b for b in bad), bad
    assert any("pipeline.b: 401 lines (no module over 400" in b for b in bad), bad
    assert any("pipeline.c: defines __all__" in b for b in bad), bad
    assert any("training/many/: 11 modules (no folder over 10" in b for b in bad), bad


@pytest.mark.parametrize(
    "files, expected",
    [
        ({"bench/a.py": "import sys\nsys.path.insert(0, '.')\n"}, "bench.a edits sys.path"),
        ({"bench/a.py": 'CHILD = "import sys; sys.path.append(x)"\n'}, "bench.a edits sys.path"),
        ({"bench/a.py": "from pipeline.m import _helper\n", "pipeline/m.py": ""},
         "bench.a imports the private name pipeline.m._helper"),
        ({"bench/a.py": "def f():\n    from tests.fixtures import _stop\n"},
         "bench.a imports the private name tests.fixtures._stop"),
        ({"bench/a.py": "import cluster.tool\n"}, "bench.a imports cluster.tool (bench may import only"),
        ({"bench/a.py": "", "jobs/a.py": "def f():\n    from bench import a\n"},
         "jobs.a imports bench, bench.a (nothing but tests imports bench)"),
    ],
)  # fmt: skip
def test_bench_rules_are_caught(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    ok = {
        "bench/__init__.py": "",
        "bench/ok.py": "from pipeline import m\nfrom bench import a\nimport tests.x\n",
    }
    bad = bench_violations(_tree(tmp_path, {**ok, "pipeline/m.py": "", **files}))
    assert len(bad) == 1 and bad[0].startswith(expected), bad
