"""The one runner: ``python -m bench`` lists the benchmarks; ``python -m bench NAME [ARGS ...]`` runs
``bench.NAME`` with ARGS and, when it succeeds, rewrites docs/benchmarks.md from bench/results/.

Each benchmark is also ``python -m bench.NAME [ARGS ...]`` on its own (what the recorded commands say).
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# Modules of the package that are not benchmarks: the shared helpers, the page generators.
NOT_BENCHMARKS = frozenset(
    {"__init__", "__main__", "alternate", "schema", "scale_pool", "benchmarks_doc", "track_bill"}
)


def benchmarks() -> dict[str, str]:
    """Benchmark name → the first line of its docstring, read without importing it."""
    out = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.stem not in NOT_BENCHMARKS:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            out[path.stem] = doc.splitlines()[0] if doc else ""
    return out


def main(argv: list[str]) -> int:
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), end="\n\n")
        width = max(map(len, known))
        for name, line in known.items():
            print(f"  {name:<{width}}  {line}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in known:
        print(f"no benchmark {name!r}; python -m bench lists them", file=sys.stderr)
        return 2
    sys.argv = [f"bench.{name}", *args]
    try:
        runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code not in (0, None):
            return stop.code if isinstance(stop.code, int) else 1
    from bench import benchmarks_doc

    return benchmarks_doc.main([])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
