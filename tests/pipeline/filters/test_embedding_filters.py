"""negCLIPLoss and NormSim (pipeline/filters/embedding.py) against float64 references of the paper's
definitions, and through the one registry on DataComp's embedding files, without Ray."""

from __future__ import annotations

import io

import mpmath as mp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import schema as S
from pipeline.common.hashing import splitmix64
from pipeline.common.storage import LOCAL
from pipeline.filters import embedding as E
from pipeline.filters.base import FilterError
from pipeline.filters.specs import apply, parse_filter_specs, run_filters


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _pairs(n=50, d=16, seed=0):
    rng = np.random.default_rng(seed)
    image = _unit(rng.standard_normal((n, d)))
    text = _unit(image + 0.8 * rng.standard_normal((n, d)))  # matched pairs, some better than others
    return image, text


def _uids(n, seed=0):
    rng = np.random.default_rng(seed)
    return S.uids_to_u8pairs(
        [f"{int(a):016x}{int(b):016x}" for a, b in rng.integers(0, 2**64, (n, 2), dtype=np.uint64)]
    )


def _reference_batches(uids, batch_size, seed, k):
    """The batch rule (decision 0098) written out: sort by (key, uid), ⌈n/b⌉ near-equal runs."""
    mix = lambda x: int(splitmix64(np.array([x % 2**64], np.uint64))[0])  # noqa: E731
    salt_seed, salt_k = mix(seed), mix(k + 1)
    keys = [(mix(mix(int(hi) ^ salt_seed) ^ int(lo) ^ salt_k), int(hi), int(lo), i)
            for i, (hi, lo) in enumerate(zip(uids["f0"], uids["f1"], strict=True))]  # fmt: skip
    order = [i for *_, i in sorted(keys)]
    m = -(-len(order) // batch_size)
    size, extra = divmod(len(order), m)
    cuts = np.cumsum([0] + [size + (j < extra) for j in range(m)])
    return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def _reference_neg_clip_loss(image, text, uids, tau, batch_size, batches, seed):
    """The paper's Eq. 1–2 literally, in 40-digit arithmetic (mpmath): −τ × the CLIP loss of row i in
    each random batch, averaged over the batches; a pair that dominates its batch scores −1e-11 or so,
    where float64's log-softmax of the matched pair would keep only a digit or two."""
    mp.mp.dps = 40
    v, t = _unit(image.astype(np.float64)), _unit(text.astype(np.float64))
    n = len(v)
    total = [mp.mpf(0)] * n
    for k in range(batches):
        for rows in _reference_batches(uids, batch_size, seed, k):
            s = [
                [mp.fsum(mp.mpf(x) * mp.mpf(y) for x, y in zip(v[i], t[j], strict=True)) / tau for j in rows]
                for i in rows
            ]
            for p, i in enumerate(rows):
                i2t = s[p][p] - mp.log(mp.fsum(mp.exp(x) for x in s[p]))
                t2i = s[p][p] - mp.log(mp.fsum(mp.exp(s[q][p]) for q in range(len(rows))))
                total[i] += -tau * (-(i2t + t2i) / 2)
    return np.array([float(x / batches) for x in total])


@pytest.mark.parametrize("batch_size, batches, tau", [(30, 1, 0.01), (16, 2, 0.01), (7, 3, 0.07)])
def test_neg_clip_loss_equals_the_papers_definition(batch_size, batches, tau):
    image, text = _pairs(n=30)
    uids = _uids(30)
    got = E.neg_clip_loss_scores(image, text, uids, tau=tau, batch_size=batch_size, batches=batches, seed=3)
    want = _reference_neg_clip_loss(image, text, uids, tau, batch_size, batches, 3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_neg_clip_batches_are_a_function_of_the_uids():
    """Round k's batches: the written-out rule, at most b rows each, the same rows whatever their order,
    another draw per round and per seed; a pool of at most b rows is one batch."""
    uids = _uids(103, seed=1)
    got = E.neg_clip_batches(uids, 16, seed=2, k=1)
    assert [r.tolist() for r in got] == _reference_batches(uids, 16, 2, 1)
    assert len(got) == 7 and {len(r) for r in got} <= {14, 15, 16}
    perm = np.random.default_rng(0).permutation(103)
    moved = E.neg_clip_batches(uids[perm], 16, seed=2, k=1)
    assert [sorted(perm[r].tolist()) for r in moved] == [sorted(r.tolist()) for r in got]
    assert sorted(E.neg_clip_batches(uids, 16, seed=2, k=2)[0].tolist()) != sorted(got[0].tolist())
    assert sorted(E.neg_clip_batches(uids, 16, seed=3, k=1)[0].tolist()) != sorted(got[0].tolist())
    assert [len(r) for r in E.neg_clip_batches(uids, 103, seed=2, k=0)] == [103]


def test_neg_clip_loss_groups_are_uid_ranges_scored_alone():
    """Scores drawn within G uid ranges equal each range scored on its own (what one task holds),
    whatever order the rows come in."""
    image, text = _pairs(n=60)
    uids = _uids(60, seed=2)
    whole = E.neg_clip_loss_scores(image, text, uids, batch_size=8, batches=2, seed=1, groups=3)
    group = E.neg_clip_group_of(uids, 3)
    assert sorted(set(group.tolist())) == [0, 1, 2]
    for g in range(3):
        at = np.flatnonzero(group == g)[::-1]
        alone = E.neg_clip_loss_scores(
            image[at], text[at], uids[at], batch_size=8, batches=2, seed=1, groups=3
        )
        np.testing.assert_array_equal(alone, whole[at])
    assert E.neg_clip_groups(4 * 32768 - 1, 32768) == 1 and E.neg_clip_groups(12_800_000, 32768) == 97


def test_neg_clip_loss_chunks_long_batches(monkeypatch):
    """A batch longer than one row chunk carries its column sums across chunks."""
    image, text = _pairs(n=40)
    uids = _uids(40)
    whole = E.neg_clip_loss_scores(image, text, uids, batch_size=40, batches=2, seed=1)
    monkeypatch.setattr(E, "_ROWS", 8)
    np.testing.assert_allclose(
        E.neg_clip_loss_scores(image, text, uids, batch_size=40, batches=2, seed=1), whole, rtol=1e-12
    )


@pytest.mark.parametrize("p", [2.0, 3.0, float("inf")])
def test_norm_sim_equals_the_papers_definition(p):
    rng = np.random.default_rng(4)
    image, targets = rng.standard_normal((30, 12)), rng.standard_normal((9, 12))
    v, g = _unit(image), _unit(targets)
    sims = np.abs(v @ g.T)
    want = sims.max(axis=1) if np.isinf(p) else (sims**p).sum(axis=1) ** (1 / p)
    np.testing.assert_allclose(E.norm_sim_scores(image, targets, p), want, rtol=1e-6)


def _shard(tmp_path, uids, image, text):
    """A DataComp metadata shard: the parquet and its row-aligned .npz (float16, as DataComp ships)."""
    pq.write_table(pa.table({"uid": uids, "text": ["x"] * len(uids)}), tmp_path / "0000.parquet")
    buf = io.BytesIO()
    np.savez(buf, l14_img=image.astype(np.float16), l14_txt=text.astype(np.float16))
    (tmp_path / "0000.npz").write_bytes(buf.getvalue())


def test_registry_filters_read_datacomp_shards(tmp_path):
    image, text = _pairs(n=40)
    uids = [f"{i:032x}" for i in range(40)]
    _shard(tmp_path, uids, image, text)
    np.save(tmp_path / "targets.npy", image[:5])
    # the table lists two uids the shards do not have, and misses none of theirs
    table = pa.table({"uid": [*uids, "f" * 32, "e" * 32]})
    ncl = apply(
        "neg_clip_loss:fraction=0.25,batch_size=16,batches=2",
        table,
        metadata=[str(tmp_path / "0000.parquet")],
    )
    assert ncl.keep.sum() == 10 and list(ncl.reason[-2:]) == ["missing_embedding"] * 2
    scores = E.neg_clip_loss_scores(
        image.astype(np.float16).astype(np.float32),
        text.astype(np.float16).astype(np.float32),
        S.uids_to_u8pairs(uids),
        batch_size=16,
        batches=2,
    )
    assert set(np.flatnonzero(ncl.keep)) == set(np.argsort(-scores)[:10])
    spec = f"norm_sim:fraction=0.5,p=inf,target_file={tmp_path / 'targets.npy'},embeddings_file={tmp_path}"
    ns = apply(spec, table)
    assert ns.keep[:5].all() and ns.keep.sum() == 20  # a target's own picture matches it best
    assert ns.reason[~ns.keep][0].startswith("norm_sim_not_in_top_50%")


def test_embedding_filters_name_what_is_missing(tmp_path):
    table = pa.table({"uid": ["a" * 32]})
    with pytest.raises(FilterError, match="needs embeddings_file"):
        apply("neg_clip_loss", table)
    pq.write_table(pa.table({"uid": ["a" * 32]}), tmp_path / "m.parquet")
    with pytest.raises(FilterError, match="no columns .* and no .*m.npz"):
        apply("neg_clip_loss", table, metadata=[str(tmp_path / "m.parquet")])
    with pytest.raises(FilterError, match="needs target_file"):
        apply(f"norm_sim:embeddings_file={tmp_path / 'm.parquet'}", table)


def test_embedding_files_of_every_layout_load_the_same(tmp_path):
    rng = np.random.default_rng(9)
    uids = [f"{i:032x}" for i in range(6)]
    vec = rng.standard_normal((6, 4)).astype(np.float32)
    np.savez(tmp_path / "a.npz", uid=np.array(uids), embedding=vec)
    emb_list = pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1)), 4)
    pq.write_table(pa.table({"uid": uids, "image_mu": emb_list}), tmp_path / "b.parquet")
    for path, key in ((tmp_path / "a.npz", "embedding"), (tmp_path / "b.parquet", "image_mu")):
        e = E.load_embeddings(str(path), LOCAL, key)
        assert e.uids == uids and np.array_equal(e.vectors, vec)


