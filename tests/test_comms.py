"""The communication model (stem.train.comms) against the bytes that really cross a gloo process group: W
forked processes run one training step (``stem.train.step.train_step``, as the loop calls it) of tiny models
of every table/expert kind under both backbone strategies and count each collective (op, payload bytes); the
model must list exactly the same ones. Forked from this process (torch already imported): no torchrun start-up."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: FSDP2 would import it in each of them)
import torch.distributed.fsdp  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem import config as C  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.models.offload import dse_row_ids  # noqa: E402
from stem.optim.adamw import use_row_sparse  # noqa: E402
from stem.train import comms, distributed, memtrace, step  # noqa: E402
from stem.train.plan import ParallelPlan  # noqa: E402
from stem.train.tables import row_shardable  # noqa: E402
from conftest import reshaped  # noqa: E402

# every table / expert kind; each backbone strategy with plain, row-sparse and padded (DSE's prime rows) units;
# (variant, backbone strategy, table layout [+ activation checkpointing] [+ tied embedding and head])
ROWS = [("stem", "fsdp", "rows"), ("stem", "ddp", "rows"), ("stem_sparse", "fsdp", "rows"), ("hashmoe", "fsdp", "rows"),
        ("dse", "ddp", "rows"), ("stem", "fsdp", "rows+ckpt"), ("stem", "fsdp", "rows+tied")]
CASES = {2: [("stem", "fsdp", "fsdp"), ("stem", "ddp", "fsdp"), ("stem_sparse", "fsdp", "fsdp"),
             ("stem_sparse", "ddp", "fsdp"), ("hashmoe", "fsdp", "fsdp"), ("moe", "ddp", "fsdp"), ("dse", "fsdp", "fsdp"),
             ("dse", "ddp", "fsdp"), ("stem", "fsdp", "fsdp+ckpt"), ("stem", "fsdp", "fsdp+tied")] + ROWS,
         4: [("stem", "fsdp", "fsdp"), ("stem_sparse", "ddp", "fsdp")] + ROWS}
V, T = 96, 8


def _cfg(layout: str = "fsdp", vocab_size: int = V):
    """config/tiny.yaml reshaped to a small 350m model and ``layout``, as its typed tree."""
    tables, *extra = layout.split("+")
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=vocab_size, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16,
                                tie_embeddings="tied" in extra)
    cfg["variant_overrides"] = {"hashmoe": {"n_experts": 4}, "moe": {"moe_experts": 4, "moe_d_ff": 8},
                                "dse": {"dse": {"rows_per_head": 31, "d_mem": 16, "heads": 2}}}
    cfg["stages"]["pretrain"]["350m"].update(batch_size=8, micro_batch=2, seq_len=T,
                                             activation_checkpointing="ckpt" in extra)
    cfg["cluster"] = {"tables": tables}
    return reshaped(cfg)


def _lookups(model, plan, batches, world: int) -> list:
    """(width, unique ids, ids asked of rank 0) of rank 0's row-sharded lookups of a step (rank 0 owns the ids 0,
    W, 2W, ...: stem.train.tables.storage_ids): a STEM table reads the token ids, a DSE table its hashed ids
    (``dse_row_ids``, computed by the unsharded ``model``)."""
    def ids(x):   # each row-sharded table's ids for the token ids x, in the plan's (module) order
        hashed = iter(dse_row_ids(model, x) if model.cfg.dse is not None else [])
        return [next(hashed) if ".dse." in name else x for name in plan.row_sharded]
    widths = [model.get_submodule(name).weight.shape[1] for name in plan.row_sharded]
    out = []
    for i in range(0, len(batches), world):   # rank 0's micro-batches; rank r's i-th is batches[i + r]
        per_rank = [[t.unique() for t in ids(batches[i + r][0])] for r in range(world)]
        for k, d in enumerate(widths):
            out.append((d, per_rank[0][k].numel(), sum(int((u[k] % world == 0).sum()) for u in per_rank)))
    return out


def _rank(world: int, specs: list, out: str):
    ctx = distributed.setup(torch.device("cpu"))
    rows = []
    for (variant, strategy, layout), spec in zip(CASES[world], specs):
        torch.manual_seed(0)
        model = build_model(spec.model, ctx.device)
        model.set_training_options(activation_checkpointing=spec.train.activation_checkpointing)
        sparse = spec.optim.row_sparse_tables(model)
        plan = ParallelPlan.of(spec.train, world, strategy, sparse, row_shardable(model))
        g = torch.Generator().manual_seed(1)
        batches = [(x, x, None) for x in (torch.randint(0, V, (plan.micro_batch, T), generator=g)
                                          for _ in range(plan.accum))]
        uniq = max(torch.cat([b[0].flatten() for b in batches[r::world]]).unique().numel() for r in range(world))
        lookups = _lookups(model, plan, batches, world) if plan.row_sharded else None
        use_row_sparse(model, plan.row_sparse)
        distributed.parallelize(model, ctx, plan)
        opt = step.make_optimizer(model, spec, plan, fused=False)
        with comms.count_collectives() as seen:
            step.train_step(model, opt, batches, ctx, torch.autocast("cpu", enabled=False), 1e-3, 1.0, metrics={})
        modelled = comms.collectives(build_model(spec.model, "meta"), plan, mixed_precision=False, unique_rows=uniq,
                                     lookups=lookups)
        rows.append({"case": f"{variant}/{strategy}/{layout}", "sharded": len(plan.row_sharded),
                     "counted": sorted(map(list, seen.items())),
                     "modelled": sorted(map(list, comms.as_counter(modelled).items()))})
    if ctx.is_main:
        Path(out).write_text(json.dumps(rows))
    distributed.teardown(ctx)


@pytest.mark.parametrize("world", [2, 4])
def test_modelled_collectives_equal_counted(tmp_path, world):
    out = tmp_path / "out.json"
    specs = [C.train_job(_cfg(tables), "350m", v, "pretrain") for v, _, tables in CASES[world]]
    assert comms.fork_ranks(_rank, world, world, specs, str(out)) == [0] * world
    rows = json.loads(out.read_text())
    assert [row["case"] for row in rows] == ["/".join(c) for c in CASES[world]]
    for row in rows:
        assert row["counted"] == row["modelled"], row["case"]
        assert any(op != "all_reduce" or n > 8 for (op, n), _ in row["counted"]), row["case"]   # not only scalars
        # row-sharded: STEM's and DSE's tables, the row-sparse ones too; Hash-MoE has none (its experts: FSDP units)
        assert bool(row["sharded"]) == ("/rows" in row["case"] and "hashmoe" not in row["case"]), row["case"]


def test_paper_table_traffic_is_the_hand_count():
    """1b/stem/pretrain at world 32 (4 nodes), bf16 gathers, tables as FSDP units: each of the 5 tables (V x d_ff,
    V = 128,256 rows padded to a multiple of 32) is gathered twice and reduce-scattered once a micro-batch, 4
    micro-batches per GPU, (W-1)/W of each payload through every GPU. Row-sharded (config/paper.yaml's
    ``cluster.tables: rows``): at least 20x fewer table bytes, total comm within 1.15x of dense's (issue 29)."""
    from stem.__main__ import main
    cfg = C.experiment.load(REPO / "config" / "paper.yaml")
    jobs = [("1b", "dense", "pretrain"), ("1b", "stem", "pretrain")]
    rows = {r["job"]: r for r in memtrace.experiment_steps(cfg, jobs)}
    units = {r["job"]: r for r in memtrace.experiment_steps(cfg, jobs, tables="fsdp")}
    stem, dense, rows = units["1b/stem/pretrain"], units["1b/dense/pretrain"], rows["1b/stem/pretrain"]
    table = 128256 * 8192
    assert (stem["world"], stem["nodes"], stem["link_gbs"]) == (32, 4, comms.INTER_NODE_GBS)
    assert stem["bytes_per_gpu"]["table_all_gather"] == pytest.approx(5 * table * 2 * 2 * 4 * 31 / 32, rel=1e-12)
    assert stem["bytes_per_gpu"]["table_reduce_scatter"] == pytest.approx(5 * table * 4 * 4 * 31 / 32, rel=1e-12)
    assert dense["table_bytes"] == 0 and stem["comm_vs_dense"] == pytest.approx(stem["total_bytes"] / dense["total_bytes"])
    assert stem["comm_compute_ratio"] == pytest.approx(stem["comm_s"] / stem["compute_s"])
    assert rows["bytes_per_gpu"]["table_all_gather"] == 0 and rows["bytes_per_gpu"]["row_sharded_lookup"] > 0
    assert stem["table_bytes"] / rows["table_bytes"] >= 20 and rows["comm_vs_dense"] <= 1.15
    with pytest.raises(SystemExit):
        main(["comms", "--mfu", "1.5"])


