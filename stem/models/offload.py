"""Offloaded STEM tables for inference (paper Sec. 3.4): the tables leave the compute device, each forward
fetches only the rows of its unique token ids, one STEM layer ahead, and hot rows stay in an LFU cache.

    engine = offload(model, weights="ckpt/model.safetensors", cache_rows=256)
    logits = model(ids)            # every forward goes through the engine (a forward pre-hook)
    engine.stats()                 # hit rate, unique/total ids, bytes moved per token

Tiers. Far: the tables off the device, pinned host memory when the model computes on CUDA, else a memory
map of the safetensors file (a gather pages in only the rows it reads). Near: this forward's rows and the
cache, on the compute device.

Per forward: the token ids are known before any layer runs, so a forward pre-hook on the model takes their
unique ids (dedup), asks the cache which it holds and starts fetching the missing rows of the first STEM
layer; each STEM layer, when it looks its rows up, starts the fetch of the next STEM layer's rows (a
background thread; on CUDA the host-to-device copy runs on a side stream) and then waits for its own. Rows
are exact copies of the table's, so the logits equal the resident model's.

Which modules are tables: the registry's parameter roles. A submodule of a layer's FFN that declares a
``lookup`` role for its own ``weight`` is a token-indexed table (the FFN calls it with the token ids, as an
``nn.Embedding``); it is replaced by an ``OffloadedTable``, which holds no parameters.

DSE tables (the hashed N-gram memory, stem.models.dse): every DSE layer's order x head tables are offloaded
too (``dse_tables``). Their row ids are hashes of the token ids (and, under a KV cache, of the cached last
ids), so the pre-hook computes them before any layer runs (``DSEMemory.row_ids``) and fetches them in layer
order with the STEM rows: a DSE layer's rows, all its tables at once, are one fetch of the chain. Each DSE
table has its own row space, so its own ``LFUCache`` of min(cache_rows, its rows) rows. A table that is
asked for rows other than the announced ones (a call the pre-hook did not foresee) reads them synchronously.

Cache (``LFUCache``): one directory for all STEM layers (they read the same ids), rows per layer. An id's
count is the number of tokens that have read it over the engine's life, cached or not. After each forward
the cache holds the ``cache_rows`` ids with the highest count among the ids it held and the forward's misses;
equal counts go to the most recently used (LRU tie-break), then to the smaller id.
"""
from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from stem.models.model import document_ids
from stem.models.registry import param_roles

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}  # BF16: raw bits


class MappedRows:
    """One [V, d] tensor of a safetensors file, memory-mapped (the far tier on CPU)."""

    def __init__(self, path, name: str, dtype: torch.dtype):
        try:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                info = json.loads(f.read(n)).get(name)
        except (OSError, ValueError, AttributeError, struct.error) as e:   # AttributeError: a header not a mapping
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        if info is None or info["dtype"] not in _NUMPY or len(info["shape"]) != 2:
            raise ValueError(f"{path}: no 2-D float tensor {name!r} (expected the model's table weights)")
        self.bf16 = info["dtype"] == "BF16"
        end, size = 8 + n + info["data_offsets"][1], Path(path).stat().st_size
        if size < end:   # np.memmap would say only "mmap length is greater than file size"
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes; tensor {name!r} ends at byte {end}); "
                             "expected the whole file (copy or save the checkpoint again)")
        try:
            self.rows = np.memmap(path, dtype=_NUMPY[info["dtype"]], mode="r", offset=8 + n + info["data_offsets"][0],
                                  shape=tuple(info["shape"]))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot map tensor {name!r} ({e})") from None
        self.shape, self.dtype = tuple(info["shape"]), dtype

    def gather(self, ids: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.take(self.rows, ids, axis=0))
        return (t.view(torch.bfloat16) if self.bf16 else t).to(self.dtype)

    def read_all(self) -> torch.Tensor:
        return self.gather(np.arange(self.shape[0]))