def test_neg_clip_loss_with_norm_sim_is_one_spec():
    (spec,) = parse_filter_specs(["neg_clip_loss:fraction=0.3+norm_sim:p=inf,target_file=t.npy"])
    assert [name for name, _ in spec.parts] == ["neg_clip_loss", "norm_sim"]
    with pytest.raises(Exception, match="p"):
        parse_filter_specs(["norm_sim:p=0.5"])
    assert callable(run_filters)


@pytest.mark.parametrize("layout", ["stored.npz", "deflated.npz", "plain.npy"])
def test_embedding_blocks_read_a_file_as_loading_it_whole(tmp_path, layout):
    """``iter_embedding_blocks`` streams an .npz (stored or deflated) or .npy a block of rows at a time and
    yields what ``load_embedding_set`` loads."""
    rng = np.random.default_rng(2)
    uids = np.array([f"{i:032x}" for i in range(1000)])
    img, txt = (
        rng.standard_normal((1000, 16)).astype(np.float32),
        rng.standard_normal((1000, 16)).astype(np.float16),
    )
    path = str(tmp_path / layout)
    keys = ("img",) if layout.endswith(".npy") else ("img", "txt")
    if layout == "plain.npy":
        np.save(path, img)
        np.save(str(tmp_path / "plain.uid.npy"), uids)
    else:
        (np.savez if layout == "stored.npz" else np.savez_compressed)(path, uid=uids, img=img, txt=txt)
    want_uids, want = E.load_embedding_set(path, keys)
    blocks = list(E.iter_embedding_blocks(path, keys, rows=300))
    assert [len(u) for u, _ in blocks] == [300, 300, 300, 100]
    assert [u for b, _ in blocks for u in b] == want_uids
    for k in keys:
        np.testing.assert_array_equal(np.concatenate([a[k] for _, a in blocks]), want[k])
