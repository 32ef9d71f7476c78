"""Caption tokenizer: HF ``tokenizers`` BPE wrapped with the special ids the model and masking need.

- ``train_tokenizer`` trains a byte-level BPE (GPT-2/CLIP style: every string is encodable, no UNK) with
  NFKC + lowercase normalisation (CLIP lowercases too) on an iterable of captions, offline. Special
  tokens come first: ``<pad>`` = 0 (``ModelConfig.pad_id`` default), ``<end>`` = 1, ``<mask>`` = 2.
- ``TextTokenizer.from_file`` wraps any ``tokenizer.json`` (CLIP's, SigLIP's, ...). Pad/end/mask tokens
  are given by name or detected among common spellings; a missing pad or mask token is *added* (CLIP's BPE
  has neither; padding with a real token id would hide that token from attention), which grows
  ``vocab_size`` — build the model config from ``tok.vocab_size`` and ``tok.pad_id``.
- ``clip_bpe_tokenizer()`` builds CLIP's BPE (``bpe_simple_vocab_16e6.txt.gz`` from the ``open_clip_torch``
  wheel, or a path to it) as a ``tokenizers`` model with open_clip's cleaning (``clean="lower"``: ftfy, HTML
  unescape twice, whitespace collapse, lower-case), split pattern and start/end tokens: ``encode_batch(texts,
  77)`` gives open_clip's ids (its pad 0 aside: ours is an added ``<pad>``; spelled special tokens stay text).
- ``encode_batch(texts, C)`` → int64 (B, C): ``[start?] tokens… <end> <pad>…``, truncated so that the end
  token (never masked: ProLIP §4.1, docs/math.md "Objective") always fits; a caption cannot inject ``<pad>``.
"""

from __future__ import annotations

import gzip
import html
import importlib.metadata
import json
import os
import string
import tempfile
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_IDS_FILE = "special_tokens.json"

PAD_TOKEN, END_TOKEN, MASK_TOKEN = "<pad>", "<end>", "<mask>"
_PAD_CANDIDATES = (PAD_TOKEN, "[PAD]", "<|pad|>", "<|padding|>")
_END_CANDIDATES = (END_TOKEN, "<|endoftext|>", "</s>", "[SEP]", "<eos>", "[EOS]")
_MASK_CANDIDATES = (MASK_TOKEN, "[MASK]", "<|mask|>")

CLIP_VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
CLIP_START, CLIP_END = "<start_of_text>", "<end_of_text>"
# CLIP's pre-tokenisation pattern (Radford et al. 2021, as open_clip applies it after cleaning).
_CLIP_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_CLIP_N_MERGES = 49152 - 256 - 2  # merges used by CLIP: vocab 49408 = 2·256 bytes + merges + 2 specials


def _basic_clean(text: str) -> str:
    import ftfy  # a runtime dependency; imported here so tokenizers without cleaning do not need it

    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


def _clean_lower(text: str) -> str:
    return " ".join(_basic_clean(text).split()).lower()


def _clean_canonicalize(text: str) -> str:
    """SigLIP-style: basic clean, ``_`` → space, punctuation removed, lower-case, whitespace collapsed."""
    text = _basic_clean(text).replace("_", " ").translate(str.maketrans("", "", string.punctuation))
    return " ".join(text.lower().split())


