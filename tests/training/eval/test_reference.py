"""The eval reference (training/eval/reference.py) read through the harness's own readers: on the demo
pool's sets it holds every picture with the build's pHash, and it finds the pool's planted leaks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.dedup.eval_leaks import EvalReference, eval_leaks
from training.eval.reference import parts, reference_table, save_reference
from training.eval.reference_dataset import build_reference
from training.eval.reference_dataset import write_reference as write_reference_on_ray
from training.eval.sets import load_tasks


def test_reference_of_the_demo_task_list(demo_pool, tmp_path):
    tasks = load_tasks("demo", root=str(Path(demo_pool.pool_dir) / "eval"))
    table = reference_table(tasks)
    own = pq.read_table(Path(demo_pool.pool_dir) / "eval" / "reference.parquet")  # the generator's
    for task in ("colours", "shapes", "retrieval", "hierarchy"):
        mine = sorted(
            h for t, h in zip(table["task"].to_pylist(), table["phash"].to_pylist(), strict=True) if t == task
        )
        gen = sorted(
            h for t, h in zip(own["task"].to_pylist(), own["phash"].to_pylist(), strict=True) if t == task
        )
        assert mine == gen and len(mine) > 0, task
    assert "embedding" not in table.column_names  # no checkpoint: pHash only
    counts = save_reference(table, str(tmp_path / "ref.parquet"))
    assert counts == {"colours": 32, "hierarchy": 16, "retrieval": 16, "shapes": 32}


def test_the_harness_reference_finds_the_planted_leaks(demo_pool):
    tasks = load_tasks("demo", root=str(Path(demo_pool.pool_dir) / "eval"))
    t = reference_table(tasks)
    ref = EvalReference(
        np.asarray(t["task"].to_pylist(), object),
        np.asarray(t["key"].to_pylist(), object),
        t["phash"].to_numpy(),
    )
    truth = demo_pool.truth.to_pydict()
    clean = [i for i, n in enumerate(truth["noise"]) if n in ("clean", "small", "elongated")]
    task, _ = eval_leaks(np.array([truth["phash"][i] for i in clean], np.int64), None, ref)
    want = [truth["eval_leak"][i] for i in clean]
    assert list(task) == want and sum(bool(w) for w in want) == 6


@pytest.mark.ray
def test_the_ray_data_reference_equals_the_serial_one(ray_local, demo_pool, tmp_path):
    """The reference built by one Ray Data task per part: the serial table's rows in its order."""
    tasks = load_tasks("demo", root=str(Path(demo_pool.pool_dir) / "eval"))
    assert len(parts(tasks)) >= len(tasks) > 1  # several parts: their order matters
    got = build_reference(tasks)
    assert got.equals(reference_table(tasks))
    counts = write_reference_on_ray(tasks, str(tmp_path / "ref.parquet"))
    assert counts == {"colours": 32, "hierarchy": 16, "retrieval": 16, "shapes": 32}
    assert pq.read_table(tmp_path / "ref.parquet").equals(got)
