"""Host tables' optimizer (``train.tables: host``; stem.train.tables, stem.optim.adamw): gradients kept as (unique
ids, rows), the update applied to the rows a step touched. Lazy-exact AdamW (``table_update: dense``) against
dense AdamW on resident tables after 20 steps in which most rows are skipped for several steps (fails with the
replay removed); row-sparse AdamW (``table_update: sparse``) against the resident row-sparse update; a save
settles every row and a resume continues exactly; the host gradient is never dense."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem import config as C  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.optim import adamw  # noqa: E402
from stem.optim.adamw import use_row_sparse  # noqa: E402
from stem.train import distributed, memtrace, step  # noqa: E402
from stem.train.loop import mixed_precision  # noqa: E402
from stem.train.plan import ParallelPlan  # noqa: E402
from stem.train.tables import row_shardable, to_host  # noqa: E402
from conftest import reshaped  # noqa: E402

V, T, STEPS = 64, 8, 20


def _spec(tables: str, variant: str = "stem", clip: float = 0.05, workers: int | None = None):
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=V, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=16)
    cfg["variant_overrides"] = {"dse": {"dse": {"rows_per_head": 31, "d_mem": 16, "heads": 2}}}
    cfg["stages"]["pretrain"]["350m"].update(batch_size=4, micro_batch=2, seq_len=T, lr=3e-3)
    cfg["optim"]["grad_clip"] = clip
    cfg["cluster"] = {"tables": tables, **({"host_workers": workers} if workers else {})}
    return C.train_job(reshaped(cfg, f"tiny.yaml (a small 350m, tables {tables})"), "350m", variant, "pretrain")


def _batches(i: int) -> list:
    """Step ``i``'s 2 micro-batches: ids from a window of 12 of the 64 that moves by 5 a step, so most rows are
    skipped for several steps and then read again (every other step also the window 40 further on)."""
    g = torch.Generator().manual_seed(100 + i)
    lo = 5 * i % V
    out = []
    for k in range(2):
        base = lo + (40 * (i % 2) if k else 0)
        x = (base + torch.randint(0, 12, (2, T), generator=g)) % V
        out.append((x, torch.roll(x, -1, 1), None))
    return out


def _model(spec):
    torch.manual_seed(0)
    model = build_model(spec.model)
    plan = ParallelPlan.of(spec.train, 1, row_sparse=spec.optim.row_sparse_tables(model), tables=row_shardable(model))
    use_row_sparse(model, plan.row_sparse)
    to_host(model, plan.host_tables, plan.sparse_rows)
    return model, plan, step.make_optimizer(model, spec, plan, fused=False)


def _train(spec, steps=STEPS, start=0, state=None, save=None, bf16=False):
    """``steps`` steps (``state``: resumed from that state folder; ``save``: the state saved there at the end;
    ``bf16``: under the loop's bf16 autocast, as a GPU job trains)."""
    model, plan, opt = _model(spec)
    ctx, off = distributed.DistContext(), mixed_precision(torch.device("cpu"), bf16)
    if state is not None:
        start = distributed.load_state(state, model, opt, ctx)["step"]
    losses = []
    for i in range(start, steps):
        losses.append(step.train_step(model, opt, _batches(i), ctx, off, spec.train.lr, spec.optim.grad_clip, i)[0])
    if save is not None:
        distributed.save_state(save, steps, model, opt, {}, ctx)
    return model, plan, opt, losses


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}   # settles a lazy table first


def _close(ref: dict, got: dict, tol: float = 1e-6):
    assert ref.keys() == got.keys()
    for k in ref:
        err = (ref[k].double() - got[k].double()).abs().max().item()
        assert err <= tol * max(1.0, ref[k].abs().max().item()), f"{k}: max |diff| {err:.3g}"


def test_lazy_exact_host_tables_equal_dense_adamw_on_resident_tables():
    """20 steps, rows skipped for up to 12 steps, clipping active: every parameter to 1e-6 (the tables'
    rows brought current by their replays, on read and at the save), the moments too."""
    _, _, ref_opt, ref_losses = (ref := _train(_spec("fsdp")))
    model, plan, opt, losses = _train(_spec("host"))
    assert plan.host_tables and not plan.sparse_rows
    assert [m.row_update for m in (model.get_submodule(n) for n in plan.host_tables)] == ["lazy"] * len(plan.host_tables)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    _close(_weights(ref[0]), _weights(model))
    for n in plan.host_tables:   # the moments, settled by the save above
        a, b = ref_opt.state[ref[0].get_submodule(n).weight], opt.state[model.get_submodule(n).weight]
        _close({"m": a["exp_avg"], "v": a["exp_avg_sq"]}, {"m": b["exp_avg"], "v": b["exp_avg_sq"]})


