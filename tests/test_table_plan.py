"""Tables by a plan (issue 38 item 4): every lookup table's placement is one mapping decided once
(``stem.train.plan.place``, ``ParallelPlan.tables``), and the row-sharded / host tables are modules of their own made
from it (``stem.train.tables.RowShardedTable`` / ``HostTable``) with the original's state-dict key and parameter role,
the optimizer learning a step's touched rows from the module. Tiny models, one process (a world-1 gloo group for the
row-sharded table): about 2 s of CPU."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem.models.model import build_model  # noqa: E402
from stem.models.spec import ModelConfig  # noqa: E402
from stem.optim import OptimSpec  # noqa: E402
from stem.train import tables  # noqa: E402
from stem.train.plan import ParallelPlan, Placement, Where, place  # noqa: E402

OPTIM = {"betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1e-8}
R, F, H = Where.REPLICATED, Where.FSDP, Where.ROWS


@pytest.mark.parametrize("layout, world, want", [
    ("fsdp", 1, {"a": Placement(R, True), "b": Placement(F), "c": Placement(R, True)}),
    ("fsdp", 4, {"a": Placement(R, True), "b": Placement(F), "c": Placement(R, True)}),
    ("rows", 1, {"a": Placement(R, True), "b": Placement(H), "c": Placement(R, True)}),   # nothing to shard at 1
    ("rows", 4, {"a": Placement(H, True), "b": Placement(H), "c": Placement(R, True)}),
    ("host", 1, {"a": Placement(Where.HOST, True), "b": Placement(Where.HOST), "c": Placement(R, True)}),
])
def test_every_table_has_one_placement(layout, world, want):
    """Lookup tables a (row-sparse) and b, and c, row-sparse but not a lookup table: one mapping, in that order;
    the plan's views (``row_sparse``, ``row_sharded``, ``host_tables``, ``sparse_rows``) are read off it."""
    train = SimpleNamespace(batch_size=8, micro_batch=2, tables=layout, parallel="fsdp", seq_len=4,
                            activation_checkpointing=False)
    plan = ParallelPlan.of(train, world, row_sparse=("a", "c"), tables=("a", "b"))
    assert plan.tables == want and list(plan.tables) == ["a", "b", "c"] == list(place(layout, world, ("a", "b"), ("a", "c")))
    assert plan.row_sparse == tuple(n for n, p in want.items() if p.where == R)
    assert plan.row_sharded + plan.host_tables == tuple(n for n, p in want.items() if p.where in (H, Where.HOST))
    assert plan.sparse_rows == (("a",) if want["a"].where != R else ())
    assert [plan.outside_fsdp(f"{n}.weight") for n in "abc"] == [want[n].where in (H, Where.HOST) for n in "abc"]


def test_host_tables_are_refused_on_several_ranks():
    train = SimpleNamespace(batch_size=8, micro_batch=2, tables="host", parallel="fsdp", seq_len=4,
                            activation_checkpointing=False)
    with pytest.raises(ValueError, match="train.tables: host .* this one has 2"):
        ParallelPlan.of(train, 2, tables=("a",))


def _model():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16,
                      ffn=("stem", "stem"))
    torch.manual_seed(0)
    return build_model(cfg)


def _layout(model) -> tuple:
    """(state-dict keys, {parameter name: its optimizer group}) of ``model``."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {names[id(p)]: g for g, ps in model.param_groups().items() for p in ps}
    return list(model.state_dict()), groups


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_host_tables_are_modules_of_their_own_with_the_originals_keys_and_roles():
    model = _model()
    before, names = _layout(model), tables.row_shardable(model)
    weights = tables.to_host(model, names, sparse=names[:1])
    assert [type(model.get_submodule(n)) for n in names] == [tables.HostTable] * 2
    assert [model.get_submodule(n).row_update for n in names] == ["sparse", "lazy"]
    assert _layout(model) == before and before[1][f"{names[0]}.weight"] == "table"
    assert all(not vars(p) for p in weights)   # nothing hung on a Parameter


def test_row_sharded_table_hands_the_optimizer_its_touched_rows(world_of_one):
    model = _model()
    before, names = _layout(model), tables.row_shardable(model)
    tables.shard_rows(model, names, world_of_one, mixed_precision=False, sparse=names)
    table = model.get_submodule(names[0])
    assert type(table) is tables.RowShardedTable and _layout(model) == before
    opt = OptimSpec.coerce({**OPTIM, "table_update": "sparse", "grad_clip": 0}).build(model, 1e-2)
    assert set(opt.touched) == {model.get_submodule(n).weight for n in names}
    ids = torch.tensor([[3, 5, 3, 9]])
    w0 = table.weight.to_local().detach().clone()
    table(ids).sum().backward()
    opt.step()
    moved = (table.weight.to_local() != w0).any(1).nonzero().squeeze(1).tolist()
    assert moved == [3, 5, 9] and not table.touched.any()   # the rows asked, then cleared for the next step


def test_optim_groups_take_any_registered_group_and_name_an_unknown_one():
    from stem.registry import OPTIM_GROUPS
    with pytest.raises(ValueError, match=r"optim.groups.tabel: expected a registered optimizer group \(one of .*table"):
        OptimSpec.coerce({**OPTIM, "groups": {"tabel": {"lr_mult": 2}}})
    OPTIM_GROUPS.add("plugin_group", (2.0, 0.0))
    try:
        assert OptimSpec.coerce({**OPTIM, "groups": {"plugin_group": {"lr_mult": 3}}}).groups["plugin_group"].lr_mult == 3
    finally:
        OPTIM_GROUPS.remove("plugin_group")
