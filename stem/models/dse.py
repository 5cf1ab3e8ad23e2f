"""Deep Sparse Embedding (DSE, "Conditional Memory via Scalable Lookup"): a hashed N-gram memory.

Per DSE layer: the suffix N-grams (N in ``orders``) of compressed token ids are hashed by K heads
(multiplicative-XOR mix with seeded odd multipliers, modulo a distinct prime per head) into
per-head tables; the concatenated memory e_t gives a key and a value; a context-aware gate
sigmoid(RMSNorm(h) . RMSNorm(k) / sqrt(d)) scales the value (Eq. 4, u = alpha * v); a zero-initialised
depthwise causal convolution (kernel 4, dilation = max order) refines it, y = SiLU(Conv1D(RMSNorm(u))) + u
(Eq. 5); y is added to the residual stream before attention. Neither the N-grams nor the convolution
reach across a document start.

``mode`` is an inference-only override of the gate for the DSE paper's sensitivity analysis (App. G):
``normal`` (the learned gate), ``disabled`` (gate 0: u = 0, so y = 0 and the block sees no memory) and
``forced`` (gate 1: u = v, full-strength injection). It is a plain attribute, neither a parameter nor a
buffer: training never sets it and checkpoints never hold it (``Transformer.set_dse_mode``).
"""
from __future__ import annotations

import math
import random
import unicodedata

import torch
import torch.nn as nn
import torch.nn.functional as F

from stem.models.spec import DSEConfig, ModelConfig, table_rows
from stem.models.registry import Role


