"""A toy FFN kind registered from the tests alone (tests/test_registry.py): a dense SwiGLU FFN plus a
per-token bias table B[t] (V x d_model) added to its output. The table declares its role: its own optimizer
group ``toy_bias`` (LR x2, no decay), a lookup (zero FLOPs), its own shard unit, zero-initialised by its
module. Imported by the test and by its 2-rank gloo worker (which must register the kind too)."""
from __future__ import annotations

import torch.nn as nn

from stem.models import registry
from stem.models.ffn import DenseFFN

KIND, GROUP = "toy_bias", "toy_bias"


class ToyBiasTable(nn.Embedding):
    param_roles = {"weight": registry.Role(group=GROUP, count="lookup", init="module")}
    shard_unit = True

    def reset_parameters(self):
        nn.init.zeros_(self.weight)


class ToyBiasFFN(DenseFFN):
    def __init__(self, cfg, layer: int = 0):
        super().__init__(cfg, layer)
        self.bias = ToyBiasTable(cfg.vocab_size, cfg.d_model)

    def forward(self, x, ids):
        return super().forward(x, ids) + self.bias(ids)


def register():
    registry.register_group(GROUP, lr_mult=2.0, weight_decay=0.0)
    registry.register_ffn(KIND)(ToyBiasFFN)


def unregister():
    if KIND in registry.FFN_KINDS:
        registry.FFN_KINDS.remove(KIND)
    if GROUP in registry.OPTIM_GROUPS:
        registry.OPTIM_GROUPS.remove(GROUP)
