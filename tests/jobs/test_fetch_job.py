"""``jobs.fetch`` against a stand-in hub on 127.0.0.1 (tests/fixtures/hub_server.py) that the real
``huggingface_hub`` client talks to: a small-shaped DataComp pool (parquet + npz) and two evaluation sets
(a webdataset set, and Flickr's test split as the hub's parquet conversion) copied to S3 (SeaweedFS) and read
back by the build's and the evaluation's own readers; a connection cut mid-file resumed with a range
request, within a run and from a killed run's partial file; bytes that do not match the hub's hash fetched
again; a set the hub does not have ends the job in one line with exit status 3."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from jobs.fetch.cli import main
from pipeline.common.storage import Storage
from pipeline.hub.listing import HubFile
from pipeline.hub.transfer import staged_path
from tests.fixtures.hub_server import hub_server  # noqa: F401
from training.eval import hf_sets
from training.eval import sets as eval_sets
from training.eval.reference import reference_table, save_reference
from training.eval.sets import load_tasks

ROOT = Path(__file__).resolve().parents[2]
POOL = "mlfoundations/datacomp_small"
WDS = "djghosh/wds_cifar10_test"
FLICKR = "nlphuji/flickr_1k_test_image_text_retrieval"
PARQUET = ("0a1b2c3d.parquet", "4e5f6a7b.parquet")


def _jpeg(rgb: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), rgb).save(buf, "JPEG")
    return buf.getvalue()


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def pool_files() -> dict[str, bytes]:
    """Two metadata shards of 200 rows in DataComp's columns, each with its .npz of embeddings."""
    rng = np.random.default_rng(0)
    files = {}
    for k, name in enumerate(PARQUET):
        n = 200
        uids = [f"{k:02x}{i:030x}" for i in range(n)]
        files[name] = _parquet(pa.table({
            "uid": uids, "url": [f"http://img.example/{u}.jpg" for u in uids], "text": ["a photo"] * n,
            "original_width": [640] * n, "original_height": [480] * n, "sha256": ["0" * 64] * n,
            "clip_b32_similarity_score": rng.random(n), "clip_l14_similarity_score": rng.random(n),
            "face_bboxes": [[] for _ in range(n)],
        }))  # fmt: skip
        npz = io.BytesIO()
        np.savez(npz, l14_img=rng.standard_normal((n, 8)).astype(np.float16), uid=np.array(uids))
        files[name.replace(".parquet", ".npz")] = npz.getvalue()
    files["README.md"] = b"# a pool\n"
    return files


def wds_files() -> dict[str, bytes]:
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        for i, rgb in enumerate([(250, 10, 10), (10, 250, 10), (10, 10, 250)]):
            for ext, data in (("jpg", _jpeg(rgb)), ("cls", str(i % 2).encode())):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return {"classnames.txt": b"cat\ndog\n", "zeroshot_classification_templates.txt": b"a photo of a {c}.\n",
            "test/0.tar": tar.getvalue(), "test/nshards.txt": b"1", ".gitattributes": b"*.tar filter=lfs\n"}  # fmt: skip


