"""Training batches from a weighted mixture of tokenized sources; deterministic and resumable.

- Source choice: smooth weighted round-robin over the mixture (each sequence goes to the source
  furthest behind its quota), so the delivered token proportions match the weights exactly up to
  one sequence, with no randomness to seed.
- Within a source, ``packed=False`` takes consecutive windows of seq_len+1 tokens in a fixed
  pseudo-shuffled order (an affine permutation: O(1) memory at any corpus size), crossing document
  boundaries as plain pretraining does. ``packed=True`` packs whole documents into rows (a document
  longer than a row is split), and returns per-token positions that restart at every document;
  targets that would cross a document boundary, and padding, are -1.
- ``state_dict()`` / ``load_state_dict()`` capture the position, saved with every checkpoint.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from stem.data.shards import ShardSet


def _coprime_stride(n: int, seed: int) -> int:
    a = (0x9E3779B97F4A7C15 ^ (seed * 0xBF58476D1CE4E5B9)) % max(n, 1) or 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


class SourceStream:
    def __init__(self, name: str, shards: ShardSet, seq_len: int, seed: int):
        self.name, self.shards, self.seq_len = name, shards, seq_len
        self.n_windows = (shards.tokens - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"source {name!r}: {shards.tokens} tokens, fewer than one sequence of {seq_len + 1}")
        self.doc_starts = np.append(shards.doc_starts, shards.tokens)
        self.n_docs = len(self.doc_starts) - 1
        self.window_stride = _coprime_stride(self.n_windows, seed)
        self.doc_stride = _coprime_stride(self.n_docs, seed + 1)
        self.cursor, self.doc_offset = 0, 0   # sequences (or documents) drawn; offset inside a split document

    def window(self) -> np.ndarray:
        i = (self.cursor * self.window_stride) % self.n_windows
        self.cursor += 1
        return self.shards.get(i * self.seq_len, self.seq_len + 1)

    def packed_row(self, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """seq_len+1 tokens and a document index per token (-1 for padding)."""
        room, toks, docs, k = self.seq_len + 1, [], [], 0
        while room > 0:
            d = (self.cursor * self.doc_stride) % self.n_docs
            start, end = int(self.doc_starts[d]) + self.doc_offset, int(self.doc_starts[d + 1])
            length = end - start
            if length > room and toks and end - int(self.doc_starts[d]) <= self.seq_len + 1:
                break  # a whole document that fits a fresh row: do not split it, pad this one
            take = min(length, room)
            toks.append(self.shards.get(start, take)), docs.append(np.full(take, k))
            room, k = room - take, k + 1
            if take == length:
                self.cursor, self.doc_offset = self.cursor + 1, 0
            else:
                self.doc_offset += take
        if room:
            toks.append(np.full(room, pad_id)), docs.append(np.full(room, -1))
        return np.concatenate(toks).astype(np.int64), np.concatenate(docs)

    def state(self):
        return {"cursor": self.cursor, "doc_offset": self.doc_offset}


def positions_from_docs(docs: np.ndarray) -> np.ndarray:
    """Per-token positions restarting at each document (padding counts as its own document)."""
    idx = np.arange(len(docs))
    start = np.ones(len(docs), dtype=bool)
    start[1:] = docs[1:] != docs[:-1]
    return idx - np.maximum.accumulate(np.where(start, idx, 0))


class MixtureLoader:
    def __init__(self, sources: dict[str, tuple[ShardSet, float]], seq_len: int, micro_batch: int,
                 seed: int, packed: bool = False, pad_id: int = 0):
        self.streams = {n: SourceStream(n, s, seq_len, seed + i) for i, (n, (s, _)) in enumerate(sorted(sources.items()))}
        total = sum(w for _, w in sources.values())
        self.weights = {n: w / total for n, (_, w) in sources.items()}
        self.credit = {n: 0.0 for n in self.streams}
        self.tokens_by_source = {n: 0 for n in self.streams}
        self.micro_batch, self.seq_len, self.packed, self.pad_id = micro_batch, seq_len, packed, pad_id

    def _pick(self) -> str:
        for n in self.credit:
            self.credit[n] += self.weights[n]
        name = max(self.credit, key=lambda n: (self.credit[n], n))
        self.credit[name] -= 1.0
        return name

    def next_batch(self):
        """(inputs, targets, positions-or-None), each (micro_batch, seq_len) int64 tensors."""
        rows, pos_rows = [], []
        for _ in range(self.micro_batch):
            name = self._pick()
            self.tokens_by_source[name] += self.seq_len
            if self.packed:
                row, docs = self.streams[name].packed_row(self.pad_id)
                pos_rows.append((row, docs))
            rows.append(row if self.packed else self.streams[name].window().astype(np.int64))
        batch = torch.from_numpy(np.stack(rows))
        x, y = batch[:, :-1].clone(), batch[:, 1:].clone()
        if not self.packed:
            return x, y, None
        docs = np.stack([d for _, d in pos_rows])
        cross = torch.from_numpy((docs[:, 1:] != docs[:, :-1]) | (docs[:, 1:] < 0))
        y[cross] = -1
        positions = torch.from_numpy(np.stack([positions_from_docs(d[:-1]) for d in docs]))
        return x, y, positions

    def state_dict(self) -> dict:
        return {"credit": dict(self.credit), "tokens_by_source": dict(self.tokens_by_source),
                "streams": {n: s.state() for n, s in self.streams.items()}}

    def load_state_dict(self, state: dict):
        self.credit.update(state["credit"])
        self.tokens_by_source.update(state["tokens_by_source"])
        for n, s in state["streams"].items():
            self.streams[n].cursor, self.streams[n].doc_offset = s["cursor"], s["doc_offset"]


def validation_batches(sources: dict[str, ShardSet], seq_len: int, micro_batch: int, n_batches: int):
    """A fixed list of validation batches: the first windows of each source's held-out split, round-robin."""
    windows = []
    names = sorted(sources)
    for i in range(n_batches * micro_batch):
        s = sources[names[i % len(names)]]
        j = i // len(names)
        if (j + 1) * seq_len + 1 > s.tokens:
            break
        windows.append(s.get(j * seq_len, seq_len + 1).astype(np.int64))
    if not windows:
        return []
    data = torch.from_numpy(np.stack(windows))
    return [(b[:, :-1], b[:, 1:]) for b in data.split(micro_batch)]
