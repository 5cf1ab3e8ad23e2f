"""Parameter and FLOP accounting, in the paper's convention and exactly.

Which parameters are tables or experts comes from the modules' declared roles (``stem.models.registry``).

- ``total_params``: exact count of the model as built (a tied embedding and head, ``tie_embeddings``, is one
  parameter: counted once, as ``model.parameters()`` and the official tied configs count it).
- ``paper_total_params``: the paper's Table 3 convention, dense total + the parameters whose role is
  ``paper_table`` (n_table_layers * V * d_ff for STEM: the removed up-projections are not subtracted);
  without such parameters (Hash-MoE, DSE) the exact count.
- ``active_params``: parameters used per token in matrix products: ``lookup`` roles (all STEM/DSE tables:
  zero FLOPs) are not counted, and of an ``expert`` role (dim 0 = E experts) ``active_experts`` run: one of
  Hash-MoE's, top-k of the routed MoE's (its router and shared experts run for every token). For STEM this is
  dense total - n_stem * d_model * d_ff (the input embedding counts, as in the paper's dense rows).
- ``gflops_per_token``: 2 * active / 1e9 (forward, attention's context-dependent term excluded).

The DSE paper's convention (its Sec. 3.1), beside these (new keys; the ones above are unchanged):

- ``p_tot``: trainable parameters excluding the vocabulary embedding (``tok_emb``) and the LM head.
- ``p_act``: parameters used per token (``active_params``) excluding the embedding and the head; it sets the
  per-token FLOPs.
- ``p_free``: ``p_tot - p_act``, the parameters a token does not use (STEM/DSE tables, idle experts).
- ``dse_params``: the hashed DSE tables (parameters in the ``dse_table`` optimizer group), Table 1's
  "# DSE Parameters"; 0 without DSE.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from stem.models.spec import ModelConfig
from stem.models.model import build_model
from stem.models.registry import param_roles


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def accounting(model: nn.Module) -> dict:
    cfg: ModelConfig = model.cfg
    roles = param_roles(model)
    total = _numel(model.parameters())
    lookups = _numel(p for p in model.parameters() if id(p) in roles and roles[id(p)].count == "lookup")
    inactive_experts = sum(_inactive_expert_params(p, roles[id(p)]) for p in model.parameters()
                           if id(p) in roles and roles[id(p)].count == "expert")
    active = total - lookups - inactive_experts
    paper_tables = _numel(p for p in model.parameters() if id(p) in roles and roles[id(p)].paper_table)
    paper_total = dense_total_params(cfg) + paper_tables if paper_tables else total
    emb_head = _numel({id(p): p for p in (model.tok_emb.weight, model.lm_head.weight)}.values())   # once if tied
    dse_tables = _numel(p for p in model.parameters() if id(p) in roles and roles[id(p)].group == "dse_table")
    sparse = [i for i, block in enumerate(model.layers) if any(id(p) in roles for p in block.ffn.parameters())]
    return {
        "total_params": total,
        "paper_total_params": paper_total,
        "active_params": active,
        "gflops_per_token": 2 * active / 1e9,
        "sparse_layers": sparse,
        "dse_layers": list(cfg.dse.layers) if cfg.dse else [],
        "p_tot": total - emb_head,
        "p_act": active - emb_head,
        "p_free": total - active,
        "dse_params": dse_tables,
    }


def _inactive_expert_params(p, role) -> int:
    """Parameters of the experts that do not run for a token: (E - a) / E of an ``expert`` parameter whose
    dim 0 indexes E experts, a = ``role.active_experts`` of which run (Hash-MoE 1, routed MoE top-k)."""
    e, a = p.shape[0], role.active_experts
    if a > e:
        raise ValueError(f"an expert parameter of shape {tuple(p.shape)} declares {a} active experts of {e}")
    return p.numel() // e * (e - a)


def dense_total_params(cfg: ModelConfig) -> int:
    dense = dataclasses.replace(cfg, ffn=("dense",) * cfg.n_layers, dse=None)
    return _numel(build_model(dense, "meta").parameters())


def training_flops(active_params: int, tokens: int) -> float:
    """Training FLOPs in the paper's convention: forward 2 * active per token, backward twice that."""
    return 6.0 * active_params * tokens


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of attention's context-dependent products (QK^T and AV), which no parameter
    counts: 2 products x 2 FLOPs a multiply-add x n_heads x head_dim x seq_len per layer forward, x 3 for
    forward + backward = 12 x n_layers x n_heads x head_dim x seq_len (PaLM, Chowdhery et al. 2022, App. B;
    the convention torchtitan's MFU uses). The full context is counted (the causal half is not subtracted),
    as in that convention."""
    return 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def matmul_active_params(acct: dict, cfg: ModelConfig) -> int:
    """The active parameters that run in matrix products: ``active_params`` less the input embedding (a
    lookup, like STEM's tables; the paper's convention counts it in ``active_params``, MFU does not)."""
    return acct["active_params"] - cfg.vocab_size * cfg.d_model


def flops_per_token(acct: dict, cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token for MFU: 6 x the matrix-product active parameters (forward 2, backward 4)
    + attention's context term at ``seq_len``."""
    return 6.0 * matmul_active_params(acct, cfg) + attention_flops_per_token(cfg, seq_len)
