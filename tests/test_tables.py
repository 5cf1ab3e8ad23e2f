"""Lookup tables outside FSDP (stem.train.tables). Row-sharded (``train.tables: rows``) on gloo: 4 forked ranks
train 3 steps of 2 micro-batches each a rank (packed rows: document starts, untrained targets) and must give the
single-process, unsharded model's losses, gradient norms (clipping active) and parameters (fp32, relative
1e-6), for every table variant, ``table_update: sparse`` included (row-sharded, not replicated). Three of them
save their state after 2 steps (stem_sparse's run again and SIGKILLed in the middle of step 3); 2 ranks resume
each DCP state with the same weights and AdamW moments and finish step 3 as the unsharded model did; one
process restores them too. Host tables (``train.tables: host``): the same against resident tables in one
process, and out of the traced peak."""
from __future__ import annotations

import json
import os
import signal
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
from stem.train import comms, distributed, memory, memtrace, optstate, step, tables  # noqa: E402
from stem.train.plan import ParallelPlan  # noqa: E402
from stem.optim.adamw import use_row_sparse  # noqa: E402
from stem.train.tables import row_shardable, to_host  # noqa: E402
from conftest import reshaped  # noqa: E402

CASES = [("stem", "fsdp"), ("stem_half", "fsdp"), ("stem_gate", "ddp"), ("stem_dagger", "fsdp"), ("dse", "ddp"),
         ("stem_sparse", "fsdp")]
RESUMED = (0, 4, 5)   # the cases whose state at step SAVE_AT resumes at RESUME_WORLD; the last one's ranks are killed
V, T, STEPS, SAVE_AT, CLIP, WORLD, RESUME_WORLD = 96, 8, 3, 2, 0.05, 4, 2
GIB = 1024 ** 3


def _cfg_tables(tables: str):
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=V, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16)
    cfg["variant_overrides"] = {"dse": {"dse": {"rows_per_head": 31, "d_mem": 16, "heads": 2}}}
    cfg["stages"]["pretrain"]["350m"].update(batch_size=2 * 2 * WORLD, micro_batch=2, seq_len=T, lr=1e-3)
    cfg["optim"]["grad_clip"] = CLIP
    cfg["cluster"] = {"tables": tables}
    return reshaped(cfg, f"tiny.yaml (a small 350m, tables {tables})")


def _specs() -> list:
    cfg = _cfg_tables("rows")
    return [C.train_job(cfg, "350m", v, "pretrain") for v, _ in CASES]


