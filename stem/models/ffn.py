"""Feed-forward kinds. Every FFN takes ``(x, ids)``: hidden states (B, T, d) and token ids (B, T).

- ``dense``       y = W_d(SiLU(W_g x) * W_u x)                 (SwiGLU, Eq. 1)
- ``stem``        y = W_d(SiLU(W_g x) * U[t])                  (Eq. 4)
- ``stem_gate``   y = W_d(SiLU(U[t]) * W_u x)                  (gate-proj ablation, Sec. 4.4.2)
- ``stem_dagger`` y = W_d(SiLU(W_g x) * (W_u x + U[t]))        (STEM-dagger, Eq. 5)
- ``hashmoe``     y = f_{h(t)}(x), top-1 of E SwiGLU experts, h a seeded balanced token->expert map
- ``moe``         shared + softmax-routed top-k SwiGLU experts with a balance loss (DeepSeekMoE; stem.models.moe)

Each kind is registered by name in ``stem.models.registry``; the modules declare their parameters' roles.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from stem.models.spec import ModelConfig
from stem.models.registry import Role, ffn_class

# A STEM table is read by token id: its own optimizer group, zero FLOPs, added to the dense total in the
# paper's convention, initialised by StemTable.reset_parameters (after the backbone's normal init).
TABLE = Role(group="table", count="lookup", paper_table=True, init="module")
# Hash-MoE expert weights (dim 0 = expert): backbone matrices, one expert of E active per token.
EXPERT = Role(group="matrix", count="expert")


def _linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


class DenseFFN(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, d_ff: int | None = None):
        super().__init__()
        f = d_ff or cfg.d_ff   # another width: the routed MoE's shared experts
        self.w_gate = _linear(cfg.d_model, f)
        self.w_up = _linear(cfg.d_model, f)
        self.w_down = _linear(f, cfg.d_model)

    def forward(self, x, ids):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class RowSparseLookup(torch.autograd.Function):
    """``weight[ids]`` whose gradient is the batch's unique rows only: a coalesced sparse COO tensor
    (indices = the sorted unique ids, values = the summed gradient of each row), so backward costs
    uniq(ids) x d_ff instead of zero-filling and writing a V x d_ff dense gradient."""

    @staticmethod
    def forward(ctx, weight, ids):
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        uniq, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        rows = grad_out.new_zeros(uniq.numel(), ctx.shape[1])
        rows.index_add_(0, inverse, grad_out.reshape(-1, ctx.shape[1]))
        grad = torch.sparse_coo_tensor(uniq.unsqueeze(0), rows, ctx.shape, is_coalesced=True, check_invariants=False)
        return grad, None


class StemTable(nn.Embedding):
    """The per-layer V x d_ff table U, sharded over all ranks as its own unit.

    ``row_sparse = True`` (set by ``stem.optim.adamw.use_row_sparse`` for ``optim.table_update:
    sparse``): the lookup's gradient holds only the batch's unique rows (``RowSparseLookup``) and the table
    is not sharded (its sparse gradient is all-gathered instead, ``stem.train.distributed``)."""
    param_roles = {"weight": TABLE}
    shard_unit = True
    row_sparse = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.vocab_size, cfg.d_ff)
        self.init_kind, self.init_std = cfg.table_init, cfg.table_init_std
        self.reset_parameters()  # nn.Embedding's own call ran before init_kind was known

    def reset_parameters(self):
        if getattr(self, "init_kind", "xavier_normal") == "xavier_normal":  # std = sqrt(2 / (V + d_ff)), as the official code
            nn.init.xavier_normal_(self.weight)
        else:
            nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, ids):
        return RowSparseLookup.apply(self.weight, ids) if self.row_sparse else super().forward(ids)


class StemFFN(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.w_gate = _linear(cfg.d_model, cfg.d_ff)
        self.table = StemTable(cfg)
        self.w_down = _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, ids):
        return self.w_down(F.silu(self.w_gate(x)) * self.table(ids))


class StemGateFFN(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.table = StemTable(cfg)
        self.w_up = _linear(cfg.d_model, cfg.d_ff)
        self.w_down = _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, ids):
        return self.w_down(F.silu(self.table(ids)) * self.w_up(x))


class StemDaggerFFN(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.w_gate = _linear(cfg.d_model, cfg.d_ff)
        self.w_up = _linear(cfg.d_model, cfg.d_ff)
        self.table = StemTable(cfg)
        self.w_down = _linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, ids):
        return self.w_down(F.silu(self.w_gate(x)) * (self.w_up(x) + self.table(ids)))


def balanced_expert_map(vocab_size: int, n_experts: int, seed: int) -> torch.Tensor:
    """Token id -> expert: a seeded permutation of ``arange(V) % E`` (each expert gets V/E ids)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=g, device="cpu")
    return (perm % n_experts).to(torch.int64)


class HashMoEFFN(nn.Module):
    """Hash layer MoE (Roller et al., 2021): no router, no auxiliary loss, one full SwiGLU expert per token."""
    param_roles = {"w_gate": EXPERT, "w_up": EXPERT, "w_down": EXPERT}
    shard_unit = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        self.w_gate = nn.Parameter(torch.empty(e, f, d))
        self.w_up = nn.Parameter(torch.empty(e, f, d))
        self.w_down = nn.Parameter(torch.empty(e, d, f))
        # Persistent: the map is part of the model (saved with checkpoints, different per layer).
        emap = balanced_expert_map(cfg.vocab_size, e, cfg.hash_seed * 1000 + layer)
        self.register_buffer("expert_of_token", emap.to(self.w_up.device))

    def forward(self, x, ids):
        # Tokens sorted by expert, one matmul chain per expert, then put back in order. The output is
        # built from the experts' results, so it has their dtype (bf16 under autocast).
        flat, expert = x.reshape(-1, x.shape[-1]), self.expert_of_token[ids.reshape(-1)]
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.w_up.shape[0]).tolist()
        ys = [(F.silu(h @ self.w_gate[e].T) * (h @ self.w_up[e].T)) @ self.w_down[e].T
              for e, h in enumerate(flat.index_select(0, order).split(counts))]
        return torch.cat(ys).index_select(0, torch.argsort(order)).reshape(x.shape)


def build_ffn(kind: str, cfg: ModelConfig, layer: int) -> nn.Module:
    return ffn_class(kind)(cfg, layer)