def normalise_token(text: str) -> str:
    """The DSE vocabulary compression key: NFKC, NFD, strip accents, lowercase, collapse whitespace."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if not unicodedata.combining(c)).lower()
    return " ".join(t.split()).strip()


def compression_map(token_texts: list[str]) -> torch.Tensor:
    """Map every id to the smallest id with the same normal form."""
    first: dict[str, int] = {}
    return torch.tensor([first.setdefault(normalise_token(t), i) for i, t in enumerate(token_texts)])


def token_compression(tok, vocab_size: int) -> torch.Tensor:
    """``compression_map`` of a model's ``vocab_size`` ids from its tokenizer (``decode``, ``vocab_size``): each
    id's decoded text; ids past the tokenizer's vocabulary are each their own class."""
    texts = [tok.decode([i]) for i in range(min(tok.vocab_size, vocab_size))]
    texts += [f"<unused{i}>" for i in range(len(texts), vocab_size)]
    return compression_map(texts)


DSE_MODES = ("normal", "disabled", "forced")


class DSEMemory(nn.Module):
    # Hashed tables: their own optimizer group (LR x5, no decay), zero FLOPs. The convolution starts at
    # zero (reset_parameters). The whole memory is one shard unit over all ranks.
    param_roles = {"tables.*.weight": Role(group="dse_table", count="lookup"),
                   "conv.weight": Role(init="module")}
    shard_unit = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        dc: DSEConfig = cfg.dse
        n_tables = len(dc.orders) * dc.heads
        if dc.d_mem % n_tables:
            raise ValueError(f"dse.d_mem={dc.d_mem}: must divide evenly over {n_tables} order x head tables")
        self.orders, self.heads, self.d_model = tuple(dc.orders), dc.heads, cfg.d_model
        self._hash = (dc.seed * 7919 + layer, dc.rows_per_head, n_tables, max(dc.orders))
        primes, mult = self._hash_constants()
        self.tables = nn.ModuleList(nn.Embedding(p, dc.d_mem // n_tables) for p in primes)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.int64), persistent=False)
        self.w_key = nn.Linear(dc.d_mem, cfg.d_model, bias=False)
        self.w_value = nn.Linear(dc.d_mem, cfg.d_model, bias=False)
        self.norm_h = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.norm_k = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.norm_u = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.dilation = max(dc.orders)
        self.conv = nn.Conv1d(cfg.d_model, cfg.d_model, dc.conv_kernel, groups=cfg.d_model,
                              dilation=self.dilation, bias=False)
        self.mode = "normal"   # inference-only gate override (module docstring); never saved

    def _hash_constants(self) -> tuple[list[int], list[list[int]]]:
        """(a distinct prime row count per table, seeded odd multipliers per table and N-gram position)."""
        seed, rows, n_tables, n_max = self._hash
        rng = random.Random(seed)
        primes = list(table_rows(rows, n_tables))
        return primes, [[rng.randrange(1, 1 << 20) | 1 for _ in range(n_max)] for _ in range(n_tables)]

    def reset_buffers(self):
        """Recompute the hash constants (not saved with the weights), e.g. after ``to_empty`` of a meta model."""
        primes, mult = self._hash_constants()
        self.primes.copy_(torch.tensor(primes, dtype=torch.int64))
        self.multipliers.copy_(torch.tensor(mult, dtype=torch.int64))

    def reset_parameters(self):
        nn.init.zeros_(self.conv.weight)

    def forward(self, h: torch.Tensor, cids: torch.Tensor, doc_ids: torch.Tensor | None,
                state: dict | None = None) -> torch.Tensor:
        """h: (B, T, d) hidden states; cids: (B, T) compressed ids; doc_ids: (B, T) document index or None.
        ``state`` (incremental decoding, a KV cache's per-layer dict, filled here): the last max(orders) - 1
        compressed ids and the last (W-1) x dilation convolution inputs of the prefix seen so far (zeros before
        the row start, as the full forward pads), so the new tokens' N-grams and taps read the cached prefix
        and the outputs are those of the whole sequence's forward."""
        rows = self._rows(cids, doc_ids) if state is None else self._rows_cached(cids, state)
        mem = torch.cat([tab(r) for tab, r in zip(self.tables, rows)], dim=-1)
        key, value = self.w_key(mem), self.w_value(mem)
        if self.mode == "normal":
            # the key in its norm's dtype, as the residual stream h is: under bf16 autocast the projection gives
            # bf16 and the weight is fp32, and CUDA's fused rms_norm needs the two equal (a no-op otherwise)
            key_n = self.norm_k(key.to(self.norm_k.weight.dtype))
            score = (self.norm_h(h) * key_n).sum(-1, keepdim=True) / math.sqrt(self.d_model)
            gate = torch.sigmoid(score)
        else:  # App. G: the gate forced to 0 (disabled) or 1 (forced)
            gate = torch.full_like(value[..., :1], 1.0 if self.mode == "forced" else 0.0)
        u = gate * value
        x = self.norm_u(u)
        conv = self._causal_conv(x, doc_ids) if state is None else self._causal_conv_cached(x, state)
        return F.silu(conv) + u

    def _causal_conv(self, x: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """Depthwise causal dilated convolution of x (B, T, d) with ``self.conv``'s weights, as a sum of
        shifted copies: tap i reads x[t - (W-1-i) * dilation], zero before the row or the document start."""
        w, t = self.conv.weight[:, 0, :], x.shape[1]   # (d, W)
        out = torch.zeros_like(x)
        for i in range(w.shape[1]):
            shift = (w.shape[1] - 1 - i) * self.dilation
            if shift >= t:
                continue
            xs = F.pad(x, (0, 0, shift, 0))[:, :t]
            if doc_ids is not None and shift:
                same = F.pad(doc_ids, (shift, 0), value=-1)[:, :t] == doc_ids
                xs = xs * same.unsqueeze(-1)
            out = out + xs * w[:, i]
        return out

    def _causal_conv_cached(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        """``_causal_conv`` of the new positions x (B, t, d) after the cached inputs ``state['conv']``
        (B, (W-1) x dilation, d; zeros before the row start): the same terms in the same order (a tap before the
        row start adds zero where the full forward skips it); the cache then keeps the last (W-1) x dilation
        inputs."""
        span = (self.conv.weight.shape[-1] - 1) * self.dilation
        past = state.get("conv")
        if past is None:
            past = x.new_zeros(x.shape[0], span, x.shape[2])
        xc = torch.cat([past, x], dim=1)
        state["conv"] = xc[:, xc.shape[1] - span:]
        return self._causal_conv(xc, None)[:, span:]

    def row_ids(self, cids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                state: dict | None = None) -> list[torch.Tensor]:
        """The row ids (B, T) each table reads for ``cids``, as ``forward`` computes them (``state``: a KV
        cache's, read and not changed), e.g. for an offload engine that fetches rows before the layer runs."""
        if state is None:
            return self._rows(cids, doc_ids)
        return [r[:, self.dilation - 1:] for r in self._rows(self._with_cached_ids(cids, state), None)]

    def _with_cached_ids(self, cids: torch.Tensor, state: dict) -> torch.Tensor:
        """The cached last max(orders) - 1 compressed ids (-1 before the row start: padding, as the full
        forward pads) followed by ``cids``."""
        past = state.get("ids")
        if past is None:
            past = cids.new_full((cids.shape[0], self.dilation - 1), -1)
        return torch.cat([past, cids], dim=1)

    def _rows_cached(self, cids: torch.Tensor, state: dict) -> list[torch.Tensor]:
        """``row_ids`` under the cache; the cache then keeps the last max(orders) - 1 ids."""
        rows = self.row_ids(cids, None, state)
        full = self._with_cached_ids(cids, state)
        state["ids"] = full[:, full.shape[1] - (self.dilation - 1):]
        return rows

    def _rows(self, cids: torch.Tensor, doc_ids: torch.Tensor | None) -> list[torch.Tensor]:
        rows, t = [], 0
        for n in self.orders:
            grams = [cids]
            for j in range(1, n):
                prev = F.pad(cids, (j, 0), value=-1)[:, :-j]
                if doc_ids is not None:  # a token from another document counts as padding (-1)
                    prev_doc = F.pad(doc_ids, (j, 0), value=-1)[:, :-j]
                    prev = torch.where(prev_doc == doc_ids, prev, torch.full_like(prev, -1))
                grams.append(prev + 1)  # +1: padding (-1) hashes as 0, token id k as k + 1
            for _ in range(self.heads):
                mix = torch.zeros_like(cids)
                for j, g in enumerate(grams):
                    mix = mix ^ (g * self.multipliers[t, j])
                rows.append(mix % self.primes[t])
                t += 1
        return rows
