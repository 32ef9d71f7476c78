"""Training ingest: augmentation, the decode/augment/tokenize stage, masked variants, shards on Ray."""

from __future__ import annotations

import io
import tarfile
import time

import numpy as np
import pytest

from pipeline.ingest import augment as A
from pipeline.ingest.masking import round_half_up
from pipeline.ingest.tokenizer import train_tokenizer
from pipeline.ingest.transforms import DecodeAugment, MaskedVariants, TrainCollate, window_shuffle
from tests.fixtures.train_shards import demo_samples, write_demo_shards
from training.config import DataConfig

SAMPLES = demo_samples(64, size=48)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([s["txt"] for s in SAMPLES], vocab_size=300)


def raw_batch(samples):
    return {
        "key": np.array([s["__key__"] for s in samples], dtype=object),
        "jpg": np.array([s["jpg"] for s in samples], dtype=object),
        "txt": np.array([s["txt"] for s in samples], dtype=object),
    }


# --- augmentation -------------------------------------------------------------------------------------


def test_random_resized_crop_box_respects_area_and_bounds() -> None:
    rng = np.random.default_rng(0)
    for h, w in [(100, 100), (60, 200), (300, 40)]:
        for _ in range(50):
            x0, y0, x1, y1 = A.random_resized_crop_box(h, w, (0.8, 1.0), (3 / 4, 4 / 3), rng)
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
    boxes = [A.random_resized_crop_box(200, 200, (0.8, 1.0), (0.75, 4 / 3), rng) for _ in range(200)]
    fractions = np.array([(b[2] - b[0]) * (b[3] - b[1]) / 200**2 for b in boxes])
    assert fractions.min() >= 0.78 and fractions.max() <= 1.0


# --- decode / augment / tokenize ----------------------------------------------------------------------


def test_decode_augment_drops_and_counts_bad_images(tokenizer) -> None:
    batch = raw_batch(SAMPLES[:8])
    batch["jpg"][3] = b"not an image"
    batch["jpg"][5] = SAMPLES[5]["jpg"][:40]  # truncated JPEG
    stage = DecodeAugment(32, 16, tokenizer, DataConfig(), seed=0)
    out = stage(batch)
    assert stage.bad_images == 2
    # uint8 crops leave the decode task; the pixel operations' parameters travel beside them.
    assert out["image"].shape == (6, 32, 32, 3) and out["image"].dtype == np.uint8
    assert out["jitter"].shape == (6, 4) and out["jitter_order"].shape == (6, 4) and out["gray"].shape == (6,)
    assert out["tokens"].shape == (6, 16) and out["tokens"].dtype == np.int64
    assert list(out["key"]) == [k for i, k in enumerate(batch["key"]) if i not in (3, 5)]
    assert out["image"].std() > 10  # pictures, not a constant fill


def test_each_recipe_ships_only_its_pixel_parameters(tokenizer) -> None:
    from training.config import TRAIN_PRESETS

    batch = raw_batch(SAMPLES[:4])
    datacomp = TRAIN_PRESETS["datacomp-small"].data
    assert datacomp.crop_scale == (0.9, 1.0) and datacomp.color_jitter_p == 0 and datacomp.grayscale_p == 0
    out = DecodeAugment(32, 16, tokenizer, datacomp, seed=0)(batch)
    assert set(out) == {"key", "image", "tokens"}  # open_clip's default: a crop, no jitter, no grayscale
    prolip = TRAIN_PRESETS["prolip-b16"].data
    assert prolip.crop_scale == (0.8, 1.0) and prolip.color_jitter == (0.32, 0.32, 0.32, 0.08)
    assert prolip.color_jitter_p == 0.8 and prolip.grayscale_p == 0.2
    assert set(DecodeAugment(32, 16, tokenizer, prolip, seed=0)(batch)) == {
        "key", "image", "tokens", "jitter", "jitter_order", "gray"
    }  # fmt: skip


