"""Lookup tables outside FSDP (stem.train.tables). Row-sharded (``train.tables: rows``) on gloo: 2 forked ranks
train 3 steps of 2 micro-batches each (packed rows: document starts, untrained targets) and must give the
single-process, unsharded model's losses, gradient norms (clipping active) and parameters (fp32, relative
1e-6), for every table variant; a DCP state they save resumes in one process with the same weights and AdamW
moments. Host tables (``train.tables: host``): the same against resident tables in one process, and out of the
traced peak."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork, as tests/test_comms.py)
import torch.distributed.fsdp  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem import config as C  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.train import comms, distributed, memory, memtrace, step  # noqa: E402
from stem.train.plan import ParallelPlan  # noqa: E402
from stem.train.tables import row_shardable, to_host  # noqa: E402

CASES = [("stem", "fsdp"), ("stem_half", "fsdp"), ("stem_gate", "ddp"), ("stem_dagger", "fsdp"), ("dse", "ddp")]
V, T, STEPS, SAVE_AT, CLIP = 96, 8, 3, 2, 0.05
GIB = 1024 ** 3


def _cfg_tables(tables: str) -> dict:
    cfg = C.load_experiment(REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=V, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16)
    cfg["variant_overrides"] = {"dse": {"dse": {"rows_per_head": 31, "d_mem": 16, "heads": 2}}}
    cfg["stages"]["pretrain"]["350m"].update(batch_size=8, micro_batch=2, seq_len=T, lr=1e-3)
    cfg["optim"]["grad_clip"] = CLIP
    cfg["cluster"] = {"tables": tables}
    return cfg


def _specs() -> list:
    cfg = _cfg_tables("rows")
    return [C.train_job(cfg, "350m", v, "pretrain") for v, _ in CASES]


def _batches(step: int) -> list:
    """A step's 4 micro-batches of 2 packed rows: a document starts mid-row, its first target untrained."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(4):
        x = torch.randint(0, V, (2, T), generator=g)
        pos = torch.cat([torch.arange(3), torch.arange(T - 3)]).expand(2, T).clone()
        y = torch.roll(x, -1, 1)
        y[:, 2] = -1
        out.append((x, y, pos))
    return out


def _train(spec, strategy, ctx, state_dir=None) -> dict:
    torch.manual_seed(0)
    model = build_model(spec.model, ctx.device)
    plan = ParallelPlan.of(spec.train, ctx.world, strategy, tables=row_shardable(model))
    to_host(model, plan.host_tables)
    distributed.parallelize(model, ctx, plan)
    opt = step.make_optimizer(model, spec, plan, fused=False)
    off = torch.autocast("cpu", enabled=False)
    losses, norms, saved = [], [], None
    for i in range(STEPS):
        loss, norm = step.train_step(model, opt, _batches(i), ctx, off, spec.train.lr, spec.optim.grad_clip, i)
        losses.append(loss)
        norms.append(float(norm))
        if i + 1 == SAVE_AT:
            if state_dir is not None:
                distributed.save_state(state_dir, SAVE_AT, model, opt, {}, ctx)
            if ctx.world == 1:
                saved = _snapshot(model, opt)
    full = {k: v.clone() for k, v in distributed.full_model_view(model, ctx).state_dict().items()}
    return {"losses": losses, "norms": norms, "params": full, "saved": saved, "plan": plan}


def _snapshot(model, opt) -> dict:
    return {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
            for n, p in model.named_parameters()}


def _rank(specs: list, out: Path):
    ctx = distributed.setup(torch.device("cpu"))
    for i, (spec, (_, strategy)) in enumerate(zip(specs, CASES)):
        r = _train(spec, strategy, ctx, out / f"state{i}")
        if ctx.is_main:
            torch.save({k: r[k] for k in ("losses", "norms", "params")}, out / f"case{i}.pt")
            (out / f"plan{i}.json").write_text(json.dumps(r["plan"].row_sharded))
    distributed.teardown(ctx)


