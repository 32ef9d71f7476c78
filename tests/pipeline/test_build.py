"""The build end to end on the served demo pool: accounting against the generator's truth, resume, S3."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import schema as S
from pipeline.build import build
from pipeline.common.config import merge
from pipeline.common.storage import LOCAL
from pipeline.config import BUILD_PRESETS
from pipeline.shards.reader import iter_shard
from pipeline.subsets.reshard import reshard
from pipeline.subsets.uid_files import read_subset
from tests.fixtures.build_reference import build_outputs, reference_build, status_rows

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _cfg(demo_pool, out, **kw):
    cfg = dataclasses.replace(BUILD_PRESETS["demo"], metadata=str(demo_pool.metadata_path), output=str(out))
    # 64-row buckets: every per-uid and per-URL stage runs as ~10 tasks, so decisions cross buckets
    cfg = merge(cfg, {"samples_per_shard": 200, "part_size": 150, "bucket_rows": 64})
    return merge(cfg, kw) if kw else cfg


def _shard_uids(shards):
    return [s["json"]["uid"] for path in shards for s in iter_shard(path)]


@pytest.fixture(scope="module")
def built(ray_local, demo_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    cfg = _cfg(demo_pool, out, tokenizer_vocab=300)
    pool = Path(demo_pool.pool_dir)
    # the embedding filters read per embeddings file in blocks; neg_clip_loss then scored per uid range
    emb = f"embeddings_file={pool / 'embeddings.npz'}"
    with np.load(pool / "embeddings.npz") as z:
        uids, img = z["uid"], z["l14_img"]
    np.savez(out / "image.npz", uid=uids[: len(uids) * 9 // 10], embedding=img[: len(uids) * 9 // 10])
    np.save(out / "centroids.npy", img[::700][:12])
    np.save(out / "targets.npy", np.array([0, 3, 4, 9]))
    names = [*cfg.filters.names, f"norm_sim:fraction=0.3,target_file={pool / 'target_embeddings.npy'},{emb}",
             f"neg_clip_loss:fraction=0.3,{emb}"]  # fmt: skip
    image = (f"image_based:embeddings_file={out / 'image.npz'},centroids_file={out / 'centroids.npy'},"
             f"centroid_ids_file={out / 'targets.npy'}")  # fmt: skip
    cfg = merge(cfg, {"filters": {"names": [*names, image]}})
    return cfg, build(cfg, log=lambda m: None)


def test_the_build_on_tasks_equals_the_single_process_rules(built, tmp_path):
    """Statuses, subset files and shards of the bucketed build equal the whole-pool rules run in one
    process over the same metadata and download parts (tests/fixtures/build_reference.py)."""
    cfg, result = built
    assert result.n_input > 8 * cfg.bucket_rows  # many buckets
    got, want = build_outputs(cfg), reference_build(cfg, tmp_path / "reference")
    assert status_rows(got["status"]) == status_rows(want["status"])
    assert got["subsets"] == want["subsets"] and len(got["subsets"]) == len(cfg.filters.names)
    assert got["tars"] == want["tars"] and len(got["tars"]) > 1
    assert got["sizes"] == want["sizes"]


def test_a_relative_output_keeps_its_own_stage_files(built, demo_pool, tmp_path, monkeypatch):
    """The store lists local files by absolute path: a build into a relative directory (``make demo``'s
    runs/demo) must still tell its own stage files from an earlier pool's. In the driver's process
    (download_actors=0): Ray's workers keep the directory they started in."""
    monkeypatch.chdir(tmp_path)
    res = build(_cfg(demo_pool, "runs/rel", download_actors=0), log=lambda m: None)
    assert res.status_counts == built[1].status_counts
    assert list((tmp_path / "runs" / "rel" / "work" / "stages").glob("*/live/*.i64"))