def test_decode_without_augmentation_is_deterministic_centre_crop(tokenizer) -> None:
    batch = raw_batch(SAMPLES[:4])
    cfg = DataConfig(augment=False)
    a = DecodeAugment(32, 16, tokenizer, cfg, seed=1)(batch)
    b = DecodeAugment(32, 16, tokenizer, cfg, seed=2)(batch)
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["tokens"][0], tokenizer.encode_batch([SAMPLES[0]["txt"]], 16)[0])


def test_window_shuffle_is_a_seeded_permutation() -> None:
    import pyarrow as pa

    table = pa.table({"key": [f"{i:032x}" for i in range(50)], "v": list(range(50))})
    a, b = window_shuffle(table, seed=3), window_shuffle(table, seed=3)
    assert a.column("v").to_pylist() == b.column("v").to_pylist()
    assert sorted(a.column("v").to_pylist()) == list(range(50)) and a.column("v").to_pylist() != list(
        range(50)
    )


# --- masked variants ----------------------------------------------------------------------------------


def masked_batch(tokenizer, n=64, start=0):
    samples = demo_samples(n, size=16, seed=7, start=start)
    return {
        "key": np.array([s["__key__"] for s in samples], dtype=object),
        "image": np.zeros((n, 16, 16, 3), np.uint8),
        "tokens": tokenizer.encode_batch([s["txt"] + " with extra words here" for s in samples], 16),
    }


def masker(tokenizer, **kw):
    return MaskedVariants(64, tokenizer.pad_id, tokenizer.end_id, tokenizer.mask_id, **kw)


def test_masking_selection_and_mask_fractions(tokenizer) -> None:
    batch = masked_batch(tokenizer)
    out = masker(tokenizer)(batch, epoch=0)
    sel = out["selected"]
    assert sel.dtype == bool and sel.sum() == 8  # 12.5% of 64
    tokens, masked = batch["tokens"], out["masked_tokens"]
    assert out["keep_idx"].shape == (64, 16) and out["keep_idx"].dtype == np.int64  # 25% of 64 patches
    np.testing.assert_array_equal(masked[~sel], tokens[~sel])
    for row in np.flatnonzero(sel):
        content = (tokens[row] != tokenizer.pad_id) & (tokens[row] != tokenizer.end_id)
        n_masked = int((masked[row] == tokenizer.mask_id).sum())
        assert n_masked == round_half_up(0.75 * content.sum())
        np.testing.assert_array_equal(masked[row][~content], tokens[row][~content])  # pad/end untouched
        keep = out["keep_idx"][row]
        assert len(set(keep)) == 16 and (np.diff(keep) > 0).all() and keep.max() < 64


def test_masking_is_reproducible_and_order_free(tokenizer) -> None:
    batch = masked_batch(tokenizer)
    m = masker(tokenizer, seed=5)
    a, b = m(batch, epoch=2), m(batch, epoch=2)
    for k in ("selected", "masked_tokens", "keep_idx"):
        np.testing.assert_array_equal(a[k], b[k])
    perm = np.random.default_rng(0).permutation(64)
    c = m({k: v[perm] for k, v in batch.items()}, epoch=2)
    for k in ("selected", "masked_tokens", "keep_idx"):
        np.testing.assert_array_equal(c[k], a[k][perm])
    other = m(batch, epoch=3)
    assert other["selected"].sum() == 8 and not np.array_equal(other["selected"], a["selected"])


def test_dropped_text_variants_remove_the_masked_tokens(tokenizer) -> None:
    from training.train.loop import DroppedTextVariants

    batch = masked_batch(tokenizer)
    masked = masker(tokenizer, seed=3)(batch, epoch=1)
    out = DroppedTextVariants(masker(tokenizer, seed=3), tokenizer.mask_id, tokenizer.pad_id)(batch, epoch=1)
    for k in ("selected", "keep_idx"):  # the same samples and image variants
        np.testing.assert_array_equal(out[k], masked[k])
    sel, pad = out["selected"], tokenizer.pad_id
    np.testing.assert_array_equal(out["masked_tokens"][~sel], batch["tokens"][~sel])
    for row in np.flatnonzero(sel):
        holes = masked["masked_tokens"][row] == tokenizer.mask_id
        # the unmasked words and the end token, in their order
        kept = [t for t in batch["tokens"][row][~holes] if t != pad]
        dropped = out["masked_tokens"][row]
        assert holes.sum() > 0 and tokenizer.mask_id not in dropped and len(dropped) == 16
        assert list(dropped[: len(kept)]) == kept and (dropped[len(kept) :] == pad).all()