CLEANERS: dict[str, Callable[[str], str]] = {"lower": _clean_lower, "canonicalize": _clean_canonicalize}


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus pad/end/mask (and optional start) token ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pad_id: int,
        end_id: int,
        mask_id: int,
        start_id: int | None = None,
        clean: str | None = None,
    ) -> None:
        ids = {"pad": pad_id, "end": end_id, "mask": mask_id}
        if len(set(ids.values())) != 3:
            raise ValueError(f"pad, end and mask ids must differ, got {ids}")
        if clean is not None and clean not in CLEANERS:
            raise ValueError(f"clean: unknown {clean!r} (known: {', '.join(CLEANERS)})")
        self.clean = clean
        self._tokenizer = tokenizer
        # Captions are data: "<pad>" typed in a caption must not become the pad id.
        self._tokenizer.encode_special_tokens = True
        self._pad_id, self._end_id, self._mask_id, self._start_id = pad_id, end_id, mask_id, start_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def end_id(self) -> int:
        return self._end_id

    @property
    def mask_id(self) -> int:
        return self._mask_id

    @property
    def start_id(self) -> int | None:
        return self._start_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[str, int | None]:
        return {
            "pad_id": self.pad_id,
            "end_id": self.end_id,
            "mask_id": self.mask_id,
            "start_id": self.start_id,
        }

    def to_state(self) -> dict:
        """Plain data (JSON string, special ids, cleaning) for Ray configs, actors and ``save``."""
        return {"json": self._tokenizer.to_str(), "ids": {**self.special_ids, "clean": self.clean}}

    @classmethod
    def from_state(cls, state: dict) -> TextTokenizer:
        return cls._from_ids(Tokenizer.from_str(state["json"]), state["ids"])

    @classmethod
    def _from_ids(cls, tokenizer: Tokenizer, ids: dict) -> TextTokenizer:
        start = ids.get("start_id")
        return cls(
            tokenizer,
            pad_id=int(ids["pad_id"]),
            end_id=int(ids["end_id"]),
            mask_id=int(ids["mask_id"]),
            start_id=None if start is None else int(start),
            clean=ids.get("clean"),
        )

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        pad_token: str | None = None,
        end_token: str | None = None,
        mask_token: str | None = None,
        start_token: str | None = None,
        clean: str | None = None,
    ) -> TextTokenizer:
        """Wrap a ``tokenizer.json``; tokens not named are detected, and a missing pad/mask is added.

        ``start_token`` (e.g. CLIP's ``<|startoftext|>``) is prepended only when given; ``clean`` names
        a text cleaning applied before encoding (``CLEANERS``: ``lower``, ``canonicalize``).
        """
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file missing: {path}")
        tokenizer = Tokenizer.from_file(str(path))
        end_id = _find_token(tokenizer, end_token, _END_CANDIDATES, "end", path)
        if end_id is None:
            raise ValueError(f"{path}: no end token among {_END_CANDIDATES}; pass end_token=")
        pad_id = _find_token(tokenizer, pad_token, _PAD_CANDIDATES, "pad", path)
        if pad_id is None:
            pad_id = _add_special(tokenizer, PAD_TOKEN)
        mask_id = _find_token(tokenizer, mask_token, _MASK_CANDIDATES, "mask", path)
        if mask_id is None:
            mask_id = _add_special(tokenizer, MASK_TOKEN)
        start_id = None
        if start_token is not None:
            start_id = _find_token(tokenizer, start_token, (), "start", path)
        return cls(tokenizer, pad_id=pad_id, end_id=end_id, mask_id=mask_id, start_id=start_id, clean=clean)

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` and ``special_tokens.json`` into ``directory``; returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(directory / TOKENIZER_FILE))
        (directory / SPECIAL_IDS_FILE).write_text(json.dumps(self.to_state()["ids"], indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        """Read what ``save`` wrote; a missing or unreadable file raises naming it."""
        directory = Path(directory)
        tok_path, ids_path = directory / TOKENIZER_FILE, directory / SPECIAL_IDS_FILE
        for p in (tok_path, ids_path):
            if not p.is_file():
                raise FileNotFoundError(f"tokenizer file missing: {p}")
        try:
            return cls._from_ids(Tokenizer.from_file(str(tok_path)), json.loads(ids_path.read_text()))
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt tokenizer.json
            raise ValueError(
                f"cannot read tokenizer from {directory} ({TOKENIZER_FILE}, {SPECIAL_IDS_FILE}): {e}"
            ) from e

    def encode_batch(self, texts: Sequence[str] | Iterable[str], context_length: int) -> np.ndarray:
        """int64 (B, context_length): ``[start] ids… end pad…``; the end token always fits."""
        texts = list(texts)
        if self.clean is not None:
            texts = [CLEANERS[self.clean](t) for t in texts]
        n_prefix = 0 if self._start_id is None else 1
        room = context_length - 1 - n_prefix
        if room < 0:
            raise ValueError(f"context_length {context_length} leaves no room for the end token")
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((min(len(e.ids), room) for e in encodings), dtype=np.int64, count=len(texts))
        flat = np.fromiter(chain.from_iterable(e.ids[:room] for e in encodings), dtype=np.int64)
        out = np.full((len(texts), context_length), self._pad_id, dtype=np.int64)  # (B, C)
        cols = np.arange(context_length)[None, :]  # (1, C)
        # Row-major boolean assignment fills each row's content slots in order with that row's ids.
        out[(cols >= n_prefix) & (cols < n_prefix + lengths[:, None])] = flat
        if n_prefix:
            out[:, 0] = self._start_id
        out[np.arange(len(texts)), n_prefix + lengths] = self._end_id
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of one row, stopping at the end token and skipping pad/start."""
        ids = [int(i) for i in ids]
        if self._end_id in ids:
            ids = ids[: ids.index(self._end_id)]
        skip = {self._pad_id, self._start_id}
        return self._tokenizer.decode([i for i in ids if i not in skip], skip_special_tokens=False).strip()


def _find_token(
    tokenizer: Tokenizer, name: str | None, candidates: Sequence[str], role: str, path: Path
) -> int | None:
    if name is not None:
        token_id = tokenizer.token_to_id(name)
        if token_id is None:
            raise ValueError(f"{path}: {role} token {name!r} is not in the vocabulary")
        return token_id
    for candidate in candidates:
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return token_id
    return None


def _add_special(tokenizer: Tokenizer, token: str) -> int:
    tokenizer.add_special_tokens([token])
    return tokenizer.token_to_id(token)


def train_tokenizer(captions: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> TextTokenizer:
    """Train a lowercase byte-level BPE on ``captions`` (offline); ``<pad>``=0, ``<end>``=1, ``<mask>``=2.

    The result may hold fewer than ``vocab_size`` tokens when the corpus has too few frequent pairs.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD_TOKEN, END_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((str(c) for c in captions), trainer=trainer)
    return TextTokenizer(
        tokenizer,
        pad_id=tokenizer.token_to_id(PAD_TOKEN),
        end_id=tokenizer.token_to_id(END_TOKEN),
        mask_id=tokenizer.token_to_id(MASK_TOKEN),
    )


CLIP_SPEC = "clip"
HF_HUB_SPEC = "hf-hub:"  # a Hugging Face Hub repository's tokenizer.json, e.g. hf-hub:timm/ViT-B-16-SigLIP


def hf_hub_tokenizer_file(repo: str) -> Path:
    """``tokenizer.json`` of a Hub repository: from the local Hugging Face cache when it is there (the cluster
    image fills it when it is built, so no node downloads at start), else downloaded into it."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, TOKENIZER_FILE, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError and kin): fetch it
        return Path(hf_hub_download(repo, TOKENIZER_FILE))


def tokenizer_from_spec(spec: str, clean: str | None = None, store: Storage = LOCAL) -> TextTokenizer:
    """The tokenizer a config names: ``clip`` (CLIP's BPE from the installed open_clip_torch),
    ``clip:PATH`` (CLIP's BPE from that ``bpe_simple_vocab_16e6.txt.gz``), ``hf-hub:REPO`` (that Hub
    repository's ``tokenizer.json``), a directory written by ``save``, or any ``tokenizer.json`` (or a
    directory holding one), e.g. SigLIP's, cleaned by ``clean``. Every path may be ``s3://`` (``store``)."""
    if spec == CLIP_SPEC or spec.startswith(CLIP_SPEC + ":"):
        vocab = spec[len(CLIP_SPEC) + 1 :]
        if storage.is_s3(vocab):
            with tempfile.TemporaryDirectory() as d:
                return clip_bpe_tokenizer(_fetch(vocab, d, store))
        return clip_bpe_tokenizer(vocab or None)
    if spec.startswith(HF_HUB_SPEC):
        return TextTokenizer.from_file(hf_hub_tokenizer_file(spec[len(HF_HUB_SPEC) :]), clean=clean)
    if storage.is_s3(spec):
        with tempfile.TemporaryDirectory() as d:  # the tokenizer is in memory once loaded
            return tokenizer_from_spec(_fetch(spec, d, store), clean)
    path = Path(spec)
    if path.is_dir() and (path / SPECIAL_IDS_FILE).is_file():
        return TextTokenizer.load(path)
    return TextTokenizer.from_file(path, clean=clean)


def _fetch(url: str, local_dir: str, store: Storage) -> str:
    """Copy an ``s3://`` file, or the files of an ``s3://`` directory, into ``local_dir``; the local path."""
    if not store.isdir(url) and not store.exists(url):
        raise FileNotFoundError(f"tokenizer file missing: {url}")
    for src in [url] if not store.isdir(url) else store.list_files(url):
        with open(os.path.join(local_dir, src.rsplit("/", 1)[-1]), "wb") as fh:
            fh.write(store.read_bytes(src))
    return local_dir if store.isdir(url) else os.path.join(local_dir, url.rstrip("/").rsplit("/", 1)[-1])


def clip_vocab_path() -> Path:
    """``bpe_simple_vocab_16e6.txt.gz`` inside the installed ``open_clip_torch`` (found without importing it)."""
    try:
        path = Path(
            importlib.metadata.distribution("open_clip_torch").locate_file(f"open_clip/{CLIP_VOCAB_FILE}")
        )
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"CLIP's BPE vocabulary ({CLIP_VOCAB_FILE}) needs open_clip_torch installed "
            "(pip install 'prolip-ray[clip]', or `pip install --no-deps open_clip_torch` on a CPU-only "
            f"machine), or a tokenizer setting of the form clip:/path/to/{CLIP_VOCAB_FILE}"
        )
    return path


def clip_bpe_tokenizer(vocab_path: str | Path | None = None) -> TextTokenizer:
    """CLIP's BPE (49,408 ids, open_clip's numbering) plus an added ``<pad>`` and ``<mask>``.

    Ids: the 256 byte symbols, the same 256 with the end-of-word mark ``</w>``, one id per merge in rank
    order, then ``<start_of_text>`` = 49406 and ``<end_of_text>`` = 49407 — as open_clip's
    ``SimpleTokenizer`` numbers them, so token embeddings of open_clip/OpenAI checkpoints line up.
    """
    path = Path(vocab_path) if vocab_path else clip_vocab_path()
    lines = gzip.open(path).read().decode("utf-8").split("\n")[1 : _CLIP_N_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    symbols = list(pre_tokenizers.ByteLevel.alphabet())
    symbols = sorted(symbols, key=_BYTE_ORDER.get)
    vocab_list = (
        symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [CLIP_START, CLIP_END]
    )
    vocab = {token: i for i, token in enumerate(vocab_list)}
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="</w>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("</w>", " ")])
    tokenizer.add_special_tokens([CLIP_START, CLIP_END])
    pad_id, mask_id = _add_special(tokenizer, PAD_TOKEN), _add_special(tokenizer, MASK_TOKEN)
    return TextTokenizer(
        tokenizer,
        pad_id=pad_id,
        end_id=vocab[CLIP_END],
        mask_id=mask_id,
        start_id=vocab[CLIP_START],
        clean="lower",
    )


def _byte_symbol_order() -> dict[str, int]:
    """GPT-2's byte → symbol map in byte order (printable bytes map to themselves, the rest to 256+n)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    order, extra = [], 0
    for b in printable:
        order.append(chr(b))
    for b in range(256):
        if b not in printable:
            order.append(chr(256 + extra))
            extra += 1
    return {symbol: i for i, symbol in enumerate(order)}


_BYTE_ORDER = _byte_symbol_order()