def test_status_counts_equal_injected_truth(built, demo_pool):
    _cfg_, result = built
    truth = pq.read_table(Path(demo_pool.pool_dir) / "truth.parquet")
    expected = Counter(truth.column("expected_status").to_pylist())
    assert result.status_counts == dict(expected)
    assert sum(result.status_counts.values()) == result.n_input == truth.num_rows


def test_every_uid_gets_its_expected_status(built, demo_pool):
    cfg, _ = built
    status = pq.read_table(os.path.join(cfg.output, "metadata", "status.parquet"))
    got = dict(zip(status.column("uid").to_pylist(), status.column("status").to_pylist(), strict=True))
    truth = pq.read_table(Path(demo_pool.pool_dir) / "truth.parquet")
    want = dict(
        zip(truth.column("uid").to_pylist(), truth.column("expected_status").to_pylist(), strict=True)
    )
    wrong = {u: (got.get(u), s) for u, s in want.items() if got.get(u) != s}
    assert not wrong, f"{len(wrong)} uids with another status, e.g. {list(wrong.items())[:5]}"


def test_build_trains_a_tokenizer_on_the_captions(built):
    from pipeline.ingest.tokenizer import TextTokenizer

    cfg, _ = built
    tok = TextTokenizer.load(os.path.join(cfg.output, "tokenizer"))
    ids = tok.encode_batch(["a red circle"], context_length=16)
    assert ids.shape == (1, 16) and tok.end_id in ids[0]
    assert tok.vocab_size <= 300


def test_shards_hold_exactly_the_successes(built, demo_pool):
    cfg, result = built
    uids = _shard_uids(result.shards)
    assert len(uids) == len(set(uids)) == result.status_counts["success"]
    # The json's sha256 is of the bytes as downloaded (img2dataset's), not of the resized JPEG stored.
    truth = pq.read_table(Path(demo_pool.pool_dir) / "truth.parquet", columns=["uid", "served_sha256"])
    served = dict(zip(*(truth.column(c).to_pylist() for c in ("uid", "served_sha256")), strict=True))
    samples = [s for p in result.shards for s in iter_shard(p)]
    assert all(s["json"]["sha256"] == served[s["json"]["uid"]] for s in samples)
    assert any(s["json"]["sha256"] != hashlib.sha256(s["jpg"]).hexdigest() for s in samples)
    for path in result.shards:
        stats = Path(path.replace(".tar", "_stats.json"))
        assert stats.exists()
    # open_clip's sizes.json beside them: shard name → its sample count
    sizes = json.loads((Path(result.shards[0]).parent / "sizes.json").read_text())
    assert sizes == {Path(p).name: sum(1 for _ in iter_shard(p)) for p in result.shards}


def test_subsets_are_datacomp_format_and_subsets_of_successes(built):
    cfg, result = built
    assert set(result.subsets) >= {"no_filter", "basic", "english", "random"}
    success = result.status_counts["success"]
    for name, path in result.subsets.items():
        arr = np.load(path)
        assert arr.dtype == np.dtype("u8,u8"), name
        assert np.array_equal(arr, np.sort(arr)), name
    sizes = result.subset_sizes
    assert sizes["no_filter"]["downloaded"] == success
    assert sizes["basic"]["downloaded"] < success


