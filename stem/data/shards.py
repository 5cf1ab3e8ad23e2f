"""Tokenize a document stream into fixed-size binary token shards, and read them back.

Layout of ``out_dir`` (written atomically: built in a temp dir next to it, then renamed):

    manifest.json
    train_00000.bin  train_00000.idx.npy  train_00001.bin ...
    val_00000.bin    val_00000.idx.npy    ...

``{split}_{i:05d}.bin`` is a raw native-endian (little on x86/ARM) token array (uint16 or uint32, see
``manifest["dtype"]``); every shard except the last of a split holds exactly
``shard_tokens`` tokens, so a document may continue from one shard into the next.
Each document is followed by ``eos_id``. ``{split}_{i:05d}.idx.npy`` holds the int64
offsets (within that shard) of the documents that *start* in it; a shard's
``documents`` count in the manifest is the number of such starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from stem.data.tokenizer import load_tokenizer
from stem.io import atomic_open, make_temp_dir, replace_dir

SPLITS = ("train", "val")
CREATED_BY = "stem.data.shards"
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


# ----------------------------------------------------------------------------- helpers


def choose_dtype(dtype, vocab_size: int) -> np.dtype:
    """'auto' -> uint16 if vocab_size <= 65536 else uint32; explicit dtypes are checked."""
    if dtype == "auto":
        return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected 'auto', 'uint16' or 'uint32'")
    dt = np.dtype(_DTYPES[name])
    if vocab_size - 1 > np.iinfo(dt).max:
        raise ValueError(f"dtype {name} cannot hold vocab_size {vocab_size} (max id {np.iinfo(dt).max}); use uint32 or 'auto'")
    return dt


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def doc_uniform(doc_keys, seed: int = 0) -> np.ndarray:
    """A uniform in [0, 1) per document key: splitmix64(splitmix64(seed) ^ key) / 2**64 (top 53 bits)."""
    idx = np.asarray(doc_keys, dtype=np.uint64)
    key = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))[0]
    return (_splitmix64(idx ^ key) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def val_mask(doc_indices, fraction: float, seed: int = 0) -> np.ndarray:
    """Deterministic split: document i is in val iff splitmix64(splitmix64(seed) ^ i) / 2**64 < fraction."""
    return doc_uniform(doc_indices, seed) < fraction


SAMPLE_SALT = 0x5A4D504C  # sampling draws its uniform with seed ^ SAMPLE_SALT: independent of the val split


def content_keys(docs) -> np.ndarray:
    """uint64 key per document: the first 8 bytes (little-endian) of blake2b of its UTF-8 text or its
    token ids' bytes; the same document gets the same key in whichever job or position it is read."""
    out = np.empty(len(docs), dtype=np.uint64)
    for i, d in enumerate(docs):
        data = d.encode("utf-8", "surrogatepass") if isinstance(d, str) else np.ascontiguousarray(d, np.uint32).tobytes()
        out[i] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return out


