"""Per-window held-out loss: the items of the paired bootstrap behind the loss direction (stem.report.verdict).

``windows`` windows of ``seq_len`` tokens at evenly spaced offsets of a source's validation split (the same
windows for every variant of a scale: same tokenizer, same split); each window's mean next-token loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stem.analysis.common import load, val_windows


@torch.no_grad()
def run(ckpt_dir, spec: dict) -> dict:
    model, _, _ = load(ckpt_dir, spec.get("device", "cpu"))
    n = min(spec["seq_len"], model.cfg.max_seq_len) + 1
    starts, x = val_windows(spec["manifest"], n, spec["windows"])
    device, losses = model.tok_emb.weight.device, []
    for b in range(0, len(x), spec.get("batch", 8)):  # bounded logits at a large vocabulary
        xb = x[b:b + spec.get("batch", 8)].to(device)
        logits = model(xb[:, :-1]).float()
        losses.append(F.cross_entropy(logits.transpose(1, 2), xb[:, 1:], reduction="none").mean(dim=1).cpu())
    loss = torch.cat(losses)
    return {"analysis": "heldout", "source": spec["source"], "seq_len": n - 1, "starts": starts.tolist(),
            "window_loss": loss.tolist(), "mean_loss": float(loss.mean())}
