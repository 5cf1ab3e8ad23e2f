"""Rotary position embeddings with pluggable scaling (theta change, position interpolation, YaRN)."""
from __future__ import annotations

import math

import torch

from stem.models.spec import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the attention temperature factor for this scaling."""
    if scaling.kind == "theta":
        theta = scaling.theta
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling.kind == "linear":
        return (inv / scaling.factor).float(), 1.0
    if scaling.kind == "llama3":
        # Llama 3.1/3.2 (the published rope_scaling of type llama3): wavelength w_d = 2 pi / theta_d over the
        # original context L; w_d < L / high_freq_factor kept, w_d > L / low_freq_factor divided by s, between
        # theta_d' = (1 - k) theta_d / s + k theta_d with k = (L / w_d - low) / (high - low).
        s, low, high, length = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_seq_len
        ratio = length * inv / (2 * math.pi)                 # L / w_d
        k = ((ratio - low) / (high - low)).clamp(0, 1)       # 0: long wavelengths (scaled), 1: short (kept)
        return ((1 - k) * inv / s + k * inv).float(), 1.0
    if scaling.kind == "yarn":
        # YaRN (Peng et al., 2023). NTK-by-parts (Sec. 3.2): dimension d turns r = L / lambda_d times over
        # the original context L; gamma(r) = 0 below alpha, 1 above beta, linear between;
        # theta_d' = (1 - gamma) theta_d / s + gamma theta_d.
        s, alpha, beta, length = scaling.factor, scaling.beta_slow, scaling.beta_fast, scaling.original_max_seq_len
        if scaling.ramp == "rotations":
            gamma = ((length * inv / (2 * math.pi) - alpha) / (beta - alpha)).clamp(0, 1)
        else:  # "dims", the reference code's ramp: linear in d between the (floored/ceiled) d where r = beta, alpha
            def dim_at(r):
                return head_dim * math.log(length / (2 * math.pi * r)) / (2 * math.log(theta))
            low, high = max(math.floor(dim_at(beta)), 0), min(math.ceil(dim_at(alpha)), head_dim - 1)
            d = torch.arange(head_dim // 2, dtype=torch.float64)
            gamma = 1 - ((d - low) / ((high - low) or 0.001)).clamp(0, 1)
        inv = (1 - gamma) * inv / s + gamma * inv
        # Attention temperature (Sec. 3.4): sqrt(1/t) = 0.1 ln s + 1 multiplies cos/sin, so both q and k,
        # and q.k / sqrt(D) is scaled by 1/t.
        return inv.float(), 0.1 * math.log(s) + 1.0
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
