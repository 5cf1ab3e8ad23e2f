"""AdamW with named parameter groups owned by the model (matrix, norm, table, dse_table)."""
from __future__ import annotations

import torch

# Weight decay and LR multiplier per group unless the config overrides them: norms are not decayed;
# STEM tables are decayed like the backbone (the official code's separate AdamW uses the same
# hyper-parameters); DSE tables follow the DSE paper (no decay, LR x5).
GROUP_DEFAULTS = {"matrix": (1.0, None), "norm": (1.0, 0.0), "table": (1.0, None), "dse_table": (5.0, 0.0)}


def build_optimizer(model, optim: dict, lr: float, fused: bool = False) -> torch.optim.AdamW:
    overrides = optim.get("groups", {})
    groups = []
    for name, params in model.param_groups().items():
        lr_mult, wd = GROUP_DEFAULTS[name]
        o = overrides.get(name, {})
        lr_mult = o.get("lr_mult", lr_mult)
        wd = o.get("weight_decay", optim["weight_decay"] if wd is None else wd)
        groups.append({"params": params, "name": name, "lr_mult": lr_mult, "weight_decay": wd, "lr": lr * lr_mult})
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(optim["betas"]), eps=optim["eps"], fused=fused)


def set_lr(opt: torch.optim.Optimizer, lr: float):
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_mult"]