def test_train_collate_emits_fixed_shape_tensors(tokenizer) -> None:
    import torch

    out = TrainCollate(masker(tokenizer), epoch=0)(masked_batch(tokenizer, n=32))
    assert out["images"].shape == (32, 16, 16, 3) and out["images"].dtype == torch.uint8
    assert out["tokens"].dtype == out["masked_tokens"].dtype == out["keep_idx"].dtype == torch.int64
    assert out["selected"].dtype == torch.bool and int(out["selected"].sum()) == 4
    assert torch.equal(out["masked_index"], out["selected"].nonzero().squeeze(1))
    plain = TrainCollate(None, epoch=0)(masked_batch(tokenizer, n=8))
    assert set(plain) == {"images", "tokens"}


def test_trimmed_padding_encodes_exactly_like_the_full_context(tokenizer) -> None:
    import torch

    from training.model.config import model_config
    from training.model.two_tower import ProLIP

    batch = masked_batch(tokenizer, n=16)
    batch["tokens"] = tokenizer.encode_batch([f"a {c} square" for c in "ab" * 8], 24)
    full = TrainCollate(masker(tokenizer), epoch=0)(batch)
    cut = TrainCollate(masker(tokenizer), epoch=0, pad_id=tokenizer.pad_id)(batch)
    width = int((batch["tokens"] != tokenizer.pad_id).sum(1).max())
    assert full["tokens"].shape[1] == 24 and width < 24
    assert cut["tokens"].shape[1] == cut["masked_tokens"].shape[1] == width
    assert torch.equal(cut["tokens"], full["tokens"][:, :width])
    torch.manual_seed(0)
    model = ProLIP(model_config("tiny", context_length=24, vocab_size=tokenizer.vocab_size)).eval()
    with torch.no_grad():
        for a, b in zip(
            model.encode_text(full["masked_tokens"]), model.encode_text(cut["masked_tokens"]), strict=True
        ):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- shards on Ray ------------------------------------------------------------------------------------