def _encode(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode texts (token-id arrays are taken as they are), append eos to each; return (flat int64
    tokens, per-doc lengths)."""
    ids = texts if not isinstance(texts[0], str) else tok.encode_batch(texts)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    end = np.cumsum(lengths)
    flat[end - 1] = tok.eos_id
    pos = 0
    for x, e in zip(ids, end):
        flat[pos : e - 1] = x
        pos = e
    return flat, lengths


def _batches(documents: Iterable[str], batch_docs: int, stats: dict) -> Iterator[tuple[np.ndarray, list[str]]]:
    idx: list[int] = []
    texts: list[str] = []
    for i, doc in enumerate(documents):
        stats["documents_seen"] = i + 1
        if not isinstance(doc, (str, np.ndarray)):
            raise ValueError(f"document {i} is {type(doc).__name__}, expected str (or token ids)")
        if not len(doc):
            stats["empty_documents_skipped"] += 1
            continue
        idx.append(i)
        texts.append(doc)
        if len(texts) == batch_docs:
            yield np.array(idx, dtype=np.int64), texts
            idx, texts = [], []
    if texts:
        yield np.array(idx, dtype=np.int64), texts


def _limit_threads(num_workers: int) -> None:
    """Best effort: tokenizers' Rust thread pool reads RAYON_NUM_THREADS once, at its
    first parallel use in the process; an already-set value wins."""
    if num_workers >= 1:
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_workers))


class _ShardWriter:
    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.dir, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0
        self.documents = 0
        self._f = None

    def _open(self) -> None:
        self._name = f"{self.split}_{len(self.shards):05d}"
        self._f = open(self.dir / f"{self._name}.bin", "wb")
        self._hash = hashlib.sha256()
        self._n = 0
        self._starts: list[np.ndarray] = []

    def _close(self) -> None:
        self._f.close()
        self._f = None
        starts = np.concatenate(self._starts) if self._starts else np.zeros(0, np.int64)
        np.save(self.dir / f"{self._name}.idx.npy", starts.astype(np.int64))
        self.shards.append(
            {"file": f"{self._name}.bin", "tokens": self._n, "documents": int(len(starts)), "sha256": self._hash.hexdigest()}
        )

    def write(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents (``flat`` tokens, ``lengths`` per document, in order)."""
        if len(flat) == 0:
            return
        flat = np.ascontiguousarray(flat, dtype=self.dtype)
        starts = np.cumsum(lengths) - lengths
        pos = 0
        while pos < len(flat):
            if self._f is None:
                self._open()
            take = min(len(flat) - pos, self.shard_tokens - self._n)
            chunk = flat[pos : pos + take]
            lo, hi = np.searchsorted(starts, [pos, pos + take])
            self._starts.append(starts[lo:hi] - pos + self._n)
            buf = memoryview(chunk).cast("B")
            self._f.write(buf)
            self._hash.update(buf)
            self._n += take
            pos += take
            if self._n == self.shard_tokens:
                self._close()
        self.tokens += len(flat)
        self.documents += len(lengths)

    def finish(self) -> dict:
        if self._f is not None:
            self._close()
        return {"tokens": self.tokens, "documents": self.documents, "shards": self.shards}

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class ShardOptions:
    """How ``tokenize_to_shards`` splits, samples and stores a document stream (checked when built).

    shard_tokens: tokens per shard file (the last of a split holds the rest).
    val_fraction: the fraction of documents in the val split, chosen by ``val_mask`` of each document's key.
    seed: of the val split (and of sampling, with ``SAMPLE_SALT``).
    dtype: "auto" (uint16 when the vocabulary fits, else uint32), "uint16" or "uint32".
    batch_docs: documents encoded together, in-process with tokenizers' own Rust thread pool.
    num_workers: >= 1 caps that pool's threads via RAYON_NUM_THREADS (best effort: only if unset and the pool
        has not started yet in this process; 0 = all cores). (On 2 cores a process pool was measured no
        faster, so there is none.)
    max_tokens: caps train+val tokens; the document crossing the cap is truncated.
    doc_keys: what the val split (and sampling) hashes per document: "index" (its position in the stream) or
        "content" (blake2b of the document, see ``content_keys``: independent of order and of which scattered
        job reads it).
    sample: ``(lo, hi)`` keeps a document iff ``doc_uniform(key, seed ^ SAMPLE_SALT)`` is in [lo, hi): a seeded
        random fraction hi-lo of the documents of the whole stream; disjoint ranges give disjoint samples.
    allow_empty: an empty result is written (a scattered part may hold no document).
    """
    shard_tokens: int = 2**24
    val_fraction: float = 0.01
    seed: int = 0
    dtype: str = "auto"
    batch_docs: int = 512
    num_workers: int = 2
    max_tokens: int | None = None
    doc_keys: str = "index"
    sample: tuple[float, float] | None = None
    allow_empty: bool = False

    def __post_init__(self):
        if int(self.shard_tokens) < 1 or int(self.batch_docs) < 1:
            raise ValueError(f"shard_tokens ({self.shard_tokens}) and batch_docs ({self.batch_docs}) must be >= 1")
        if not 0.0 <= float(self.val_fraction) < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_tokens is not None and int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.doc_keys not in ("index", "content"):
            raise ValueError(f"doc_keys must be 'index' or 'content', got {self.doc_keys!r}")
        if self.sample is not None and not 0.0 <= float(self.sample[0]) < float(self.sample[1]) <= 1.0:
            raise ValueError(f"sample must be a range [lo, hi) with 0 <= lo < hi <= 1, got {self.sample!r}")


def tokenize_to_shards(documents: Iterable[str], tok, out_dir, *, source: dict | None = None, progress=None,
                       extra: dict | None = None, **options) -> dict:
    """Tokenize ``documents`` into train/val shards under ``out_dir``; return the manifest.

    ``tok``: a ``Tok`` (or anything ``load_tokenizer`` accepts). ``options``: the fields of ``ShardOptions``.
    Empty strings are skipped (they still count for document indices / the split). Token-id documents (numpy
    arrays) are stored as they are, each followed by eos. ``source`` (the source spec) is recorded in the
    manifest, ``extra`` merged into it. ``progress(stats)`` is called after every batch with documents,
    tokens, seconds.
    """
    opts = ShardOptions(**options)
    tok = load_tokenizer(tok) if not hasattr(tok, "encode_batch") else tok
    np_dtype = choose_dtype(opts.dtype, tok.vocab_size)
    out_dir = Path(out_dir)
    tmp = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    writers = {s: _ShardWriter(tmp, s, np_dtype, int(opts.shard_tokens)) for s in SPLITS}
    try:
        stats = _encode_into(writers, documents, tok, opts, np_dtype, progress)
        splits = {s: w.finish() for s, w in writers.items()}
        if (stats["tokens"] == 0 or sum(s["documents"] for s in splits.values()) == 0) and not opts.allow_empty:
            raise ValueError(
                f"empty corpus: {stats['documents_seen']} documents read "
                f"({stats['empty_documents_skipped']} empty), 0 tokens written"
            )
        manifest = _manifest(tok, np_dtype, opts, stats, splits, source, extra)
        with open(tmp / "manifest.json", "w") as f:
            json.dump(manifest, f, indent=2)
        replace_dir(tmp, out_dir)
    except BaseException:
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _encode_into(writers: dict, documents, tok, opts: ShardOptions, np_dtype: np.dtype, progress) -> dict:
    """Encode the stream batch by batch into the split writers; the stream's counts: documents_seen,
    empty_documents_skipped, documents_not_sampled (when sampling), tokens, truncated."""
    stats = {"documents_seen": 0, "empty_documents_skipped": 0, "tokens": 0, "truncated": False}
    max_id = np.iinfo(np_dtype).max
    t0 = time.perf_counter()
    _limit_threads(int(opts.num_workers))
    for idx, texts in _batches(documents, int(opts.batch_docs), stats):
        if opts.doc_keys == "content" or opts.sample is not None:
            texts, idx = _keyed(texts, idx, opts, stats)
            if not texts:
                continue
        flat, lengths = _encode(tok, texts)
        if len(flat) and int(flat.max()) > max_id:
            raise ValueError(f"token id {int(flat.max())} does not fit dtype {np_dtype.name}")
        if opts.max_tokens is not None and stats["tokens"] + len(flat) >= opts.max_tokens:
            flat, lengths, idx = _truncate(flat, lengths, idx, int(opts.max_tokens) - stats["tokens"])
            stats["truncated"] = True
        is_val = val_mask(idx, opts.val_fraction, opts.seed)
        tok_val = np.repeat(is_val, lengths)
        writers["val"].write(flat[tok_val], lengths[is_val])
        writers["train"].write(flat[~tok_val], lengths[~is_val])
        stats["tokens"] += len(flat)
        if progress is not None:
            progress({"documents": stats["documents_seen"], "tokens": stats["tokens"],
                      "seconds": time.perf_counter() - t0})
        if stats["truncated"]:
            break
    return stats


def _keyed(texts: list, idx: np.ndarray, opts: ShardOptions, stats: dict) -> tuple[list, np.ndarray]:
    """A batch's documents with the keys the val split hashes (``opts.doc_keys``), the sampled ones only
    when ``opts.sample`` is set (the others counted in ``stats["documents_not_sampled"]``)."""
    keys = content_keys(texts) if opts.doc_keys == "content" else idx.astype(np.uint64)
    if opts.sample is not None:
        u = doc_uniform(keys, opts.seed ^ SAMPLE_SALT)
        keep = np.flatnonzero((u >= opts.sample[0]) & (u < opts.sample[1]))
        stats["documents_not_sampled"] = stats.get("documents_not_sampled", 0) + len(texts) - len(keep)
        texts, keys = [texts[i] for i in keep], keys[keep]
    return texts, keys


def _manifest(tok, np_dtype, opts: ShardOptions, stats: dict, splits: dict, source, extra) -> dict:
    manifest = {
        "format_version": 1,
        "created_by": CREATED_BY,
        "vocab_size": int(tok.vocab_size),
        "dtype": np_dtype.name,
        "eos_id": int(tok.eos_id),
        "tokenizer_sha256": getattr(tok, "sha256", None),
        "tokenizer": getattr(tok, "source", None),
        "shard_tokens": int(opts.shard_tokens),
        "val_fraction": float(opts.val_fraction),
        "seed": int(opts.seed),
        "max_tokens": None if opts.max_tokens is None else int(opts.max_tokens),
        "truncated": stats["truncated"],
        "documents_seen": stats["documents_seen"],
        "empty_documents_skipped": stats["empty_documents_skipped"],
        "source": source,
        "splits": splits,
    }
    if opts.doc_keys != "index" or opts.sample is not None:
        manifest.update(doc_keys=opts.doc_keys, sample=None if opts.sample is None else [float(x) for x in opts.sample],
                        documents_not_sampled=stats.get("documents_not_sampled", 0))
    manifest.update(extra or {})
    return manifest


def gather_parts(out_dir, part_dirs) -> dict:
    """Write ``out_dir/manifest.json`` over the shards of scattered parts (each a directory under
    ``out_dir`` written by ``tokenize_to_shards``), in part order; return it. The parts must agree
    on tokenizer, dtype and eos; shard files are listed by their path relative to ``out_dir``."""
    out_dir = Path(out_dir)
    parts = [(Path(d), _load_manifest(Path(d) / "manifest.json")) for d in part_dirs]
    if not parts:
        raise ValueError(f"{out_dir}: no parts to gather")
    first = parts[0][1]
    splits = {s: {"tokens": 0, "documents": 0, "shards": []} for s in SPLITS}
    for d, m in parts:
        for key in ("vocab_size", "dtype", "eos_id", "tokenizer_sha256"):
            if m.get(key) != first.get(key):
                raise ValueError(f"{d}/manifest.json: {key} {m.get(key)!r} differs from {parts[0][0]}'s {first.get(key)!r}")
        rel = os.path.relpath(d, out_dir)
        for name, info in m["splits"].items():
            splits[name]["tokens"] += int(info["tokens"])
            splits[name]["documents"] += int(info["documents"])
            splits[name]["shards"] += [{**sh, "file": f"{rel}/{sh['file']}"} for sh in info["shards"]]
    if sum(s["tokens"] for s in splits.values()) == 0:
        raise ValueError(f"{out_dir}: empty corpus: the {len(parts)} parts hold 0 tokens")
    sums = {k: sum(int(m.get(k) or 0) for _, m in parts)
            for k in ("documents_seen", "empty_documents_skipped", "documents_not_sampled")}
    manifest = {**{k: first.get(k) for k in ("format_version", "created_by", "vocab_size", "dtype", "eos_id",
                                             "tokenizer_sha256", "tokenizer", "shard_tokens", "val_fraction",
                                             "seed", "source", "doc_keys", "sample")},
                **sums, "truncated": any(m.get("truncated") for _, m in parts),
                "parts": [os.path.relpath(d, out_dir) for d, _ in parts], "splits": splits}
    with atomic_open(out_dir / "manifest.json") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def _truncate(flat, lengths, idx, remaining: int):
    """Keep the first ``remaining`` tokens of the batch (the last document may be cut)."""
    ends = np.cumsum(lengths)
    k = int(np.searchsorted(ends, remaining, side="left"))  # doc k holds token remaining-1
    lengths = lengths[: k + 1].copy()
    lengths[k] -= int(ends[k]) - remaining
    return flat[:remaining], lengths, idx[: k + 1]


# ----------------------------------------------------------------------------- reading


class ShardSet:
    """Memory-mapped read access to one split of a shard directory.

    Token positions are global within the split (shards concatenated in order). What is read is
    checked: every shard's size when the set is opened, its sha256 against the manifest when it is
    first read in this process (``checksums``; default: on unless STEM_SHARD_CHECKSUMS=0), and every
    token read is below the manifest's vocab_size (a max over what ``get`` returns).
    """

    def __init__(self, out_dir, split: str = "train", checksums: bool | None = None):
        self.out_dir = Path(out_dir)
        self.split = split
        self.checksums = os.environ.get("STEM_SHARD_CHECKSUMS", "1") != "0" if checksums is None else checksums
        self._verified: set[int] = set()
        self.manifest = _load_manifest(self.out_dir / "manifest.json")
        m = self.manifest
        if split not in m["splits"]:
            raise ValueError(f"{self.out_dir / 'manifest.json'}: no split {split!r}; have {sorted(m['splits'])}")
        info = m["splits"][split]
        self.dtype = np.dtype(m["dtype"])
        self.vocab_size = int(m["vocab_size"])
        self.eos_id = int(m["eos_id"])
        self.shards = info["shards"]
        sizes = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.tokens = int(self._offsets[-1])
        self.num_documents = int(info["documents"])
        if self.tokens != info["tokens"]:
            raise ValueError(f"{self.out_dir / 'manifest.json'}: split {split!r} tokens {info['tokens']} != sum of shards {self.tokens}")
        for s in self.shards:
            path = self.out_dir / s["file"]
            if not path.is_file():
                raise ValueError(f"shard {path} listed in manifest is missing")
            if path.stat().st_size != s["tokens"] * self.dtype.itemsize:
                raise ValueError(
                    f"shard {path}: size {path.stat().st_size} bytes, expected {s['tokens']} {self.dtype.name} tokens"
                )
        self._mm: list = [None] * len(self.shards)

    def __len__(self) -> int:
        return self.tokens

    def __getstate__(self):  # picklable for DataLoader workers: drop open memmaps
        state = self.__dict__.copy()
        state["_mm"] = [None] * len(self.shards)
        return state

    def _shard(self, i: int) -> np.memmap:
        if self._mm[i] is None:
            if self.checksums and i not in self._verified:
                self.verify_shard(i)
            self._mm[i] = np.memmap(self.out_dir / self.shards[i]["file"], dtype=self.dtype, mode="r")
        return self._mm[i]

    def get(self, start: int, length: int) -> np.ndarray:
        """Copy of tokens [start, start+length) of the split, across shard boundaries."""
        start, length = int(start), int(length)
        if start < 0 or length < 0 or start + length > self.tokens:
            raise IndexError(f"get({start}, {length}) out of range for {self.split} split of {self.tokens} tokens")
        out = np.empty(length, dtype=self.dtype)
        pos = 0
        i = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while pos < length:
            lo = start + pos - int(self._offsets[i])
            take = min(length - pos, int(self._offsets[i + 1]) - (start + pos))
            out[pos : pos + take] = self._shard(i)[lo : lo + take]
            pos += take
            i += 1
        if length and int(out.max()) >= self.vocab_size:
            at = start + int(out.argmax())
            j = int(np.searchsorted(self._offsets, at, side="right")) - 1
            raise ValueError(f"shard {self.out_dir / self.shards[j]['file']}: token id {int(out.max())} at token "
                             f"{at - int(self._offsets[j])} is not below the manifest's vocab_size {self.vocab_size} "
                             "(corrupt shard, or shards of another tokenizer)")
        return out

    def windows(self, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ``count`` windows of ``length`` tokens as int64 rows) at evenly spaced offsets of the split."""
        starts = np.linspace(0, len(self) - length, count).astype(int)
        return starts, np.stack([self.get(s, length) for s in starts]).astype(np.int64)

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """Global token offsets (int64) of every document start in the split."""
        parts = []
        for i, s in enumerate(self.shards):
            idx_path = self.out_dir / s["file"].replace(".bin", ".idx.npy")
            try:
                parts.append(np.load(idx_path).astype(np.int64) + self._offsets[i])
            except (OSError, ValueError) as e:
                raise ValueError(f"document index {idx_path}: cannot read ({e})") from None
        starts = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(starts) != self.num_documents:
            raise ValueError(f"{self.out_dir}: split {self.split!r} has {len(starts)} document starts, manifest says {self.num_documents}")
        return starts

    def verify(self) -> bool:
        """Recompute every shard's sha256; raise ValueError on the first mismatch."""
        for i in range(len(self.shards)):
            self.verify_shard(i)
        return True

    def verify_shard(self, i: int) -> None:
        """Recompute shard ``i``'s sha256 and compare it with the manifest's (ValueError naming the file)."""
        s = self.shards[i]
        path = self.out_dir / s["file"]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        if h.hexdigest() != s["sha256"]:
            raise ValueError(f"shard {path}: sha256 mismatch ({h.hexdigest()[:12]}..., the manifest says "
                             f"{s['sha256'][:12]}...): the file is corrupt or was modified; rerun the tokenize stage")
        self._verified.add(i)


def _load_manifest(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"shard manifest {path} does not exist (run the tokenize stage first)")
    try:
        with open(path) as f:
            m = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"shard manifest {path} is corrupt: {e}") from None
    try:
        if m.get("created_by") != CREATED_BY:
            raise ValueError(f"created_by is {m.get('created_by')!r}, expected {CREATED_BY!r}")
        if m["dtype"] not in _DTYPES:
            raise ValueError(f"dtype {m['dtype']!r} not in {sorted(_DTYPES)}")
        int(m["vocab_size"]), int(m["eos_id"])
        for name, info in m["splits"].items():
            int(info["tokens"]), int(info["documents"])
            for s in info["shards"]:
                s["file"], int(s["tokens"]), int(s["documents"]), s["sha256"]
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"shard manifest {path} is invalid: {type(e).__name__}: {e}") from None
    return m
