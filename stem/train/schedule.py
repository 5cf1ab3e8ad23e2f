"""Learning-rate schedules: linear warmup, then cosine (to min_lr_ratio x peak) or linear decay."""
from __future__ import annotations

import math


def get_lr(step: int, *, lr: float, steps: int, warmup: float, schedule: str, min_lr_ratio: float,
           schedule_steps: int | None = None) -> float:
    """LR at optimizer step ``step`` (0-based). ``warmup`` is a fraction of the schedule's horizon,
    ``schedule_steps`` (default ``steps``) the horizon the decay is laid out over."""
    horizon = schedule_steps or steps
    n_warm = max(1, round(warmup * horizon)) if warmup > 0 else 0
    if step < n_warm:
        return lr * (step + 1) / n_warm
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - n_warm) / max(1, horizon - n_warm))
    min_lr = lr * min_lr_ratio
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"schedule {schedule!r}: expected cosine, linear or constant")
