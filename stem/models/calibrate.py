"""STEM tables calibrated from a dense model's own activations (``insert.init: calibrated``; issue 41, docs/real.md).

At a STEM layer the dense FFN W_d(s * u), s = SiLU(W_g h), u = W_up h (h the FFN input, after the FFN norm),
becomes W_d(s * U[t]). Over the occurrences n of token t in calibration text, the row U[t] that minimises the
gated error at the down-projection's input, sum_n ||s_n * (U[t] - u_n)||^2, is per coordinate j

    U[t]_j = sum_n s_nj^2 u_nj / sum_n s_nj^2        (a gate-weighted conditional mean)

(set the derivative 2 sum_n s_nj^2 (U_j - u_nj) to 0). It is accumulated in forward hooks, without storing
activations: two running sums (numerator, denominator) of the calibration text's distinct tokens only, n_layers x
distinct x d_ff x 2 fp32 (printed). Tokens the calibration never saw take the ``unseen`` rule: ``mean``, the same
statistic over all tokens (the gate-weighted mean of u), or ``raw``, E[t] W_up^T (the official script's row).

``sequential``: layer after layer, each calibrated with the earlier STEM layers already replaced by their
calibrated tables (as GPTQ calibrates), one forward pass per STEM layer instead of one in all. Every pass stops
after the last layer it calibrates (no later layer, no LM head).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

UNSEEN = ("mean", "raw")


class Stats:
    """The running sums of one layer: num = sum s^2 u, den = sum s^2 over the rows of ``ids`` (compact)."""

    def __init__(self, n_rows: int, d_ff: int):
        self.num = torch.zeros(n_rows, d_ff)
        self.den = torch.zeros(n_rows, d_ff)

    def add(self, rows: torch.Tensor, s: torch.Tensor, u: torch.Tensor):
        s2 = s.float().pow(2).reshape(-1, s.shape[-1])
        self.num.index_add_(0, rows.reshape(-1), s2 * u.float().reshape(-1, u.shape[-1]))
        self.den.index_add_(0, rows.reshape(-1), s2)

    def rows(self, fallback: torch.Tensor) -> torch.Tensor:
        """The calibrated rows; a coordinate no occurrence gated (den 0) takes ``fallback``'s value."""
        return torch.where(self.den > 0, self.num / self.den.clamp_min(1e-30), fallback)

    def mean(self) -> torch.Tensor:
        """The gate-weighted mean of u over every calibration token (the ``mean`` rule for unseen tokens)."""
        den = self.den.sum(0)
        return torch.where(den > 0, self.num.sum(0) / den.clamp_min(1e-30), torch.zeros_like(den))


class Calibration:
    """Calibrated rows of the STEM layers ``layers`` of a dense model: ``ids`` (the distinct calibration tokens),
    ``rows[i]`` (len(ids) x d_ff), ``mean[i]`` (d_ff); ``table(i, want, dense_state)`` builds any rows."""

    def __init__(self, ids: torch.Tensor, rows: dict, mean: dict, unseen: str, vocab_size: int):
        self.ids, self.rows, self.mean, self.unseen = ids, rows, mean, unseen
        self.index = torch.full((vocab_size,), -1, dtype=torch.long)
        self.index[ids] = torch.arange(len(ids))

    def table(self, layer: int, want: torch.Tensor, dense_state: dict) -> torch.Tensor:
        """The rows of token ids ``want`` (len(want) x d_ff) of layer ``layer``'s table: calibrated where seen, the
        ``unseen`` rule elsewhere."""
        k = self.index[want]
        seen = k >= 0
        if self.unseen == "raw":
            w_up = dense_state[f"layers.{layer}.ffn.w_up.weight"].float()
            out = F.linear(dense_state["tok_emb.weight"][want].float(), w_up)
        else:
            out = self.mean[layer].expand(len(want), -1).clone()
        out[seen] = self.rows[layer][k[seen]]
        return out

    def with_unseen(self, unseen: str) -> "Calibration":
        """The same rows with another rule for unseen tokens (no copy of the rows)."""
        if unseen not in UNSEEN:
            raise ValueError(f"calibration unseen={unseen!r}: expected one of {', '.join(UNSEEN)}")
        out = Calibration.__new__(Calibration)
        out.ids, out.rows, out.mean, out.index, out.unseen = self.ids, self.rows, self.mean, self.index, unseen
        return out

    def coverage(self, tokens: torch.Tensor) -> float:
        """The share of ``tokens`` whose row was calibrated."""
        return float((self.index[tokens.reshape(-1)] >= 0).float().mean())


