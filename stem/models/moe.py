"""Routed top-k Mixture-of-Experts FFN (ffn kind ``moe``): DeepSeekMoE (Dai et al., 2024), the DSE paper's
MoE baseline (its Table 3: 2 shared + top-6 of 72 routed experts at 27B, the first layer dense).

Per MoE layer, ``moe_shared`` shared experts that every token uses and E = ``moe_experts`` routed experts,
each a SwiGLU ``FFN_i(x) = W_d,i(SiLU(W_g,i x) * W_u,i x)`` of hidden width f = ``moe_d_ff`` (0: d_ff);
a router e_i (d x E, no bias) and k = ``moe_top_k``. For token t with input x_t:

    s_{i,t} = softmax_i(x_t . e_i)                       over the E routed experts
    g_{i,t} = s_{i,t} if i in top-k(s_t) else 0
    y_t     = sum_{j shared} FFN_j(x_t) + sum_i g_{i,t} FFN_i(x_t)

Choices (DeepSeekMoE v1): the top-k gates are *not* renormalised to sum to 1; ties are broken by
``torch.topk``; the router's logits and softmax are computed in fp32 (outside autocast), as DeepSeek's code
does, so bf16 rounding does not decide the routing. The ``moe_shared`` shared experts are computed as one
SwiGLU of width ``moe_shared * f`` (the sum of SwiGLUs is the SwiGLU of their concatenated hidden units:
the same function and the same parameters, as DeepSeek's ``shared_experts`` module).

DeepSeekMoE's expert-level balance loss, per MoE layer, over the T tokens of the forward call (all of them,
padding included: the layer does not see the targets); the DSE paper does not state its balance setting, so
alpha = ``moe_aux_coef`` defaults to 0.01:

    L = alpha * sum_i f_i P_i,   f_i = E / (k T) * #{t : i in top-k(s_t)},   P_i = (1 / T) sum_t s_{i,t}

(f_i counts, no gradient; P_i carries the router's gradient; L = alpha at perfectly uniform routing). It is
set as ``self.aux_loss`` in training mode and added to the objective by the model (stem.models.registry).
The loss depends on which tokens share a forward call: the training step computes it per micro-batch, so two
runs give the same objective when their per-rank micro-batches are the same.

Efficiency: the T k (token, expert) assignments are sorted by expert, each expert runs one matmul chain on
its rows, and the results are put back in assignment order by the inverse permutation (an index_select:
every assignment has its own slot, so nothing is scattered onto the same row and the sum over a token's k
experts is a fixed-order reduction). The routed experts are one module (``RoutedExperts``, dim 0 = expert),
its own FSDP unit over all ranks (``shard_unit``); router and shared experts belong to the block.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from stem.models.spec import ModelConfig
from stem.models.ffn import DenseFFN
from stem.models.registry import Role


class RoutedExperts(nn.Module):
    """E SwiGLU experts stacked on dim 0 (``w_gate``, ``w_up``: E x f x d; ``w_down``: E x d x f), k of
    which run per token (accounting: ``Role.active_experts``)."""
    shard_unit = True

    def __init__(self, n_experts: int, d_model: int, d_ff: int, top_k: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        # backbone matrices (normal init, the matrix group), top_k of n_experts active per token
        self.param_roles = {"w_*": Role(group="matrix", count="expert", active_experts=top_k)}

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` (N, d) sorted by expert, ``counts[e]`` of them for expert e -> each row's expert output."""
        ys = [(F.silu(h @ self.w_gate[e].T) * (h @ self.w_up[e].T)) @ self.w_down[e].T
              for e, h in enumerate(rows.split(counts))]
        return torch.cat(ys)


class RoutedMoEFFN(nn.Module):
    aux_loss: torch.Tensor | None = None   # the last training forward's balance loss (taken by the model)

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        d, f = cfg.d_model, cfg.expert_d_ff
        self.n_experts, self.top_k, self.aux_coef = cfg.moe_experts, cfg.moe_top_k, cfg.moe_aux_coef
        self.router = nn.Linear(d, cfg.moe_experts, bias=False)     # e_i: the rows of router.weight (E x d)
        self.shared = DenseFFN(cfg, layer, d_ff=cfg.moe_shared * f) if cfg.moe_shared else None
        self.experts = RoutedExperts(cfg.moe_experts, d, f, cfg.moe_top_k)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores s: T x E fp32 softmax, gates: T x k, chosen experts: T x k) of the tokens ``flat`` (T x d)."""
        with torch.autocast(flat.device.type, enabled=False):
            scores = F.linear(flat.float(), self.router.weight.float()).softmax(dim=-1)
        gates, chosen = torch.topk(scores, self.top_k, dim=-1)
        return scores, gates, chosen

    def forward(self, x, ids):
        flat = x.reshape(-1, x.shape[-1])
        t, k = flat.shape[0], self.top_k
        scores, gates, chosen = self.route(flat)
        expert = chosen.reshape(-1)                          # assignment a = t k + j: token t's j-th expert
        counts = torch.bincount(expert, minlength=self.n_experts)
        order = torch.argsort(expert, stable=True)           # assignments sorted by expert
        out = self.experts(flat.index_select(0, order // k), counts.tolist())
        out = out.index_select(0, torch.argsort(order)).view(t, k, -1)    # back in assignment order
        y = (out * gates.unsqueeze(-1).to(out.dtype)).sum(dim=1)   # the experts' dtype (bf16 under autocast)
        if self.shared is not None:
            y = y + self.shared(flat, None)
        self.aux_loss = self.balance_loss(scores, counts) if self.training else None
        return y.view(x.shape)

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """alpha * sum_i f_i P_i (module docstring) from the scores (T x E) and the assignments per expert."""
        t, e = scores.shape
        f = counts.to(scores.dtype) * (e / (self.top_k * t))
        return self.aux_coef * (f * scores.mean(dim=0)).sum()