def _damage(path: str, out: str, how: str) -> None:
    data = open(path, "rb").read()
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        offsets = [m.offset for m in t.getmembers()]
    cut = offsets[len(offsets) // 2 // 3 * 3]  # a member boundary at a sample start
    if how == "truncate":
        data = data[:cut]
    else:
        data = data[:cut] + b"\xff" * 512 + data[cut + 512 :]
    open(out, "wb").write(data)


def test_shard_reader_keeps_intact_samples_and_counts_damaged_shards(tmp_path) -> None:
    from pipeline.shards.reader import ShardReader, TooManyBadShards, list_shards

    good = write_demo_shards(tmp_path / "src", n_shards=3, per_shard=20, size=48)
    _damage(good[1], good[1], "truncate")  # cut at a member boundary: tarfile reads it as complete
    _damage(good[2], good[2], "corrupt")
    assert list_shards(str(tmp_path / "src")) == sorted(good)
    assert list_shards(",".join(good[::-1])) == sorted(good)
    reported: dict[str, str] = {}

    def report(path: str, error: str) -> int:
        reported.setdefault(path, error)
        return len(reported)

    reader = ShardReader(max_bad_shards=2, report=report, chunk_rows=8)
    tables = [t for p in good for t in reader(p)]
    assert all(t.num_rows <= 8 for t in tables) and tables[0].column_names == ["key", "jpg", "txt"]
    rows = sum(t.num_rows for t in tables)
    assert 20 < rows < 60 and sorted(reported) == sorted(good[1:])
    assert tables[0].column("txt").to_pylist()[0] == demo_samples(1, size=48)[0]["txt"]
    with_json = next(ShardReader(with_json=True)(good[0]))
    assert with_json.column_names == ["key", "jpg", "txt", "json"]
    strict = ShardReader(max_bad_shards=0)
    with pytest.raises(TooManyBadShards, match="max_bad_shards=0"):
        list(strict(good[2]))


@pytest.mark.ray
def test_dataset_counts_damaged_shards_and_stops_past_the_limit(ray_local, tmp_path, tokenizer) -> None:
    import ray

    from pipeline.common.storage import LOCAL
    from pipeline.ingest.dataset import build_train_dataset, read_counters, start_counters, stop_counters
    from pipeline.shards.reader import TooManyBadShards

    good = write_demo_shards(tmp_path / "src", n_shards=3, per_shard=20, size=48)
    _damage(good[1], good[1], "truncate")  # cut at a member boundary: tarfile reads it as complete
    _damage(good[2], good[2], "corrupt")
    cfg = DataConfig(shards=str(tmp_path / "src"), max_bad_shards=2, decode_cpus=0.5, shuffle_window=16,
                     decode_batch_size=16)  # fmt: skip
    name = start_counters()
    ds = build_train_dataset(cfg, LOCAL, tokenizer, 32, 16, name)
    batches = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    rows = sum(len(b["key"]) for b in batches)
    assert 20 < rows < 60  # the good shard plus the intact part of each damaged one
    assert batches[0]["image"].shape[1:] == (32, 32, 3)
    counts = read_counters(name)
    assert counts["bad_shards"] == 2 and counts["bad_images"] == 0
    assert sorted(counts["bad_shard_paths"]) == sorted(good[1:])
    stop_counters(name)  # one actor per training must not outlive it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name)
        except ValueError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"counters actor {name} still alive after stop_counters")

    strict = build_train_dataset(
        DataConfig(**{**cfg.__dict__, "max_bad_shards": 0}), LOCAL, tokenizer, 32, 16, start_counters()
    )
    with pytest.raises((TooManyBadShards, ray.exceptions.RayTaskError)) as err:
        strict.materialize()
    assert "max_bad_shards=0" in str(err.value) and "0000000" in str(err.value)


@pytest.mark.ray
def test_ingest_tasks_reserve_the_decode_cpus_unless_reads_are_set(ray_local, tmp_path, tokenizer) -> None:
    """``data.read_cpus`` None = ``data.decode_cpus``: no extra read workers to start again every epoch
    (docs/decisions/0085-shard-reads-reserve-the-decode-cpus.md); a value of its own is kept."""
    from pipeline.common.storage import LOCAL
    from pipeline.ingest.dataset import build_train_dataset

    write_demo_shards(tmp_path / "src", n_shards=2, per_shard=8, size=48)

    def cpus_per_stage(cfg: DataConfig) -> dict[str, float]:
        ds, out, todo = build_train_dataset(cfg, LOCAL, tokenizer, 32, 16), {}, []
        todo.append(ds._logical_plan.dag)
        while todo:
            op = todo.pop()
            todo += op.input_dependencies
            out[op.name] = op.ray_remote_args.get("num_cpus")
        return out

    base = {"shards": str(tmp_path / "src"), "shuffle_window": 8, "decode_batch_size": 8, "decode_cpus": 0.5}
    assert DataConfig().read_cpus is None
    stages = cpus_per_stage(DataConfig(**base))
    assert len(stages) == 3 and set(stages.values()) == {0.5}, stages  # read, window shuffle, decode
    stages = cpus_per_stage(DataConfig(**base, read_cpus=0.25))
    assert sorted(stages.values()) == [0.25, 0.25, 0.5], stages


