"""Byte-level BPE training and tokenizer loading (HF ``tokenizers`` library)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from stem.io import atomic_path

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def train_bpe(
    documents: Iterable[str],
    vocab_size: int,
    out_path,
    special_tokens=("<|endoftext|>", "<|pad|>"),
) -> Tokenizer:
    """Train a byte-level BPE tokenizer and save it atomically as tokenizer.json.

    ``out_path`` is the target file, or an existing directory (then
    ``out_path/tokenizer.json``). ``<|endoftext|>`` (first special token by
    default) is the EOS/document separator; special tokens get the lowest ids.
    """
    special_tokens = list(special_tokens)
    min_size = 256 + len(special_tokens)
    if int(vocab_size) < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least {min_size} (256 bytes + special tokens)")
    if not any(t in EOS_CANDIDATES for t in special_tokens):
        raise ValueError(f"special_tokens {special_tokens} contain no EOS token; expected one of {list(EOS_CANDIDATES)}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)

    out_path = Path(out_path)
    if out_path.is_dir():
        out_path = out_path / "tokenizer.json"
    with atomic_path(out_path) as tmp:
        tok.save(str(tmp))
    return tok


def add_words(path, words: Iterable[str]) -> int:
    """Add ``words`` to the tokenizer.json at ``path`` as tokens of their own (not special: they are text), each
    matched as a whole word with the whitespace before it (the knowledge experiment's one-token names,
    stem.data.bios); atomic. Returns the new vocabulary size."""
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens([AddedToken(w, single_word=True, lstrip=True, normalized=False) for w in words])
    with atomic_path(path) as tmp:
        tok.save(str(tmp))
    return tok.get_vocab_size(with_added_tokens=True)


class Tok:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the few things the pipeline needs."""

    def __init__(self, tokenizer: Tokenizer, path: str | None = None, source: str | None = None):
        self.tokenizer = tokenizer
        # Literal "<|endoftext|>" etc. inside a document is encoded as plain text, so the
        # only EOS ids in token shards are the document separators we add.
        tokenizer.encode_special_tokens = True
        self.path = path  # tokenizer.json path, or None when loaded from the hub
        self.source = source if source is not None else path
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        for name in EOS_CANDIDATES:
            eos = tokenizer.token_to_id(name)
            if eos is not None:
                self.eos_token, self.eos_id = name, eos
                break
        else:
            raise ValueError(f"tokenizer {self.source}: no EOS token found; expected one of {list(EOS_CANDIDATES)}")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text; no special tokens added (special-token text is split as plain text)."""
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def sha256(self) -> str:
        """sha256 of the tokenizer.json bytes (of its serialization when there is no file)."""
        if self.path is not None and os.path.isfile(self.path):
            with open(self.path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def to_str(self) -> str:
        return self.tokenizer.to_str()

    def __repr__(self) -> str:
        return f"Tok(source={self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec_or_path) -> Tok:
    """Load a tokenizer from a tokenizer.json, a directory holding one, or a hub id.

    Accepts a ``Tok`` (returned as is), a ``tokenizers.Tokenizer``, a str/Path,
    or a dict ``{"path": ...}`` / ``{"hub": "org/name"}``.
    """
    if isinstance(spec_or_path, Tok):
        return spec_or_path
    if isinstance(spec_or_path, Tokenizer):
        return Tok(spec_or_path)
    if isinstance(spec_or_path, dict):
        if "hub" in spec_or_path:
            return _from_hub(str(spec_or_path["hub"]), spec_or_path.get("revision"))
        if "path" in spec_or_path:
            spec_or_path = spec_or_path["path"]
        else:
            raise ValueError(f"tokenizer spec {spec_or_path!r}: expected a 'path' or 'hub' key")
    if not isinstance(spec_or_path, (str, os.PathLike)):
        raise ValueError(f"tokenizer spec must be a path or hub id, got {type(spec_or_path).__name__}")

    path = Path(os.path.expanduser(os.fspath(spec_or_path)))
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer directory {path.parent} has no tokenizer.json")
    elif not path.is_file():
        if _looks_like_hub_id(os.fspath(spec_or_path)):
            return _from_hub(os.fspath(spec_or_path), local_hint=True)
        raise ValueError(f"tokenizer file {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"tokenizer file {path}: cannot parse ({msg}); expected a Hugging Face tokenizers "
                         "tokenizer.json") from None
    return Tok(tok, str(path))


def _looks_like_hub_id(s: str) -> bool:
    # "org/name": exactly one slash, no path-ish prefixes or file suffixes.
    parts = s.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not s.startswith((".", "~"))
        and not s.endswith(".json")
    )


def _from_hub(repo_id: str, revision: str | None = None, local_hint: bool = False) -> Tok:
    try:
        tok = Tokenizer.from_pretrained(repo_id, revision=revision or "main")
    except Exception as e:
        where = "is not a local file or directory, and as a hub id it" if local_hint else "(hub id)"
        raise ValueError(f"tokenizer {repo_id!r} {where} cannot be loaded: {e}") from None
    return Tok(tok, None, source=f"hub:{repo_id}")