def test_without_the_replay_lazy_tables_differ_from_dense_adamw(monkeypatch):
    """The check above can fail: with the replay removed (rows left as they were when skipped, as the row-sparse
    update does) the tables are far from dense AdamW's."""
    ref = _weights(_train(_spec("fsdp"))[0])
    monkeypatch.setattr(adamw.LazyRows, "replay", lambda self, p, state, rows: 0)
    got = _weights(_train(_spec("host"))[0])
    tables = [k for k in ref if "table" in k]
    assert tables and max((ref[k] - got[k]).abs().max().item() for k in tables) > 1e-4


def test_row_sparse_host_tables_equal_resident_row_sparse_tables():
    """``table_update: sparse`` with host tables: the resident row-sparse update (stem_sparse) to 1e-6."""
    ref = _train(_spec("fsdp", "stem_sparse"))
    model, plan, _, losses = _train(_spec("host", "stem_sparse"))
    assert plan.host_tables and plan.sparse_rows == plan.host_tables and not plan.row_sparse
    assert losses == pytest.approx(ref[3], rel=1e-6)
    _close(_weights(ref[0]), _weights(model))


def test_host_tables_train_as_resident_ones_under_bf16_autocast():
    """The paper's dtype: under the loop's bf16 autocast (``stem.train.loop.mixed_precision``, what a GPU job runs) a
    host table's fp32 rows and gradients (``HostLookup``: the rows cast to the weight's dtype) train as the resident
    tables do: row-sparse against row-sparse bit for bit; lazy-exact against dense AdamW to 1e-4 (the replays' fp32
    rounding, 1e-7 apart, flips a few bf16 roundings of the forward: measured 4.5e-5 after 8 steps, the losses equal);
    and bf16 does change the losses."""
    bf16 = {}
    for variant, tol in (("stem", 1e-4), ("stem_sparse", 0.0)):
        ref = _train(_spec("fsdp", variant), steps=8, bf16=True)
        model, _, _, bf16[variant] = _train(_spec("host", variant), steps=8, bf16=True)
        assert bf16[variant] == pytest.approx(ref[3], rel=1e-6)
        _close(_weights(ref[0]), _weights(model), tol)
    assert _train(_spec("host"), steps=8)[3] != pytest.approx(bf16["stem"], rel=1e-6)


def test_host_gradient_is_the_touched_rows_only():
    """After a step's backward a host table's gradient is a sparse (ids, rows) tensor of the unique ids read, each
    once (accumulated by id, ``StepRows``), not coalesced (clipping and the optimizer take it as it is)."""
    spec = _spec("host", clip=1e3)
    model, plan, opt = _model(spec)
    batches = _batches(3)
    step.accumulate_gradients(model, batches, distributed.DistContext(), "cpu", torch.autocast("cpu", enabled=False))
    ids = torch.cat([x.reshape(-1) for x, _, _ in batches]).unique()
    for n in plan.host_tables:
        g = model.get_submodule(n).weight.grad
        assert g.is_sparse and not g.is_coalesced() and g._nnz() == ids.numel()
        assert torch.equal(g.coalesce().indices()[0], ids)


def test_a_saved_lazy_state_resumes_exactly(tmp_path):
    """A state saved after 7 steps (every row settled) resumed for the remaining 13: the uninterrupted run."""
    spec = _spec("host")
    straight = _weights(_train(spec)[0])
    _train(spec, steps=7, save=tmp_path / "state")
    resumed = _weights(_train(spec, state=tmp_path / "state")[0])
    _close(straight, resumed, 1e-7)


def _table_after(steps: list, update: str = "lazy", workers: int | None = None, first: bool = False) -> torch.Tensor:
    """A 50 x 4 host table (stem.bench.host's) trained by lazy (or row-sparse) AdamW on ``steps`` (each a list of id
    tensors), its update on ``workers`` threads if given (``first``: the next step's first ids updated first,
    ``read_first``), its weights after a save's settle."""
    from stem.bench.host import _Holder
    from stem.train.tables import _fetch
    torch.manual_seed(0)
    holder = _Holder(50, 4)
    to_host(holder, ("table",), sparse=("table",) if update == "sparse" else ())
    m, w = holder.table, holder.table.weight
    opt = adamw.RowSparseAdamW([{"params": [w], "lr": 1e-2, "weight_decay": 0.1}], betas=(0.9, 0.95), eps=1e-8)
    opt.track(m)
    if workers:
        opt.overlap(workers)
    for i, micro in enumerate(steps):
        for ids in micro:
            _, host_ids, rows = _fetch(m, ids)
            m.step_rows().accumulate(w, host_ids, rows.sin())
        if first and i + 1 < len(steps):
            opt.read_first([(w, steps[i + 1][0].unique())])
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.settle()
    return w.detach().clone()


