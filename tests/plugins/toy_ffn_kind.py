"""An FFN kind as a plugin module (config ``plugins: [toy_ffn_kind]``; tests/test_plugins.py): a dense FFN
with a squared-ReLU activation, ``relu2``, built as ``cls(cfg, layer)`` taking ``(x, ids)``. It declares no
parameter roles, so accounting, optimizer groups, initialisation and sharding treat it as backbone.
It declares no torch-free facts (stem.models.registry.FFNFacts), so the workflow builds its models on the meta
device to count their parameters. (It imports torch, so a DAG built with it does too; a torch-free plugin
registers ``declare_ffn("relu2", "module:Class", table=False, lookup=False, params=lambda c: 2 * c.d_model *
c.d_ff)`` and keeps the class in that other module.)"""
import torch.nn as nn
import torch.nn.functional as F

from stem.models.registry import register_ffn


@register_ffn("relu2")
class Relu2FFN(nn.Module):
    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x, ids):
        return self.w_down(F.relu(self.w_up(x)).square())
