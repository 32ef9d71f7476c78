"""Row-level rules decided before download, the run fingerprint and part commits: pure, no Ray."""

from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pytest

from pipeline import schema as S
from pipeline.common.config import ConfigError, merge
from pipeline.common.storage import LOCAL
from pipeline.config import BuildConfig, DedupeConfig, DownloadConfig, FilterConfig
from pipeline.filters.specs import check_build_filters
from pipeline.source import run_state as R
from pipeline.source.row_checks import CAPTION_STATUS, ROW_KEY, caption_status, pre_statuses, prepare_batch
from pipeline.subsets.uid_files import kept_uids, to_subset_array

GOOD = "0123456789abcdef0123456789abcdef"
# Every way ``int(x, 16)`` would have read a uid that is not DataComp's spelling.
BAD_UIDS = [
    GOOD.upper(),
    "0123456789ABCDEF0123456789abcdef",
    "-" + GOOD[1:],
    "+" + GOOD[1:],
    "0x" + GOOD[2:],
    " " + GOOD[1:],
    GOOD[:-1] + " ",
    GOOD + "\n",
    GOOD[:16] + "_" + GOOD[17:],
    "٠" + GOOD[1:],  # ARABIC-INDIC DIGIT ZERO
    "０" + GOOD[1:],  # FULLWIDTH DIGIT ZERO
    GOOD[:-1],
    GOOD + "0",
    "g" * 32,
    "",
    None,
    12345,
]


@pytest.mark.parametrize("uid", BAD_UIDS, ids=repr)
def test_strict_uid_rule_and_packing_refuses_other_spellings(uid):
    assert not S.is_valid_uid(uid)
    with pytest.raises(ValueError, match="not a uid"):
        S.uids_to_u8pairs([GOOD, uid])
    if isinstance(uid, str):
        with pytest.raises(ValueError):
            to_subset_array([uid])


def test_packing_matches_the_128_bit_value():
    uids = [GOOD, "f" * 32, "0" * 31 + "1"]
    pairs = S.uids_to_u8pairs(uids)
    for u, p in zip(uids, pairs, strict=True):
        assert (int(p["f0"]) << 64) | int(p["f1"]) == int(u, 16)
    assert S.u8pairs_to_uids(pairs) == uids


def test_filter_subsets_list_each_uid_once():
    table = pa.table({S.UID: [GOOD, "a" * 32, GOOD, "b" * 32]})

    class Keep:
        keep = np.array([True, True, True, False])

    got = kept_uids(table, Keep())
    assert got.tolist() == sorted({GOOD, "a" * 32})


def test_transient_statuses_are_one_set():
    yes = [
        "timeout",
        "connection_error",
        "truncated",
        "deadline",
        "http_429",
        "http_500",
        "http_503",
        "http_599",
    ]
    no = ["http_404", "http_403", "too_large", "http_5000", "http_50"]
    assert all(S.is_transient(S.failed_download(r)) for r in yes)
    assert not any(S.is_transient(S.failed_download(r)) for r in no)
    for final in (S.STATUS_SUCCESS, S.STATUS_OPTED_OUT, S.failed_resize("corrupt"), None, ""):
        assert not S.is_transient(final)


# --- captions -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,status",
    [
        (b"a red circle", ""),
        ("caf\u00e9 \u2603".encode(), ""),
        (b"", ""),
        (None, "invalid_caption:null"),
        (b"\xff\xfe bad", "invalid_caption:invalid_utf8"),
        (b"lone \xed\xa0\x80 surrogate", "invalid_caption:invalid_utf8"),
        (b"x" * 101, "invalid_caption:too_long"),
        (b"x" * 100, ""),
    ],
)
def test_caption_status(raw, status):
    got, text = caption_status(raw, max_bytes=100)
    assert got == status
    assert text == (raw.decode() if not status else "")


def _string_column_with_raw_bytes(values: list[bytes | None]) -> pa.Array:
    """A *string* column holding arbitrary bytes, as a parquet written by a careless tool may."""
    return pa.array(values, pa.binary()).view(pa.string())


@pytest.mark.parametrize("kind", ["string", "binary", "large_binary"])
def test_prepare_batch_decodes_or_rejects_every_caption(kind):
    raw = [b"ok", b"\xc3\x28", None, b"y" * 50, b"\xed\xb2\x80"]
    text = _string_column_with_raw_bytes(raw) if kind == "string" else pa.array(raw, getattr(pa, kind)())
    uids = [f"{i:032x}" for i in range(5)]
    batch = pa.table({S.UID: uids, S.URL: [f"http://h/{i}" for i in range(5)], S.TEXT: text, "x": range(5)})
    out = prepare_batch(batch, max_caption_bytes=40)
    assert out.column(S.TEXT).to_pylist() == ["ok", "", "", "", ""]
    assert out.column(CAPTION_STATUS).to_pylist() == [
        "",
        "invalid_caption:invalid_utf8",
        "invalid_caption:null",
        "invalid_caption:too_long",
        "invalid_caption:invalid_utf8",
    ]
    assert out.column("x").to_pylist() == list(range(5))
    assert S.SchemaError is not None and S.check_metadata_schema(batch.schema) == []


