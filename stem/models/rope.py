"""Rotary position embeddings with pluggable scaling (theta change, position interpolation, YaRN)."""
from __future__ import annotations

import math

import torch

from stem.models.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the attention temperature factor for this scaling."""
    if scaling.kind == "theta":
        theta = scaling.theta
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.kind == "linear":
        return (inv / scaling.factor).float(), 1.0
    if scaling.kind == "yarn":
        # NTK-by-parts: interpolate low frequencies (long wavelengths), keep high ones.
        wavelen = 2 * math.pi / inv
        orig = scaling.original_max_seq_len
        low, high = orig / scaling.beta_slow, orig / scaling.beta_fast
        ramp = ((wavelen - high) / (low - high)).clamp(0, 1)  # 0: keep, 1: interpolate
        inv = inv / (1 + ramp * (scaling.factor - 1))
        return inv.float(), 0.1 * math.log(scaling.factor) + 1.0
    return inv.float(), 1.0


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0):
    """cos/sin of shape positions.shape + (head_dim/2,) for integer per-token positions."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos() * mscale, angles.sin() * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (B, T, D/2). Rotates the two halves of the head dim (the HF Llama "rotate_half" convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)
