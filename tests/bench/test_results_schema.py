"""Every file under bench/results/ fits the one result schema (bench/schema.py), one file per question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from bench import benchmarks_doc
from bench.__main__ import benchmarks, main
from bench.schema import NONE, RESULTS, RecordsFile, Row, Section, append_run

FILES = sorted(p for p in RESULTS.iterdir() if p.is_file())


def test_results_are_json_with_their_plots_only() -> None:
    odd = [
        p.name
        for p in FILES
        if p.suffix != ".json" and not (p.suffix == ".png" and p.with_suffix(".json").exists())
    ]
    assert odd == [], "bench/results/ holds JSON result files (and a .png plot beside its .json) only"


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix == ".json"], ids=lambda p: p.name)
def test_each_result_file_is_a_section_of_the_schema(path: Path) -> None:
    section = benchmarks_doc.to_section(path)
    assert isinstance(section, Section) and section.source == path.name
    assert section.rows and all(isinstance(r, Row) and r.figure != NONE for r in section.rows)
    assert all(not r.command.startswith("python bench/") for r in section.rows)


def test_one_section_per_question() -> None:
    titles = [benchmarks_doc.to_section(p).title for p in FILES if p.suffix == ".json"]
    assert len(titles) == len(set(titles)), "two result files answer the same question: keep the latest"


def test_the_schema_rejects_what_the_page_cannot_show(tmp_path: Path) -> None:
    ok = {"what": "x ÷ y", "command": "python -m bench.train_step", "figure": "1.09", "spread": "1.0–1.2"}
    assert Row(**ok).load == NONE and Row(**{**ok, "date": None}).date == NONE
    for bad in ({**ok, "figure": ""}, {**ok, "command": "python bench/train_step.py"}, {**ok, "extra": 1}):
        with pytest.raises(ValidationError):
            Row(**bad)
    with pytest.raises(ValidationError):
        RecordsFile.model_validate({"title": "t", "records": []})
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"rows": [1, 2]}))
    with pytest.raises(ValueError, match="neither a RecordsFile"):
        benchmarks_doc.to_section(raw)


def test_append_run_keeps_every_run_in_one_json_file(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    append_run(path, {"seed": 0})
    append_run(path, {"seed": 1})
    assert json.loads(path.read_text()) == {"runs": [{"seed": 0}, {"seed": 1}]}


def test_the_runner_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    listed = capsys.readouterr().out
    names = benchmarks()
    assert {"train_step", "build_throughput", "loss_memory"} <= set(names)
    assert not {"alternate", "schema", "benchmarks_doc"} & set(names)
    assert all(f"  {name} " in listed for name in names)
    assert main(["no_such_benchmark"]) == 2


def test_a_gpu_check_report_comes_out_as_a_section(tmp_path: Path) -> None:
    # the layout tests/gpu_check.py writes to bench/results/gpu_check.json (the CPU fallback's, shortened)
    step = {"preset": "datacomp-small", "model": "ViT-B-32", "batch": 512, "samples_per_s": 5000.0, "mfu": 0.25,
            "gflop_per_sample": 48.3, "cores_per_gpu_needed": 14.2}  # fmt: skip
    report = {"date": "2026-12-06T05:00:00", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
              "steps": [step, {**step, "preset": "prolip-b16", "mfu": None}], "failed": [],
              "ingest": {"cores": 16, "per_core_samples_per_s": 352.0, "all_cores_samples_per_s": 5100.0}}  # fmt: skip
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    rows = benchmarks_doc.to_section(path).rows
    assert [r.figure for r in rows] == [
        "5000 samples/s",
        "5000 samples/s",
        "352 samples/s per core",
        "all passed",
    ]
    assert rows[0].spread.startswith("MFU 25.0%") and "MFU not known" in rows[1].spread