def test_binary_uid_bytes_never_raise_and_are_invalid():
    uid = _string_column_with_raw_bytes([b"\xff" * 32, GOOD.encode()])
    batch = pa.table({S.UID: uid, S.URL: ["http://h/a", "http://h/b"], S.TEXT: ["a", "b"]})
    out = prepare_batch(batch, 100)
    st = pre_statuses(out.select([S.UID, S.URL, CAPTION_STATUS, ROW_KEY]))
    assert st.tolist() == [S.STATUS_INVALID_UID, ""]


def _narrow(rows):
    uids, urls, caps = zip(*rows, strict=True)
    batch = pa.table({S.UID: list(uids), S.URL: list(urls), S.TEXT: pa.array(list(caps), pa.binary())})
    return prepare_batch(batch, 100).select([S.UID, S.URL, CAPTION_STATUS, ROW_KEY])


def test_pre_statuses_one_per_row_and_canonical_row_independent_of_order():
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    rows = [
        (a, "http://h/1", b"one"),
        (a, "http://h/2", b"two"),  # repeated uid, another row
        (a.upper(), "http://h/9", b"x"),  # another spelling of a's value
        (b, "http://h/1", b"same url as a"),  # duplicate URL of a's canonical row?
        (c, "http://h/3", None),
        (c, "http://h/4", b"ok"),  # the repeated uid's other row has a usable caption
    ]
    want = None
    for seed in range(6):
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        st = pre_statuses(_narrow([rows[i] for i in order]))
        got = sorted((rows[i][0], rows[i][1], s) for i, s in zip(order, st, strict=True))
        want = want or got
        assert got == want  # the same row of each uid goes on, whatever order the rows come in
    statuses = [s for *_, s in want]
    assert len(statuses) == len(rows)
    assert statuses.count(S.STATUS_INVALID_UID) == 1
    assert statuses.count(S.STATUS_DUPLICATE_UID) == 2
    live = [(u, url) for u, url, s in want if s == ""]
    assert len({u for u, _ in live}) == len(live)  # at most one row per uid goes on


# --- config ranges --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (DownloadConfig, "image_size", 0),
        (DownloadConfig, "image_size", -5),
        (DownloadConfig, "threads_per_actor", 0),
        (DownloadConfig, "timeout_s", -1.0),
        (DownloadConfig, "timeout_s", math.nan),
        (DownloadConfig, "timeout_s", math.inf),
        (DownloadConfig, "max_bytes", -1),
        (DownloadConfig, "max_pixels", 0),
        (DownloadConfig, "jpeg_quality", 500),
        (DownloadConfig, "jpeg_quality", 0),
        (DownloadConfig, "retries", -1),
        (FilterConfig, "names", ["random:fraction=5.0"]),
        (FilterConfig, "names", ["random:fraction=0.0"]),
        (FilterConfig, "names", ["clip_score:fraction=-0.1"]),
        (FilterConfig, "names", ["clip_score:threshold=nan"]),
        (FilterConfig, "names", ["laion2b:threshold=inf"]),
        (FilterConfig, "names", ["basic", "basic"]),
        (FilterConfig, "names", [""]),
        (DedupeConfig, "phash_threshold", 65),
        (BuildConfig, "part_size", 0),
        (BuildConfig, "samples_per_shard", 0),
        (BuildConfig, "max_caption_bytes", 0),
        (BuildConfig, "download_actors", -1),
        (BuildConfig, "download_cpus", math.nan),
    ],
)
def test_config_ranges_checked_at_construction(cls, field, value):
    with pytest.raises(ConfigError, match=field):
        cls(**{field: value})


def test_config_range_error_through_set_names_the_nested_field():
    with pytest.raises(ConfigError, match=r"download\.image_size"):
        merge(BuildConfig(), {"download": {"image_size": 0}})


def test_filters_checked_against_the_metadata_columns():
    cols = [S.UID, S.URL, S.TEXT]
    with pytest.raises(
        S.SchemaError, match=r"meta\.parquet: filter 'basic' \(basic\) needs metadata column 'original_width'"
    ):
        check_build_filters(FilterConfig(names=["no_filter", "basic"]), cols, "meta.parquet")
    with pytest.raises(S.SchemaError, match="clip_l14_similarity_score"):
        check_build_filters(FilterConfig(names=["clip_score"]), cols, "m")
    with pytest.raises(ConfigError, match="unknown filter 'bsaic'"):
        check_build_filters(FilterConfig(names=["bsaic"]), cols, "m")
    with pytest.raises(ConfigError, match="model scores"):
        check_build_filters(FilterConfig(names=["csd_best"]), cols, "m")
    check_build_filters(FilterConfig(names=["no_filter", "english", "random"]), cols, "m")


# --- fingerprint and commits --------------------------------------------------------------------------