def test_owner_map_balances_zipf_ids():
    """Ids drawn from a Zipf(1) law (a vocabulary ordered by frequency): contiguous blocks of ids load the first
    owner ~3.4x the mean, as ``zipf_seen`` predicts; the interleaved map (stem.train.tables) balances them, and
    ``expected_lookups`` asks the busiest owner what the estimate says."""
    V, W, n = 4096, 8, 2048
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    ids = torch.multinomial(p / p.sum(), n * W * 20, replacement=True, generator=torch.Generator().manual_seed(0))
    got = comms.owner_imbalance(ids, V, W, n)
    seen = comms.zipf_seen(n, V)
    assert got["steps"] == 20 and got["blocks"] == pytest.approx(float(seen[:V // W].sum() / seen.sum() * W), rel=0.03)
    assert got["blocks"] > 3 and got["interleaved"] < 1.1
    spec = C.train_job(_cfg("rows", vocab_size=V), "350m", "stem", "pretrain")
    model = build_model(spec.model, "meta")
    plan = ParallelPlan.of(spec.train, 2, tables=row_shardable(model))
    (d, uniq, asked), *_ = comms.expected_lookups(model, plan)
    seen = comms.zipf_seen(plan.micro_batch * plan.seq_len, V)
    assert (uniq, asked) == (round(float(seen.sum())), round(2 * float(seen[::2].sum()))) and asked >= uniq
