"""AdamW with named parameter groups owned by the model (matrix, norm, table, dse_table, and any group a
registered kind adds: ``stem.models.registry.OPTIM_GROUPS``)."""
from __future__ import annotations

import torch

from stem.models.registry import OPTIM_GROUPS

# LR multiplier and weight decay per group unless the config overrides them (see the registry).
GROUP_DEFAULTS = OPTIM_GROUPS


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
