"""DataComp baseline filters on hand-written rows: every rule's edges, reasons, registry and file formats."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common.config import ConfigError
from pipeline.common.storage import LOCAL
from pipeline.config import FilterConfig
from pipeline.filters import base
from pipeline.filters import datacomp as F
from pipeline.filters import embedding as C
from pipeline.filters import specs as P
from pipeline.filters import text_based as T
from pipeline.schema import uids_to_u8pairs
from pipeline.subsets.uid_files import write_subsets

U = [f"{i:032x}" for i in range(8)]


def eight_rows() -> pa.Table:
    """One row per edge of the basic filter; ``lang`` is a precomputed fastText column."""
    return pa.table(
        {
            "uid": U,
            "text": [
                "a dog on grass",  # keep: 4 words; 200x600 = aspect exactly 3.0, min exactly 200
                "two words",  # exactly 2 words
                "a b c",  # 3 words but exactly 5 characters
                "a bb c",  # 6 characters, but 199 px
                "a cat on a mat",  # aspect 601/200 > 3
                None,  # null text
                "ein Hund im Garten",  # German
                "the red circle here",  # null width
            ],
            "original_width": pa.array([200, 640, 640, 199, 200, 640, 640, None], pa.int64()),
            "original_height": pa.array([600, 480, 480, 300, 601, 480, 480, 480], pa.int64()),
            "lang": ["en", "en", "en", "en", "en", "", "de", "en"],
            "clip_b32_similarity_score": [0.30, 0.28, 0.2799, None, 0.5, 0.1, 0.35, 0.28],
            "clip_l14_similarity_score": [0.9, 0.8, 0.7, 0.6, 0.5, None, None, None],
        }
    )


def test_no_filter_keeps_everything():
    r = F.no_filter(eight_rows())
    assert r.keep.all() and set(r.reason) == {""}


def test_english_top1_label():
    r = F.english(eight_rows())
    assert r.keep.tolist() == [True] * 5 + [False, False, True]
    assert r.reason.tolist()[5:7] == ["not_english", "not_english"]


def test_basic_edges_and_reasons():
    r = F.basic(eight_rows())
    assert r.reason.tolist() == [
        "",
        "too_few_words",
        "too_short",
        "too_small",
        "too_elongated",
        "not_english",
        "not_english",
        "missing_size",
    ]
    assert r.keep.tolist() == [True] + [False] * 7
    assert r.counts() == {
        "kept": 1,
        "too_few_words": 1,
        "too_short": 1,
        "too_small": 1,
        "too_elongated": 1,
        "not_english": 2,
        "missing_size": 1,
    }


def test_basic_counts_words_like_python_split():
    t = pa.table(
        {
            "uid": U[:4],
            "text": ["  padded   two  ", "three\twords\nhere", "", " "],
            "original_width": [300] * 4,
            "original_height": [300] * 4,
            "lang": ["en"] * 4,
        }
    )
    assert F.basic(t).reason.tolist() == ["too_few_words", "", "too_few_words", "too_few_words"]


def test_basic_takes_a_dict_of_numpy_arrays():
    t = eight_rows()
    d = {c: np.asarray(t.column(c).to_pylist(), dtype=object) for c in t.column_names}
    assert F.basic(d).reason.tolist() == F.basic(t).reason.tolist()


def test_english_with_the_real_model():
    from pipeline.filters.language import LanguageId

    t = pa.table(
        {
            "uid": U[:4],
            "text": [
                "A brown dog is running across a green field in the park.",
                "Ein brauner Hund läuft über eine grüne Wiese im Park.",
                "Un chien brun court à travers un champ vert dans le parc.",
                "一只棕色的狗在公园的绿色草地上奔跑。",
            ],
        }
    )
    res = P.apply_filters(t, FilterConfig(names=["english"]), lang=LanguageId())
    assert res["english"].keep.tolist() == [True, False, False, False]


def test_missing_language_labels_is_a_clear_error():
    t = eight_rows().drop_columns(["lang"])
    with pytest.raises(base.FilterError, match="'basic' needs language labels"):
        F.basic(t)


def test_random_subset_exact_size_deterministic_order_free():
    rng = np.random.default_rng(0)
    uids = [f"{v:032x}" for v in rng.integers(0, 2**62, size=1000)]
    t = pa.table({"uid": uids})
    a = F.random_subset(t, 0.3, seed=7)
    assert a.keep.sum() == 300 and set(a.reason[~a.keep]) == {"random_not_selected"}
    perm = rng.permutation(1000)
    b = F.random_subset(t.take(perm), 0.3, seed=7)
    assert {uids[i] for i in perm[b.keep]} == {u for u, k in zip(uids, a.keep, strict=True) if k}
    assert (F.random_subset(t, 0.3, seed=8).keep != a.keep).any()
    small = F.random_subset(t, 0.1, seed=7).keep
    assert small.sum() == 100 and not (small & ~a.keep).any()  # nested
    assert F.random_subset(pa.table({"uid": uids[:5]}), 0.5, seed=0).keep.sum() == 3  # round half up: 2.5 → 3
    with pytest.raises(base.FilterError, match="fraction"):
        F.random_subset(t, 1.5, seed=0)


def test_uid_hash_is_a_function_of_the_string_only():
    uids = [f"{i:032x}" for i in range(20)]
    sliced = pa.array(uids).slice(10, 5)  # an Arrow slice shares its parent's buffers
    assert F.uid_hash(sliced, 3).tolist() == F.uid_hash(uids[10:15], 3).tolist()
    mixed = ["abc", None, "a longer uid than 32 characters, oddly", uids[0]]
    assert F.uid_hash(mixed, 3)[3] == F.uid_hash(uids[:1], 3)[0]
    assert F.uid_hash(mixed, 3)[1] == F.uid_hash([""], 3)[0]


def test_clip_threshold_inclusive_and_nulls():
    r = F.clip_score_threshold(eight_rows(), "clip_b32_similarity_score", 0.28)
    assert r.keep.tolist() == [True, True, False, False, True, False, True, True]
    assert r.reason[2] == "clip_score_below_threshold" and r.reason[3] == "missing_clip_score"


def test_clip_fraction_threshold_uses_all_rows():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, np.nan, np.nan, np.nan, np.nan, np.nan])
    # N = 10 rows (nulls count), int(10 * 0.3) = 3 → the 4th largest; over the 5 scored rows it'd be 0.8.
    assert F.clip_fraction_threshold(scores, 0.3) == 0.6
    full = np.random.default_rng(1).random(1000)
    assert F.clip_fraction_threshold(full, 0.3) == -np.sort(-full)[int(len(full) * 0.3)]  # DataComp's formula
    # Past the scored rows DataComp's threshold is NaN (no row kept); all_scored keeps every scored row.
    assert np.isnan(F.clip_fraction_threshold(scores, 0.9))
    assert F.clip_fraction_threshold(scores, 0.9, nan_cut="all_scored") == 0.5
    assert np.isnan(F.clip_fraction_threshold(np.full(3, np.nan), 0.5, nan_cut="all_scored"))
    with pytest.raises(base.FilterError, match="no threshold"):
        F.clip_fraction_threshold(scores, 1.0)  # index N: DataComp's code fails there


def test_clip_fraction_on_a_table_and_with_pool_scores():
    t = eight_rows()
    r = F.clip_score_fraction(t, "clip_l14_similarity_score", 0.3)  # int(8·0.3)=2 → 0.7
    assert r.keep.tolist() == [True, True, True, False, False, False, False, False]
    part = t.slice(2, 3)  # a slice of the pool must use the pool's threshold
    pool = np.array([0.9, 0.8, 0.7, 0.6, 0.5, np.nan, np.nan, np.nan])
    assert F.clip_score_fraction(part, "clip_l14_similarity_score", 0.3, pool).keep.tolist() == [
        True,
        False,
        False,
    ]


def test_all_null_clip_column_drops_everything_as_missing():
    t = pa.table({"uid": U[:3], "clip_l14_similarity_score": pa.nulls(3)})
    r = F.clip_score_fraction(t, "clip_l14_similarity_score", 0.3)
    assert r.reason.tolist() == ["missing_clip_score"] * 3


def test_laion2b_is_english_and_b32_threshold():
    r = F.laion2b(eight_rows(), 0.28)
    assert r.keep.tolist() == [True, True, False, False, True, False, False, True]
    assert r.reason.tolist()[2:7] == [
        "clip_score_below_threshold",
        "missing_clip_score",
        "",
        "not_english",
        "not_english",
    ]


def test_concepts_file_formats(tmp_path):
    path = tmp_path / "lemmas.txt"
    path.write_text(
        "# ImageNet-21k style\ndog, domestic dog, Canis familiaris\n\nhot_dog\nice cream\nt-shirt\n"
    )
    assert T.load_concepts(str(path)) == [
        "dog",
        "domestic dog",
        "Canis familiaris",
        "hot_dog",
        "ice cream",
        "t-shirt",
    ]


def test_concept_match_word_boundaries():
    concepts = ["dog", "hot_dog", "ice cream", "T-shirt", "Canis familiaris"]
    texts = [
        "A Dog!",
        "two dogs",  # plural is another word: no match
        "doghouse",
        "a hot-dog stand",
        "I scream for ice   cream",
        "white t shirt",
        "ends with ice",  # ...and the next row starts with "cream": no match across rows
        "cream puff",
        None,
        "canis familiaris, the dog",
    ]
    assert T.concept_match(texts, concepts).tolist() == [
        True,
        False,
        False,
        True,
        True,
        True,
        False,
        False,
        False,
        True,
    ]


def test_text_based_needs_english_and_a_concept():
    t = pa.table(
        {
            "uid": U[:3],
            "text": ["a dog in the snow", "der Hund", "a tall building"],
            "lang": ["en", "de", "en"],
        }
    )
    r = T.text_based_lemmas(t, ["dog", "hund"])
    assert r.reason.tolist() == ["", "not_english", "no_concept_match"]


def centroid_inputs():
    centroids = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=np.float32)
    vectors = np.array([[0.9, 0.1], [0.1, 0.9], [-0.8, 0.2], [0.7, -0.7]], dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return centroids, vectors


def test_nearest_centroid_and_membership():
    centroids, vectors = centroid_inputs()
    assert C.nearest_centroid(vectors, centroids * 5).tolist() == [
        0,
        1,
        2,
        0,
    ]  # a common scale changes nothing
    # Raw dot product, not cosine: a longer centroid wins a vector nearer (in angle) to a shorter one.
    assert C.nearest_centroid(vectors[:1], centroids * [[1.0], [10.0], [1.0]]).tolist() == [1]
    assert C.target_centroid_ids(vectors[:2], centroids).tolist() == [0, 1]
    t = pa.table({"uid": U[:5]})
    emb = C.Embeddings(uids=[U[3], U[0], U[1], U[2]], vectors=vectors)  # U[4] has none
    r = F.centroid_membership(t, emb, centroids, np.array([0, 2]))
    assert r.reason.tolist() == ["not_in_centroid", "", "", "", "missing_embedding"]


def test_image_based_from_files_via_registry(tmp_path):
    centroids, vectors = centroid_inputs()
    t = pa.table(
        {
            "uid": U[:5],
            "text": ["a dog on grass", "a dog on grass", "dog", "a cat sitting", "a red car parked"],
            "lang": ["en", "en", "en", "de", "en"],
        }
    )
    np.save(tmp_path / "centroids.npy", centroids)
    (tmp_path / "ids.txt").write_text("0\n1\n")
    np.savez(tmp_path / "emb.npz", uid=uids_to_u8pairs(U[:4]), embedding=vectors)
    np.save(tmp_path / "emb.npy", vectors)
    np.save(tmp_path / "emb.uid.npy", np.array(U[:4]))
    pq.write_table(pa.table({"uid": U[:4], "embedding": vectors.tolist()}), tmp_path / "emb.parquet")
    expected = ["", "", "too_few_words", "not_english", "missing_embedding"]
    for name in ("emb.npz", "emb.npy", "emb.parquet"):
        files = f"embeddings_file={tmp_path / name},centroids_file={tmp_path / 'centroids.npy'}"
        cfg = FilterConfig(names=[f"image_based:{files},centroid_ids_file={tmp_path / 'ids.txt'}"])
        assert P.apply_filters(t, cfg)["image_based"].reason.tolist() == expected, name
    # row 1 embeds near centroid 1; a target set without it drops the row
    np.save(tmp_path / "ids.npy", np.array([0]))
    cfg = FilterConfig(names=[f"image_based:{files},centroid_ids_file={tmp_path / 'ids.npy'}"])
    assert P.apply_filters(t, cfg)["image_based"].reason[1] == "not_in_centroid"


def test_intersections_and_first_failing_reason():
    cfg = FilterConfig(
        names=[
            "basic",
            "clip_score:fraction=0.3",
            "basic+clip_score:fraction=0.3",
            "clip_score:fraction=0.3+basic",
        ]
    )
    res = P.apply_filters(eight_rows(), cfg)
    both = res["basic+clip_score"]
    assert both.keep.tolist() == (res["basic"].keep & res["clip_score"].keep).tolist()
    assert both.reason[3] == "too_small" and res["clip_score+basic"].reason[3] == "clip_score_below_threshold"
    assert both.reason[7] == "missing_size" and res["clip_score+basic"].reason[7] == "missing_clip_score"


def test_clip_score_config_fraction_wins_else_threshold():
    t = eight_rows()
    by_fraction = P.apply_filters(t, FilterConfig(names=["clip_score:fraction=0.3"]))["clip_score"]
    assert by_fraction.keep.sum() == 3
    cfg = FilterConfig(names=["clip_score:fraction=0.0,threshold=0.55"])
    assert P.apply_filters(t, cfg)["clip_score"].keep.sum() == 4


def test_unknown_filter_and_missing_inputs_are_named():
    t = eight_rows()
    with pytest.raises(ValueError, match="unknown filter 'bogus' in 'basic\\+bogus'"):
        P.apply_filters(t, FilterConfig(names=["basic+bogus"]))
    with pytest.raises(base.FilterError, match="'basic' needs column 'original_width'"):
        P.apply_filters(t.drop_columns(["original_width"]), FilterConfig(names=["basic"]))
    with pytest.raises(base.FilterError, match="'laion2b' needs column 'clip_b32_similarity_score'"):
        P.apply_filters(t.drop_columns(["clip_b32_similarity_score"]), FilterConfig(names=["laion2b"]))
    with pytest.raises(base.FilterError, match="synsets_file="):
        P.apply_filters(t, FilterConfig(names=["text_based"]))
    with pytest.raises(base.FilterError, match="concepts_file="):
        P.apply_filters(t, FilterConfig(names=["text_based:method=lemmas"]))
    with pytest.raises(base.FilterError, match="embeddings_file="):
        P.apply_filters(t, FilterConfig(names=["image_based"]))
    missing = FilterConfig(
        names=[
            "image_based:embeddings_file=/nonexistent/emb.npz,centroids_file=/nonexistent/c.npy,"
            "centroid_ids_file=/nonexistent/ids.txt"
        ]
    )
    with pytest.raises(base.FilterError, match="'image_based'.*emb.npz"):
        P.apply_filters(t, missing)
    no_file = FilterConfig(names=["text_based:method=lemmas,concepts_file=/nonexistent/lemmas.txt"])
    with pytest.raises(base.FilterError, match="'text_based': file not found: /nonexistent/lemmas.txt"):
        P.apply_filters(t, no_file)
    no_wordnet = FilterConfig(names=[f"text_based:synsets_file={__file__},wordnet=/nonexistent/wn"])
    with pytest.raises(base.FilterError, match="WordNet file not found: /nonexistent/wn/index.noun"):
        P.apply_filters(t, no_wordnet)


def test_lang_argument_labels_override_and_length_checked():
    t = eight_rows()
    res = P.apply_filters(t, FilterConfig(names=["english"]), lang=["en"] * 8)
    assert res["english"].keep.all()
    with pytest.raises(base.FilterError, match="7 language labels for 8 rows"):
        P.apply_filters(t, FilterConfig(names=["english"]), lang=["en"] * 7)


def test_spec_parameters_override_the_defaults_per_part():
    t = eight_rows()
    cfg = FilterConfig(
        names=[
            "basic+clip_score:fraction=0.5",
            "clip_score:threshold=0.55,label=clip55",
            "random:fraction=0.5",
        ],
    )
    res = P.apply_filters(t, cfg)
    assert list(res) == ["basic+clip_score", "clip55", "random"]
    half = F.clip_score_fraction(t, "clip_l14_similarity_score", 0.5)
    assert res["basic+clip_score"].reason.tolist() == base.intersect(F.basic(t), half).reason.tolist()
    assert res["clip55"].keep.sum() == 4  # threshold= without fraction= is DataComp's threshold rule
    assert res["random"].keep.sum() == 4
    spec = P.parse_filter_spec("basic+clip_score:fraction=0.3,column=clip_b32_similarity_score")
    assert spec.parts == (
        ("basic", {}),
        ("clip_score", {"fraction": 0.3, "column": "clip_b32_similarity_score"}),
    )
    assert spec.label == "basic+clip_score" and spec.name == "basic+clip_score"
    assert P.required_columns([spec]) == {
        "text",
        "original_width",
        "original_height",
        "clip_b32_similarity_score",
    }


def test_spec_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"names\[0\].fracton: unknown parameter of clip_score"):
        P.apply_filters(eight_rows(), FilterConfig(names=["basic+clip_score:fracton=0.3"]))
    with pytest.raises(ConfigError, match=r"filters\[0\]\.seed: input should be a valid integer"):
        P.parse_filter_specs(["random:seed=1.5"])
    with pytest.raises(ConfigError, match=r"filters\[1\].label: subset name 'basic' used twice"):
        P.parse_filter_specs(["basic", "basic"])
    with pytest.raises(ConfigError, match=r"filters\[0\]: expected key=value"):
        P.parse_filter_specs(["basic+clip_score:fraction"])


def test_random_control_copies_a_size_given_from_elsewhere():
    scores = pa.table({"uid": U, "ok": [True] * 7 + [False], "csd": np.linspace(0, 1, 8)})
    specs = P.parse_filter_specs("random_same_size:of=basic,seed=2", known=["basic"])
    res = P.run_filters(scores, specs, sizes={"basic": 3})["random_same_size"]
    assert res.keep.sum() == 3 and res.reason[7] == "image_failed"
    with pytest.raises(ConfigError, match="no filter labelled 'basic'"):
        P.parse_filter_specs("random_same_size:of=basic")


def test_write_subsets_keeps_eligible_rows_sorted(tmp_path):
    t = eight_rows()
    res = P.apply_filters(t, FilterConfig(names=["english"]))
    eligible = np.array([True, False] * 4)
    paths = {"english": str(tmp_path / "subsets" / "english.npy")}
    assert write_subsets(LOCAL, t, res, paths, eligible) == {"english": 3}
    arr = np.load(paths["english"])
    assert (
        arr.dtype == np.dtype("u8,u8")
        and arr.tolist() == np.sort(uids_to_u8pairs([U[0], U[2], U[4]])).tolist()
    )
