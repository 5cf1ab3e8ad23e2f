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