def _steps() -> list:
    g = torch.Generator().manual_seed(3)
    return [[(torch.randint(0, 30, (16,), generator=g) + 5 * i) % 50 for _ in range(2)] for i in range(6)]


def test_a_save_settles_in_chunks_exactly(monkeypatch):
    """``settle`` brings rows current ``SETTLE_ROWS`` at a time (no second copy of a whole table): the same weights,
    bit for bit, as all rows at once; and not those of a table never settled (the check can fail)."""
    whole = _table_after(_steps())
    monkeypatch.setattr(adamw, "SETTLE_ROWS", 7)
    assert torch.equal(whole, _table_after(_steps()))
    monkeypatch.setattr(adamw.RowSparseAdamW, "settle", lambda self: None)
    assert not torch.equal(whole, _table_after(_steps()))


def test_every_missed_row_step_is_replayed_once():
    """The step-time model's replay count (stem.train.comms.host_update: V - u row-steps a step) against the real
    lazy update (stem.bench.host.run: the replays counted as they run, a final save included)."""
    from types import SimpleNamespace
    from stem.bench import host
    args, steps = SimpleNamespace(rows=50, width=4), _steps()
    r = host.run(args, "lazy", steps)
    missed = sum(args.rows - torch.cat(micro).unique().numel() for micro in steps)
    assert r["replayed_row_steps_per_step"] * (len(steps) - 1) == missed
    assert host.run(args, "sparse", steps)["replayed_row_steps_per_step"] == 0


@pytest.fixture(scope="module")
def rehearsal_1b_stem():
    exp = C.experiment.load(REPO / "config" / "rehearsal.yaml")
    return exp, memtrace.experiment_steps(exp, [("1b", "stem", "pretrain")])[0]


def test_the_step_time_model_counts_the_host_side(rehearsal_1b_stem):
    """config/rehearsal.yaml's 1b/stem/pretrain (fitted: host tables, 4 micro-batches of 2 x 4,096): the host side
    counts the step's unique rows of its 5 tables, the V - u rows each lazy table replays, at min(100 GB/s,
    8 cpus x 10 GB/s), and the step over the compute adds it to the copies."""
    from stem.train import comms
    _, r = rehearsal_1b_stem
    h, u = r["host"], comms.zipf_unique(4 * 2 * 4096, 128256)
    assert h["gbs"] == 80.0 and h["touched_params"] == 5 * u * 8192
    assert h["replayed_param_steps"] == 5 * (128256 - u) * 8192
    assert h["total_s"] == pytest.approx(sum(h["bytes"].values()) / 80e9) and set(h["bytes"]) == {"fetch", "update", "replay"}
    assert h["device_s"] == pytest.approx(sum(h["device_bytes"].values()) / 3350e9)   # accumulation and norm: the GPU's
    fetched = 4 * 5 * comms.zipf_unique(2 * 4096, 128256) * 8192   # every micro-batch's rows in, the step's out once
    assert r["bytes_per_gpu"]["host_copy"] == pytest.approx(4 * fetched + 5 * u * (4 * 8192 + 8), rel=1e-9)
    step = r["compute_s"] + r["comm_s"] + h["total_s"] + h["device_s"]
    assert r["step_vs_compute"] == pytest.approx(step / r["compute_s"])


def test_host_memory_holds_no_dense_gradient(rehearsal_1b_stem):
    """The host tables' host memory: weights and moments (12 B a parameter) and the touched rows, not the 21 GB
    dense gradient (4 B a parameter) they had."""
    from stem.models.model import build_model
    from stem.train import comms, memory, memtrace
    exp, _ = rehearsal_1b_stem
    spec, plan = memtrace.job(C.train_spec(exp, "1b", "stem", "pretrain"), 1, "fsdp")
    model = build_model(spec.model, "meta")
    counts = comms.host_update(model, plan, 1.0)
    h = memory.host_estimate(model, plan, counts["touched_params"], counts["fetched_params"])
    n = 5 * 128256 * 8192
    assert plan.host_tables and h["table_params"] == n and h["tables"] == 12 * n and h["dense_grad"] == 4 * n
    assert h["gradient_rows"] == 8 * counts["touched_params"] < h["dense_grad"] / 5