def _batches(step: int) -> list:
    """A step's 8 micro-batches of 2 packed rows (2 a rank at world 4): a document starts mid-row, its first
    target untrained."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(2 * WORLD):
        x = torch.randint(0, V, (2, T), generator=g)
        pos = torch.cat([torch.arange(3), torch.arange(T - 3)]).expand(2, T).clone()
        y = torch.roll(x, -1, 1)
        y[:, 2] = -1
        out.append((x, y, pos))
    return out


def _train(spec, strategy, ctx, state_dir=None, kill=False, resume=False) -> dict:
    """3 steps (``resume``: from the state in ``state_dir``), the state saved after SAVE_AT (``kill``: then this
    process SIGKILLs itself after step 3's first backward)."""
    torch.manual_seed(0)
    model = build_model(spec.model, ctx.device)
    sparse = spec.optim.row_sparse_tables(model)
    plan = ParallelPlan.of(spec.train, ctx.world, strategy, sparse, row_shardable(model))
    use_row_sparse(model, plan.row_sparse)
    to_host(model, plan.host_tables, plan.sparse_rows)
    distributed.parallelize(model, ctx, plan)
    opt = step.make_optimizer(model, spec, plan, fused=False)
    off = torch.autocast("cpu", enabled=False)
    losses, norms, saved, start = [], [], None, 0
    host = [model.get_submodule(n) for n in plan.host_tables]
    if resume:
        start = distributed.load_state(state_dir, model, opt, ctx)["step"]
        saved = _snapshot(model, opt, ctx)
    for i in range(start, STEPS):
        die = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if kill and i == SAVE_AT else None
        loss, norm = step.train_step(model, opt, _batches(i), ctx, off, spec.train.lr, spec.optim.grad_clip, i,
                                     on_backward=die)
        losses.append(loss)
        norms.append(float(norm))
        if i + 1 == SAVE_AT:
            if state_dir is not None:
                distributed.save_state(state_dir, SAVE_AT, model, opt, {}, ctx)
            saved = _snapshot(model, opt, ctx)
            if state_dir is not None and ctx.is_main:   # what was saved, whole, to check the resumed against
                torch.save(saved, f"{state_dir}.pt")
    full = {k: v.clone() for k, v in distributed.full_model_view(model, ctx).state_dict().items()}
    return {"losses": losses, "norms": norms, "params": full, "saved": saved, "plan": plan, "host": host,
            "model": model, "opt": opt}


def _snapshot(model, opt, ctx) -> dict:
    """name -> (weight, exp_avg, exp_avg_sq), whole and in id order (gathered to rank 0 when sharded)."""
    if ctx.world == 1:
        return {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                for n, p in model.named_parameters()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tables.logical_full(model, msd, osd)
    return {n: (w.clone(), osd["state"][n]["exp_avg"].clone(), osd["state"][n]["exp_avg_sq"].clone())  # replicated
            for n, w in msd.items() if n in osd["state"]}                    # ones are the live tensors: copies


def _rank(specs: list, out: Path):
    """WORLD ranks: every case for 3 steps (the RESUMED ones but the last saving their state), then the last
    RESUMED one again, saved and killed in step 3 (this process dies)."""
    ctx = distributed.setup(torch.device("cpu"))
    for i, (spec, (_, strategy)) in enumerate(zip(specs, CASES)):
        r = _train(spec, strategy, ctx, out / f"state{i}" if i in RESUMED[:-1] else None)
        if ctx.is_main:
            torch.save({k: r[k] for k in ("losses", "norms", "params")}, out / f"case{i}.pt")
            (out / f"plan{i}.json").write_text(json.dumps([r["plan"].row_sharded, r["plan"].sparse_rows]))
    killed = RESUMED[-1]
    _train(specs[killed], CASES[killed][1], ctx, out / f"state{killed}", kill=True)


def _resume(specs: list, out: Path):
    """RESUME_WORLD ranks: the RESUMED cases' states, their step 3, then the optimizer state a later stage carries
    (``save_optimizer``) beside the moments it must hold."""
    ctx = distributed.setup(torch.device("cpu"))
    for i in RESUMED:
        r = _train(specs[i], CASES[i][1], ctx, out / f"state{i}", resume=True)
        optstate.save_optimizer(out / f"optim{i}", r["model"], r["opt"])
        final = _snapshot(r["model"], r["opt"], ctx)
        if ctx.is_main:
            torch.save({k: r[k] for k in ("losses", "params", "saved")} | {"final": final}, out / f"resumed{i}.pt")
    distributed.teardown(ctx)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rel: float = 1e-6):
    """Equal to ``rel`` of the tensor's norm (a summation order apart: the ranks' gradients are reduced)."""
    a, b = a.double(), b.double()
    assert (a - b).norm().item() <= rel * max(a.norm().item(), 1e-12), what


def _close_params(ref: dict, got: dict):
    """All parameters as one vector to 1e-6 of its norm, each tensor to 2e-6 of its own (at 4 ranks AdamW's
    normalisation lifts the summation-order noise of a small DDP-backbone matrix of DSE to 1.3e-6)."""
    assert got.keys() == ref.keys()
    _close(torch.cat([v.flatten() for v in ref.values()]), torch.cat([got[k].flatten() for k in ref]), "all")
    for k in ref:
        _close(ref[k], got[k], k, 2e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, specs = tmp_path_factory.mktemp("tables"), _specs()
    # the unsharded single-process references (computed after the ranks, which fork from this process)
    assert comms.fork_ranks(_rank, WORLD, specs, out) == [-signal.SIGKILL] * WORLD   # killed in the last case
    assert comms.fork_ranks(_resume, RESUME_WORLD, specs, out) == [0] * RESUME_WORLD
    refs = [_train(spec, strategy, distributed.DistContext()) for spec, (_, strategy) in zip(specs, CASES)]
    return out, specs, refs


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{v}-{s}" for v, s in CASES])
def test_row_sharded_tables_equal_unsharded_model(runs, case):
    out, specs, refs = runs
    ref = refs[case]
    got = torch.load(out / f"case{case}.pt", weights_only=True)
    sharded, sparse_rows = json.loads((out / f"plan{case}.json").read_text())
    assert sharded and all(("table" in n) for n in sharded)   # the STEM / DSE tables, nothing else
    assert bool(sparse_rows) == (CASES[case][0] == "stem_sparse")   # row-sparse: sharded too, not replicated
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6) and min(ref["norms"]) > CLIP   # clipping on
    _close_params(ref["params"], got["params"])


@pytest.mark.parametrize("case", RESUMED, ids=[CASES[i][0] for i in RESUMED])
def test_row_sharded_state_killed_at_four_ranks_resumes_at_two_and_one(runs, case):
    """The DCP state 4 ranks saved after SAVE_AT steps (stem_sparse's then SIGKILLed mid-step): 2 ranks restore
    its weights and AdamW moments exactly (the row-sharded tables' rows at their new owners) and finish step 3
    as the unsharded model; one process restores them exactly too."""
    out, specs, refs = runs
    ref, got = refs[case], torch.load(out / f"resumed{case}.pt", weights_only=True)
    saved = torch.load(out / f"state{case}.pt", weights_only=True)
    assert set(got["saved"]) == set(saved) == set(ref["saved"])
    for n, tensors in saved.items():
        for a, b, what in zip(tensors, got["saved"][n], ("weight", "exp_avg", "exp_avg_sq")):
            assert torch.equal(a, b), f"{n} {what} at {RESUME_WORLD} ranks"
    assert got["losses"] == pytest.approx(ref["losses"][SAVE_AT:], rel=1e-6)
    _close_params(ref["params"], got["params"])
    model = build_model(specs[case].model)
    ctx = distributed.DistContext()
    sparse = specs[case].optim.row_sparse_tables(model)
    use_row_sparse(model, sparse)
    opt = step.make_optimizer(model, specs[case], ParallelPlan.of(specs[case].train, 1, row_sparse=sparse), fused=False)
    assert distributed.load_state(out / f"state{case}", model, opt, ctx)["step"] == SAVE_AT
    loaded = _snapshot(model, opt, ctx)
    for n, tensors in saved.items():
        for a, b, what in zip(tensors, loaded[n], ("weight", "exp_avg", "exp_avg_sq")):
            assert torch.equal(a, b), f"{n} {what} in one process"
    # the optimizer state the 2 ranks saved for a later stage (reset_optimizer: false) loads in one process
    optstate.load_optimizer(out / f"optim{case}", model, opt)
    loaded = _snapshot(model, opt, ctx)
    for n, (_, m, v) in got["final"].items():
        assert torch.equal(m, loaded[n][1]) and torch.equal(v, loaded[n][2]), f"{n} carried moments"


def test_host_tables_equal_resident_tables(tmp_path, variant="stem"):
    """``train.tables: host`` on the CPU (host and device the same, the same code path): the resident model's
    losses, gradient norms and parameters after 3 steps; its state saves and resumes with the tables' moments."""
    spec = C.train_job(_cfg_tables("host"), "350m", variant, "pretrain")
    ref = _train(C.train_job(_cfg_tables("fsdp"), "350m", variant, "pretrain"), "fsdp", distributed.DistContext())
    got = _train(spec, "fsdp", distributed.DistContext(), tmp_path / "state")
    assert got["plan"].host_tables and all("table" in n for n in got["plan"].host_tables)
    # every micro-batch but a step's first used the rows fetched ahead during the previous one's backward
    assert [m.prefetched for m in got["host"]] == [STEPS * (2 * WORLD - 1)] * len(got["host"])
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6) and got["norms"] == pytest.approx(ref["norms"], rel=1e-6)
    for k in ref["params"]:
        _close(ref["params"][k], got["params"][k], k)
    model = build_model(spec.model)
    plan = ParallelPlan.of(spec.train, 1, tables=row_shardable(model))
    to_host(model, plan.host_tables, plan.sparse_rows)
    opt = step.make_optimizer(model, spec, plan, fused=False)
    assert distributed.load_state(tmp_path / "state", model, opt, distributed.DistContext())["step"] == SAVE_AT
    for n, tensors in ref["saved"].items():
        p = model.get_parameter(n)
        for a, b, what in zip(tensors, (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), ("w", "m", "v")):
            _close(a, b.detach(), f"{n} {what}")
    with pytest.raises(ValueError, match="train.tables: host keeps the whole tables in one host's memory"):
        ParallelPlan.of(spec.train, 2, tables=plan.host_tables)


