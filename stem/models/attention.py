"""Document masking on CUDA with flex_attention: one block mask per step from per-token document ids.

On CPU (and wherever flex_attention is unavailable) the model falls back to a dense boolean mask
through scaled_dot_product_attention; both compute causal attention within documents only.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention   # lazy: only the document-masked (flex) path
    return torch.compile(flex_attention, dynamic=False)


def flex_document_mask(doc_ids: torch.Tensor):
    """Returns attend(q, k, v) that applies the causal within-document mask of ``doc_ids`` (B, T)."""
    from torch.nn.attention.flex_attention import create_block_mask   # lazy: only the flex path needs it

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)

    b, t = doc_ids.shape
    block_mask = create_block_mask(doc_causal, b, None, t, t, device=doc_ids.device)
    flex = _compiled_flex()

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    return attend
