"""Parameter and FLOP accounting, in the paper's convention and exactly.

- ``total_params``: exact count of the model as built.
- ``paper_total_params``: the paper's Table 3 convention, dense total + n_table_layers * V * d_ff
  (the removed up-projections are not subtracted); for Hash-MoE and DSE the exact count.
- ``active_params``: parameters used per token in matrix products: all STEM/DSE tables are lookups
  (zero FLOPs, not counted) and only one of E Hash-MoE experts runs. For STEM this is
  dense total - n_stem * d_model * d_ff (the input embedding counts, as in the paper's dense rows).
- ``gflops_per_token``: 2 * active / 1e9 (forward, attention's context-dependent term excluded).
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from stem.models.config import TABLE_KINDS, ModelConfig
from stem.models.dse import DSEMemory
from stem.models.ffn import HashMoEFFN, StemTable
from stem.models.model import build_model


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def accounting(model: nn.Module) -> dict:
    cfg: ModelConfig = model.cfg
    total = _numel(model.parameters())
    tables = _numel(m.weight for m in model.modules() if isinstance(m, StemTable))
    dse_tables = _numel(t.weight for m in model.modules() if isinstance(m, DSEMemory) for t in m.tables)
    experts = [m for m in model.modules() if isinstance(m, HashMoEFFN)]
    inactive_experts = sum(_numel(m.parameters()) * (cfg.n_experts - 1) // cfg.n_experts for m in experts)
    active = total - tables - dse_tables - inactive_experts
    n_table_layers = sum(k in TABLE_KINDS for k in cfg.ffn)
    if n_table_layers:
        paper_total = dense_total_params(cfg) + n_table_layers * cfg.vocab_size * cfg.d_ff
    else:
        paper_total = total
    return {
        "total_params": total,
        "paper_total_params": paper_total,
        "active_params": active,
        "gflops_per_token": 2 * active / 1e9,
        "sparse_layers": cfg.sparse_layers,
        "dse_layers": list(cfg.dse.layers) if cfg.dse else [],
    }


def dense_total_params(cfg: ModelConfig) -> int:
    dense = dataclasses.replace(cfg, ffn=("dense",) * cfg.n_layers, dse=None)
    return _numel(build_model(dense, "meta").parameters())


def training_flops(active_params: int, tokens: int) -> float:
    """Training FLOPs in the paper's convention: forward 2 * active per token, backward twice that."""
    return 6.0 * active_params * tokens
