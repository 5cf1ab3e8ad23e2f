"""Greedy decoding, with a KV cache or by recomputing the whole prefix each step."""
from __future__ import annotations

from typing import Callable

import torch

from stem.models.model import KVCache


@torch.no_grad()
def greedy_generate(model, ids: list[int], max_new: int, eos_id: int | None = None, use_cache: bool = True,
                    stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """New token ids (EOS excluded) after ``ids``; stops at EOS, when ``stop(generated)`` is true,
    or after ``max_new`` tokens. ``len(ids) + max_new`` must fit the model's context."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    cache = KVCache() if use_cache else None
    out: list[int] = []
    for _ in range(max_new):
        logits = model(x, cache=cache)[0, -1]
        nxt = int(logits.argmax())
        if nxt == eos_id:
            break
        out.append(nxt)
        if stop is not None and stop(out):
            break
        step = torch.tensor([[nxt]], device=device)
        x = step if use_cache else torch.cat([x, step], dim=1)
    return out


def _forward(model, ids, positions, mask, cache: KVCache):
    """Logits of the last position, with an explicit mask that excludes the left padding."""
    return model(ids, positions=positions, cache=cache, attn_mask=mask)[:, -1]


@torch.no_grad()
def greedy_generate_batch(model, prompts: list[list[int]], max_new: int, eos_id: int | None = None,
                          stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """``greedy_generate`` for several prompts at once. Each prompt is prefilled alone (the model's
    own causal forward), the caches are left-padded into one, and decoding steps run batched with
    the padding masked out and per-row positions, so a row decodes as it would alone (up to float
    round-off)."""
    if len(prompts) == 1:
        return [greedy_generate(model, p, max_new, eos_id, True, stop) for p in prompts]
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    cache, nxt = KVCache(length=width), []
    for i, p in enumerate(prompts):
        c = KVCache()
        nxt.append(int(model(torch.tensor([p], device=device), cache=c)[0, -1].argmax()))
        for layer, (k, v) in enumerate(zip(c.k, c.v)):
            if i == 0:
                cache.k.append(k.new_zeros(b, k.shape[1], width, k.shape[3]))
                cache.v.append(v.new_zeros(b, v.shape[1], width, v.shape[3]))
            cache.k[layer][i, :, width - len(p):] = k[0]
            cache.v[layer][i, :, width - len(p):] = v[0]
        for layer, state in c.dse.items():   # DSE memory state: per row, the last ids and conv inputs
            merged = cache.dse.setdefault(layer, {name: t.new_zeros(b, *t.shape[1:]) for name, t in state.items()})
            for name, t in state.items():
                merged[name][i] = t[0]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    valid = torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]  # (B, S) real keys
    out, done = [[] for _ in prompts], [False] * b
    for step in range(max_new):
        for i, tok in enumerate(nxt):
            if done[i]:
                continue
            if tok == eos_id:
                done[i] = True
                continue
            out[i].append(tok)
            done[i] = (stop is not None and stop(out[i])) or len(out[i]) == max_new
        if all(done) or step == max_new - 1:
            break
        valid = torch.cat([valid, torch.ones(b, 1, dtype=torch.bool, device=device)], dim=1)
        ids = torch.tensor(nxt, device=device)[:, None]
        logits = _forward(model, ids, (lengths + step)[:, None], valid[:, None, None, :], cache)
        nxt = logits.argmax(-1).tolist()
    return out
