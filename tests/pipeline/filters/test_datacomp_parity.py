"""Each DataComp baseline on hand-built rows that pin one rule each; the expected uid sets are written out
from DataComp's rules (baselines/apply_filter.py, nltk 3.8.1's WordNet reader, fastText's tokenizer),
not computed by our code. Face blur parity against img2dataset's own blurrer is in tests/pipeline/download/test_resize.py.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.common.config import ConfigError
from pipeline.config import FilterConfig
from pipeline.filters import datacomp as F
from pipeline.filters import specs as P
from pipeline.filters import wordnet as WN

# --- text_based: a WordNet in WordNet's own file format ------------------------------------------------
# index.<pos> lines: lemma pos synset_cnt p_cnt [ptr...] sense_cnt tagsense_cnt offset... (sense order).
# The ImageNet-21k list below holds dog.n.01, goose, box, ice_cream and run.v.01; not bank.n.01 (the
# sloping land), not run.n.01, not the first senses of ice, cream, hot.
INDEX = {
    "noun": [
        "  1 This software and database is being provided to you, the LICENSEE, by",
        "  2 Princeton University under the following license.",
        "bank n 2 2 @ ~ 2 1 09213565 08420278",
        "box n 1 1 @ 1 0 02883344",
        "cream n 1 1 @ 1 0 07923748",
        "dog n 2 2 @ ~ 2 1 02084071 10114209",
        "goose n 1 1 @ 1 0 01855672",
        "ice n 1 1 @ 1 0 14915184",
        "ice_cream n 1 1 @ 1 0 07614500",
        "run n 1 1 @ 1 0 00189565",
    ],
    "verb": [
        "dog v 1 1 @ 1 0 02005948",
        "hurry v 1 1 @ 1 0 02084071",  # a verb synset whose offset equals dog.n.01's number
        "run v 1 1 @ 1 0 01926311",
    ],
    "adj": ["hot a 1 1 & 1 0 01247240"],
    "adv": [],
}
EXC = {"noun": ["geese goose"], "verb": ["ran run"], "adj": [], "adv": []}
IN21K = ["n02084071", "n01855672", "n02883344", "n07614500", "n01926311", ""]


@pytest.fixture()
def wordnet_files(tmp_path):
    wn_dir = tmp_path / "dict"
    wn_dir.mkdir()
    for suffix, lines in INDEX.items():
        (wn_dir / f"index.{suffix}").write_text("".join(f"{line}\n" for line in lines))
    for suffix, lines in EXC.items():
        (wn_dir / f"{suffix}.exc").write_text("".join(f"{line}\n" for line in lines))
    ids = tmp_path / "imagenet21k_wordnet_ids.txt"
    ids.write_text("\n".join(IN21K))
    return str(wn_dir), str(ids)


TEXT_ROWS = [  # (caption, fastText label, DataComp keeps?)
    ("two dogs on a sofa", "en", True),  # plural: morphy s→ gives dog, first sense dog.n.01
    ("DOG", "en", True),  # synsets() lower-cases
    ("my dog, asleep", "en", False),  # "dog," keeps its comma: no synset
    ("(dog)", "en", False),
    ("the river bank", "en", False),  # first sense of bank is not in the list (the second is)
    ("a fun run", "en", False),  # the noun comes first: run.n.01, not run.v.01
    ("she ran", "en", True),  # verb.exc ran → run; no noun "ran": run.v.01 is in the list
    ("hurry up", "en", True),  # offsets are compared whatever the part of speech
    ("geese flying", "en", True),  # noun.exc geese → goose
    ("boxes", "en", True),  # xes→x: box
    ("dogses", "en", True),  # no round-one rewrite is listed; round two (dogs → dog) is
    ("ice cream cone", "en", False),  # split on whitespace: ice, cream separately
    ("ice_cream cone", "en", True),
    ("hot\u00a0dog", "en", True),  # str.split() splits on U+00A0: "hot", "dog"
    ("a\ndog", "en", True),
    ("Hund dog", "de", False),  # not English
    (None, "", False),
]


def _table(rows, extra=None):
    uids = [f"{i:032x}" for i in range(len(rows))]
    cols = {"uid": uids, "text": [r[0] for r in rows], "lang": [r[1] for r in rows]}
    return pa.table({**cols, **(extra or {})}), uids


def test_text_based_matches_datacomp_on_pinned_words(wordnet_files):
    wn_dir, ids = wordnet_files
    t, uids = _table(TEXT_ROWS)
    cfg = FilterConfig(names=[f"text_based:wordnet={wn_dir},synsets_file={ids}"])
    result = P.apply_filters(t, cfg)["text_based"]
    expected = {u for u, r in zip(uids, TEXT_ROWS, strict=True) if r[2]}
    assert {u for u, k in zip(uids, result.keep, strict=True) if k} == expected
    assert result.reason[5] == "no_in21k_synset" and result.reason[15] == "not_english"


def test_wordnet_lookup_orders_parts_of_speech_and_senses(wordnet_files):
    wn = WN.WordNet.load(wordnet_files[0])
    assert wn.synset_offsets("Dogs") == [("n", 2084071), ("n", 10114209), ("v", 2005948)]
    assert wn.synset_offsets("bank") == [("n", 9213565), ("n", 8420278)]
    assert wn.first_offset("run") == 189565 and wn.first_offset("ran") == 1926311
    assert wn.first_offset("hotter") is None  # no adj.exc entry, and "hott" / "hotte" are not lemmas
    assert WN.load_synset_ids(IN21K) == {2084071, 1855672, 2883344, 7614500, 1926311}


def test_wordnet_loads_from_nltk_style_zip(wordnet_files, tmp_path):
    import zipfile

    wn_dir, _ = wordnet_files
    archive = tmp_path / "wordnet.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for suffix in ("noun", "verb", "adj", "adv"):
            z.write(f"{wn_dir}/index.{suffix}", f"wordnet/index.{suffix}")
            z.write(f"{wn_dir}/{suffix}.exc", f"wordnet/{suffix}.exc")
    assert WN.WordNet.load(str(archive)).first_offset("geese") == 1855672
    with pytest.raises(WN.WordNetError, match="line 1"):
        WN.parse_index(["dog n two 1 @ 2 1 02084071"], "index.noun")


# --- image_based: fastText word counts and raw dot products -------------------------------------------
# Centroid 1 is 10× longer than the others; the target set is {1}. Every embedding below points at
# 82° from centroid 1 or nearer: its raw dot product with centroid 1 wins, though cosine would pick 0.
CENTROIDS = np.array([[1.0, 0.0], [0.0, 10.0], [-1.0, 0.0]], np.float32)
IMAGE_ROWS = [  # (caption, label, DataComp keeps?)
    ("a photo of a dog", "en", True),
    ("hello\n", "en", True),  # fastText: "hello" + one token per newline = 2 > 1 (str.split(): 1)
    ("dog\u00a0house", "en", False),  # U+00A0 does not separate for fastText: 1 token
    ("a\ndogs", "en", True),  # 3 tokens, 6 characters
    ("a\ndog", "en", False),  # 3 tokens but only 5 characters
    ("\n\n\n\n\n\n", "en", True),  # 6 newline tokens, 6 characters (lid.176 calls blank text en)
    ("big\x0bdog", "en", True),  # \v separates for fastText
    ("hund katze", "de", False),
]


def test_image_based_matches_datacomp_on_pinned_captions_and_centroids():
    vec = np.array([0.99, 0.14], np.float32)
    vectors = np.tile(vec / np.linalg.norm(vec), (len(IMAGE_ROWS), 1))
    vectors[-2] = [0.995, -0.0998]  # nearest (any metric) to centroid 0, not a target
    rows = IMAGE_ROWS[:-2] + [("a lovely dog", "en", False), IMAGE_ROWS[-1]]
    t, uids = _table(rows)
    r = F.image_based(t, vectors, CENTROIDS, np.array([1]))
    expected = {u for u, row in zip(uids, rows, strict=True) if row[2]}
    assert {u for u, k in zip(uids, r.keep, strict=True) if k} == expected
    assert r.reason[2] == "too_few_words" and r.reason[4] == "too_short" and r.reason[6] == "not_in_centroid"


def test_fasttext_token_counts_follow_its_tokenizer():
    texts = [
        "a b",
        "a\nb",
        "\n",
        "a  b\n\nc",
        "a\u00a0b",
        "a\u2003b c",
        " x ",
        "a\x00b",
        "a\x0bb\x0cc\rd",
        "",
        None,
    ]
    assert F.fasttext_token_counts(texts).tolist() == [2, 3, 1, 5, 1, 2, 1, 2, 4, 0, 0]


# --- CLIP score: the column's dtype, the fraction cut ---------------------------------------------------


def test_fixed_threshold_compares_in_the_column_dtype():
    below = np.nextafter(np.float32(0.32), np.float32(0))
    f32 = np.array([0.32, below, 0.33, np.nan], np.float32)  # float32(0.32) = 0.319999992… < 0.32
    t, uids = _table([("x", "en", None)] * 4, {"clip_l14_similarity_score": f32})
    keep = P.apply("clip_score:threshold=0.32", t).keep
    assert {u for u, k in zip(uids, keep, strict=True) if k} == {uids[0], uids[2]}  # = float32(0.32) kept
    f64 = pa.array(f32.astype(np.float64))  # the same numbers in a float64 column compare in float64
    t64, _ = _table([("x", "en", None)] * 4, {"clip_l14_similarity_score": f64})
    assert P.apply("clip_score:threshold=0.32", t64).keep.tolist() == [False, False, True, False]


def test_laion2b_threshold_in_float32_and_cld3_english():
    scores = np.array([0.28, 0.28, 0.28, np.nextafter(np.float32(0.28), np.float32(0))], np.float32)
    texts = [
        "This text is written in English.",
        "shoes",
        "Ein Hund im Garten",
        "This text is written in English.",
    ]
    t = pa.table({"uid": [f"{i:032x}" for i in range(4)], "text": texts, "clip_b32_similarity_score": scores})
    assert P.apply("laion2b", t).keep.tolist() == [True, False, False, False]  # CLD3 calls "shoes" French
    fasttext = P.apply("laion2b:language_model=fasttext", t, lang=["en", "en", "de", "en"])
    assert fasttext.keep.tolist() == [True, True, False, False]


def test_fraction_cut_among_nulls_keeps_nothing_and_fraction_one_is_refused():
    scores = pa.array([0.9, 0.8, None, None], pa.float32())
    t, uids = _table([("x", "en", None)] * 4, {"clip_l14_similarity_score": scores})
    # N = 4 rows: int(4·0.25) = 1 → the 2nd largest (0.8); int(4·0.5) = 2 → a null: threshold NaN.
    assert P.apply("clip_score:fraction=0.25", t).keep.tolist() == [True, True, False, False]
    cut = P.apply("clip_score:fraction=0.5", t)
    assert not cut.keep.any() and cut.reason.tolist()[:2] == ["clip_score_cut_among_missing"] * 2
    assert P.apply("clip_score:fraction=0.5,nan_cut=all_scored", t).keep.tolist() == [
        True,
        True,
        False,
        False,
    ]
    with pytest.raises(ConfigError, match="fraction: input should be less than 1"):  # refused at the spec
        P.apply("clip_score:fraction=1.0", t)
    with pytest.raises(ConfigError, match="fraction: input should be less than 1"):
        P.parse_filter_specs(FilterConfig(names=["clip_score:fraction=1.0"]).names)
