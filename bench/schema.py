"""The one result schema: every file under bench/results/ becomes a titled list of the same six-field rows.

A benchmark script either writes its figures as a ``RecordsFile`` itself (``title``, ``about``,
``records``, and any raw data beside them), or keeps its own raw layout and has an extractor in
bench/benchmarks_doc.py that turns it into ``Row``s; tests/bench/test_results_schema.py checks that every
file under bench/results/ comes out as a valid ``Section``. Runs that accumulate (one per seed, one per
pair) go into one JSON file's ``runs`` list through ``append_run``: JSON only, no JSON lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

RESULTS = Path(__file__).resolve().parent / "results"
NONE = "—"  # a field the measurement does not record
FIELDS = ("what", "command", "figure", "spread", "load", "date")


class Row(BaseModel):
    """One figure: what was measured, the command that measures it, the median, its spread, the load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    what: str = Field(min_length=1)
    command: str = NONE  # `python -m bench.<name> ...`, a make target or a pytest line
    figure: str = Field(min_length=1)
    spread: str = NONE  # min–max over the rounds, or why there is none
    load: str = NONE  # the 1-minute load average while measured
    date: str = NONE  # when it was measured (ISO date or timestamp)

    @field_validator("command", "spread", "load", "date", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        return NONE if value is None or value == "" else value

    @field_validator("command")
    @classmethod
    def _runs_as_a_module(cls, value: str) -> str:
        # a script run by its path cannot import the package it lives in: benchmarks run with -m
        if value.startswith("python bench/"):
            raise ValueError(f"run benchmarks as modules (python -m bench.<name>), not {value!r}")
        return value


class RecordsFile(BaseModel):
    """A results file that carries its rows itself; keys besides these three are the run's raw data."""

    model_config = ConfigDict(extra="allow")

    title: str = Field(min_length=1)
    about: str = ""
    records: list[Row] = Field(min_length=1)


class Section(BaseModel):
    """One result file as docs/benchmarks.md shows it: a heading, a note and the rows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str  # the file's name under bench/results/
    title: str = Field(min_length=1)
    about: str = ""
    rows: list[Row] = Field(min_length=1)


def read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def append_run(path: Path | str, run: dict[str, Any]) -> None:
    """Add one run to the ``runs`` list of the JSON results file at ``path`` (created when missing)."""
    path = Path(path)
    data = read(path) if path.exists() else {"runs": []}
    data["runs"].append(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def write_records(path: Path | str, title: str, doc: str | None, records: list[dict], raw: dict) -> None:
    """A results file that carries its rows: ``about`` is the module docstring's first paragraph, ``raw``
    the run's own figures; checked against ``RecordsFile`` before it is written."""
    about = (doc or "").split("\n\n")[0].replace("\n", " ")
    data = RecordsFile(title=title, about=about, records=records, **raw).model_dump(mode="json")
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
