"""The held-out loss of a mid-training insertion at step 0 (issue 30; docs/real.md): a dense checkpoint (e.g. the
imported SmolLM2) with STEM inserted (stem.models.insert) at each placement by each table init, before any
training, against the dense model itself, on the same held-out windows (``val_windows`` of a source's
validation split, as the ``heldout`` analysis reads them).

    python -m stem insertion-step0 CHECKPOINT MANIFEST OUT.json [--placements 1/3,1/2 --inits projected,raw,xavier]

Memory: one inserted model at a time; its tables are n_stem x V x d_ff fp32 (SmolLM2 at 1/3: 10 x 49,152 x
1,536 = 3.0 GB; full: 8.7 GB).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from stem.analysis.common import load, val_windows
from stem.models.config import resolve_placement
from stem.models.insert import INSERT_INITS, insert_stem
from stem.models.model import build_model

# the paper's placements (config/variants.yaml: stem, stem_half, stem_full)
PLACEMENTS = {"1/3": {"every": 3, "offset": 2}, "1/2": {"every": 2, "offset": 1}, "full": {"start": 1}}


@torch.no_grad()
def window_losses(model, x: torch.Tensor, batch: int = 4) -> list[float]:
    """Each window's mean next-token loss (fp32)."""
    out = []
    for b in range(0, len(x), batch):
        xb = x[b:b + batch]
        logits = model(xb[:, :-1]).float()
        out += F.cross_entropy(logits.transpose(1, 2), xb[:, 1:], reduction="none").mean(dim=1).tolist()
    return out


def step0(ckpt_dir, manifest, seq_len: int = 256, windows: int = 8, placements=("1/3", "1/2"),
          inits=INSERT_INITS, seed: int = 0) -> dict:
    """{"rows": [{placement, init, stem_layers, mean_loss, delta_vs_dense, window_loss}], ...}; the first row is the
    dense model. ``placements``: names of ``PLACEMENTS`` or {name: placement spec}."""
    dense, _, _ = load(ckpt_dir, "cpu")
    starts, x = val_windows(manifest, min(seq_len, dense.cfg.max_seq_len) + 1, windows)
    return {"checkpoint": str(ckpt_dir), "manifest": str(manifest), "seq_len": int(x.shape[1] - 1),
            "windows": len(starts), "starts": starts.tolist(), "seed": seed,
            "rows": step0_rows(dense, x, placements, inits, seed, str(ckpt_dir))}


def step0_rows(dense, x: torch.Tensor, placements=("1/3", "1/2"), inits=INSERT_INITS, seed: int = 0,
               where: str = "dense model") -> list[dict]:
    """The rows of ``step0`` for a loaded dense model (eval mode) and held-out windows ``x`` (B, T + 1)."""
    bad = [i for i in inits if i not in INSERT_INITS]
    if bad:
        raise ValueError(f"insertion init {bad[0]!r}: expected one of {', '.join(INSERT_INITS)}")
    named = placements if isinstance(placements, dict) else {}
    for p in placements if not named else ():
        if p not in PLACEMENTS:
            raise ValueError(f"placement {p!r}: expected one of {', '.join(PLACEMENTS)}")
        named[p] = PLACEMENTS[p]
    rows = [{"placement": "dense", "init": None, "stem_layers": [], "window_loss": window_losses(dense, x)}]
    state = dense.state_dict()
    for name, spec in named.items():
        layers = resolve_placement(spec, dense.cfg.n_layers)
        cfg = dataclasses.replace(dense.cfg, ffn=tuple("stem" if i in layers else "dense"
                                                       for i in range(dense.cfg.n_layers)))
        for init in inits:
            torch.manual_seed(seed)   # xavier: the tables' own init, from the seed
            model = build_model(cfg, "cpu").eval()
            insert_stem(model, state, init, where)
            rows.append({"placement": name, "init": init, "stem_layers": layers, "window_loss": window_losses(model, x)})
            del model
    for r in rows:
        r["mean_loss"] = sum(r["window_loss"]) / len(r["window_loss"])
        r["delta_vs_dense"] = r["mean_loss"] - rows[0]["mean_loss"]
    return rows