def test_subset_scope_metadata_is_datacomps_and_downloaded_is_the_shards(built, demo_pool, tmp_path):
    cfg, result = built
    assert cfg.filters.subset_scope == "metadata"  # the default: DataComp's filter outputs
    in_shards = set(_shard_uids(result.shards))
    pool_uids = pq.read_table(demo_pool.metadata_path, columns=["uid"]).column("uid").to_pylist()
    listable = {u for u in pool_uids if isinstance(u, str) and re.fullmatch(r"[0-9a-f]{32}", u)}

    def listed(path: str) -> set[str]:
        uids = S.u8pairs_to_uids(read_subset(path))
        assert len(uids) == len(set(uids)), path  # each uid once
        return set(uids)

    # DataComp's no_filter is the whole pool, downloaded or not.
    assert listed(result.subsets["no_filter"]) == listable
    for name, path in result.subsets.items():
        uids, sizes = listed(path), result.subset_sizes[name]
        assert len(uids) == sizes["metadata"] == result.filter_counts[name], name
        assert len(uids & in_shards) == sizes["downloaded"], name
    assert result.subset_sizes["basic"]["metadata"] > result.subset_sizes["basic"]["downloaded"]

    # "downloaded" on a copy of the run (its parts are done, so nothing downloads again): the same
    # filters, only the uids that are in the shards.
    shutil.copytree(cfg.output, tmp_path / "run")
    scoped = merge(cfg, {"output": str(tmp_path / "run"), "tokenizer_vocab": 0})
    scoped = merge(scoped, {"filters": {"subset_scope": "downloaded"}})
    again = build(scoped, log=lambda m: None)
    for name, path in again.subsets.items():
        assert listed(path) == listed(result.subsets[name]) & in_shards, name
        assert again.filter_counts[name] == result.subset_sizes[name]["downloaded"], name
    assert again.subset_sizes == result.subset_sizes


def test_rerun_reuses_the_filters_until_a_spec_or_the_status_table_changes(built, tmp_path):
    """A re-run with nothing to download reuses filters.parquet and the subsets; a changed filter spec or a
    changed status table recomputes them."""
    from pipeline.build import run_paths
    from pipeline.source import run_state as R

    cfg, first = built
    shutil.copytree(cfg.output, tmp_path / "run")
    again_cfg = merge(cfg, {"output": str(tmp_path / "run"), "tokenizer_vocab": 0})
    paths = run_paths(again_cfg.output)
    written = {p: os.stat(p).st_mtime_ns for p in [paths["filters"], *again_cfg_subsets(paths, first)]}
    logs: list[str] = []
    again = build(again_cfg, log=logs.append)
    assert any(f"reusing {len(cfg.filters.names)} subsets" in m for m in logs), logs
    assert not any(m.startswith("filter ") for m in logs)  # no filter ran
    assert {p: os.stat(p).st_mtime_ns for p in written} == written  # nothing rewritten
    assert again.subset_sizes == first.subset_sizes
    assert {n: Path(p).read_bytes() for n, p in again.subsets.items()} == {
        n: Path(p).read_bytes() for n, p in first.subsets.items()
    }

    # A changed spec: that filter's subset is recomputed with the new parameter.
    half = [n if n != "random" else "random:fraction=0.5" for n in again_cfg.filters.names]
    changed = merge(again_cfg, {"filters": {"names": half}})
    logs.clear()
    res = build(changed, log=logs.append)
    assert not any("reusing" in m for m in logs) and any(m.startswith("filter random") for m in logs)
    assert res.subset_sizes["random"] != first.subset_sizes["random"]
    assert res.subset_sizes["basic"] == first.subset_sizes["basic"]

    # A changed status table (a part rewritten with one success turned into a failure, as a retry run
    # rewrites a part under a new token): recomputed, that uid leaves the downloaded scope.
    part, m = min(R.committed_markers(paths["parts"], LOCAL).items())
    rows = pq.read_table(R.part_file(paths["parts"], part, m.token, "parquet"))
    values, shas = rows.column(S.STATUS).to_pylist(), rows.column(S.IMAGE_SHA256).to_pylist()
    everywhere = Counter(pq.read_table(paths["status"]).column(S.IMAGE_SHA256).to_pylist())
    i = next(
        k
        for k, (v, h) in enumerate(zip(values, shas, strict=True))
        if v == S.STATUS_SUCCESS and everywhere[h] == 1
    )
    values[i] = "failed_to_download:timeout"
    rows = rows.set_column(rows.schema.get_field_index(S.STATUS), S.STATUS, pa.array(values))
    pq.write_table(rows, R.part_file(paths["parts"], part, "feedbeef", "parquet"))
    shutil.copy(
        R.part_file(paths["parts"], part, m.token, "tar"),
        R.part_file(paths["parts"], part, "feedbeef", "tar"),
    )
    R.commit(paths["parts"], part, "feedbeef", LOCAL, (m.transient or 0) + 1, m.late, m.seq + 1)
    logs.clear()
    sizes = build(changed, log=logs.append).subset_sizes
    assert not any("reusing" in m for m in logs)
    assert sizes["no_filter"]["downloaded"] == res.subset_sizes["no_filter"]["downloaded"] - 1
    assert sizes["no_filter"]["metadata"] == res.subset_sizes["no_filter"]["metadata"]


