"""LogitLens (the DSE paper's Sec. 6, Fig. 3a): how far each layer's hidden state is from the final prediction.

Every block's output hidden state h_l is read out through the model's own final RMSNorm and LM head,
q_l = softmax(W_head RMSNorm(h_l)), and compared with the model's final distribution p = q_{L-1}:
KL(p || q_l) = sum_v p_v (log p_v - log q_{l,v}), averaged over the held-out tokens (``windows`` windows of
``seq_len`` tokens of a source's validation split, as ``heldout`` reads them). The last layer's KL is 0 by
construction. Run on a DSE checkpoint and on its baseline (the same experiment/scale/stage's ``baseline``
variant) on the same tokens; per-window values are kept for the paired comparison (stem.report.verdict).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stem.analysis.common import layer_outputs, load, load_baseline, val_windows


@torch.no_grad()
def layer_kl(model, x: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """(windows, layers): the mean over each window's tokens of KL(final || layer l)."""
    device, rows = model.tok_emb.weight.device, []
    for b in range(0, len(x), batch):   # bounded logits at a large vocabulary
        outs, logits = layer_outputs(model, x[b:b + batch].to(device))
        logp = F.log_softmax(logits.float(), dim=-1)
        p = logp.exp()
        kl = [(p * (logp - F.log_softmax(model.lm_head(model.norm(h)).float(), dim=-1))).sum(-1).mean(-1)
              for h in outs]
        rows.append(torch.stack(kl, dim=1).double().cpu())
    return torch.cat(rows)


def run(ckpt_dir, spec: dict) -> dict:
    model, _, _ = load(ckpt_dir, spec.get("device", "cpu"))
    base, _, _ = load_baseline(ckpt_dir, spec)
    n = min(spec["seq_len"], model.cfg.max_seq_len, base.cfg.max_seq_len)
    starts, x = val_windows(spec["manifest"], n, spec["windows"])
    out = {"analysis": "logitlens", "source": spec["source"], "seq_len": n, "starts": starts.tolist(),
           "tokens": int(x.numel()), "baseline": spec["baseline"]}
    for key, m in (("model", model), ("baseline_model", base)):
        kl = layer_kl(m, x, spec.get("batch", 8))
        out[key] = {"layers": list(range(kl.shape[1])), "kl": kl.mean(0).tolist(), "window_kl": kl.tolist()}
    return out
