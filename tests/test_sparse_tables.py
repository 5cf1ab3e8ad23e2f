"""Row-sparse STEM table updates (optim.table_update: sparse; issue 13, item 4).

The sparse path's gradient holds the batch's unique rows and RowSparseAdamW updates only those rows. Checked
against the dense path (first step identical, accumulation and clipping), against AdamW's formula computed
by hand in numpy, and through the training loop: SIGKILL + resume. 1 vs 2 gloo ranks: tests/test_distributed.py.
"""
import copy
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from stem import config as C
from stem.models.spec import ModelConfig
from stem.models.model import build_model
from stem.models.registry import Role
from stem.train import distributed
from stem.train.loop import train
from stem.train.step import accumulate_gradients
from stem.optim import build_optimizer, configure_table_update
from stem.optim.adamw import RowSparseAdamW
from stem.train.plan import ParallelPlan, place

from killing import sigkill_after_state

REPO = Path(__file__).resolve().parents[1]
OPTIM = {"betas": [0.9, 0.95], "weight_decay": 0.0, "eps": 1e-8, "grad_clip": 1.0}
CTX = distributed.DistContext()


def _pair():
    """The same small STEM model twice: dense table path, sparse table path (tables of 512 rows)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48, max_seq_len=64,
                      ffn=("dense", "stem", "dense"))
    dense = build_model(cfg)
    sparse = copy.deepcopy(dense)
    assert configure_table_update(dense, {**OPTIM, "table_update": "dense"}) == ()
    assert len(configure_table_update(sparse, {**OPTIM, "table_update": "sparse"})) == 1
    return dense, sparse


def _batch(seed, lo=0, hi=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (4, 16), generator=g), torch.randint(0, 512, (4, 16), generator=g)


def _table(model):
    return model.layers[1].ffn.table.weight


def _step(model, opt, batch, max_norm=1.0):
    opt.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    norm = distributed.clip_grad_norm_(model, max_norm, CTX)
    opt.step()
    return loss.item(), norm.item()


def test_first_step_is_dense_adamw_then_untouched_rows_stay_put():
    dense, sparse = _pair()
    od = build_optimizer(dense, {**OPTIM, "table_update": "dense"}, 1e-2)
    osp = build_optimizer(sparse, {**OPTIM, "table_update": "sparse"}, 1e-2)
    assert type(od) is torch.optim.AdamW and type(osp) is RowSparseAdamW
    batch = _batch(0)
    # step 1 (fresh moments, no weight decay): AdamW moves no row without gradient, so both paths are equal;
    # max_norm 0.1 makes clipping act, so the norm over the sparse rows must be the dense one
    ld, nd = _step(dense, od, batch, max_norm=0.1)
    ls, ns = _step(sparse, osp, batch, max_norm=0.1)
    assert ls == ld and ns == pytest.approx(nd, rel=1e-6) and nd > 0.1
    touched = batch[0].unique()
    assert 0 < touched.numel() < 512
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name
    # step 2 on ids 0..99 only: rows touched at step 1 and not now keep moving under dense AdamW (momentum),
    # not under the sparse update, where they stay bit-identical
    before = _table(sparse).detach().clone()
    _step(dense, od, _batch(1, 0, 100))
    _step(sparse, osp, _batch(1, 0, 100))
    now = _batch(1, 0, 100)[0].unique()
    idle = torch.tensor([i for i in touched.tolist() if i >= 100])
    assert torch.equal(_table(sparse)[idle], before[idle])
    assert not torch.allclose(_table(dense)[idle], before[idle])
    assert not torch.equal(_table(sparse)[now], before[now])
    assert float(osp.state[_table(sparse)]["step"]) == 2


def _adamw_rows_numpy(w, m, v, rows, g, t, lr, wd, b1, b2, eps):
    """AdamW (Loshchilov & Hutter; torch's form) on the given rows only, written out by hand."""
    w, m, v = w.copy(), m.copy(), v.copy()
    for r, gr in zip(rows, g):
        w[r] = w[r] * (1 - lr * wd)
        m[r] = b1 * m[r] + (1 - b1) * gr
        v[r] = b2 * v[r] + (1 - b2) * gr * gr
        m_hat, v_hat = m[r] / (1 - b1 ** t), v[r] / (1 - b2 ** t)
        w[r] = w[r] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return w, m, v


def test_row_wise_adamw_matches_a_numpy_reference_and_leaves_other_rows_bit_identical():
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(10, 6, dtype=torch.float64))
    opt = RowSparseAdamW([{"params": [p], "lr_mult": 1.0}], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)
    w, m, v = p.detach().numpy().copy(), np.zeros((10, 6)), np.zeros((10, 6))
    g = torch.Generator().manual_seed(2)
    for t, ids in enumerate([[1, 4, 4, 7], [0, 1], [9, 4, 1, 2, 9]], start=1):
        ids = torch.tensor(ids)
        vals = torch.randn(len(ids), 6, generator=g, dtype=torch.float64)
        before = p.detach().clone()
        # an uncoalesced gradient with a repeated id: the update must use the row's summed gradient
        p.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), vals, p.shape, check_invariants=False)
        opt.step()
        rows, inverse = np.unique(ids.numpy(), return_inverse=True)
        summed = np.zeros((len(rows), 6))
        np.add.at(summed, inverse, vals.numpy())
        w, m, v = _adamw_rows_numpy(w, m, v, rows, summed, t, 0.05, 0.3, 0.8, 0.9, 1e-6)
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(opt.state[p]["exp_avg"].numpy(), m, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(opt.state[p]["exp_avg_sq"].numpy(), v, rtol=1e-12, atol=1e-14)
        other = [i for i in range(10) if i not in rows]
        assert torch.equal(p.detach()[other], before[other])   # no decay, no momentum step: untouched


def test_accumulated_sparse_gradients_equal_the_dense_gradient():
    dense, sparse = _pair()
    x, y = _batch(3)
    batches = [(x[i:i + 1], y[i:i + 1], None) for i in range(4)]   # four micro-batches, sharing some ids
    for model in (dense, sparse):
        accumulate_gradients(model, batches, CTX, torch.device("cpu"), nullcontext())
    gs = _table(sparse).grad
    assert gs.is_sparse and gs.is_coalesced()   # coalesced after each micro-batch: at most V rows held
    assert gs.indices()[0].tolist() == x.unique().tolist()   # only the rows the step touched
    assert torch.allclose(gs.to_dense(), _table(dense).grad, rtol=1e-6, atol=1e-8)
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters()):
        if not q.grad.is_sparse:
            assert torch.equal(p.grad, q.grad), name


