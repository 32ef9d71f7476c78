"""The documentation's contract: short front pages, no experiment rounds, links that resolve, decision
records with their four sections, and a benchmarks page that matches bench/results/.

Everything is read relative to this file, and the benchmarks generator is loaded from its path, so the
test checks this checkout whatever the installed package points at.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("README.md", "Makefile", "docs", "pipeline", "training", "jobs", "bench", "cluster", "tests")
ROUND = re.compile(r"Round [0-9]+")

DATA = ("bench/results/",)  # measurements, not prose

DECISION_SECTIONS = ("Context", "Choice", "Evidence", "Consequences")


def tracked_files() -> list[str]:
    """Paths under SCANNED that git tracks (every file there when git is not available)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *SCANNED], cwd=ROOT, capture_output=True, check=True, text=True
        ).stdout
        return sorted(p for p in out.split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        found = []
        for name in SCANNED:
            base = ROOT / name
            paths = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
            found += [p.relative_to(ROOT).as_posix() for p in paths if "__pycache__" not in p.parts]
        return sorted(found)


def text_of(rel: str) -> str | None:
    try:
        data = (ROOT / rel).read_bytes()
    except FileNotFoundError:  # tracked but deleted in the working tree
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_readme_is_a_front_page():
    assert line_count(ROOT / "README.md") < 150


def test_track_doc_is_short():
    assert line_count(ROOT / "docs" / "track.md") < 300


def test_no_experiment_rounds():
    hits = []
    for rel in tracked_files():
        if rel.startswith(DATA):
            continue
        text = text_of(rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if ROUND.search(line):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "cite a decision record (docs/decisions/) instead:\n" + "\n".join(hits)


# --- links --------------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    targets = LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_same_page_anchors_resolve():
    broken = []
    for doc in markdown_files():
        for anchor in re.findall(r"\[[^\]]*\]\(#([^)\s]+)\)", prose(doc.read_text(encoding="utf-8"))):
            if anchor not in anchors(doc):
                broken.append(f"{doc.relative_to(ROOT)}: #{anchor}")
    assert not broken, "; ".join(broken)


# --- decision records ---------------------------------------------------------------------------------


def decision_records() -> list[Path]:
    return sorted(p for p in (ROOT / "docs" / "decisions").glob("*.md") if p.name != "README.md")


def test_there_are_decision_records():
    assert decision_records()


@pytest.mark.parametrize("record", decision_records(), ids=lambda p: p.name)
def test_decision_record_has_its_heading_and_four_sections(record):
    assert re.fullmatch(r"[0-9]{4}-[a-z0-9-]+\.md", record.name), "name: NNNN-short-name.md"
    text = record.read_text(encoding="utf-8")
    first = text.splitlines()[0]
    assert re.fullmatch(rf"# {record.name[:4]}: \S.*", first), (
        f"first line must be '# {record.name[:4]}: title'"
    )
    sections = re.findall(r"^## (.+?)\s*$", text, re.M)
    assert sections == list(DECISION_SECTIONS), f"sections {sections}, want {list(DECISION_SECTIONS)}"


def test_decision_index_lists_every_record():
    index = (ROOT / "docs" / "decisions" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([0-9]{4}-[a-z0-9-]+\.md)\)", index))
    assert listed == {p.name for p in decision_records()}


# --- the generated benchmarks page --------------------------------------------------------------------


def load_generator():
    path = ROOT / "bench" / "benchmarks_doc.py"
    spec = importlib.util.spec_from_file_location("benchmarks_doc_under_test", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_matches_the_results():
    generator = load_generator()
    expected = generator.render(ROOT / "bench" / "results")
    committed = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert committed == expected, "docs/benchmarks.md is stale: run python -m bench.benchmarks_doc"


def test_benchmarks_page_has_one_section_per_result_file():
    generator = load_generator()
    results = ROOT / "bench" / "results"
    names = sorted(p.name for p in results.iterdir() if p.suffix in (".json", ".jsonl"))
    page = generator.render(results)
    for name in names:
        assert f"Source: [bench/results/{name}]" in page
    assert "| what | command | figure | spread | load | date |" in page
