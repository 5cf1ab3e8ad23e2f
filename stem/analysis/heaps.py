"""Context-length adaptive parameter usage (STEM paper Sec. 3.2.5).

On held-out text (the validation split of a token source), L_uniq(L) is the number of distinct token ids in
the first L tokens of a window, averaged over windows at evenly spaced offsets. The Heaps fit
L_uniq = K L^beta is a least-squares line through (log L, log L_uniq). The STEM parameters a sequence
activates are |S| d_ff L_uniq (|S| = the layers with a STEM table): they grow with the context at a constant
per-token FLOP count.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from stem.analysis.common import table_sites
from stem.checkpoint import read_checkpoint_spec
from stem.data.shards import ShardSet
from stem.models.spec import ModelConfig
from stem.models.model import build_model


def unique_counts(tokens: np.ndarray, lengths: list[int]) -> list[int]:
    """Distinct ids among the first L tokens, for each L."""
    return [int(np.unique(tokens[:L]).size) for L in lengths]


def fit_power_law(x, y) -> dict:
    """Least squares of log y = log K + beta log x: {K, beta, r2}."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if lx.size < 2 or np.ptp(lx) == 0:
        raise ValueError(f"Heaps fit: need at least two distinct context lengths, got {list(x)}")
    beta, logk = np.polyfit(lx, ly, 1)
    pred = logk + beta * lx
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float(((ly - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {"K": float(math.exp(logk)), "beta": float(beta), "r2": r2}


def heaps_curve(tokens: np.ndarray, lengths: list[int], windows: int) -> tuple[list[int], list[float]]:
    """(lengths that fit in ``tokens``, mean L_uniq over ``windows`` windows at evenly spaced offsets)."""
    lengths = sorted(L for L in lengths if 1 <= L <= tokens.size)
    if len(lengths) < 2:
        raise ValueError(f"Heaps: held-out text of {tokens.size} tokens fits fewer than two of the configured "
                         "lengths; lower analysis.heaps.lengths or use a larger source")
    span = tokens.size - lengths[-1]
    starts = np.linspace(0, span, windows).astype(int) if windows > 1 else [0]
    counts = np.array([unique_counts(tokens[s:s + lengths[-1]], lengths) for s in starts], float)
    return lengths, counts.mean(axis=0).tolist()


def run(ckpt_dir, spec: dict) -> dict:
    saved = read_checkpoint_spec(ckpt_dir)
    cfg = ModelConfig.from_dict(saved["model"])
    model = build_model(cfg, "meta")  # shapes and roles only
    n_stem = len(table_sites(model))
    shards = ShardSet(Path(spec["manifest"]).parent, "val")
    tokens = shards.get(0, len(shards))
    lengths, uniq = heaps_curve(tokens, spec["lengths"], spec["windows"])
    fit = fit_power_law(lengths, uniq)
    return {"analysis": "heaps", "source": spec["source"], "heldout_tokens": int(tokens.size),
            "windows": spec["windows"], "n_stem_layers": n_stem, "d_ff": cfg.d_ff,
            "lengths": lengths, "unique": uniq, "fit": fit,
            "activated_stem_params": [n_stem * cfg.d_ff * u for u in uniq],
            "note": "activated STEM parameters = |S| d_ff L_uniq (Sec. 3.2.5); 0 for a model without tables"}