def test_another_stage_layout_version_runs_the_stages_again_and_keeps_the_parts(built, tmp_path, monkeypatch):
    """A re-run under another stage layout version (``stages.layout.VERSION``, bumped when a stage's files
    change format) reads none of the earlier stage files and removes them, downloads nothing again and
    gives the same status table and subsets."""
    import pipeline.build as B
    from pipeline.build import run_paths
    from pipeline.source import run_state as R

    cfg, first = built
    shutil.copytree(cfg.output, tmp_path / "run")
    again_cfg = merge(cfg, {"output": str(tmp_path / "run")})
    paths = run_paths(again_cfg.output)
    before = {k: m.token for k, m in R.committed_markers(paths["parts"], LOCAL).items()}
    stages = Path(paths["work"]) / "stages"
    old = {p.name for p in stages.iterdir()}
    monkeypatch.setattr(B, "VERSION", B.VERSION + 1)
    logs: list[str] = []
    again = build(again_cfg, log=logs.append)
    (fresh,) = {p.name for p in stages.iterdir()} - old  # the stages ran in a root of their own
    assert (stages / fresh / "scan" / "stage.json").exists(), logs
    assert not [p for name in old for p in (stages / name).rglob("*") if p.is_file()]  # their files removed
    assert {k: m.token for k, m in R.committed_markers(paths["parts"], LOCAL).items()} == before
    assert pq.read_table(paths["status"]).sort_by(S.UID) == pq.read_table(
        run_paths(cfg.output)["status"]
    ).sort_by(S.UID)
    assert {n: Path(p).read_bytes() for n, p in again.subsets.items()} == {
        n: Path(p).read_bytes() for n, p in first.subsets.items()
    }


def test_rerun_keeps_the_tokenizer_until_the_captions_change(built, tmp_path):
    """A finished build's re-run does not retrain the tokenizer (the one step whose cost grows with the
    pool); a changed status table (another set of successful captions) retrains it."""
    cfg, _ = built
    shutil.copytree(cfg.output, tmp_path / "run")
    again_cfg = merge(cfg, {"output": str(tmp_path / "run")})
    tok_dir = tmp_path / "run" / "tokenizer"
    written = {p: p.stat().st_mtime_ns for p in tok_dir.iterdir()}
    logs: list[str] = []
    build(again_cfg, log=logs.append)
    assert any(m.startswith("tokenizer: unchanged captions") for m in logs), logs
    assert {p: p.stat().st_mtime_ns for p in tok_dir.iterdir()} == written

    # the stamp records the status table's digest: another one (other successful captions) retrains
    stamp_file = tmp_path / "run" / "work" / "tokenizer_stamp.json"
    stamp = json.loads(stamp_file.read_text())
    stamp_file.write_text(json.dumps({**stamp, "status": "another status table"}))
    logs.clear()
    build(again_cfg, log=logs.append)
    assert any(m.startswith("tokenizer: BPE vocab") for m in logs), logs
    assert json.loads(stamp_file.read_text()) == stamp
    logs.clear()
    build(again_cfg, log=logs.append)  # and now that one is kept
    assert any(m.startswith("tokenizer: unchanged captions") for m in logs), logs


def again_cfg_subsets(paths: dict[str, str], result) -> list[str]:
    return [os.path.join(paths["subsets"], os.path.basename(p)) for p in result.subsets.values()]


