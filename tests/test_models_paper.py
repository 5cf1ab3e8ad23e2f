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