def test_a_table_group_parameter_without_a_row_sparse_lookup_is_refused():
    class Plain(nn.Module):
        param_roles = {"weight": Role(group="table", count="lookup")}

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 2))

    with pytest.raises(ValueError, match=r"optim.table_update: sparse: Plain.weight is in the 'table' group"):
        configure_table_update(nn.Sequential(Plain()), {**OPTIM, "table_update": "sparse"})
    with pytest.raises(ValueError, match=r"optim.table_update: expected one of dense, sparse, got 'rows'"):
        configure_table_update(nn.Sequential(Plain()), {**OPTIM, "table_update": "rows"})


def test_variant_stem_sparse_carries_the_option_in_its_train_spec():
    raw = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg = C.experiment.parse(raw, "tiny.yaml")
    assert C.train_spec(cfg, "350m", "stem_sparse", "pretrain")["optim"]["table_update"] == "sparse"
    assert "table_update" not in C.train_spec(cfg, "350m", "stem", "pretrain")["optim"]  # the default, left out
    assert C.train_job(cfg, "350m", "stem", "pretrain").optim.table_update == "dense"
    assert C.train_spec(cfg, "350m", "stem_sparse", "pretrain")["model"] == C.train_spec(cfg, "350m", "stem", "pretrain")["model"]
    raw["variant_overrides"] = {"stem_sparse": {"optim": {"table_update": "rows"}}}
    with pytest.raises(C.ConfigError, match=r"variant 'stem_sparse' .*key 'optim.table_update': 'rows'; expected one of dense, sparse"):
        C.experiment.parse(raw, "tiny.yaml")


def test_sparse_path_sigkill_then_rerun_ends_with_the_same_loss(spec_factory, tmp_path):
    def spec(name):
        s = spec_factory(tmp_path / name, steps=16, checkpoint_interval=4)
        s["optim"]["table_update"] = "sparse"
        return s
    full = train(spec("full"), threads=1)
    killed = spec("killed")
    sigkill_after_state(killed, 8)
    resumed = train(killed, threads=1)
    assert resumed["last_step_loss"] == full["last_step_loss"]
    assert resumed["final_val_loss"] == full["final_val_loss"]


def test_memory_estimate_counts_row_sparse_tables_as_replicated():
    from stem.train import memory
    cfg = C.experiment.load(REPO / "config" / "paper.yaml")
    dense = build_model(C.model_config_for(cfg, "350m", "stem", "pretrain"), "meta")
    sparse = build_model(C.model_config_for(cfg, "350m", "stem", "pretrain"), "meta")
    tables = configure_table_update(sparse, {**OPTIM, "table_update": "sparse"})
    e_dense, e_sparse = (memory.estimate(m, ParallelPlan(8, "fsdp", 16, 32, 2048, tables=place("fsdp", 8, row_sparse=r)))
                         for m, r in ((dense, ()), (sparse, tables)))
    n_table = 10 * 32000 * 2560                   # 10 STEM layers of V x d_ff at 350M
    assert e_sparse["replicated_table_params"] == n_table and e_sparse["sharded_table_params"] == 0
    assert e_dense["sharded_table_params"] == n_table
    # fp32 weights, gradient, two moments: the 7/8 of each table FSDP would not hold on this rank
    extra = 16 * n_table * (1 - 1 / 8) / 1024 ** 3
    assert e_sparse["total_gib"] - e_dense["total_gib"] == pytest.approx(extra, rel=1e-9)



def test_row_sparse_tables_are_listed_in_module_order():
    """Every rank all-gathers the tables' gradients in this order: a set (ordered by object ids, which differ
    between processes) could pair one rank's table with another rank's other table."""
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16,
                      ffn=("stem", "dense", "stem_gate", "stem_dagger"))
    model = build_model(cfg, "meta")
    plan = ParallelPlan(2, "fsdp", 1, 2, 16, tables=place("fsdp", 2, row_sparse=configure_table_update(
        model, {**OPTIM, "table_update": "sparse"})))
    got = plan.row_sparse_params(model)
    assert isinstance(got, list)
    assert [id(p) for p in got] == [id(model.layers[i].ffn.table.weight) for i in (0, 2, 3)]
    assert plan.shard_units(model) == []      # none of them is an FSDP unit