@pytest.mark.parametrize("update", ["lazy", "sparse"])
def test_an_overlapped_host_update_equals_the_synchronous_one(monkeypatch, update):
    """Issue 42 item 3: the row update on 2 worker threads, 3 rows a task, each read waiting for its own rows only:
    the synchronous update's weights, bit for bit (the same arithmetic on the same rows)."""
    sync = _table_after(_steps(), update)
    monkeypatch.setattr(adamw, "OVERLAP_ROWS", 3)
    assert torch.equal(sync, _table_after(_steps(), update, workers=2))


@pytest.mark.parametrize("update", ["lazy", "sparse"])
def test_the_next_steps_first_rows_updated_first_give_the_same_table(monkeypatch, update):
    """The update on 2 workers, 3 rows a task, the rows the next step's first micro-batch reads taken first
    (``read_first``): the synchronous update's weights, bit for bit (independent rows: the order changes no value)."""
    sync = _table_after(_steps(), update)
    monkeypatch.setattr(adamw, "OVERLAP_ROWS", 3)
    assert torch.equal(sync, _table_after(_steps(), update, workers=2, first=True))


def test_the_rows_the_next_step_reads_are_updated_first_in_its_read_order(monkeypatch):
    """Two host tables, the update on one worker (its tasks run in the order submitted), 3 rows a task: the rows the
    next step's first micro-batch reads go first, table by table in the order given (the forward's: here the second
    table's first), then the others; without ``read_first``, table by table in id order."""
    from stem.bench.host import _Holder
    from stem.train.tables import _fetch
    monkeypatch.setattr(adamw, "OVERLAP_ROWS", 3)
    done, rows_of = [], adamw._adamw_rows
    monkeypatch.setattr(adamw, "_adamw_rows", lambda local, rows, *a: (done.append((local[0], rows.tolist())),
                                                                       rows_of(local, rows, *a)))
    tables = [_Holder(20, 4), _Holder(20, 4)]
    for h in tables:
        to_host(h, ("table",), sparse=("table",))
    ws = [h.table.weight for h in tables]
    opt = adamw.RowSparseAdamW([{"params": ws, "lr": 1e-2}], betas=(0.9, 0.95), eps=1e-8)
    for h in tables:
        opt.track(h.table)
    opt.overlap(1)
    ids = torch.arange(0, 20, 2)
    for order in ([1, 0], None):
        for h, w in zip(tables, ws):
            _, host_ids, rows = _fetch(h.table, ids)
            h.table.step_rows().accumulate(w, host_ids, rows.sin())
        if order:
            opt.read_first([(ws[k], torch.tensor([4, 10, 16, 3])) for k in order])
        done.clear()
        opt.step()
        opt.drain()
        opt.zero_grad(set_to_none=True)
        seq = [(next(k for k, w in enumerate(ws) if w is p), r) for p, rs in done for r in rs]
        if order:
            assert seq == [(1, r) for r in (4, 10, 16)] + [(0, r) for r in (4, 10, 16)] + \
                [(k, r) for k in (0, 1) for r in ids.tolist() if r not in (4, 10, 16)]
        else:
            assert seq == [(k, r) for k in (0, 1) for r in ids.tolist()]


def test_a_job_drawing_its_next_batch_ahead_resumes_exactly(spec_factory, tmp_path):
    """A training job with host workers draws each next step's batches a step ahead (``loop.draw_ahead``, for
    ``read_first``) and saves the loader's state from before them: killed after a saved state and rerun, it ends
    where the uninterrupted run does, and that run where the job without workers does (bit for bit)."""
    from stem.train.loop import train
    from killing import sigkill_after_state

    def spec(name, **kw):
        return spec_factory(tmp_path / name, steps=8, checkpoint_interval=4, tables="host", **kw)
    plain, full = train(spec("plain"), threads=1), train(spec("full", host_workers=1), threads=1)
    assert (full["last_step_loss"], full["final_val_loss"]) == (plain["last_step_loss"], plain["final_val_loss"])
    killed = spec("killed", host_workers=1)
    sigkill_after_state(killed, 4)
    resumed = train(killed, threads=1)
    assert (resumed["last_step_loss"], resumed["final_val_loss"]) == (full["last_step_loss"], full["final_val_loss"])


