"""The DataComp-style filtering track as one library call: ``run_track(cfg) -> TrackResult``.

Steps, all under one run directory (local or ``s3://``):

1. **build** — ``pipeline.build`` (the demo preset generates the pool and serves it on 127.0.0.1);
   baseline subsets ``no_filter`` and ``basic`` come out of it.
2. **scorer** — a ProLIP trained on the *unfiltered* pool (``train/scorer``), as ProLIP App. C.8 scores
   DataComp with a model trained on uncurated data.
3. **score** — CSD, μ_v·μ_t and Σσ² of every pool pair (``scores/scores.parquet``, Ray batch inference).
4. **filters** — CSD best ``csd_fraction`` (paper 20%; the demo pool has ≈35% bad captions, so the demo
   keeps 50%), an uncertainty-aware variant (drop the most uncertain captions first, same size), and a
   random subset of the same size as the control; each a DataComp ``.npy`` in ``subsets/``.
5. **train** one model per (subset, seed) — from the build's shards through the subset's ``.npy``, or
   from a resharded copy per subset (``subset_shards/<name>/``, ``train_from=reshard``) — with the
   *same samples seen* (DataComp's rule: the compute budget is fixed, smaller subsets repeat more).
6. **evaluate** every model on the task list (demo: shapes, colours, retrieval, hierarchy) and the scorer
   with the uncertainty analyses; 7. **report** — ``report.md`` with the DataComp-style table.

A re-run with the same output resumes: finished steps are recorded in ``track_state.json`` and skipped;
an interrupted training resumes from its last checkpoint (same run name). The state also records the
config that made those steps (``resume_key``): a re-run whose config would change what a finished step
produced stops with one line naming the keys, instead of reporting the old steps' figures as the new
config's. Keys that say only where or how fast a step runs (cores, actors, GPUs, checkpoint interval,
download retries) and further seeds may change between runs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from jobs.track.config import TrackConfig, paths
from pipeline.common import storage
from pipeline.common.config import to_dict
from pipeline.common.errors import RefusedError
from pipeline.common.storage import Storage
from pipeline.source.run_state import RETRY_KNOBS, differences

# Keys that change where or how fast a step runs, not what it produces (resume_key leaves them out).
_PLACEMENT = {
    "": (
        "output", "storage", "num_cpus", "seeds", "score_actors", "score_gpus", "eval_gpus", "train_parallel",
        "eval_parallel",
    ),
    "build": (
        "output", "storage", "num_cpus", "download_actors", "download_cpus", "keep_parts", "overwrite",
        "retry_failed", "bucket_rows",
    ),
    "build.download": RETRY_KNOBS,
    "model": ("scaling", "run"),
    "model.data": (
        "shards", "storage", "read_cpus", "decode_tasks", "decode_cpus", "prefetch_batches", "label_selector",
    ),
}  # fmt: skip


class ResumeMismatch(RefusedError, ValueError):
    """The output holds a track run made with another config; the message names the keys."""


def resume_key(cfg: TrackConfig) -> dict[str, Any]:
    """What the recorded steps depend on: the config without its ``_PLACEMENT`` keys, and of the seeds only
    the first (the scorer's); more seeds only add models."""
    key = to_dict(cfg)

    def drop(d: dict[str, Any], names: tuple[str, ...]) -> None:
        for name in names:
            d.pop(name, None)

    drop(key, _PLACEMENT[""])
    drop(key["build"], _PLACEMENT["build"])
    drop(key["build"]["download"], _PLACEMENT["build.download"])
    for name in ("scorer", "train"):
        drop(key[name], _PLACEMENT["model"])
        drop(key[name]["data"], _PLACEMENT["model.data"])
    key["scorer_seed"] = cfg.seeds[0]
    return key


def claim_output(cfg: TrackConfig, store: Storage | None = None) -> _State:
    """Check ``cfg`` against the steps already recorded in its output, record it and return the state;
    raises ``ResumeMismatch`` (a ``RefusedError``, exit 5) naming what differs."""
    store = store or cfg.storage.store()
    state = _State(cfg.output, store)
    new = resume_key(cfg)
    steps = [k for k in state.data if k not in NOT_STEPS]
    old = state.get("config")
    if steps and old is None:
        raise ResumeMismatch(
            f"{state.path} records {len(steps)} finished steps but not their config (an earlier version made "
            "them); use a new output (--set output=DIR) or remove that directory"
        )
    diff = differences(old, new) if old is not None else []
    if diff:
        shown = "; ".join(diff[:4]) + ("; …" if len(diff) > 4 else "")
        raise ResumeMismatch(
            f"{state.path}: its finished steps were made with another config ({shown}); resume with that "
            "config, or use a new output (--set output=DIR)"
        )
    state.done("config", new)
    state.done("plan", planned_steps(cfg))  # what jobs.status compares the finished steps with
    return state


NOT_STEPS = ("timings", "config", "plan")  # the state's entries that are not finished steps


def planned_steps(cfg: TrackConfig) -> list[str]:
    """Every step ``run_track`` records, in its order (one ``train/`` and ``evaluate/`` per model)."""
    models = [f"{name}-seed{seed}" for name in cfg.subsets for seed in cfg.seeds]
    reshard = ["reshard"] if cfg.train_from == "reshard" else []  # else the subsets train through their .npy
    # with eval_parallel > 1 the scorer's evaluation runs beside the scoring
    early, late = (["evaluate/scorer"], []) if cfg.eval_parallel > 1 else ([], ["evaluate/scorer"])
    return [
        "build", "scorer", "score", *early, "filters", *reshard, *[f"train/{m}" for m in models], *late,
        *[f"evaluate/{m}" for m in models],
    ]  # fmt: skip


@dataclass
class TrackResult:
    output: str
    report: str  # path of report.md
    table: list[dict[str, Any]]  # one row per subset (means over seeds)
    comparisons: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


class _State:
    """``track_state.json``: finished steps and what they produced, so a re-run skips them."""

    def __init__(self, output: str, store: Storage) -> None:
        self.path, self.store = storage.join(output, "track_state.json"), store
        self.data: dict[str, Any] = store.read_json(self.path) if store.exists(self.path) else {}

    def get(self, step: str) -> Any:
        return self.data.get(step)

    def done(self, step: str, value: Any) -> Any:
        self.data[step] = value
        self.store.write_json(self.data, self.path)
        return value


def cpu_reference(seconds: float = 1.0, n: int = 256) -> dict[str, float]:
    """fp32 matmul GFLOP/s of this machine (torch's default threads): a yardstick printed beside the
    timings: one 2-core machine measured 2.3× apart on the same training step within an hour."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        a @ b
        count += 1
    return {"cores": os.cpu_count() or 0, "matmul_gflops": round(2 * n**3 * count / elapsed / 1e9, 1)}


def _serialised(log: Callable[[str], None], lock: threading.Lock) -> Callable[[str], None]:
    def say(line: str) -> None:
        with lock:
            log(line)

    return say


def in_parallel(
    fn: Callable[[Any], Any], items: Sequence[Any], workers: int, log: Callable[[str], None]
) -> list:
    """``[fn(x) for x in items]``, ``workers`` at a time (threads: each ``fn`` here waits on Ray). A failure
    lets the others finish, so their steps are recorded, and is raised after them. Ctrl-C cancels the queued
    ones and shuts the local Ray down, which ends the running trainings; their checkpoints stay, so the same
    command resumes them."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    pool = ThreadPoolExecutor(workers, thread_name_prefix="track")
    futures = [pool.submit(fn, x) for x in items]
    try:
        wait(futures)
    except KeyboardInterrupt:
        import ray

        pool.shutdown(wait=False, cancel_futures=True)
        print("[track] interrupted: the same command resumes from the last checkpoints", file=sys.stderr)
        ray.shutdown()
        raise SystemExit(130) from None
    pool.shutdown()
    failed = [f.exception() for f in futures if f.exception() is not None]
    for exc in failed[1:]:
        log(f"[track] also failed: {type(exc).__name__}: {exc}")
    if failed:
        raise failed[0]
    return [f.result() for f in futures]


def run_track(cfg: TrackConfig, log: Callable[[str], None] = print) -> TrackResult:
    """Run (or resume) every step; needs Ray initialised (``jobs.common.init_ray``)."""
    from jobs.track.datacomp.starts import build_or_adopt, scorer_or_start
    from jobs.track.report import write_report
    from jobs.track.steps import (
        evaluate_models,
        make_subsets,
        reshard_subsets,
        score_pool,
        train_models,
    )

    said = threading.Lock()  # one line at a time when models train side by side
    log = _serialised(log, said)
    machine = cpu_reference()
    log(f"[track] machine: {machine['cores']} cores, fp32 matmul {machine['matmul_gflops']} GFLOP/s")
    t_start = time.perf_counter()
    p = paths(cfg)
    state = claim_output(cfg)
    timings: dict[str, float] = dict(state.get("timings") or {})

    recording = threading.Lock()  # subset models may finish side by side (train_parallel)

    def step(name: str, fn: Callable[[], Any]) -> Any:
        cached = state.get(name)
        if cached is not None:
            log(f"[track] {name}: done earlier, skipped")
            return cached
        log(f"[track] {name} …")
        t = time.perf_counter()
        value = fn()
        with recording:
            timings[name] = time.perf_counter() - t
            state.done("timings", timings)
            state.done(name, value)
        log(f"[track] {name}: {timings[name]:.0f}s")
        return value

    def evaluation(name: str, info: dict[str, Any]) -> Any:  # one step per model: none is done twice
        return step(f"evaluate/{name}", lambda: evaluate_models(cfg, {name: info}, log)[name])

    # Starting points (jobs/track/datacomp/starts.py) may replace the build and the scorer's training.
    built = step("build", lambda: build_or_adopt(cfg, log))
    scorer = step("scorer", lambda: scorer_or_start(cfg, log))
    # Scoring and the scorer's evaluation share the GPU nodes at once when eval_parallel > 1
    first = [lambda: step("score", lambda: score_pool(cfg, scorer["checkpoint"], log))]
    first += [lambda: evaluation("scorer", scorer)] if cfg.eval_parallel > 1 else []
    scores, *scorer_eval = in_parallel(lambda fn: fn(), first, len(first), log)
    subsets = step(
        "filters", lambda: make_subsets(cfg, built["subsets"], scores["path"], log, scorer["checkpoint"])
    )
    if cfg.train_from == "reshard":
        shards = step("reshard", lambda: reshard_subsets(cfg, subsets, log))
        source = {name: (shards[name]["dir"], "") for name in cfg.subsets}
    else:  # the build's shards through each subset's .npy: nothing copied
        source = {name: (p["shards"], subsets[name]["path"]) for name in cfg.subsets}
    runs = {
        f"{name}-seed{seed}": (cfg.train, source[name][0], seed, source[name][1])
        for name in cfg.subsets
        for seed in cfg.seeds
    }
    # One state entry per model, so an interrupted track never retrains or re-evaluates a finished one.
    train = lambda item: step(f"train/{item[0]}", lambda: train_models(cfg, dict([item]), log)[item[0]])  # noqa: E731
    trained = in_parallel(train, list(runs.items()), cfg.train_parallel, log)
    models = dict(zip(runs, trained, strict=True))
    # eval_parallel evaluations at once (the scorer's ran beside the scoring when that is above 1)
    todo = {**({} if scorer_eval else {"scorer": scorer}), **models}
    done = in_parallel(lambda item: evaluation(*item), list(todo.items()), cfg.eval_parallel, log)
    evals = {"scorer": scorer_eval[0]} if scorer_eval else {}
    evals.update(zip(todo, done, strict=True))
    timings["this_invocation"] = time.perf_counter() - t_start
    report, table, comparisons = write_report(
        cfg, built, scores, subsets, models, scorer, evals, timings, machine
    )
    return TrackResult(
        output=cfg.output, report=report, table=table, comparisons=comparisons, timings=timings
    )