def test_fingerprint_refuses_another_pool_and_names_what_differs(tmp_path):
    cfg = BuildConfig(output=str(tmp_path / "run"))
    logs: list[str] = []
    R.claim(cfg, R.fingerprint(cfg, ["a" * 32, "b" * 32]), LOCAL, logs.append)
    R.claim(cfg, R.fingerprint(cfg, ["a" * 32, "b" * 32]), LOCAL, logs.append)  # the same pool resumes
    with pytest.raises(R.FingerprintMismatch, match=r"pool\.uids_sha256") as exc:
        R.claim(cfg, R.fingerprint(cfg, ["a" * 32, "c" * 32]), LOCAL, logs.append)
    assert "\n" not in str(exc.value) and "overwrite=true" in str(exc.value)
    # The parts are ranges of the live rows in read order: another order or other live rows are another pool.
    with pytest.raises(R.FingerprintMismatch, match=r"pool\.uids_sha256"):
        R.claim(cfg, R.fingerprint(cfg, ["b" * 32, "a" * 32]), LOCAL, logs.append)
    with pytest.raises(R.FingerprintMismatch, match=r"pool\.live_sha256"):
        R.claim(cfg, R.fingerprint(cfg, ["a" * 32, "b" * 32], np.array([True, False])), LOCAL, logs.append)
    other = merge(cfg, {"download": {"image_size": 256}, "part_size": 7})
    with pytest.raises(
        R.FingerprintMismatch, match=r"download\.image_size: 512 → 256.*part_size|part_size.*image_size"
    ):
        R.claim(other, R.fingerprint(other, ["a" * 32, "b" * 32]), LOCAL, logs.append)
    # Cosmetic fields and derived settings never refuse; the latter are logged.
    knobs = {"threads_per_actor": 3, "timeout_s": 60.0, "retries": 5, "part_deadline_s": 900.0}
    cosmetic = merge(cfg, {"download": knobs, "download_actors": 9, "num_cpus": 1})
    R.claim(cosmetic, R.fingerprint(cosmetic, ["a" * 32, "b" * 32]), LOCAL, logs.append)
    derived = merge(cfg, {"filters": {"names": ["no_filter"]}, "samples_per_shard": 3})
    R.claim(derived, R.fingerprint(derived, ["a" * 32, "b" * 32]), LOCAL, logs.append)
    assert any("filters.names" in line for line in logs) and any("samples_per_shard" in line for line in logs)


def test_overwrite_discards_the_old_run_but_not_pool_or_manifest(tmp_path):
    out = tmp_path / "run"
    cfg = BuildConfig(output=str(out))
    R.claim(cfg, R.fingerprint(cfg, ["a" * 32]), LOCAL, print)
    for rel in (
        "work/parts/part-000000.abc.tar",
        "shards/00000000.tar",
        "subsets/basic.npy",
        "pool/x.jpg",
        "manifest.json",
    ):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"x")
    with pytest.raises(R.FingerprintMismatch):
        R.claim(cfg, R.fingerprint(cfg, ["b" * 32]), LOCAL, print)
    R.claim(merge(cfg, {"overwrite": True}), R.fingerprint(cfg, ["b" * 32]), LOCAL, print)
    assert (
        not (out / "shards/00000000.tar").exists() and not (out / "work/parts/part-000000.abc.tar").exists()
    )
    assert not (out / "subsets/basic.npy").exists()
    assert (out / "pool/x.jpg").exists() and (out / "manifest.json").exists()
    R.claim(cfg, R.fingerprint(cfg, ["b" * 32]), LOCAL, print)  # now the recorded pool is b's


def test_parts_without_fingerprint_are_refused(tmp_path):
    parts = tmp_path / "run" / "work" / "parts"
    parts.mkdir(parents=True)
    (parts / "part-000000.tar").write_bytes(b"")
    (parts / "part-000000.done").write_bytes(b"")
    cfg = BuildConfig(output=str(tmp_path / "run"))
    with pytest.raises(R.FingerprintMismatch, match="without a fingerprint"):
        R.claim(cfg, R.fingerprint(cfg, ["a" * 32]), LOCAL, print)


def test_only_committed_tokens_count_and_the_rest_is_removed(tmp_path):
    d = str(tmp_path)
    for part, token in ((0, "aa"), (0, "bb"), (1, "cc"), (2, "dd")):
        for ext in ("tar", "parquet"):
            (tmp_path / f"part-{part:06d}.{token}.{ext}").write_bytes(b"")
    R.commit(d, 0, "bb", LOCAL)  # part 0: a later run's files; "aa" is an actor that outlived its driver
    R.commit(d, 1, "cc", LOCAL)
    (tmp_path / "part-000001.cc.parquet").unlink()  # a marker whose files are incomplete does not count
    (tmp_path / "part-000003.done").write_bytes(b"")  # an empty marker (older format) does not count
    done = R.committed(d, LOCAL)
    assert done == {0: "bb"}
    assert R.remove_uncommitted(d, LOCAL) == 6  # aa ×2, cc.tar, dd ×2 and part 1's marker
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".done")) == [
        "part-000000.bb.parquet",
        "part-000000.bb.tar",
    ]