def test_host_workers_overlap_a_training_jobs_update():
    """``cluster.host_workers`` reaches the job's optimizer (stem.train.step.make_optimizer): after a step the host
    tables' updates are pending on the worker, and 8 steps end where the synchronous job does, bit for bit."""
    spec = _spec("host", workers=1)
    assert spec.train.host_workers == 1 and _spec("host").train.host_workers is None
    model, _, opt = _model(spec)
    step.train_step(model, opt, _batches(0), distributed.DistContext(), torch.autocast("cpu", enabled=False), 1e-3, 1.0)
    assert opt.pool is not None and opt.pending
    _close(_weights(_train(_spec("host"), steps=3)[0]), _weights(_train(spec, steps=3)[0]), 0.0)


@pytest.mark.parametrize("update", ["lazy", "sparse"])
def test_the_fused_row_update_is_the_unfused_formula_and_independent_of_its_blocks(monkeypatch, update):
    """Issue 42's fused row update (stem.optim.adamw._adamw_block: torch's fused AdamW kernel on rows gathered into a
    workspace, the last rows of a call through a zero-padded side buffer): within 1e-6 of the same formula in
    unfused ops (FUSED_ROWS off; they round differently), and bit for bit the same whatever the blocks (3 rows)."""
    fused = _table_after(_steps(), update)
    monkeypatch.setattr(adamw, "ROW_BLOCK_BYTES", 3 * 4 * 4)
    assert torch.equal(fused, _table_after(_steps(), update))
    monkeypatch.setattr(adamw, "FUSED_ROWS", False)
    unfused = _table_after(_steps(), update)
    _close({"w": unfused}, {"w": fused}, 1e-6)
    monkeypatch.setattr(adamw, "_adamw_block", lambda w, g, m, v, *a: None)   # the check can fail: no update at all
    assert (_table_after(_steps(), update) - fused).abs().max() > 1e-4


def test_the_step_accumulates_by_id_bit_for_bit_as_coalesced_sums():
    """Issue 42: a host table's gradient accumulated by id once a step (``StepRows.accumulate``: one
    ``index_add_`` a micro-batch into the step's rows, the buffer grown and reused from step to step) equals the sparse
    sum coalesced after every micro-batch (the code before) bit for bit, each id held once; a gradient that is not
    the step's own (clipping's coalesced one) is summed with the next micro-batch's rows as before."""
    from stem.train.tables import StepRows
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(50, 4))
    acc = StepRows(w)
    for micro in _steps()[:3]:
        w.grad, ref = None, None
        for ids in micro + [micro[0] + 7]:   # three micro-batches, some ids in all of them
            ids = ids.remainder(50).unique()
            rows = torch.randn(ids.numel(), 4)
            g = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, w.shape, is_coalesced=True, check_invariants=False)
            ref = g if ref is None else (ref + g).coalesce()
            acc.accumulate(w, ids, rows)
        got = w.grad.coalesce()
        assert w.grad._nnz() == ref._nnz()
        assert torch.equal(got.indices(), ref.indices()) and torch.equal(got.values(), ref.values())
    assert acc.buf.shape[0] >= ref._nnz()
    w.grad = got                              # as clipping leaves it: coalesced, not the step's own
    ids, rows = torch.tensor([1, 2]), torch.ones(2, 4)
    acc.accumulate(w, ids, rows)
    assert w.grad.is_coalesced() and torch.equal(w.grad.to_dense(), got.to_dense().index_add(0, ids, rows))


def test_fetches_reuse_their_buffer_and_a_prefetch_survives_a_forwards_own_fetch():
    """``_fetch`` gathers into a reused buffer per slot (a fresh one's page faults cost more than the gather): a second
    fetch of a slot reuses the first's memory, and the rows fetched ahead (``prefetch``'s slot) are still the table's
    rows after a forward's own fetch (a recomputed forward under activation checkpointing) of other ids."""
    from stem.bench.host import _Holder
    from stem.train.tables import _fetch
    holder = _Holder(50, 4)
    to_host(holder, ("table",))
    m, w = holder.table, holder.table.weight.detach()
    a, b = torch.tensor([1, 3, 5, 7]), torch.tensor([2, 4, 6, 8, 9])
    ahead = _fetch(m, a, slot="ahead")[2]
    first = _fetch(m, b)[2]
    assert torch.equal(first, w[b]) and torch.equal(ahead, w[a])
    again = _fetch(m, a)[2]
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, w[a]) and torch.equal(ahead, w[a])


