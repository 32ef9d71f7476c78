"""The track's evaluation schedule (``eval_parallel``): the scorer's evaluation beside the scoring, then the
subset models' evaluations several at once, each still its own recorded step. The real ``run_track`` runs
with each step's library call replaced by a recorder that sleeps (the steps themselves are tested end to end
in tests/jobs/test_track.py; what is checked here is only when each one starts and ends)."""

from __future__ import annotations

import threading
import time

import pytest

import jobs.track.steps as steps
from jobs.track import run as track_run
from jobs.track.config import TRACK_PRESETS
from pipeline.common.config import merge
from pipeline.common.storage import Storage

STEP_S = 0.3


@pytest.fixture
def recorded(monkeypatch):
    spans: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()

    def record(name: str, value):
        t0 = time.monotonic()
        time.sleep(STEP_S)
        with lock:
            spans[name] = (t0, time.monotonic())
        return value

    monkeypatch.setattr(steps, "build_pool", lambda cfg, log: record("build", {"subsets": {}}))
    monkeypatch.setattr(
        steps,
        "train_models",
        lambda cfg, runs, log: {
            n: record(n if n == "scorer" else f"train/{n}", {"checkpoint": n}) for n in runs
        },
    )
    monkeypatch.setattr(steps, "score_pool", lambda cfg, ckpt, log: record("score", {"path": "scores"}))
    monkeypatch.setattr(
        steps,
        "make_subsets",
        lambda cfg, b, s, log, ckpt: record("filters", {n: {"path": n} for n in cfg.subsets}),
    )
    monkeypatch.setattr(
        steps,
        "evaluate_models",
        lambda cfg, models, log: {n: record(f"evaluate/{n}", {"ok": n}) for n in models},
    )
    monkeypatch.setattr("jobs.track.report.write_report", lambda *a: ("report.md", [], {}))
    monkeypatch.setattr(track_run, "cpu_reference", lambda: {"cores": 2, "matmul_gflops": 1.0})
    return spans


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def peak(spans: list[tuple[float, float]]) -> int:
    """The most spans running at one instant (checked at each start)."""
    return max(sum(a <= s < b for a, b in spans) for s, _ in spans)


@pytest.mark.parametrize("parallel", [1, 3])
def test_evaluations_share_the_gpu_nodes_when_eval_parallel_is_above_one(
    recorded, tmp_path, parallel
) -> None:
    cfg = merge(TRACK_PRESETS["tiny"], {"output": str(tmp_path / "track"), "eval_parallel": parallel,
                                        "train_parallel": 1})  # fmt: skip
    track_run.run_track(cfg, log=lambda line: None)
    spans = recorded
    models = [f"evaluate/{s}-seed0" for s in cfg.subsets]
    state = Storage().read_json(str(tmp_path / "track" / "track_state.json"))
    assert set(track_run.planned_steps(cfg)) <= set(state) and set(spans) == set(track_run.planned_steps(cfg))
    pairs = [(a, b) for i, a in enumerate(models) for b in models[i + 1 :]]
    if parallel == 1:  # one after the other, the scorer's last-but-models as before
        assert not overlap(spans["score"], spans["evaluate/scorer"])
        assert not any(overlap(spans[a], spans[b]) for a, b in pairs)
        assert spans["evaluate/scorer"][0] > max(spans[k][1] for k in spans if k.startswith("train/"))
    else:
        assert overlap(spans["score"], spans["evaluate/scorer"])  # the scorer's evaluation beside the scoring
        assert spans["evaluate/scorer"][1] < spans["filters"][0]
        assert peak([spans[m] for m in models]) == min(parallel, len(models))  # eval_parallel at once
    assert track_run.planned_steps(cfg).index("evaluate/scorer") == (
        3 if parallel > 1 else 4 + len(cfg.subsets)
    )
