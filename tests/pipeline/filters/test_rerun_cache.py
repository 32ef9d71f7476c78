"""The filters' re-run stamp: equal when nothing the results derive from changed, different otherwise."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.build import run_paths
from pipeline.common.config import merge
from pipeline.common.storage import LOCAL
from pipeline.config import BuildConfig
from pipeline.filters import rerun_cache as FR
from pipeline.filters.language import default_model_path
from pipeline.filters.specs import parse_filter_specs


def _setup(tmp_path, **filters):
    meta = tmp_path / "meta"
    meta.mkdir()
    pq.write_table(pa.table({"uid": ["a" * 32, "b" * 32]}), meta / "p0.parquet")
    synsets = tmp_path / "synsets.txt"
    synsets.write_text("n0001\n")
    cfg = merge(
        BuildConfig(),
        {
            "metadata": str(meta),
            "output": str(tmp_path / "out"),
            "filters": {"names": ["no_filter", "basic", f"text_based:synsets_file={synsets}"]},
        },
    )
    cfg = merge(cfg, {"filters": filters}) if filters else cfg
    status = pa.table({S.UID: ["a" * 32, "a" * 32, "b" * 32], S.STATUS: ["success", "duplicate_uid", "x"]})
    return cfg, status, meta, synsets


def _stamp(cfg, status):
    return FR.filter_stamp(cfg, parse_filter_specs(list(cfg.filters.names)), status, LOCAL)


def test_stamp_is_stable_and_ignores_row_order_within_a_uid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metadata").mkdir()  # a directory named like a setting's value is never read as an input
    cfg, status, _, synsets = _setup(tmp_path)
    first = _stamp(cfg, status)
    assert first == _stamp(cfg, status.take([1, 0, 2]))
    # the settings' input file, and the packaged fastText model "basic" reads
    assert sorted([str(synsets), default_model_path()]) == [name for name, *_ in first["inputs"]]


def test_stamp_changes_with_metadata_inputs_specs_and_statuses(tmp_path):
    cfg, status, meta, synsets = _setup(tmp_path)
    first = _stamp(cfg, status)
    random = [*cfg.filters.names, "random"]
    assert _stamp(
        merge(cfg, {"filters": {"names": [*random[:-1], "random:fraction=0.5"]}}), status
    ) != _stamp(merge(cfg, {"filters": {"names": random}}), status)
    assert _stamp(merge(cfg, {"filters": {"names": ["no_filter"]}}), status) != first
    assert _stamp(cfg, status.set_column(1, S.STATUS, pa.array(["x", "duplicate_uid", "x"]))) != first
    assert _stamp(cfg, status.slice(0, 2)) != first
    synsets.write_text("n0002\nn0003\n")
    second = _stamp(cfg, status)
    assert second != first
    pq.write_table(pa.table({"uid": ["a" * 32, "c" * 32]}), meta / "p0.parquet")
    os.utime(meta / "p0.parquet", ns=(1, 1))  # same size: the modification time tells
    assert _stamp(cfg, status) != second


def test_reusable_needs_the_same_stamp_and_every_file(tmp_path):
    cfg, status, _, _ = _setup(tmp_path)
    paths = run_paths(cfg.output)
    stamp = _stamp(cfg, status)
    assert FR.reusable(stamp, paths, LOCAL) is None  # nothing recorded yet
    os.makedirs(paths["subsets"])
    os.makedirs(os.path.dirname(paths["filters"]), exist_ok=True)
    for path in (paths["filters"], FR.subset_path(paths, "basic")):
        open(path, "wb").close()
    sizes = {"basic": {"metadata": 1, "downloaded": 1}}
    FR.remember(stamp, sizes, {"basic": FR.subset_path(paths, "basic")}, paths, LOCAL)
    assert FR.reusable(stamp, paths, LOCAL) == {
        "sizes": sizes,
        "subsets": {"basic": FR.subset_path(paths, "basic")},
    }
    assert FR.reusable(_stamp(cfg, status.slice(1)), paths, LOCAL) is None
    os.remove(FR.subset_path(paths, "basic"))
    assert FR.reusable(stamp, paths, LOCAL) is None
    FR.forget(paths, LOCAL)
    assert not os.path.exists(FR.stamp_path(paths))