@pytest.mark.parametrize("variant, clip, tol", [("stem", 1e3, 0.0), ("stem_sparse", 0.05, 1e-6)])
def test_rows_held_by_id_train_as_the_coalesced_gradient(monkeypatch, variant, clip, tol):
    """Issue 42's no-coalesce lever: clipping and the update take a host table's gradient as accumulated by id (only the
    ids sorted, the rows gathered by that order with the update's blocks; ``HostTable.held_grad``), and 4 steps end
    where the coalesced gradient (session 13's code: ``held_grad`` off) does: bit for bit with clipping inactive (the
    same arithmetic on the same rows; lazy), to 1e-6 with it active (the norm sums the rows in another order;
    row-sparse); after clipping the gradient is still the step's own, its norm the coalesced one's to 1e-6."""
    from stem.train.tables import HostTable
    spec = _spec("host", variant, clip=clip)
    held = _weights(_train(spec, steps=4)[0])
    model, _, _ = _model(spec)
    ctx, off = distributed.DistContext(), torch.autocast("cpu", enabled=False)
    step.accumulate_gradients(model, _batches(2), ctx, "cpu", off)
    norm = distributed.clip_grad_norm_(model, 1e3, ctx)
    tables = [m for m in model.modules() if isinstance(m, HostTable)]
    assert tables and all(m.held_grad() is not None and not m.weight.grad.is_coalesced() for m in tables)
    monkeypatch.setattr(HostTable, "held_grad", lambda self, lend=False: None)
    for m in tables:
        m.weight.grad = m.weight.grad.coalesce()
    assert distributed.clip_grad_norm_(model, 1e3, ctx).item() == pytest.approx(norm.item(), rel=1e-6)
    _close(_weights(_train(spec, steps=4)[0]), held, tol)


def test_an_overlapped_update_keeps_its_rows_while_the_next_step_accumulates():
    """The update on a worker reads the step's rows where they were accumulated (``StepRows.lend``): the next step
    accumulates into a second buffer, the one after into the first again (the borrower drained by then)."""
    from stem.bench.host import _Holder
    from stem.train.tables import _fetch
    holder = _Holder(50, 4)
    to_host(holder, ("table",), sparse=("table",))
    m, w = holder.table, holder.table.weight
    opt = adamw.RowSparseAdamW([{"params": [w], "lr": 1e-2, "weight_decay": 0.1}], betas=(0.9, 0.95), eps=1e-8)
    opt.track(m)
    opt.overlap(1)
    seen = []
    for micro in _steps()[:3]:
        for ids in micro:
            _, host_ids, rows = _fetch(m, ids)
            m.step_rows().accumulate(w, host_ids, rows.sin())
        seen.append(m.held_grad()[1].data_ptr())
        opt.step()
        assert m.grad_rows.lent and opt.pending
        opt.zero_grad(set_to_none=True)
    assert seen[0] != seen[1] and seen[2] == seen[0]
    opt.drain()


def test_row_sum_squares_is_the_fp64_sum_in_blocks(monkeypatch):
    """Clipping's norm of held rows (``adamw.row_sum_squares``: squared a block at a time into a workspace, the blocks
    summed in fp64): the fp64 sum of squares to 1e-7, in blocks of 3 rows too."""
    x = torch.randn(1000, 96, generator=torch.Generator().manual_seed(0)) * 1e-3
    ref = x.double().pow(2).sum().item()
    assert adamw.row_sum_squares(x).item() == pytest.approx(ref, rel=1e-7)
    monkeypatch.setattr(adamw, "ROW_BLOCK_BYTES", 3 * 96 * 4)
    assert adamw.row_sum_squares(x).item() == pytest.approx(ref, rel=1e-7)