def _close(a: torch.Tensor, b: torch.Tensor, what: str):
    """Equal to 1e-6 of the tensor's norm (a summation order apart: the ranks' gradients are reduced)."""
    a, b = a.double(), b.double()
    assert (a - b).norm().item() <= 1e-6 * max(a.norm().item(), 1e-12), what


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, specs = tmp_path_factory.mktemp("tables"), _specs()
    # the unsharded single-process references (computed after the ranks, which fork from this process)
    assert comms.fork_ranks(_rank, 2, specs, out) == [0, 0]
    refs = [_train(spec, strategy, distributed.DistContext()) for spec, (_, strategy) in zip(specs, CASES)]
    return out, specs, refs


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{v}-{s}" for v, s in CASES])
def test_row_sharded_tables_equal_unsharded_model(runs, case):
    out, specs, refs = runs
    ref = refs[case]
    got = torch.load(out / f"case{case}.pt", weights_only=True)
    sharded = json.loads((out / f"plan{case}.json").read_text())
    assert sharded and all(("table" in n) for n in sharded)   # the STEM / DSE tables, nothing else
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6) and min(ref["norms"]) > CLIP   # clipping on
    assert got["params"].keys() == ref["params"].keys()
    for k in ref["params"]:
        _close(ref["params"][k], got["params"][k], k)
    # the DCP state saved at 2 ranks after SAVE_AT steps resumes in one process: the same weights and moments
    model = build_model(specs[case].model)
    ctx = distributed.DistContext()
    opt = step.make_optimizer(model, specs[case], ParallelPlan.of(specs[case].train, 1), fused=False)
    assert distributed.load_state(out / f"state{case}", model, opt, ctx)["step"] == SAVE_AT
    loaded = _snapshot(model, opt)
    for n, tensors in ref["saved"].items():
        for a, b, what in zip(tensors, loaded[n], ("weight", "exp_avg", "exp_avg_sq")):
            _close(a, b, f"{n} {what}")


def test_host_tables_equal_resident_tables(tmp_path, variant="stem"):
    """``train.tables: host`` on the CPU (host and device the same, the same code path): the resident model's
    losses, gradient norms and parameters after 3 steps; its state saves and resumes with the tables' moments."""
    spec = C.train_job(_cfg_tables("host"), "350m", variant, "pretrain")
    ref = _train(C.train_job(_cfg_tables("fsdp"), "350m", variant, "pretrain"), "fsdp", distributed.DistContext())
    got = _train(spec, "fsdp", distributed.DistContext(), tmp_path / "state")
    assert got["plan"].host_tables and all("table" in n for n in got["plan"].host_tables)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6) and got["norms"] == pytest.approx(ref["norms"], rel=1e-6)
    for k in ref["params"]:
        _close(ref["params"][k], got["params"][k], k)
    model = build_model(spec.model)
    plan = ParallelPlan.of(spec.train, 1, tables=row_shardable(model))
    to_host(model, plan.host_tables)
    opt = step.make_optimizer(model, spec, plan, fused=False)
    assert distributed.load_state(tmp_path / "state", model, opt, distributed.DistContext())["step"] == SAVE_AT
    for n, tensors in ref["saved"].items():
        p = model.get_parameter(n)
        for a, b, what in zip(tensors, (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), ("w", "m", "v")):
            _close(a, b.detach(), f"{n} {what}")
    with pytest.raises(ValueError, match="train.tables: host keeps the whole tables in one host's memory"):
        ParallelPlan.of(spec.train, 2, tables=plan.host_tables)


def test_host_tables_leave_the_traced_peak():
    """The memory trace (one GPU) and the closed form leave out the host tables' weights, gradients and moments."""
    spec, resident = memtrace.job(C.train_spec(_cfg_tables("fsdp"), "350m", "stem", "pretrain"), 1)
    _, host = memtrace.job(C.train_spec(_cfg_tables("host"), "350m", "stem", "pretrain"), 1)
    model = build_model(spec.model, "meta")
    n = sum(p.numel() for p in host.host_params(model))
    a, b = memtrace.trace(spec, resident), memtrace.trace(spec, host)
    assert n and b["parts_gib"]["Host tables (off the GPU)"] * GIB == -16 * n
    assert b["peak_gib"] == pytest.approx(a["peak_gib"] - 16 * n / GIB, rel=1e-3)
    e_res, e_host = memory.estimate(model, resident), memory.estimate(model, host)
    assert e_host["host_table_params"] == n
    assert (e_res["total_gib"] - e_host["total_gib"]) * GIB == pytest.approx(16 * n)
