"""Gradient accumulation is the token mean of the whole step, whatever the split (issue 10, item 4).

Packed rows (cross_doc_mask) carry different numbers of trained targets per micro-batch; the step must
equal one big batch's token-mean loss for any micro-batch split and at any world size.
"""
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from stem.data.loader import MixtureLoader
from stem.data.shards import ShardSet
from stem.models.spec import ModelConfig
from stem.models.model import build_model
from stem.train import distributed
from stem.train.step import TrainingError, accumulate_gradients


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48, max_seq_len=128,
                      ffn=("dense", "stem", "dense"))
    return build_model(cfg)


def _rows(tiny_data, n=8, seq_len=96):
    """n packed rows of the long source, as one (x, y, positions) batch; row 1 keeps only a few targets."""
    loader = MixtureLoader({"long": (ShardSet(Path(tiny_data["manifests"]["long"]).parent), 1.0)}, seq_len, n,
                           seed=0, packed=True)
    x, y, pos = loader.next_batch()
    y[1, 10:] = -1   # very unequal counts per micro-batch, whatever the split
    return x, y, pos


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _split_grads(model, rows, micro):
    model.zero_grad(set_to_none=True)
    batches = [tuple(t[i:i + micro] for t in rows) for i in range(0, rows[0].shape[0], micro)]
    loss = accumulate_gradients(model, batches, distributed.DistContext(), torch.device("cpu"), nullcontext())
    return loss, _grads(model)


def test_any_split_gives_the_one_big_batch_token_mean_gradient(tiny_data):
    model, rows = _model(), _rows(tiny_data)
    x, y, pos = rows
    # the reference, independent of the accumulation code: cross-entropy over every trained target at once
    model.zero_grad(set_to_none=True)
    logits = model(x, positions=pos)
    keep = y != -1
    ref_loss = -torch.log_softmax(logits.float(), -1)[keep].gather(1, y[keep].unsqueeze(1)).mean()
    ref_loss.backward()
    ref = _grads(model)
    counts = [int(keep[i:i + 2].sum()) for i in range(0, 8, 2)]
    assert max(counts) - min(counts) > 50   # the split really carries different target counts
    for micro in (2, 4, 8, 1):
        loss, g = _split_grads(model, rows, micro)
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6), micro
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-7), (micro, (g - ref).abs().max().item())
    # the old rule (each micro-batch's mean / number of micro-batches) is measurably different here
    model.zero_grad(set_to_none=True)
    for i in range(0, 8, 2):
        (model(x[i:i + 2], y[i:i + 2], positions=pos[i:i + 2]) / 4).backward()
    assert not torch.allclose(_grads(model), ref, rtol=1e-5, atol=1e-7)


def test_a_micro_batch_without_targets_adds_nothing(tiny_data):
    model, (x, y, pos) = _model(), _rows(tiny_data, n=4)
    _, g_ref = _split_grads(model, (x[:2], y[:2], pos[:2]), 2)
    y[2:] = -1
    loss, g = _split_grads(model, (x, y, pos), 2)
    assert torch.isfinite(g).all() and torch.allclose(g, g_ref, rtol=1e-6, atol=1e-8)
    y[:] = -1
    with pytest.raises(TrainingError, match="no trained targets"):
        _split_grads(model, (x, y, pos), 2)



def test_sparse_table_gradients_are_not_an_option():
    """table_sparse_grad was documented but could not train (clipping, no SparseAdam): it is gone (issue 10, item 7).
    The working option is optim.table_update: sparse (issue 13; tests/test_sparse_tables.py)."""
    from stem import config as C
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["variant_overrides"] = {"stem": {"table_sparse_grad": True}}
    with pytest.raises(ValueError, match=r"unknown keys \['table_sparse_grad'\]"):
        C.model_config_for(C.experiment.parse(cfg), "350m", "stem")
    model = build_model(C.model_config_for(C.experiment.load(C.REPO / "config" / "tiny.yaml"), "350m", "stem"), "meta")
    assert not any(getattr(m, "sparse", False) for m in model.modules())
