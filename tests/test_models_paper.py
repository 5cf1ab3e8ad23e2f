"""The models against the papers: mixed precision, YaRN (Peng et al., 2023), DSE Eq. (4)-(5), Hash-MoE sizing."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stem import config as C
from stem.models.config import ModelConfig, RopeScaling
from stem.models.rope import inv_frequencies
from stem.train.loop import mixed_precision

TINY = dict(vocab_size=97, d_model=16, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=24, max_seq_len=64)


# ---- 1. every variant under the training loop's bf16 autocast ----------------------------------------

@pytest.mark.parametrize("variant", sorted(C.read_yaml(C.VARIANTS)))
def test_every_variant_trains_under_the_loops_bf16_autocast(variant):
    """Forward + backward under the loop's own autocast (bf16), here on the CPU."""
    cfg = C.load_experiment(C.REPO / "config" / "tiny.yaml")
    torch.manual_seed(0)
    model = C.model_config_for(cfg, "350m", variant).build()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 33))
    positions = torch.cat([torch.arange(12), torch.arange(20)]).expand(2, 32)  # packed rows too
    autocast = mixed_precision(torch.device("cpu"), enabled=True)
    with autocast:
        ffn_out = model.layers[2].ffn(torch.randn(2, 32, model.cfg.d_model), ids[:, :-1])
        loss = model(ids[:, :-1], ids[:, 1:], positions=positions)
    assert ffn_out.dtype == torch.bfloat16  # the sparse layer (or dense) really ran in bf16
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert mixed_precision(torch.device("cpu")).fast_dtype == torch.bfloat16
    assert not mixed_precision(torch.device("cpu"))._enabled  # the loop's default on the CPU: fp32


# ---- 3. DSE: Eq. (4)-(5) of the DSE paper; documents in a packed row do not see each other --------------

def _dse_model(seed=0):
    cfg = ModelConfig.from_dict({**TINY, "dse": {"layers": [1, 4], "rows_per_head": 31, "d_mem": 8, "heads": 2}})
    torch.manual_seed(seed)
    model = cfg.build().eval()
    with torch.no_grad():  # trained-looking weights: the zero-initialised conv and unit norms hide the equations
        for m in model.layers:
            if m.dse is not None:
                torch.nn.init.normal_(m.dse.conv.weight, std=0.5)
                for norm in (m.dse.norm_h, m.dse.norm_k, m.dse.norm_u):
                    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return model


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_dse_block_is_eq_4_and_5_of_the_dse_paper():
    """alpha = sigmoid(RMSNorm(h).RMSNorm(W_K e) / sqrt(d)), u = alpha W_V e, y = SiLU(Conv1D(RMSNorm(u))) + u,
    recomputed here with F.conv1d (causal: left padding of (W-1) x dilation)."""
    mem = _dse_model().layers[1].dse
    h, cids = torch.randn(2, 11, 16), torch.randint(0, 97, (2, 11))
    e = torch.cat([tab.weight[r] for tab, r in zip(mem.tables, mem._rows(cids, None))], dim=-1)
    k, v = e @ mem.w_key.weight.T, e @ mem.w_value.weight.T
    eps = mem.norm_h.eps
    alpha = torch.sigmoid((_rms(h, mem.norm_h.weight, eps) * _rms(k, mem.norm_k.weight, eps)).sum(-1, keepdim=True)
                          / math.sqrt(16))
    u = alpha * v
    pad = (mem.conv.weight.shape[-1] - 1) * 3   # dilation = max N-gram order (3)
    conv = F.conv1d(F.pad(_rms(u, mem.norm_u.weight, eps).transpose(1, 2), (pad, 0)), mem.conv.weight,
                    dilation=3, groups=16).transpose(1, 2)
    torch.testing.assert_close(mem(h, cids, None), F.silu(conv) + u, atol=1e-6, rtol=1e-5)


def test_dse_packed_row_equals_documents_run_separately():
    """Two documents packed in one row (positions restart at the second) give the logits of each run alone:
    the N-gram history and the causal convolution stop at the document start."""
    model = _dse_model(seed=1)
    a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 14))
    positions = torch.cat([torch.arange(9), torch.arange(14)]).unsqueeze(0)
    packed = model(torch.cat([a, b], dim=1), positions=positions)
    separate = torch.cat([model(a), model(b)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)
