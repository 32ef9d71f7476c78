"""WordNet's first sense of a caption word, as DataComp's ``text_based`` baseline looks it up.

DataComp (``baselines/apply_filter.py``) splits a caption on whitespace (``str.split()``) and keeps it
when, for some word, the *first* synset nltk returns (``wordnet.synsets(word)[0]``, nltk 3.8.1 with
WordNet 3.0) has an offset in the ImageNet-21k synset list (``n01234567`` → 1234567; the offset alone
is compared, whatever part of speech the synset has). That lookup, reproduced here over WordNet's own
files with nltk's rules:

- the word is lower-cased (``str.lower``); nothing else is stripped, so "dog," finds no synset;
- parts of speech in the order noun, verb, adjective, adverb; within one, the base forms morphy finds
  in their order, and within one form the synsets in ``index.<pos>`` order (WordNet's sense order);
- morphy: a word listed in ``<pos>.exc`` gives itself and its listed base forms, those in the index;
  otherwise the word and its one-step suffix rewrites (nouns: s→, ses→s, ves→f, xes→x, zes→z,
  ches→ch, shes→sh, men→man, ies→y; verbs: s→, ies→y, es→e, es→, ed→e, ed→, ing→e, ing→;
  adjectives: er→, est→, er→e, est→e; adverbs none), those in the index; if none is, rewrites of
  the rewrites, round after round, until some round finds one or nothing is left to rewrite.

Only ``index.{noun,verb,adj,adv}`` and ``{noun,verb,adj,adv}.exc`` are read: an offset is the synset's
identity, so the data files are not needed. ``WordNet.load`` takes a WordNet 3.0 ``dict`` directory
(Debian's ``wordnet-base``: ``/usr/share/wordnet``) or nltk's ``wordnet.zip`` (``nltk.download
("wordnet")`` puts it under ``~/nltk_data/corpora/``).
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterable

from pipeline.common.errors import InputError
from pipeline.common.storage import LOCAL, Storage

POS_ORDER = ("n", "v", "a", "r")  # nltk's POS_LIST
_FILES = {"n": "noun", "v": "verb", "a": "adj", "r": "adv"}
_RULES = {
    "n": (
        ("s", ""),
        ("ses", "s"),
        ("ves", "f"),
        ("xes", "x"),
        ("zes", "z"),
        ("ches", "ch"),
        ("shes", "sh"),
        ("men", "man"),
        ("ies", "y"),
    ),
    "v": (
        ("s", ""),
        ("ies", "y"),
        ("es", "e"),
        ("es", ""),
        ("ed", "e"),
        ("ed", ""),
        ("ing", "e"),
        ("ing", ""),
    ),
    "a": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
    "r": (),
}


class WordNetError(InputError, ValueError):
    """A WordNet file is missing or malformed; the message names it."""


def parse_index(lines: Iterable[str], name: str = "index") -> dict[str, list[int]]:
    """``index.<pos>`` → lemma → synset offsets in sense order (license lines start with a space)."""
    out: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        if line.startswith(" ") or not line.strip():
            continue
        f = line.split()
        try:
            n_synsets, n_pointers = int(f[2]), int(f[3])
            offsets = [int(v) for v in f[6 + n_pointers : 6 + n_pointers + n_synsets]]
        except (IndexError, ValueError) as exc:
            raise WordNetError(f"{name}, line {i + 1}: {exc}") from exc
        if len(offsets) != n_synsets or n_synsets < 1:
            raise WordNetError(f"{name}, line {i + 1}: expected {n_synsets} synset offsets")
        out[f[0]] = offsets
    return out


def parse_exceptions(lines: Iterable[str]) -> dict[str, list[str]]:
    """``<pos>.exc`` → inflected form → base forms."""
    return {f[0]: f[1:] for f in (line.split() for line in lines) if f}


class WordNet:
    """First-sense lookup over parsed WordNet files (``load`` reads them)."""

    def __init__(self, index: dict[str, dict[str, list[int]]], exceptions: dict[str, dict[str, list[str]]]):
        self.index = index  # pos → lemma → offsets
        self.exceptions = exceptions  # pos → form → base forms
        self._first: dict[str, int | None] = {}

    @classmethod
    def load(cls, path: str, store: Storage = LOCAL) -> WordNet:
        """From a WordNet ``dict`` directory or nltk's ``wordnet.zip`` (local or on ``store``)."""
        read = _reader(path, store)
        index, exceptions = {}, {}
        for pos, suffix in _FILES.items():
            index[pos] = parse_index(read(f"index.{suffix}"), f"{path}: index.{suffix}")
            exceptions[pos] = parse_exceptions(read(f"{suffix}.exc"))
        return cls(index, exceptions)

    def morphy(self, form: str, pos: str) -> list[str]:
        """nltk's ``_morphy``: the base forms of ``form`` for ``pos`` that the index lists, in order."""
        known = self.index[pos]
        rules = _RULES[pos]

        def rewrite(forms: list[str]) -> list[str]:
            return [f[: len(f) - len(old)] + new for f in forms for old, new in rules if f.endswith(old)]

        def listed(forms: list[str]) -> list[str]:
            return list(dict.fromkeys(f for f in forms if f in known))

        if form in self.exceptions[pos]:
            return listed([form, *self.exceptions[pos][form]])
        forms = rewrite([form])
        found = listed([form, *forms])
        while not found and forms:
            forms = rewrite(forms)
            found = listed(forms)
        return found

    def synset_offsets(self, word: str) -> list[tuple[str, int]]:
        """(pos, offset) of every synset nltk's ``synsets(word)`` returns, in its order."""
        lemma = word.lower()
        return [(p, o) for p in POS_ORDER for form in self.morphy(lemma, p) for o in self.index[p][form]]

    def first_offset(self, word: str) -> int | None:
        """The offset of ``synsets(word)[0]``, None when the word has no synset (cached per word)."""
        if word not in self._first:
            lemma = word.lower()
            self._first[word] = next(
                (self.index[p][forms[0]][0] for p in POS_ORDER if (forms := self.morphy(lemma, p))), None
            )
        return self._first[word]


def _reader(path: str, store: Storage):
    """A function name → lines for the WordNet files under ``path`` (a directory or nltk's zip)."""
    if path.endswith(".zip"):
        archive = zipfile.ZipFile(io.BytesIO(store.read_bytes(path)))
        members = {os.path.basename(n): n for n in archive.namelist()}

        def read_zip(name: str) -> list[str]:
            if name not in members:
                raise WordNetError(f"{path}: no {name} in the archive")
            return archive.read(members[name]).decode("utf-8").splitlines()

        return read_zip

    def read_dir(name: str) -> list[str]:
        full = f"{path.rstrip('/')}/{name}"
        try:
            return store.read_bytes(full).decode("utf-8").splitlines()
        except FileNotFoundError as exc:
            raise WordNetError(f"WordNet file not found: {full}") from exc

    return read_dir


def load_synset_ids(lines: Iterable[str]) -> set[int]:
    """ImageNet-21k WordNet ids (``n01234567`` per line, DataComp's ``imagenet21k_wordnet_ids.txt``; plain
    offsets also accepted) → offsets. Blank lines and ``#`` comments are skipped."""
    out = set()
    for i, line in enumerate(lines):
        t = line.strip()
        if not t or t.startswith("#"):
            continue
        try:
            out.add(int(t[1:] if t[0].isalpha() else t))
        except ValueError as exc:
            raise WordNetError(f"synset id file, line {i + 1}: {t!r} is not n<offset>") from exc
    return out