def flickr_files() -> dict[str, bytes]:
    """The parquet conversion's layout: <config>/test/0000.parquet, images embedded as {bytes, path}."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = pa.table({
        "image": pa.array([{"bytes": _jpeg((i * 40, 100, 200)), "path": f"{i}.jpg"} for i in range(5)], image),
        "caption": [[f"a picture number {i}", f"picture {i}"] for i in range(5)],
        "filename": [f"{i}.jpg" for i in range(5)],
    })  # fmt: skip
    return {"TEST/test/0000.parquet": _parquet(rows), "TEST/train/0000.parquet": _parquet(rows.slice(0, 1))}


@pytest.fixture
def hub(hub_server):
    hub_server.add(POOL, pool_files())
    hub_server.add(WDS, wds_files())
    hub_server.add(FLICKR, {"README.md": b"loading script only\n"})  # main holds no parquet …
    hub_server.add(FLICKR, flickr_files(), branch="refs/convert/parquet")  # … its conversion does
    return hub_server


def args(hub, out: str, *more: str) -> list[str]:
    return ["--out", out, "--npz", "--set", f"hub_endpoint={hub.endpoint}", "--set", "eval_only=[cifar10,flickr30k]",
            "--set", "progress_s=0.5", *more]  # fmt: skip


def test_a_small_shaped_pool_and_two_eval_sets_to_s3_read_by_our_readers(hub, s3_server, tmp_path, capsys):
    out = s3_server.url("fetched")
    store = Storage.from_env(s3_server.endpoint)
    more = ("--set", f"s3_endpoint={s3_server.endpoint}", "--set", f"staging={tmp_path / 'staging'}")
    assert main(args(hub, out, *more)) == 0
    printed = capsys.readouterr().out
    # the pool, flat: every parquet with its npz beside it, byte for byte; the README left out
    files = pool_files()
    meta = store.list_files(f"{out}/metadata")
    assert [p.rsplit("/", 1)[-1] for p in meta] == sorted(n for n in files if n != "README.md")
    for p in meta:
        assert store.read_bytes(p) == files[p.rsplit("/", 1)[-1]]
    assert store.read_parquet(f"{out}/metadata").num_rows == 400
    # the eval sets where the task list's readers look, through S3
    tasks = {t.name: t for t in load_tasks("datacomp", root=f"{out}/eval")}
    shards = eval_sets.validate_task(tasks["cifar10"], store)
    assert shards == [f"{out}/eval/wds_cifar10_test/test/0.tar"]
    assert [r["label"] for r in eval_sets.iter_rows(shards[0], "zeroshot_classification", store)] == [0, 1, 0]
    chunks = hf_sets.validate_task(tasks["flickr30k"], store)
    rows = list(hf_sets.iter_rows(chunks[0], "retrieval", store))
    assert len(rows) == 5 and rows[2]["captions"] == "a picture number 2\npicture 2"  # the test split only
    assert rows[0]["image"][:2] == b"\xff\xd8"
    # the decontamination reference the track builds from its task list reads them too
    ref = reference_table([tasks["cifar10"], tasks["flickr30k"]], store)
    counts = save_reference(ref, f"{out}/eval_reference.parquet", store)
    assert counts == {"cifar10": 3, "flickr30k": 5}
    # nothing left in staging, a record per file, the commits in the manifest
    assert not list((tmp_path / "staging").rglob("*.part"))
    manifest = store.read_json(f"{out}/manifest.json")["jobs"]["fetch"]
    assert set(manifest["commits"]) == {"metadata", "eval set cifar10", "eval set flickr30k"}
    assert manifest["counts"]["metadata"]["fetched"] == 4 and not manifest["failed"]
    assert "[fetch] metadata: done (4 fetched)" in printed and "eval set flickr30k" in printed
    assert "[fetch] 9/9 files, " in printed  # the progress line, last at the end
    # the same command again: every file is skipped, no byte moves
    gets = sum(hub.gets.values())
    assert main(args(hub, out, *more)) == 0
    assert sum(hub.gets.values()) == gets
    assert "4 skipped" in capsys.readouterr().out


def test_a_cut_mid_file_resumes_with_a_range_request(hub, tmp_path):
    out = tmp_path / "out"
    path, size = PARQUET[0], len(pool_files()[PARQUET[0]])
    hub.cut_next(path, 1000, 3000)  # two drops: after 1000 bytes, then 3000 bytes further on
    assert (
        main(args(hub, str(out), "--set", "eval_only=[]", "--set", "eval_tasks=", "--set", "npz=false")) == 0
    )
    assert (out / "metadata" / path).read_bytes() == pool_files()[path]
    assert hub.ranges[path] == ["", "bytes=1000-", "bytes=4000-"] and size > 4000


def test_a_killed_runs_partial_file_is_resumed_by_the_next_run(hub, tmp_path):
    out = tmp_path / "out"
    data = pool_files()[PARQUET[1]]
    f = HubFile(PARQUET[1], len(data), hashlib.sha256(data).hexdigest(), "")
    partial = Path(staged_path(str(out / "metadata" / "_hub" / "partial"), f))
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:2500])  # what a killed run left
    assert (
        main(args(hub, str(out), "--set", "eval_only=[]", "--set", "eval_tasks=", "--set", "npz=false")) == 0
    )
    assert (out / "metadata" / PARQUET[1]).read_bytes() == data
    assert hub.ranges[PARQUET[1]] == ["bytes=2500-"] and not partial.exists()


def test_bytes_that_miss_the_hubs_hash_are_fetched_again(hub, tmp_path, capsys):
    out = tmp_path / "out"
    hub.corrupt_next("test/0.tar")  # one byte flipped in the first answer
    assert main(args(hub, str(out), "--set", "metadata_repo=", "--set", "eval_only=[cifar10]")) == 0
    tar = out / "eval" / "wds_cifar10_test" / "test" / "0.tar"
    assert tar.read_bytes() == wds_files()["test/0.tar"] and hub.gets["test/0.tar"] == 2
    assert "1 fetched again" in capsys.readouterr().out
    # A copy damaged in place is found by --set verify=true and fetched again; without it, its record holds.
    tar.write_bytes(b"\0" + tar.read_bytes()[1:])
    assert main(args(hub, str(out), "--set", "metadata_repo=", "--set", "eval_only=[cifar10]")) == 0
    assert hub.gets["test/0.tar"] == 2
    assert main(args(hub, str(out), "--set", "metadata_repo=", "--set", "eval_only=[cifar10]",
                     "--set", "verify=true")) == 0  # fmt: skip
    assert tar.read_bytes() == wds_files()["test/0.tar"] and hub.gets["test/0.tar"] == 3
    # Bytes that never match fail the set after `attempts` downloads, as a storage error.
    hub.corrupt_next("test/0.tar", 5)
    tar.unlink()
    code = main(args(hub, str(out), "--set", "metadata_repo=", "--set", "eval_only=[cifar10]",
                     "--set", "attempts=2"))  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 4
        and len(err) == 1
        and err[0].startswith("storage error: 1 of 1 sets failed: eval set cifar10")
    )
    assert "2 downloads did not match the hub's sha256:" in err[0]


def test_a_set_the_hub_does_not_have_is_one_line_and_exit_3_through_hf_endpoint(hub, tmp_path):
    """The real command line, the hub named by ``HF_ENDPOINT`` as a user would: the other sets are fetched,
    the missing one ends the job in one line with its input error's status."""
    out = tmp_path / "out"
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jobs.fetch", "--preset", "eval", "--out", str(out),
           "--set", "eval_only=[cifar10,cifar100]"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 3, done.stdout + done.stderr
    assert err == [
        f"input error: 1 of 2 sets failed: eval set cifar100: djghosh/wds_vtab-cifar100_test@main: no such "
        f"dataset repo on {hub.endpoint} (or it is private: set HF_TOKEN)"
    ], err
    assert (out / "eval" / "wds_cifar10_test" / "test" / "0.tar").exists()  # the other set is there
    manifest = json.loads((out / "manifest.json").read_text())["jobs"]["fetch"]
    assert list(manifest["failed"]) == ["eval set cifar100"]
