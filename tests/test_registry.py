"""FFN kinds and parameter roles (stem.models.registry): a toy kind registered from the tests alone goes
through accounting, optimizer groups, init and sharding on 2 gloo ranks; config checks use the registry."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: FSDP2 would import it in each of them)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import toy_ffn  # noqa: E402
from stem import config as C  # noqa: E402
from stem.models import registry  # noqa: E402
from stem.models.accounting import accounting  # noqa: E402
from stem.models.spec import ModelConfig  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.train import comms  # noqa: E402
from stem.train.plan import ParallelPlan  # noqa: E402
from stem.optim import build_optimizer  # noqa: E402

V, D, L, H, KV, F = 64, 32, 3, 4, 2, 48
DENSE_PLAN = ParallelPlan(1, "fsdp", 1, 1, 16)   # no row-sparse table: every shard_unit is an FSDP unit
OPTIM = {"weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}


@pytest.fixture
def toy():
    toy_ffn.register()
    yield
    toy_ffn.unregister()


def _cfg():
    return ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=KV, d_ff=F, max_seq_len=32,
                       ffn=("dense", toy_ffn.KIND, "dense"))


def test_unknown_kind_one_line_error():
    with pytest.raises(ValueError, match=r"^ffn kind 'toy_bias': expected one of dense, stem, .*hashmoe, moe$"):
        _cfg()


def test_toy_kind_accounting_groups_init(toy):
    model = build_model(_cfg(), "cpu")
    # By hand: embedding + head 2 V D, final norm D; per layer two norms 2 D, attention D*D (q) + 2 D*(KV*D/H)
    # (k, v) + D*D (o), SwiGLU 3 D F; the toy layer adds its V x D bias table, a lookup (not active).
    dense = 2 * V * D + D + L * (2 * D + 2 * D * D + 2 * D * (KV * D // H) + 3 * D * F)
    assert dense == 27360
    a = accounting(model)
    assert a["total_params"] == dense + V * D
    assert a["active_params"] == dense
    assert a["paper_total_params"] == dense + V * D   # no paper-convention table: the exact count
    assert a["gflops_per_token"] == 2 * dense / 1e9
    assert a["sparse_layers"] == [1]

    bias = model.layers[1].ffn.bias.weight
    assert torch.count_nonzero(bias) == 0   # the role's init: the table's own reset_parameters, after normal init
    opt = build_optimizer(model, OPTIM, lr=1e-3)
    groups = {g["name"]: g for g in opt.param_groups}
    assert list(groups) == ["matrix", "norm", toy_ffn.GROUP]   # registry order, empty groups dropped
    assert [id(p) for p in groups[toy_ffn.GROUP]["params"]] == [id(bias)]
    assert (groups[toy_ffn.GROUP]["lr"], groups[toy_ffn.GROUP]["weight_decay"]) == (2e-3, 0.0)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())   # every parameter exactly once
    assert DENSE_PLAN.shard_units(model) == [model.layers[1].ffn.bias]


def test_unregistered_group_is_an_error(toy):
    registry.OPTIM_GROUPS.remove(toy_ffn.GROUP)
    with pytest.raises(ValueError, match="ToyBiasTable.param_roles\\['weight'\\]: group 'toy_bias' is not registered"):
        build_model(_cfg(), "cpu").param_groups()


def test_role_matching_no_parameter_is_an_error(toy, monkeypatch):
    monkeypatch.setattr(toy_ffn.ToyBiasTable, "param_roles", {"wieght": toy_ffn.ToyBiasTable.param_roles["weight"]})
    with pytest.raises(ValueError, match=r"ToyBiasTable.param_roles\['wieght'\]: matches none of its parameters \(weight\)"):
        accounting(build_model(_cfg(), "cpu"))


def test_builtin_roles_match_the_paper_accounting():
    """STEM tables, Hash-MoE experts and DSE tables are found by their declared roles."""
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=KV, d_ff=F, max_seq_len=32,
                      ffn=("stem", "hashmoe", "dense"), n_experts=4)
    model = build_model(cfg, "cpu")
    groups = model.param_groups()
    assert [id(p) for p in groups["table"]] == [id(model.layers[0].ffn.table.weight)]
    names = [type(m).__name__ for m in DENSE_PLAN.shard_units(model)]
    assert names == ["StemTable", "HashMoEFFN"]
    a = accounting(model)
    # active: the table (V F) is a lookup, 3 of the 4 experts (3 * 3 D F) do not run
    assert a["active_params"] == a["total_params"] - V * F - 3 * 3 * D * F
    assert a["sparse_layers"] == [0, 1]


def test_variants_checked_against_registry(tmp_path):
    variants = C.read_yaml(C.VARIANTS)
    assert all(v.get("ffn", "dense") in registry.FFN_KINDS for v in variants.values())
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["variant_overrides"] = {"stem": {"ffn": "stemm"}}
    with pytest.raises(C.ConfigError, match=r"variant 'stem' .*key 'ffn': 'stemm' is not a registered FFN kind"):
        C.experiment.parse(cfg, origin="tiny.yaml")


def _toy_rank(cfg: ModelConfig, out: Path):
    """One of 2 gloo ranks (forked from the test's process, the toy kind registered there): the toy model under
    FSDP, its bias table its own shard unit, 2 optimizer steps; rank 0 writes what it saw."""
    from torch.distributed.tensor import DTensor
    from stem.train import distributed as dist_
    ctx = dist_.setup(torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    dist_.parallelize(model, ctx, ParallelPlan(ctx.world, "fsdp", 1, ctx.world, 16))
    opt = build_optimizer(model, OPTIM, lr=1e-2)
    bias = model.layers[1].ffn.bias.weight
    got = {"sharded": isinstance(bias, DTensor), "local_rows": bias.to_local().shape[0],
           "groups": [g["name"] for g in opt.param_groups], "losses": []}
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
        loss = model(ids[:, :-1], ids[:, 1:]); loss.backward(); opt.step(); opt.zero_grad()
        got["losses"].append(loss.item())
    got["bias_abs_sum"] = bias.full_tensor().abs().sum().item()
    if ctx.rank == 0:
        out.write_text(json.dumps(got))
    dist_.teardown(ctx)


def test_toy_kind_sharded_on_two_gloo_ranks(toy, tmp_path):
    cfg = _cfg()
    out = tmp_path / "out.json"
    # two ranks forked from this process (no torchrun or fresh interpreter to start: torch is imported)
    assert comms.fork_ranks(_toy_rank, 2, cfg, out) == [0, 0]
    got = json.loads(out.read_text())
    assert got["sharded"] and got["local_rows"] == V // 2   # the bias table is its own unit over both ranks
    assert got["groups"] == ["matrix", "norm", toy_ffn.GROUP]
    # the same steps in one process (both ranks saw the same batch, so the averaged gradient is the same)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    opt = build_optimizer(model, OPTIM, lr=1e-2)
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(2):
        ids = torch.randint(0, V, (2, 17), generator=g)
        loss = model(ids[:, :-1], ids[:, 1:]); loss.backward(); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    bias_sum = model.layers[1].ffn.bias.weight.abs().sum().item()
    assert bias_sum > 0 and got["bias_abs_sum"] == pytest.approx(bias_sum, rel=1e-4)


def test_the_memory_estimate_counts_what_each_kind_declares():
    """Issue 28 item 4: an FFN kind's activations are declared with its facts (a FFN_FACTS entry), and the closed-form
    memory estimate reads them: stem.train.memory names no kind."""
    from stem.train import memory
    registry.declare_ffn("toy_acts", "stem.models.ffn:DenseFFN", table=False, lookup=False,
                         activations=lambda c: 8 * c.d_ff + 1000)
    try:
        mc = ModelConfig(vocab_size=32, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=12, max_seq_len=16,
                         ffn=("dense", "toy_acts"))
        assert memory._block_bytes_per_token(mc, 1) - memory._block_bytes_per_token(mc, 0) == 1000
        assert registry.FFN_FACTS["toy_acts"].activations(mc) == 1096
    finally:
        registry.FFN_KINDS.remove("toy_acts")
        registry.FFN_FACTS.remove("toy_acts")
    text = (REPO / "stem" / "train" / "memory.py").read_text()
    assert not [k for k in registry.FFN_KINDS if f'"{k}"' in text]
    with pytest.raises(ValueError, match="optimizer group 'norm': already registered"):
        registry.register_group("norm", 2.0)