def test_decoded_cache_serves_every_kept_row_in_a_fresh_order(tokenizer) -> None:
    from pipeline.ingest.transforms import DecodedCache

    cache = DecodedCache()
    collate = TrainCollate(None, epoch=0, cache=cache)
    collate(masked_batch(tokenizer, n=16))
    collate(masked_batch(tokenizer, n=16, start=16))
    collate(masked_batch(tokenizer, n=5, start=32))  # the first epoch's remainder is kept too
    cache.seal()
    assert cache.sealed and cache.n_rows == 37
    seen = []
    for batch in cache.batches(8, np.random.default_rng(0), lambda b: b):
        assert len(batch["key"]) == 8
        seen += list(batch["key"])
    assert len(seen) == 32 and len(set(seen)) == 32  # 4 full batches, no row twice; 5 wait for next time
    again = [k for b in cache.batches(8, np.random.default_rng(0), lambda b: b) for k in b["key"]]
    other = [k for b in cache.batches(8, np.random.default_rng(1), lambda b: b) for k in b["key"]]
    assert again == seen and other != seen
    shuffled = DecodedCache()  # the same rows arriving in another order: the same cached epochs
    for part in (masked_batch(tokenizer, n=5, start=32), masked_batch(tokenizer, n=32)):
        TrainCollate(None, epoch=0, cache=shuffled)(part)
    shuffled.seal()
    assert [k for b in shuffled.batches(8, np.random.default_rng(0), lambda b: b) for k in b["key"]] == seen
    out = next(cache.batches(8, np.random.default_rng(0), TrainCollate(masker(tokenizer), epoch=3)))
    assert int(out["selected"].sum()) == 1  # masked variants drawn for the cached epoch
    with pytest.raises(RuntimeError, match="cache_decoded"):
        DecodedCache().seal()


def test_masked_variants_unchanged_through_the_uint8_ingest(tokenizer) -> None:
    """Decode (uint8) → collate (masked variants) → device augment → the model's masked forward: 12.5% of the
    batch has a variant, 75% of its content tokens are [MASK], 25% of its patches kept, and the variant's
    image is the same augmented picture as the full sample's."""
    import torch

    from pipeline.ingest.device_augment import DeviceAugment
    from training.losses.objectives import ProLIPLossConfig
    from training.losses.registry import build_loss_from_config
    from training.model.config import model_config
    from training.model.two_tower import ProLIP
    from training.train.step import TrainModule

    cfg = model_config(
        "tiny", image_size=32, patch_size=8, vocab_size=tokenizer.vocab_size, context_length=16
    )
    data = DataConfig()  # ProLIP's recipe: jitter and grayscale on
    decoded = DecodeAugment(32, 16, tokenizer, data, seed=1)(raw_batch(SAMPLES[:32]))
    m = MaskedVariants(cfg.n_patches, tokenizer.pad_id, tokenizer.end_id, tokenizer.mask_id)
    batch = TrainCollate(m, epoch=0)(decoded)
    sel, idx = batch["selected"], batch["masked_index"]
    assert int(sel.sum()) == 4 == len(idx)  # 12.5% of 32
    assert batch["keep_idx"].shape == (32, 4)  # 25% of 16 patches
    tokens, masked = batch["tokens"].numpy(), batch["masked_tokens"].numpy()
    for row in idx.tolist():
        content = (tokens[row] != tokenizer.pad_id) & (tokens[row] != tokenizer.end_id)
        content &= tokens[row] != (tokenizer.start_id if tokenizer.start_id is not None else -1)
        assert (masked[row] == tokenizer.mask_id).sum() == round_half_up(0.75 * content.sum())
    images = DeviceAugment(data.mean, data.std)(batch)
    loss, spec = build_loss_from_config(ProLIPLossConfig())
    torch.manual_seed(0)
    module = TrainModule(ProLIP(cfg), loss, spec).eval()
    seen = []
    module.model.visual.embed_patches = (lambda f: lambda x, k: seen.append((x, k)) or f(x, k))(
        module.model.visual.embed_patches
    )
    with torch.no_grad():
        out = module(images, batch["tokens"], batch["masked_tokens"], batch["keep_idx"], idx)
    assert out["mu_v_masked"].shape == (4, cfg.embed_dim) and out["mu_t_masked"].shape == (4, cfg.embed_dim)
    (full, none), (variant, kept) = seen
    assert none is None and torch.equal(variant, full[idx]) and torch.equal(kept, batch["keep_idx"][idx])