class _Stop(Exception):
    """Raised after the last calibrated layer: the rest of the forward (and the LM head) is not needed."""


def _stop_hook(module, args, out):
    raise _Stop


def _stat_hook(stats: Stats, index: torch.Tensor):
    def hook(module, args, out):
        x, ids = args[0], args[1]
        stats.add(index[ids], F.silu(module.w_gate(x)), module.w_up(x))
    return hook


def _replace_hook(rows: torch.Tensor, index: torch.Tensor, fallback: torch.Tensor):
    """The dense FFN's output replaced by the STEM layer's: W_d(SiLU(W_g x) * U[t]) (all ids are calibrated)."""
    def hook(module, args, out):
        x, ids = args[0], args[1]
        return module.w_down(F.silu(module.w_gate(x)) * rows[index[ids]].to(x.dtype))
    return hook


@torch.no_grad()
def calibrate(model, tokens: torch.Tensor, layers: list[int], unseen: str = "mean", sequential: bool = False,
              batch: int = 4, log=print) -> Calibration:
    """Calibrate ``layers`` of the dense ``model`` (eval mode) on ``tokens`` (B, T) windows, ``batch`` at a time
    (``tokens`` may be a list of such tensors, each its own windows' length: the entity texts beside the source's
    windows, stem.train.entity_text)."""
    if unseen not in UNSEEN:
        raise ValueError(f"calibration unseen={unseen!r}: expected one of {', '.join(UNSEEN)}")
    n = model.cfg.n_layers
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"calibration layers {bad}: outside the model's {n} layers (expected 0..{n - 1})")
    parts = [t for t in (tokens if isinstance(tokens, (list, tuple)) else [tokens]) if t.numel()]
    if not parts:
        raise ValueError("calibration tokens: none (expected a calibration source with at least one window)")
    ids = torch.cat([t.reshape(-1) for t in parts]).unique()
    index = torch.full((model.cfg.vocab_size,), -1, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    d_ff = model.cfg.d_ff
    log(f"calibration: {sum(t.numel() for t in parts):,} tokens, {len(ids):,} distinct; running sums {len(layers)} x {len(ids):,} "
        f"x {d_ff:,} x 2 fp32 = {len(layers) * len(ids) * d_ff * 8 / 2 ** 20:,.0f} MiB"
        f"{', sequential' if sequential else ''}")
    stats = {i: Stats(len(ids), d_ff) for i in layers}
    rows, mean = {}, {}
    for group in ([[i] for i in layers] if sequential else [list(layers)]):
        hooks = [model.layers[i].ffn.register_forward_hook(_stat_hook(stats[i], index)) for i in group]
        hooks += [model.layers[i].ffn.register_forward_hook(_replace_hook(rows[i], index, mean[i])) for i in rows]
        hooks.append(model.layers[max(group)].register_forward_hook(_stop_hook))
        try:
            for x in (t[b:b + batch] for t in parts for b in range(0, len(t), batch)):
                try:
                    model(x)
                except _Stop:
                    pass
        finally:
            for h in hooks:
                h.remove()
        for i in group:
            mean[i] = stats[i].mean()
            rows[i] = stats[i].rows(mean[i])
            del stats[i]
    return Calibration(ids, rows, mean, unseen, model.cfg.vocab_size)
