"""The filter and embed jobs end to end on a local Ray: tiny checkpoint, two demo shards."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from jobs import embed as embed_job
from jobs.filter import cli as filter_job
from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.reader import iter_shard
from pipeline.subsets.uid_files import read_subset, subset_uids
from tests.fixtures.train_shards import write_demo_shards

pytestmark = pytest.mark.ray
N_SHARDS, PER_SHARD = 2, 64


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    directory = tmp_path_factory.mktemp("filter_pool")
    paths = write_demo_shards(directory, N_SHARDS, PER_SHARD)
    uids = [s["json"]["uid"] for p in paths for s in iter_shard(p)]
    return str(directory), sorted(uids)


def test_filter_job_scores_filters_and_reshards(ray_local, pool, tiny_checkpoint, tmp_path, capsys):
    shards, uids = pool
    out = str(tmp_path / "run")
    rc = filter_job.main(
        ["--preset", "demo", "--checkpoint", tiny_checkpoint, "--shards", shards, "--out", out]
        + ["--set", "filters=csd_best:fraction=0.2,clip_score_best:fraction=0.3,random_same_size:of=csd_best"]
        + ["--set", "samples_per_shard=10"]
    )
    assert rc == 0
    scores = pq.read_table(os.path.join(out, "scores", "scores.parquet"))
    assert scores.column("uid").to_pylist() == uids  # one row per sample, sorted by uid
    assert np.asarray(scores.column("ok")).all()
    n = len(uids)
    sizes = {
        "csd_best": round(0.2 * n),
        "clip_score_best": round(0.3 * n),
        "random_same_size": round(0.2 * n),
    }
    for label, size in sizes.items():
        kept = subset_uids(os.path.join(out, "subsets", f"{label}.npy"))
        assert len(kept) == size and set(kept) <= set(uids)
        resharded = [
            s["json"]["uid"] for p in LOCAL.list_files(os.path.join(out, "subsets", label, "shards"), ".tar")
            for s in iter_shard(p)
        ]  # fmt: skip
        assert sorted(resharded) == kept
        shard_dir = os.path.join(out, "subsets", label, "shards")
        sizes = json.load(open(os.path.join(shard_dir, "sizes.json")))
        assert sizes == {
            os.path.basename(p): sum(1 for _ in iter_shard(p)) for p in LOCAL.list_files(shard_dir, ".tar")
        }
    csd = dict(zip(scores.column("uid").to_pylist(), scores.column("csd").to_pylist(), strict=True))
    best = subset_uids(os.path.join(out, "subsets", "csd_best.npy"))
    assert max(csd[u] for u in best) <= min(csd[u] for u in set(uids) - set(best))
    report = json.load(open(os.path.join(out, "filters.json")))
    assert report["filters"]["csd_best"]["counts"] == {"kept": 26, "csd_not_in_best_20%": n - 26}
    assert "filter" in json.load(open(os.path.join(out, "manifest.json")))["jobs"]
    assert "csd_best" in capsys.readouterr().out
    assert len(read_subset(os.path.join(out, "subsets", "random_same_size.npy"))) == 26


def test_missing_checkpoint_stops_at_start(pool, tmp_path, capsys):
    missing = str(tmp_path / "no-such-ckpt")
    rc = filter_job.main(["--checkpoint", missing, "--shards", pool[0], "--out", str(tmp_path / "o")])
    assert rc == 3 and missing in capsys.readouterr().err  # an input error (docs/jobs.md)
    assert not (tmp_path / "o").exists()


def test_uncertainty_filter_with_deterministic_checkpoint_is_a_config_error(
    pool, clip_checkpoint, tmp_path, capsys
):
    rc = filter_job.main(["--checkpoint", clip_checkpoint, "--shards", pool[0], "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "filters[1]: csd_uncertainty_aware needs a probabilistic checkpoint" in err


def test_embed_job_writes_fixed_size_vectors(ray_local, pool, tiny_checkpoint, tmp_path):
    out = str(tmp_path / "emb.parquet")
    assert embed_job.main(["--checkpoint", tiny_checkpoint, "--shards", pool[0], "--out", out]) == 0
    table = pq.read_table(out)
    assert sorted(table.column("uid").to_pylist()) == pool[1]
    cfg = json.load(open(os.path.join(tiny_checkpoint, "model_config.json")))
    d = cfg["embed_dim"]
    for name in ("image_mu", "text_mu", "image_logvar", "text_logvar"):
        vectors = table.column(name).combine_chunks().flatten().to_numpy().reshape(-1, d)
        assert vectors.shape == (N_SHARDS * PER_SHARD, d) and np.isfinite(vectors).all()
    assert table.column("text").to_pylist()[0].startswith("a photo of a ")


def test_filter_job_on_s3(ray_local, pool, tiny_checkpoint, s3_server):
    shards_url = s3_server.url("pool")
    store = Storage.from_env(s3_server.endpoint)
    for name in sorted(os.listdir(pool[0])):
        with open(os.path.join(pool[0], name), "rb") as fh:
            store.write_bytes(fh.read(), storage.join(shards_url, name))
    out = s3_server.url("filter-run")
    rc = filter_job.main(
        ["--checkpoint", tiny_checkpoint, "--shards", shards_url, "--out", out]
        + ["--set", f"s3_endpoint={s3_server.endpoint}", "--set", "filters=[csd_best:fraction=0.5]"]
        + ["--set", "reshard=false"]
    )
    assert rc == 0
    scores = store.read_parquet(storage.join(out, "scores", "scores.parquet"))
    assert scores.column("uid").to_pylist() == pool[1]
    with store.open_input(storage.join(out, "subsets", "csd_best.npy")) as fh:
        assert len(read_subset(fh)) == len(pool[1]) // 2


def test_metadata_filters_and_bad_specs_stop_the_filter_job_at_validation():
    from jobs.filter.run import FilterJobConfig, validate
    from pipeline.common.config import ConfigError

    cfg = FilterJobConfig(shards="pool", checkpoint="ckpt", filters=("csd_best:fraction=0.2", "basic"))
    with pytest.raises(ConfigError, match=r"filters\[1\]: basic reads \['original_height', 'original_width'"):
        validate(cfg)
    specs = validate(FilterJobConfig(shards="pool", checkpoint="ckpt"))
    assert [s.label for s in specs][-1] == "random_same_size" and specs[-1].of == "csd_best"


def test_filter_job_scores_with_an_imported_open_clip_model(ray_local, pool, tmp_path):
    """``--checkpoint openclip:MODEL:PATH``: imported into OUT/checkpoint, then CLIP-score filtering runs;
    the cosines equal open_clip's own forward on the same pixels and captions."""
    import torch
    from safetensors.torch import save_file

    from tests.fixtures import open_clip_src
    from tests.training.imports.test_imports import _open_clip_reference
    from training.infer.encode import Encoder

    oc_model = open_clip_src.load_or_skip("model")
    ref = _open_clip_reference(oc_model, 32, quick_gelu=True, seed=3)
    weights = tmp_path / "open_clip_model.safetensors"
    save_file({k: v.detach().contiguous() for k, v in ref.state_dict().items()}, str(weights))
    shards, uids = pool
    out = str(tmp_path / "run")
    source = f"openclip:ViT-B-32-quickgelu:{weights}"
    rc = filter_job.main(
        [
            "--checkpoint",
            source,
            "--shards",
            shards,
            "--out",
            out,
            "--set",
            "filters=clip_score_best:fraction=0.3",
        ]
    )
    assert rc == 0
    manifest = json.load(open(os.path.join(out, "manifest.json")))["jobs"]["filter"]
    assert manifest["imported_from"] == source and manifest["checkpoint"] == os.path.join(out, "checkpoint")
    scores = pq.read_table(os.path.join(out, "scores", "scores.parquet")).to_pandas().set_index("uid")
    assert len(subset_uids(os.path.join(out, "subsets", "clip_score_best.npy"))) == round(0.3 * len(uids))

    samples = [s for p in sorted(LOCAL.list_files(shards, ".tar")) for s in iter_shard(p)][:16]
    encoder = Encoder(os.path.join(out, "checkpoint"))
    pixels, ok = encoder.preprocess([s["jpg"] for s in samples])
    tokens = open_clip_src.load("tokenizer").SimpleTokenizer()([s["txt"] for s in samples])
    with torch.no_grad():
        mu_v = ref.encode_image(torch.from_numpy(pixels), normalize=True)
        mu_t = ref.encode_text(tokens, normalize=True)
    expected = (mu_v * mu_t).sum(-1).numpy()
    got = scores.loc[[s["json"]["uid"] for s in samples], "cosine"].to_numpy()
    assert ok.all() and np.abs(got - expected).max() < 1e-5