def test_reshard_materialises_the_basic_subset(built, tmp_path):
    cfg, result = built
    res = reshard(result.shards, result.subsets["basic"], str(tmp_path / "basic"), samples_per_shard=100)
    listed = S.u8pairs_to_uids(read_subset(result.subsets["basic"]))
    in_shards = set(_shard_uids(result.shards))
    assert sorted(_shard_uids(res.shards)) == sorted(u for u in listed if u in in_shards)
    # uids of the metadata-scope subset that never downloaded are the resharder's "missing"
    sizes = result.subset_sizes["basic"]
    assert res.n_missing == sizes["metadata"] - sizes["downloaded"] > 0


def test_resume_after_driver_killed(ray_local, demo_pool, built, tmp_path):
    """Kill the build driver once a part is done, re-run: same uid set as the uninterrupted build."""
    _, full = built
    out = tmp_path / "resumed"
    env = dict(os.environ, RAY_ADDRESS=ray_local.address_info["address"], PYTHONUNBUFFERED="1")
    args = [
        sys.executable, "-m", "jobs.build_dataset", "--preset", "demo",
        "--set", f"metadata={demo_pool.metadata_path}", "--set", f"output={out}",
        "--set", "part_size=150", "--set", "samples_per_shard=200",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    parts = out / "work" / "parts"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(parts.glob("*.done")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_first = len(list(parts.glob("*.done")))
    assert 1 <= done_first
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # The re-run reports how many parts it skipped: at least those finished before the kill, at most all.
    skipped = re.search(r"download: (\d+) parts .*?, (\d+) already done", rerun.stdout)
    assert skipped, rerun.stdout[-2000:]
    n_parts, n_skipped = int(skipped.group(1)), int(skipped.group(2))
    assert done_first <= n_skipped <= n_parts
    shards = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    uids = _shard_uids(shards)
    assert len(uids) == len(set(uids))
    assert sorted(uids) == sorted(_shard_uids(full.shards))


def test_build_reads_and_writes_s3(ray_local, demo_pool, s3_server):
    """Metadata on s3://, run directory on s3:// (SeaweedFS on loopback): same accounting as local."""
    from pipeline.common import storage
    from pipeline.common.storage import Storage

    store = Storage.from_env(s3_server.endpoint)
    meta = s3_server.url("meta", "part-00000.parquet")
    store.write_bytes(Path(demo_pool.metadata_path).read_bytes(), meta)
    out = s3_server.url("run")
    cfg = _cfg(demo_pool, out, metadata=s3_server.url("meta"), s3_endpoint=s3_server.endpoint)
    cfg = merge(cfg, {"filters": {"names": ["no_filter"]}})
    result = build(cfg, log=lambda m: None)
    truth = pq.read_table(Path(demo_pool.pool_dir) / "truth.parquet")
    assert result.status_counts == dict(Counter(truth.column("expected_status").to_pylist()))
    assert all(p.startswith("s3://") for p in result.shards)
    uids = _shard_uids_s3(result.shards, store)
    assert len(uids) == len(set(uids)) == result.status_counts["success"]
    with store.open_input(result.subsets["no_filter"]) as fh:  # DataComp's scope: the whole pool
        assert len(read_subset(fh)) == result.subset_sizes["no_filter"]["metadata"] > len(uids)
    assert result.subset_sizes["no_filter"]["downloaded"] == result.status_counts["success"]
    assert store.read_json(storage.join(out, "shards", "sizes.json")) == dict(Counter(
        p.rsplit("/", 1)[-1] for p in result.shards for _ in iter_shard(p, store)
    ))  # fmt: skip
    status = store.read_parquet(storage.join(out, "metadata", "status.parquet"))
    assert status.num_rows == truth.num_rows


def _shard_uids_s3(shards, store):
    return [s["json"]["uid"] for path in shards for s in iter_shard(path, store)]
