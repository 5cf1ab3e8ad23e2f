"""Angular spread of address vectors (STEM paper Sec. 5.1; Fig. 6a-c).

Over N distinct token ids taken in order of first appearance in held-out text (one window of the model's
context), at every layer:
- ``table``: the STEM table rows of those ids (Fig. 6a; STEM layers only);
- ``up_proj``: the up-projection outputs W_u x at each id's first position (Fig. 6b's dense address vectors;
  layers with a ``w_up`` linear map);
- ``down_input``: the down projection's input after gating at the same positions (Fig. 6c).
Each set gives the pairwise cosine similarities of its unit-normalised vectors (N (N - 1) / 2 pairs):
a histogram over [-1, 1] and summary statistics (mean |cos|, mean, quantiles).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from stem.analysis.common import load, table_sites
from stem.data.shards import ShardSet

BINS = 80  # histogram bins over [-1, 1]
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def pairwise_cos(v: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every unordered pair of rows (i < j)."""
    u = F.normalize(v.double(), dim=-1)
    i, j = torch.triu_indices(len(u), len(u), offset=1)
    return (u @ u.T)[i, j]


def describe(c: torch.Tensor) -> dict:
    q = torch.quantile(c, torch.tensor(QUANTILES, dtype=c.dtype))
    return {"pairs": int(c.numel()), "mean_abs": float(c.abs().mean()), "mean": float(c.mean()),
            "quantiles": {f"q{round(p * 100):02d}": float(x) for p, x in zip(QUANTILES, q)},
            "hist": torch.histc(c.float(), bins=BINS, min=-1.0, max=1.0).long().tolist()}


def first_occurrences(tokens: list[int], n: int, skip: set[int]) -> tuple[list[int], list[int]]:
    """(up to n distinct ids in order of first appearance, their first positions), ids in ``skip`` left out."""
    ids, pos, seen = [], [], set(skip)
    for p, t in enumerate(tokens):
        if t not in seen:
            seen.add(t)
            ids.append(t)
            pos.append(p)
            if len(ids) == n:
                break
    return ids, pos


@torch.no_grad()
def run(ckpt_dir, spec: dict) -> dict:
    model, tok, _ = load(ckpt_dir, spec.get("device", "cpu"))
    shards = ShardSet(Path(spec["manifest"]).parent, "val")
    window = min(len(shards), model.cfg.max_seq_len, spec.get("window") or model.cfg.max_seq_len)
    tokens = shards.get(0, window).astype("int64").tolist()
    ids, pos = first_occurrences(tokens, spec["n_tokens"], {tok.eos_id})
    p = torch.tensor(pos, device=model.tok_emb.weight.device)
    captured: dict = {}  # only the sampled positions are kept (a long window's activations are not)

    def keep(i, key, t):
        captured[i, key] = t[0, p].float().cpu()
    hooks = []
    for i, layer in enumerate(model.layers):
        for name, m in layer.ffn.named_children():
            if name == "w_up" and isinstance(m, torch.nn.Linear):
                hooks.append(m.register_forward_hook(lambda m, a, out, i=i: keep(i, "up_proj", out)))
            if name == "w_down" and isinstance(m, torch.nn.Linear):
                hooks.append(m.register_forward_pre_hook(lambda m, a, i=i: keep(i, "down_input", a[0])))
    try:
        model(torch.tensor([tokens], device=model.tok_emb.weight.device))
    finally:
        for h in hooks:
            h.remove()
    tables = {int(n.split(".")[1]): w for n, w in table_sites(model) if n.startswith("layers.")}
    layers = []
    for i in range(len(model.layers)):
        sets = {}
        if i in tables:
            sets["table"] = describe(pairwise_cos(tables[i][torch.tensor(ids)].cpu()))
        for key in ("up_proj", "down_input"):
            if (i, key) in captured:
                sets[key] = describe(pairwise_cos(captured[i, key]))
        layers.append({"layer": i, "ffn": model.cfg.ffn[i], **sets})
    return {"analysis": "spread", "source": spec["source"], "n_tokens": len(ids), "window": window,
            "bins": BINS, "range": [-1.0, 1.0], "layers": layers}
