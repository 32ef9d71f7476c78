"""pipeline.subsets.reshard and jobs.reshard: DataComp semi-join semantics on hand-built shards."""

from __future__ import annotations

import json
import os
import random
import tarfile

import numpy as np
import pytest

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.schema import uids_to_u8pairs
from pipeline.shards.reader import iter_shard
from pipeline.shards.tar_format import ShardError
from pipeline.shards.writer import PartWriter, write_shard
from pipeline.subsets.reshard import output_key, reshard
from pipeline.subsets.uid_files import write_subset


def _uid(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def make_pool(
    base: str, n_tars: int = 3, per_tar: int = 5, seed: int = 0, store: Storage = LOCAL
) -> tuple[list[str], dict[str, dict]]:
    """``n_tars`` shards of random samples; returns the tar paths and uid → {jpg, txt, json, tar}."""
    rng = random.Random(seed)
    truth: dict[str, dict] = {}
    paths = []
    for t in range(n_tars):
        samples = []
        for i in range(per_tar):
            uid = _uid(rng)
            jpg = rng.randbytes(300 + rng.randrange(2000))
            meta = {"uid": uid, "url": f"http://127.0.0.1/{t}/{i}.jpg", "key": f"{t:08d}{i:04d}", "width": i}
            samples.append(
                {"__key__": f"{t:08d}{i:04d}", "jpg": jpg, "txt": f"caption {uid[:6]}", "json": meta}
            )
            truth[uid] = {"jpg": jpg, "txt": f"caption {uid[:6]}", "json": meta, "tar": t}
        path = storage.join(base, f"{t:08d}.tar")
        write_shard(path, samples, store)
        paths.append(path)
    return paths, truth


def read_out(paths: list[str], store: Storage = LOCAL) -> list[dict]:
    return [s for p in paths for s in iter_shard(p, store)]


def tar_sample_counts(directory: str) -> dict[str, int]:
    """Samples per ``.tar`` counted with the standard library's tarfile (distinct member stems)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(directory, name)) as tar:
                out[name] = len({m.name.split(".", 1)[0] for m in tar.getmembers()})
    return out


def test_semi_join_exact_subset_bytes_and_upsampling(tmp_path):
    paths, truth = make_pool(str(tmp_path / "in"))
    uids = list(truth)
    chosen = [uids[0], uids[3], uids[7], uids[7], uids[7], uids[12]]  # uids[7] up-sampled ×3
    absent = [f"{i:032x}" for i in (1, 2)]
    subset = np.sort(uids_to_u8pairs(chosen + absent))
    res = reshard(paths, subset, str(tmp_path / "out"), samples_per_shard=4)

    got = read_out(res.shards)
    assert sorted(s["json"]["uid"] for s in got) == sorted(chosen)  # exactly the subset, with multiplicity
    assert res.n_written == len(got) == 6
    assert res.n_missing == 2 and res.n_missing_rows == 2 and sorted(res.missing_uids()) == absent
    for s in got:
        src = truth[s["json"]["uid"]]
        assert s["jpg"] == src["jpg"] and s["txt"] == src["txt"]  # bytes as they were
        assert s["json"] == {**src["json"], "key": s["__key__"]}  # metadata kept, key updated
    keys = [s["__key__"] for s in got]
    # {shard:08d}{index:0Wd}, W = digits of samples_per_shard - 1 (1 here; 4 for DataComp's 10,000)
    assert keys == [output_key(i, 4) for i in range(6)]
    assert keys == ["000000000", "000000001", "000000002", "000000003", "000000010", "000000011"]
    assert output_key(10_001, 10_000) == "000000010001"
    # input order: shards in order, samples in tar order, copies consecutive
    assert [s["json"]["uid"] for s in got] == [uids[0], uids[3], uids[7], uids[7], uids[7], uids[12]]
    assert res.written[res.written > 0].tolist() == res.expected[res.written > 0].tolist()
    assert res.keys_of([uids[7], absent[0]]) == ["000000002", None]


def test_shards_split_stats_and_summary(tmp_path):
    paths, truth = make_pool(str(tmp_path / "in"), n_tars=2, per_tar=6)
    subset = np.sort(uids_to_u8pairs(list(truth)))  # all 12
    out = str(tmp_path / "out")
    res = reshard(str(tmp_path / "in"), subset, out, samples_per_shard=5)  # a directory as input
    assert [os.path.basename(p) for p in res.shards] == ["00000000.tar", "00000001.tar", "00000002.tar"]
    assert [len(list(iter_shard(p))) for p in res.shards] == [5, 5, 2]
    stats = [LOCAL.read_json(storage.join(out, f"{i:08d}_stats.json")) for i in range(3)]
    assert [s["successes"] for s in stats] == [5, 5, 2] and stats[2]["status_dict"] == {"success": 2}
    summary = LOCAL.read_json(storage.join(out, "reshard.json"))
    assert (
        summary["n_written"] == 12
        and summary["n_missing"] == 0
        and summary["key_format"] == "{shard:08d}{index:01d}"
    )
    assert summary["shards"] == ["00000000.tar", "00000001.tar", "00000002.tar"]
    # open_clip's sizes.json: what open_clip_train's get_dataset_size sums instead of --train-num-samples
    sizes = LOCAL.read_json(storage.join(out, "sizes.json"))
    assert sizes == tar_sample_counts(out) == {"00000000.tar": 5, "00000001.tar": 5, "00000002.tar": 2}


def test_subset_file_uid_from_key_and_input_duplicates(tmp_path):
    rng = random.Random(5)
    uids = [_uid(rng) for _ in range(4)]
    part = str(tmp_path / "in" / "part-000000.tar")
    with PartWriter(part) as w:  # keys are uids; json carries them too
        for u in uids:
            w.add(u, b"img" + u.encode(), "c", {})
    bare = str(tmp_path / "in" / "part-000001.tar")  # uid only in the key, no json; uids[0] again
    write_shard(bare, [{"__key__": uids[0], "jpg": b"again"}, {"__key__": "nouid", "jpg": b"x"}])
    sub = str(tmp_path / "s.npy")
    write_subset([uids[0], uids[2]], sub)
    res = reshard([part, bare], sub, str(tmp_path / "out"), samples_per_shard=10)
    got = read_out(res.shards)
    assert [(s["json"]["uid"], s["jpg"]) for s in got] == [
        (uids[0], b"img" + uids[0].encode()),
        (uids[2], b"img" + uids[2].encode()),
    ]
    assert res.n_input_duplicates == 1 and res.n_unkeyed == 1 and res.n_input_samples == 6


def test_workers_give_identical_output(tmp_path):
    paths, truth = make_pool(str(tmp_path / "in"), n_tars=4, per_tar=5)
    uids = list(truth)
    subset = np.sort(uids_to_u8pairs(uids[::2] + uids[1:3]))
    a = reshard(paths, subset, str(tmp_path / "a"), samples_per_shard=3, workers=1)
    b = reshard(paths, subset, str(tmp_path / "b"), samples_per_shard=3, workers=3)
    assert len(a.shards) == len(b.shards)
    for pa_, pb_ in zip(a.shards, b.shards, strict=True):
        assert open(pa_, "rb").read() == open(pb_, "rb").read()


def test_refuses_to_overwrite_or_write_into_inputs(tmp_path):
    paths, truth = make_pool(str(tmp_path / "in"), n_tars=1, per_tar=3)
    subset = np.sort(uids_to_u8pairs(list(truth)))
    out = str(tmp_path / "out")
    reshard(paths, subset, out, samples_per_shard=2)
    with pytest.raises(FileExistsError):
        reshard(paths, subset, out)
    res = reshard(paths, subset, out, samples_per_shard=10, overwrite=True)
    assert sorted(os.listdir(out)) == [
        "00000000.tar",
        "00000000_stats.json",
        "reshard.json",
        "sizes.json",
    ]  # stale shard 1 gone
    assert LOCAL.read_json(os.path.join(out, "sizes.json")) == tar_sample_counts(out) == {"00000000.tar": 3}
    assert res.n_written == 3
    with pytest.raises(ValueError, match="holds input"):
        reshard(paths, subset, str(tmp_path / "in"), overwrite=True)
    with pytest.raises(FileNotFoundError, match="no input"):
        reshard(str(tmp_path / "nowhere"), subset, str(tmp_path / "out3"))


def test_corrupt_input_raises_or_is_skipped(tmp_path):
    paths, truth = make_pool(str(tmp_path / "in"), n_tars=2, per_tar=4)
    data = open(paths[0], "rb").read()
    open(paths[0], "wb").write(data[: len(data) // 2])
    subset = np.sort(uids_to_u8pairs(list(truth)))
    with pytest.raises(ShardError, match="00000000.tar"):
        reshard(paths, subset, str(tmp_path / "out"))
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".tar")]  # partial shard discarded
    res = reshard(paths, subset, str(tmp_path / "out2"), skip_corrupt=True)
    assert len(res.corrupt_inputs) == 1 and 4 <= res.n_written < 8
    assert res.n_written + res.n_missing == 8


def test_reshard_s3_to_s3_and_local_to_s3(s3_server, tmp_path):
    store = Storage.from_env(s3_server.endpoint)
    src = s3_server.url("reshard-in")
    paths, truth = make_pool(src, n_tars=2, per_tar=4, store=store)
    uids = list(truth)
    sub_path = s3_server.url("subsets", "pick.npy")
    with store.open_output(sub_path) as fh:
        write_subset([uids[1], uids[1], uids[6]], fh)
    out = s3_server.url("reshard-out")
    res = reshard(f"{src}/*.tar", sub_path, out, samples_per_shard=2, store=store, workers=2)
    assert res.shards == [f"{out}/00000000.tar", f"{out}/00000001.tar"]
    got = read_out(res.shards, store)
    assert [s["json"]["uid"] for s in got] == [uids[1], uids[1], uids[6]]
    assert all(s["jpg"] == truth[s["json"]["uid"]]["jpg"] for s in got)
    assert store.read_json(f"{out}/reshard.json")["n_written"] == 3
    assert store.exists(f"{out}/00000001_stats.json")
    assert store.read_json(f"{out}/sizes.json") == {"00000000.tar": 2, "00000001.tar": 1}
    # and back to local disk
    back = reshard(res.shards, sub_path, str(tmp_path / "local"), samples_per_shard=10, store=store)
    assert [s["jpg"] for s in read_out(back.shards)] == [s["jpg"] for s in got]


def test_job_main_on_local_files(tmp_path, capsys):
    from jobs.reshard import main

    paths, truth = make_pool(str(tmp_path / "in"), n_tars=2, per_tar=3)
    uids = list(truth)
    sub = str(tmp_path / "s.npy")
    write_subset([uids[0], uids[4], uids[4], "f" * 32], sub)
    out = str(tmp_path / "out")
    rc = main(
        [
            "--shards",
            str(tmp_path / "in" / "*.tar"),
            "--subset",
            sub,
            "--out",
            out,
            "--samples-per-shard",
            "2",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "written" in text and "missing uids" in text
    summary = json.loads(open(os.path.join(out, "reshard.json")).read())
    assert (
        summary["n_written"] == 3
        and summary["n_missing"] == 1
        and summary["missing_uids_first"] == ["f" * 32]
    )
    assert main(["--shards", *paths, "--subset", sub, "--out", out]) == 5  # refuses to overwrite
    assert "overwrite" in capsys.readouterr().err