def test_the_critical_path_model_counts_what_the_code_leaves_on_it():
    """``comms.host_path`` (docs/training.md, "The critical path"): as built, micro-batch 0's fetch, what the others'
    prefetch does not fit in the previous forward (a third of its compute), the device's accumulation and norm, the
    update and the copies (every micro-batch's rows in, the step's rows out once); host workers take the update off; a
    side stream (CUDA, untested) leaves micro-batch 0's copy in and the last of 5 tables' rows out; the host's
    bandwidth bounds the step from below either way."""
    from stem.train import comms
    sec = {"fetch": 0.4, "update": 0.5, "replay": 0.0}
    host = {"seconds": sec, "total_s": sum(sec.values()), "device_s": 0.01}
    copies = {"in": 0.08, "out": 0.05}
    built = comms.host_path(host, 0.6, copies, 4, False, tables=5)
    assert built["critical"] == pytest.approx({"fetch_first": 0.1, "fetch_recompute": 0.0, "fetch_ahead": 0.3 - 0.15,
                                               "device": 0.01, "update": 0.5, "update_wait": 0.0, "copies": 0.13})
    assert built["step_s"] == pytest.approx(0.6 + 0.89)
    workers = comms.host_path(host, 0.6, copies, 4, False, workers=True, tables=5)
    assert workers["critical"]["update"] == 0 and workers["step_s"] == pytest.approx(0.6 + 0.39)
    side = comms.host_path(host, 0.6, copies, 4, False, workers=True, side_stream=True, tables=5)
    assert side["critical"]["copies"] == pytest.approx(0.02 + 0.01)
    assert side["step_s"] == pytest.approx(host["total_s"]) and host["total_s"] > 0.6 + side["critical_s"]   # bandwidth
    ckpt = comms.host_path(host, 0.6, copies, 4, True, tables=5)
    assert ckpt["critical"]["fetch_recompute"] == pytest.approx(0.2) and ckpt["critical"]["fetch_first"] == pytest.approx(0.05)
    side = comms.host_path(host, 0.6, copies, 4, True, workers=True, side_stream=True, tables=5)
    assert side["critical"]["copies"] == pytest.approx(0.08 * (1 / 8 + 1 / 2) + 0.01)   # the recomputed forward's in


def test_the_next_steps_wait_for_its_first_rows_update_is_modelled():
    """``comms.first_read_wait`` (docs/training.md, "The critical path"): two tables read at 0 and half of a 0.1 s
    forward, an update of 0.4 s (0.2 s a table) of which each read needs half (0.1 s), a 0.02 s fetch, one worker at half the
    bandwidth. Those rows first (as built), the worker and the reader together at full bandwidth: the reads are
    ready at 0.1 and 0.21 s (the update paused while the host fetches), the device waits 0.22 - 0.05 s, less the
    fetch counted apart: 0.15 s. Session 15's order (the reader alone at half the bandwidth, the worker not yet at
    the rows): 0.42 - 0.05 - 0.02 = 0.35 s. ``host_path`` puts it on the path with host workers only; the rehearsal's
    1b/stem_sparse/pretrain reads the Zipf overlap of its next micro-batch with its step at the tables' blocks."""
    from stem.train import comms
    reads = {"share": 0.5, "layers": [0.0, 0.5], "threads": 1, "thread_share": 0.5, "first": True}
    assert comms.first_read_wait(0.4, 0.02, 0.1, reads) == pytest.approx(0.15)
    assert comms.first_read_wait(0.4, 0.02, 0.1, {**reads, "first": False}) == pytest.approx(0.35)
    assert comms.first_read_wait(0.4, 0.02, 10.0, {**reads, "layers": [0.5, 0.9]}) == 0   # behind the forward
    sec = {"fetch": 0.08, "update": 0.4, "replay": 0.0}
    host = {"seconds": sec, "total_s": 0.48, "device_s": 0.0}
    args = (host, 1.2, {"in": 0.0, "out": 0.0}, 4, False)
    assert comms.host_path(*args, True, tables=2, reads=reads)["critical"]["update_wait"] == pytest.approx(0.15)
    assert comms.host_path(*args, tables=2, reads=reads)["critical"]["update_wait"] == 0   # the update is critical
    exp = C.experiment.load(REPO / "config" / "rehearsal.yaml")
    r = memtrace.experiment_steps(exp, [("1b", "stem_sparse", "pretrain")])[0]
    got = r["host"]["reads"]
    seen, step = comms.zipf_seen(8192, 128256), comms.zipf_seen(32768, 128256)
    assert got["share"] == pytest.approx(float((seen * step).sum() / step.sum())) and got["threads"] == 7
    assert got["layers"] == [2 / 16, 5 / 16, 8 / 16, 11 / 16, 14 / 16]
    paths = r["host"]["paths"]
    assert paths["step_vs_compute_overlapped"]["critical"]["update_wait"] > 0
    assert r["step_workers_unordered"] > r["step_vs_compute_overlapped"] > r["step_side_stream"]


def _session14_scale(self, coef):
    """Session 14's clipping of held rows: scaled in place, in a pass of their own (before the update's gather)."""
    ids, rows = self.held_grad()
    rows.mul_(coef.to(rows.device))