def test_host_tables_leave_the_traced_peak():
    """The memory trace (one GPU) and the closed form leave out the host tables' weights, gradients and moments;
    the trace holds their step rows on the GPU (``memory.host_device_bytes``: the trace's host tables take the
    dense-gradient bound path, so it is added, as the closed form does)."""
    spec, resident = memtrace.job(C.train_spec(_cfg_tables("fsdp"), "350m", "stem", "pretrain"), 1)
    _, host = memtrace.job(C.train_spec(_cfg_tables("host"), "350m", "stem", "pretrain"), 1)
    model = build_model(spec.model, "meta")
    n, rows = sum(p.numel() for p in host.host_params(model)), memory.host_device_bytes(model, host)
    a, b = memtrace.trace(spec, resident), memtrace.trace(spec, host)
    assert n and b["parts_gib"]["Host tables (off the GPU)"] * GIB == -16 * n
    assert rows and b["parts_gib"]["Host tables' step rows (on the GPU)"] * GIB == rows
    assert b["peak_gib"] == pytest.approx(a["peak_gib"] - (16 * n - rows) / GIB, rel=1e-3)
    e_res, e_host = memory.estimate(model, resident), memory.estimate(model, host)
    assert e_host["host_table_params"] == n
    assert (e_res["total_gib"] - e_host["total_gib"]) * GIB == pytest.approx(16 * n - rows)