class HostRows:
    """A table in host memory, pinned when CUDA is there (the far tier of a CUDA model)."""

    def __init__(self, weight: torch.Tensor):
        self.rows = weight.detach().to("cpu", copy=True)
        if torch.cuda.is_available():
            self.rows = self.rows.pin_memory()
        self.shape, self.dtype = tuple(self.rows.shape), self.rows.dtype

    def gather(self, ids: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(ids)
        if not self.rows.is_pinned():
            return self.rows.index_select(0, idx)
        out = torch.empty((len(ids), self.shape[1]), dtype=self.dtype, pin_memory=True)  # caching host allocator
        return torch.index_select(self.rows, 0, idx, out=out)


class LFUCache:
    """Which ids the near tier holds, and in which slot: LFU with LRU tie-break (see the module docstring)."""

    def __init__(self, vocab_size: int, capacity: int):
        self.capacity = capacity
        self.count = np.zeros(vocab_size, np.int64)     # tokens that read each id
        self.last = np.zeros(vocab_size, np.int64)      # the last forward (clock) that read it
        self.slot = np.full(vocab_size, -1, np.int64)   # id -> slot, -1 when not cached
        self.held = np.full(capacity, -1, np.int64)     # slot -> id, -1 when free
        self.clock = 0

    def access(self, uniq: np.ndarray, counts: np.ndarray):
        """One forward reads the sorted unique ids ``uniq`` (``counts`` tokens each). Returns (hit mask over
        uniq, the hits' slots, positions in uniq of the misses admitted, their slots); the hits' slots are
        read before the admitted rows are written (an id hit now may be evicted now)."""
        self.clock += 1
        self.count[uniq] += counts
        self.last[uniq] = self.clock
        slots = self.slot[uniq]
        hit = slots >= 0
        miss = np.flatnonzero(~hit)
        none = np.zeros(0, np.int64)
        if self.capacity == 0 or len(miss) == 0:
            return hit, slots[hit], none, none
        free = np.flatnonzero(self.held < 0)
        if len(miss) <= len(free):  # room for every miss: nothing to choose
            self.held[free[:len(miss)]] = uniq[miss]
            self.slot[uniq[miss]] = free[:len(miss)]
            return hit, slots[hit], miss, free[:len(miss)]
        held = self.held[self.held >= 0]
        cand = np.concatenate([held, uniq[miss]])
        keep = np.zeros(len(self.count), bool)
        keep[cand[np.lexsort((cand, -self.last[cand], -self.count[cand]))[:self.capacity]]] = True
        evicted = held[~keep[held]]
        admit = miss[keep[uniq[miss]]]
        free = np.concatenate([free, self.slot[evicted]])[:len(admit)]
        self.slot[evicted] = -1
        self.held[free] = uniq[admit]
        self.slot[uniq[admit]] = free
        return hit, slots[hit], admit, free

    def cached(self) -> set[int]:
        return {int(i) for i in self.held if i >= 0}


class OffloadedHashedTable(nn.Module):
    """Stands where a DSE table was (called with its row ids, as the ``nn.Embedding``): rows from the engine."""

    def __init__(self, engine: "OffloadEngine", index: int, shape: tuple[int, int]):
        super().__init__()
        self.engine, self.index, self.shape = engine, index, shape
        self.embedding_dim = shape[1]

    def forward(self, rows):
        return self.engine.lookup_hashed(self.index, rows)

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, {self.shape[1]}, offloaded (DSE table {self.index})"


@dataclass
class _Hashed:
    """One DSE table: its far tier, its own cache directory and near rows, the layer's memory module."""
    far: object
    cache: LFUCache
    near: torch.Tensor
    memory: nn.Module                # the DSEMemory that owns it (computes the row ids)
    layer: int
    k: int                           # its index among the memory's tables
    row_bytes: int


class OffloadedTable(nn.Module):
    """Stands where a table was: its rows come from the engine."""

    def __init__(self, engine: "OffloadEngine", index: int, shape: tuple[int, int]):
        super().__init__()
        self.engine, self.index, self.shape = engine, index, shape

    def forward(self, ids):
        return self.engine.lookup(self.index, ids)

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, {self.shape[1]}, offloaded (STEM layer {self.index})"


@dataclass
class _Step:
    """One forward: its ids, their dedup, the cache's answer, the fetches under way."""
    ids: torch.Tensor
    uniq: np.ndarray
    inverse: torch.Tensor            # (B*T,) position in uniq, on the device
    miss: np.ndarray                 # ids to fetch
    hit_pos: torch.Tensor            # positions in uniq of hits / misses, on the device
    miss_pos: torch.Tensor
    hit_slots: torch.Tensor
    admit: torch.Tensor              # positions in ``miss`` of the rows admitted to the cache, and their slots
    admit_slots: torch.Tensor
    fetches: dict = field(default_factory=dict)
    looked_up: set = field(default_factory=set)
    hashed: list = field(default_factory=list)   # per DSE table: _HashedStep
    dse_rows: dict = field(default_factory=dict)  # DSE layer -> its tables' fetched rows


@dataclass
class _HashedStep:
    """One DSE table in one forward: the announced row ids, their dedup and the cache's answer."""
    rows: torch.Tensor
    uniq: np.ndarray
    inverse: torch.Tensor
    miss: np.ndarray
    hit_pos: torch.Tensor
    miss_pos: torch.Tensor
    hit_slots: torch.Tensor
    admit: torch.Tensor
    admit_slots: torch.Tensor


class OffloadEngine:
    def __init__(self, far: list, device: torch.device, dtype: torch.dtype, cache_rows: int, prefetch: bool,
                 vocab: int | None = None, hashed: list | None = None, order: list | None = None):
        """``far``: the STEM tables' far tiers, in layer order; ``hashed``: (far tier, DSEMemory, layer, k) of
        every DSE table; ``order``: the fetch chain in execution order, ("dse", layer) / ("stem", j)."""
        self.far, self.device, self.dtype = far, device, dtype
        vocab = far[0].shape[0] if far else vocab
        d_ff = far[0].shape[1] if far else 0
        top, what = (vocab, "the vocabulary") if far else (max(f.shape[0] for f, *_ in hashed), "the largest DSE table")
        if not 0 <= cache_rows <= top:
            raise ValueError(f"cache_rows={cache_rows}: expected 0 (no cache) to {top} ({what})")
        self.cache = LFUCache(vocab, cache_rows if far else 0)
        self.rows = torch.empty((len(far), cache_rows, d_ff), dtype=dtype, device=device)  # near-tier cache rows
        self.row_bytes = d_ff * torch.empty((), dtype=dtype).element_size()
        self.cache_rows = cache_rows
        size = torch.empty((), dtype=dtype).element_size()
        self.hashed = [_Hashed(f, LFUCache(f.shape[0], min(cache_rows, f.shape[0])),
                               torch.empty((min(cache_rows, f.shape[0]), f.shape[1]), dtype=dtype, device=device),
                               mem, layer, k, f.shape[1] * size) for f, mem, layer, k in (hashed or [])]
        self.order = order or [("stem", j) for j in range(len(far))]
        self.unit = {u: i for i, u in enumerate(self.order)}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="stem-prefetch") if prefetch else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.step: _Step | None = None
        self.freed_bytes = 0      # table bytes taken off the compute device
        self.hook = None
        self.reset_stats()

    # ---- counters ---------------------------------------------------------------------------------------
    def reset(self):
        """An empty cache (same budget) and zeroed counters."""
        self.cache, self.step = LFUCache(len(self.cache.count), self.cache.capacity), None
        for h in self.hashed:
            h.cache = LFUCache(len(h.cache.count), h.cache.capacity)
        self.reset_stats()

    def reset_stats(self):
        self.forwards = self.total_ids = self.unique_ids = self.hits = self.bytes_moved = 0
        self.dse_total_rows = self.dse_unique_rows = self.dse_hits = self.dse_bytes_moved = 0

    def stats(self) -> dict:
        """hit_rate: cached / unique ids over the forwards (every STEM layer reads the same ids);
        bytes_moved: far-to-near row bytes, all STEM layers; per token: over every id of every forward.
        dse_*: the same over the DSE tables (each its own row ids): rows read (one per token and table),
        unique rows per table and forward, cache hits, bytes moved; all_bytes_per_token: STEM and DSE rows."""
        per_token = lambda b: b / self.total_ids if self.total_ids else 0.0  # noqa: E731
        return {"forwards": self.forwards, "total_ids": self.total_ids, "unique_ids": self.unique_ids,
                "hits": self.hits, "hit_rate": self.hits / self.unique_ids if self.unique_ids else 0.0,
                "unique_per_total": self.unique_ids / self.total_ids if self.total_ids else 0.0,
                "bytes_moved": self.bytes_moved,
                "bytes_per_token": per_token(self.bytes_moved),
                "cache_rows": self.cache_rows, "stem_layers": len(self.far), "freed_bytes": self.freed_bytes,
                "dse_tables": len(self.hashed), "dse_total_rows": self.dse_total_rows,
                "dse_unique_rows": self.dse_unique_rows, "dse_hits": self.dse_hits,
                "dse_hit_rate": self.dse_hits / self.dse_unique_rows if self.dse_unique_rows else 0.0,
                "dse_unique_per_total": self.dse_unique_rows / self.dse_total_rows if self.dse_total_rows else 0.0,
                "dse_bytes_moved": self.dse_bytes_moved, "dse_bytes_per_token": per_token(self.dse_bytes_moved),
                "all_bytes_per_token": per_token(self.bytes_moved + self.dse_bytes_moved)}

    # ---- one forward ------------------------------------------------------------------------------------
    def _dev(self, a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _plan(self, cache: LFUCache, flat: torch.Tensor):
        """Dedup ``flat`` ids and ask ``cache``: (uniq, inverse, hit mask, hit slots, admitted miss ranks, slots)."""
        uniq, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        uniq, counts = uniq.cpu().numpy(), counts.cpu().numpy()
        hit, hit_slots, admit, admit_slots = cache.access(uniq, counts)
        miss_rank = np.cumsum(~hit) - 1            # position of each miss among the misses
        return uniq, inverse, hit, hit_slots, miss_rank[admit], admit_slots

    def begin(self, ids: torch.Tensor, hashed_rows: list | None = None) -> _Step:
        """Dedup the forward's ids, consult the cache, start fetching the first layer's missing rows.
        ``hashed_rows``: the row ids (B, T) of every DSE table this forward will read (``dse_row_ids``)."""
        uniq, inverse, hit, hit_slots, admit, admit_slots = self._plan(self.cache, ids.reshape(-1))
        miss_pos = np.flatnonzero(~hit)
        st = _Step(ids, uniq, inverse.to(self.device), uniq[miss_pos], self._dev(np.flatnonzero(hit)),
                   self._dev(miss_pos), self._dev(hit_slots), self._dev(admit), self._dev(admit_slots))
        self.forwards += 1
        self.total_ids += ids.numel()
        if self.far:
            self.unique_ids += len(uniq)
            self.hits += int(hit.sum())
            self.bytes_moved += len(miss_pos) * len(self.far) * self.row_bytes
        for h, rows in zip(self.hashed, hashed_rows or []):
            st.hashed.append(self._plan_hashed(h, rows))
        self.step = st
        self._start(st, 0)
        return st

    def _plan_hashed(self, h: _Hashed, rows: torch.Tensor) -> _HashedStep:
        uniq, inverse, hit, hit_slots, admit, admit_slots = self._plan(h.cache, rows.reshape(-1))
        miss_pos = np.flatnonzero(~hit)
        self.dse_total_rows += rows.numel()
        self.dse_unique_rows += len(uniq)
        self.dse_hits += int(hit.sum())
        self.dse_bytes_moved += len(miss_pos) * h.row_bytes
        return _HashedStep(rows, uniq, inverse.to(self.device), uniq[miss_pos], self._dev(np.flatnonzero(hit)),
                           self._dev(miss_pos), self._dev(hit_slots), self._dev(admit), self._dev(admit_slots))

    def _start(self, st: _Step, u: int):
        """Start fetching unit ``u`` of the chain (a STEM layer's rows, or all tables of a DSE layer)."""
        if self.pool is None or u >= len(self.order):
            return
        kind, j = self.order[u]
        if kind == "stem":
            st.fetches[u] = self.pool.submit(self._fetch, j, st.miss)
        elif st.hashed:
            st.fetches[u] = self.pool.submit(self._fetch_hashed, st, j)

    def _fetch_hashed(self, st: _Step, layer: int):
        return [self._fetch(None, hs.miss, h.far) for h, hs in zip(self.hashed, st.hashed) if h.layer == layer]

    def _fetch(self, j: int | None, miss: np.ndarray, far=None):
        rows = (self.far[j] if far is None else far).gather(miss)
        if self.stream is None:
            return rows.to(self.device), None
        with torch.cuda.stream(self.stream):
            rows = rows.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return rows, done

    def _ready(self, fetched) -> torch.Tensor:
        rows, done = fetched
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
            rows.record_stream(torch.cuda.current_stream(self.device))
        return rows

    def _wait(self, st: _Step, j: int) -> torch.Tensor:
        u = self.unit[("stem", j)]
        return self._ready(st.fetches.pop(u).result() if u in st.fetches else self._fetch(j, st.miss))

    @staticmethod
    def _assemble(fetched, near, hit_pos, miss_pos, hit_slots, admit, admit_slots, n_uniq, dtype, device):
        """This forward's unique rows from the cache's hits and the fetched misses; admit misses to the cache."""
        if len(hit_pos) == 0:
            rows = fetched
        else:
            rows = torch.empty((n_uniq, fetched.shape[1]), dtype=dtype, device=device)
            rows[hit_pos] = near[hit_slots]
            rows[miss_pos] = fetched
        if len(admit):
            near[admit_slots] = fetched[admit]
        return rows

    def lookup(self, j: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows of STEM layer ``j`` for ``ids`` (B, T) -> (B, T, d_ff)."""
        st = self.step
        if st is None or st.ids is not ids or j in st.looked_up:  # a call the pre-hook did not announce
            st = self.begin(ids)
        st.looked_up.add(j)
        fetched = self._wait(st, j)
        self._start(st, self.unit[("stem", j)] + 1)   # the next layer's rows, while this one computes
        rows = self._assemble(fetched, self.rows[j], st.hit_pos, st.miss_pos, st.hit_slots, st.admit,
                              st.admit_slots, len(st.uniq), self.dtype, self.device)
        return rows[st.inverse].view(*ids.shape, -1)

    def lookup_hashed(self, t: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of DSE table ``t`` (engine order) for its row ids ``rows`` (B, T) -> (B, T, dim)."""
        h, st = self.hashed[t], self.step
        if st is None or len(st.hashed) <= t or ("dse", t) in st.looked_up or not torch.equal(st.hashed[t].rows, rows):
            # not announced (or announced otherwise): plan this table alone and read its rows now
            hs = self._plan_hashed(h, rows)
            fetched = self._ready(self._fetch(None, hs.miss, h.far))
        else:
            st.looked_up.add(("dse", t))
            hs = st.hashed[t]
            if h.layer not in st.dse_rows:           # the layer's first table: all its tables' rows arrive
                u = self.unit[("dse", h.layer)]
                got = st.fetches.pop(u).result() if u in st.fetches else self._fetch_hashed(st, h.layer)
                st.dse_rows[h.layer] = [self._ready(g) for g in got]
                self._start(st, u + 1)               # the next layer's rows, while this one computes
            fetched = st.dse_rows[h.layer][h.k]
        out = self._assemble(fetched, h.near, hs.hit_pos, hs.miss_pos, hs.hit_slots, hs.admit, hs.admit_slots,
                             len(hs.uniq), self.dtype, self.device)
        return out[hs.inverse].view(*rows.shape, -1)

    def close(self):
        """Stop the prefetch thread and detach from the model (the tables stay offloaded)."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def token_tables(model) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, table) of every token-indexed table, in layer order: a submodule of a layer's FFN
    declaring a ``lookup`` role for its own ``weight`` (stem.models.registry)."""
    found = []
    for block in model.layers:
        roles = param_roles(block.ffn)
        for name, m in block.ffn.named_modules():
            w = m._parameters.get("weight") if name else None
            if w is None or id(w) not in roles or roles[id(w)].count != "lookup":
                continue
            if not isinstance(m, nn.Embedding):
                raise ValueError(f"{type(m).__name__}: a lookup table the engine cannot offload (expected an "
                                 "nn.Embedding read as weight[ids])")
            parent_name, _, attr = name.rpartition(".")
            found.append((block.ffn.get_submodule(parent_name), attr, m))
    return found


def dse_tables(model) -> list[tuple[nn.Module, int, int, nn.Module]]:
    """(DSE memory, layer, k, table) of every hashed DSE table (``memory.tables[k]``), in layer order."""
    return [(block.dse, i, k, t) for i, block in enumerate(model.layers) if getattr(block, "dse", None) is not None
            for k, t in enumerate(block.dse.tables)]


def dse_row_ids(model, ids, positions=None, cache=None, attn_mask=None) -> list[torch.Tensor]:
    """The row ids every DSE table of ``model`` reads in ``model(ids, positions=, cache=, attn_mask=)``, in
    ``dse_tables`` order, computed before the forward (what the forward computes: the documents of
    ``positions`` when it builds its own mask, the cached last ids under a KV cache)."""
    cids = model.dse_compress[ids]
    doc_ids = document_ids(positions) if positions is not None and attn_mask is None else None
    out = []
    for i, block in enumerate(model.layers):
        if getattr(block, "dse", None) is not None:
            state = None if cache is None else cache.dse.get(i, {})
            out += block.dse.row_ids(cids, doc_ids, state)
    return out


def offload(model, weights=None, device=None, cache_rows: int = 0, prefetch: bool = True) -> OffloadEngine:
    """Take ``model``'s STEM tables and DSE tables off the compute device, move the rest to ``device`` (default:
    where the model is) and serve the tables' rows through an ``OffloadEngine`` (returned; also
    ``model.offload_engine``). On CUDA the far tier is pinned host memory; on the CPU it is ``weights``, the
    safetensors file holding the tables under the model's state-dict names (a checkpoint's model.safetensors)."""
    tables, hashed = token_tables(model), dse_tables(model)
    if not tables and not hashed:
        raise ValueError("offload: the model has no token-indexed tables (a STEM FFN kind) or DSE tables to offload")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    names = {id(m): n for n, m in model.named_modules()}
    every = [m for _, _, m in tables] + [t for _, _, _, t in hashed]
    dtype = every[0].weight.dtype
    if weights is not None:
        far = [MappedRows(weights, f"{names[id(m)]}.weight", dtype) for m in every]
        for m, f in zip(every, far):
            if f.shape != tuple(m.weight.shape):
                raise ValueError(f"{weights}: {names[id(m)]}.weight has shape {f.shape}, the model's table "
                                 f"{tuple(m.weight.shape)}")
        if device.type == "cuda":
            far = [HostRows(f.read_all()) for f in far]
    elif device.type == "cuda":
        far = [HostRows(m.weight) for m in every]
    else:
        raise ValueError("offload on the CPU reads the tables from a safetensors file: pass weights= "
                         "(e.g. the checkpoint's model.safetensors)")
    stem_layer = [int(names[id(m)].split(".")[1]) for _, _, m in tables]   # layers.{i}.ffn...
    order = sorted([(layer, 1, ("stem", j)) for j, layer in enumerate(stem_layer)] +
                   [(layer, 0, ("dse", layer)) for layer in dict.fromkeys(layer for _, layer, _, _ in hashed)])
    engine = OffloadEngine(far[:len(tables)], device, dtype, int(cache_rows), prefetch, vocab=model.cfg.vocab_size,
                           hashed=[(f, mem, layer, k) for f, (mem, layer, k, _) in zip(far[len(tables):], hashed)],
                           order=[u for _, _, u in order])
    for j, (parent, attr, m) in enumerate(tables):
        engine.freed_bytes += m.weight.numel() * m.weight.element_size()
        setattr(parent, attr, OffloadedTable(engine, j, tuple(m.weight.shape)))
    for t, (mem, _, k, m) in enumerate(hashed):
        engine.freed_bytes += m.weight.numel() * m.weight.element_size()
        mem.tables[k] = OffloadedHashedTable(engine, t, tuple(m.weight.shape))
    if next(model.parameters()).device.type != "meta":  # a meta model is materialised by its caller
        model.to(device)

    def announce(module, args, kwargs):
        ids = args[0] if args else kwargs["ids"]
        rows = None
        if engine.hashed:
            rows = dse_row_ids(module, ids, kwargs.get("positions"), kwargs.get("cache"), kwargs.get("attn_mask"))
        engine.begin(ids, rows)

    engine.hook = model.register_forward_pre_hook(announce, with_kwargs=True)
    model.offload_engine = engine
    return engine