@pytest.mark.parametrize("variant", ["stem", "stem_sparse"])
def test_clippings_scale_in_the_updates_gather_is_the_in_place_scale_bit_for_bit(monkeypatch, variant):
    """Issue 42's device-side lever: clipping records its coefficient for a host table's held rows
    (``HostTable.scale_grad``) and the update multiplies each row by it as it gathers it (``_row_blocks``), with no
    pass of its own: 4 steps with clipping active (0.05) end where scaling the rows in place (session 14's code) does,
    bit for bit (the same fp32 products), lazy and row-sparse; the check can fail (no scale at all)."""
    from stem.train.tables import HostTable
    spec = _spec("host", variant, clip=0.05)
    got = _weights(_train(spec, steps=4)[0])
    monkeypatch.setattr(HostTable, "scale_grad", _session14_scale)
    _close(_weights(_train(spec, steps=4)[0]), got, 0.0)
    monkeypatch.setattr(HostTable, "scale_grad", lambda self, coef: None)
    unscaled = _weights(_train(spec, steps=4)[0])
    assert max((v - unscaled[k]).abs().max().item() for k, v in got.items()) > 1e-6


@pytest.mark.parametrize("workers", [None, 1])
def test_rows_accumulated_apart_from_the_host_train_bit_for_bit(monkeypatch, workers):
    """The path a GPU takes (``StepRows`` with ``apart``: the step's rows accumulated on the lookup's device, the
    weight's gradient an empty marker, clipping's norm on those rows, one copy of (ids, rows) to the host a step into
    reused host buffers that alternate when an overlapped update keeps one), run on this CPU: 4 steps of lazy and
    row-sparse host tables, clipping active, end where the rows accumulated on the host do, bit for bit (the same
    arithmetic; only where the rows sit differs). The CUDA transfers themselves are not run here (no GPU)."""
    from stem.train.tables import HostTable, StepRows
    init, to_host = StepRows.__init__, StepRows.to_host
    for variant in ("stem", "stem_sparse"):
        spec = _spec("host", variant, clip=0.05, workers=workers)
        ref = _weights(_train(spec, steps=4)[0])
        monkeypatch.setattr(StepRows, "__init__", lambda self, w, device=None, apart=None: init(self, w, device, True))
        monkeypatch.setattr(StepRows, "to_host", lambda self, lend=False: sent.append(self.sent) or to_host(self, lend))
        sent = []
        model, _, _, _ = got = _train(spec, steps=4)
        assert sent and all(x is True for x in sent)   # sent by each table's last backward (``send_rows``)
        tables = [m for m in model.modules() if isinstance(m, HostTable)]
        assert tables and all(m.grad_rows.apart and m.grad_rows.copies[0] is not None for m in tables)
        assert (workers is None) == all(m.grad_rows.copies[1] is None for m in tables)   # alternate when lent
        _close(ref, _weights(got[0]), 0.0)
        monkeypatch.setattr(StepRows, "__init__", init)
        monkeypatch.setattr(StepRows, "to_host", to_host)


def test_rows_apart_mark_the_step_and_copy_once_to_the_host():
    """``StepRows`` apart from the host: the weight's gradient is an empty sparse marker of the step, the rows are read
    where they are (``held``), clipping's coefficient waits for the update (``to_host``: the rows, unscaled, copied
    into a host buffer, the coefficient beside them); a lent copy is kept and the next step's goes to the other."""
    from stem.train.tables import StepRows
    w = torch.nn.Parameter(torch.zeros(50, 4))
    acc = StepRows(w, apart=True)
    seen = []
    for micro in _steps()[:3]:
        w.grad = None
        ref = torch.zeros(50, 4)
        for ids in micro:
            ids = ids.unique()
            rows = torch.randn(ids.numel(), 4)
            acc.accumulate(w, ids, rows)
            ref.index_add_(0, ids, rows)
        assert w.grad.is_sparse and w.grad._nnz() == 0 and acc.held(w.grad) is not None
        acc.scale(torch.tensor(0.5))
        ids, rows, coef = acc.to_host(lend=True)
        assert rows.data_ptr() != acc.buf.data_ptr() and coef.item() == 0.5
        assert torch.equal(torch.zeros(50, 4).index_add_(0, ids, rows), ref)
        seen.append(rows.data_ptr())
    assert seen[0] != seen[1] and seen[2] == seen[0]
