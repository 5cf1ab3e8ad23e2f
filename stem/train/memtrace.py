"""Per-GPU peak memory of a training job, traced from the real training step (``trace``), and a cache of
traces (``traced``: ``python -m stem memory`` and the workflow's pre-flight check, ``stem.train.gate.check``).

``trace`` runs one real training step of the job (this project's model, FSDP2
wrapping, AdamW groups, micro-batch accumulation, gradient clipping) for rank 0 of a *fake* process group
of the job's world size, under ``FakeTensorMode`` (no memory is allocated), and records the peak of live
tensor bytes with torch's ``FSDPMemTracker`` (``torch.distributed._tools``). It runs on the CPU (FSDP2
needs a real CUDA device): the CUDA run's mixed precision is applied there too (bf16 FSDP parameters,
fp32 reduction, bf16 autocast, fused AdamW); the CPU's attention kernel stands in for the CUDA one (it
saves grouped-query keys/values expanded to all heads, slightly more than a CUDA flash kernel), and the
extend stage's document mask (flex attention on CUDA, linear memory) is traced as plain causal attention.
Not counted: the CUDA context, NCCL buffers, allocator fragmentation (leave ~10 % headroom).
The closed form beside it is ``stem.train.memory.estimate``; both take the job's ``ParallelPlan``.

The cache (one JSON a trace, in a folder) is keyed by everything that sets the peak: the job spec's model and
optimizer, the plan, torch's version and the source of every stem module the trace imports (found by
reading their import statements, ``_imported_sources``, so an edit anywhere on that path retraces and no
hand-kept list can go stale).
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, nullcontext
from importlib.metadata import version
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from stem import config as C
from stem.config.experiment import Cluster, Experiment, dataclass_mapping, node
from stem.io import atomic_write_json
from stem.options import Device
from stem.models.model import build_model
from stem.optim.adamw import use_row_sparse
from stem.specs import TrainSpec
from stem.train import comms, distributed, memory
from stem.train.plan import ParallelPlan, cluster_train, job_layout
from stem.train import step
from stem.train.tables import HostTable, RowShardedTable, row_shardable, to_host

GIB = 1024 ** 3
STEM_DIR = Path(__file__).resolve().parents[1]


def job(spec: TrainSpec | dict, world: int, strategy: str | None = None, fitted: bool = True) -> tuple[TrainSpec, ParallelPlan]:
    """A job to trace: its TrainSpec (parsed here, once, from the workflow's JSON) and its plan at ``world``
    ranks (``strategy`` overrides the spec's), the row-sparse and row-shardable tables read from a meta-device
    model; with ``train.fit_gib`` set (and ``fitted``), the layout ``memory.fit`` chooses, as the job does."""
    spec, plan, _ = options(spec, world, strategy)
    return spec, plan[fitted]


def options(spec: TrainSpec | dict, world: int, strategy: str | None = None):
    """(spec, (its plan as written, the plan the job runs), the layouts ``memory.candidates`` allows it)."""
    spec = TrainSpec.coerce(spec)
    model = build_model(spec.model, "meta")
    sparse = spec.optim.row_sparse_tables(model) if spec.optim.sparse_tables else ()
    tables = row_shardable(model)
    plan = ParallelPlan.of(spec.train, world, strategy, sparse, tables)
    # the fastest layout that fits, ranked as on the GPU within one node (bf16 collectives; the job ranks alike)
    step_s = comms.fit_step_s(model, spec.train.seq_len, world, True, spec.train.host_workers,
                              comms.host_bandwidth(spec.train))
    run = memory.fit(model, plan, spec.train.batch_size, spec.train.fit_gib, tables, step_s) if spec.train.fit_gib else plan
    return spec, (plan, run), memory.candidates(plan, spec.train.batch_size, tables)


@contextmanager
def fake_world(world: int):
    """A fake process group of ``world`` ranks in this process (it is rank 0; collectives do nothing)."""
    if world == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("the memory trace needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _peak_only(cls):
    """A torch memory tracker that keeps the global peak only (its per-module peaks cost most of its time)."""
    class Peak(cls):
        def _update_peak_stats(self, peak_state):
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)
    return Peak


def _fake_values():
    """Fake tensors have no data: the values the training step reads from them. The MoE FFNs' assignments per
    expert (``bincount(expert, minlength=E)``, then ``.tolist()``) are each of the E experts' balanced share
    of the assignments (what Hash-MoE's balanced token map and the routed MoE's balance loss aim at); any other
    scalar read (``.item()``: the step's loss and its mean over ranks) is 1 (it sets no tensor's size)."""
    class FakeValues(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bincount.default:   # assignments per expert; .tolist() reads them
                n, e = args[0].numel(), (kwargs or {}).get("minlength", args[2] if len(args) > 2 else 0)
                if not e:
                    raise RuntimeError("memory trace: a bincount without minlength (its size depends on the data)")
                self.pending += [n // e + (i < n % e) for i in range(e)]
                return torch.empty(e, dtype=torch.int64, device=args[0].device)
            if func is torch.ops.aten._local_scalar_dense.default:
                return self.pending.pop(0) if self.pending else (1.0 if args[0].dtype.is_floating_point else 1)
            return func(*args, **(kwargs or {}))
    mode = FakeValues()
    mode.pending = []
    return mode


def _laid_out(cfg, plan: ParallelPlan, ctx, mixed_precision: bool):
    """The model as the loop lays it out for ``plan`` (build, then shard), set up for tracing: its replicated
    row-sparse tables and its host tables (both returned with it)."""
    model = build_model(cfg, ctx.device)
    model.set_training_options(activation_checkpointing=plan.activation_checkpointing)
    tables = use_row_sparse(model, plan.row_sparse)   # sparse: replicated, outside FSDP
    host = to_host(model, plan.host_tables, plan.sparse_rows)   # host: off the GPU (subtracted below)
    distributed.parallelize(model, ctx, plan, mixed_precision=mixed_precision)
    for m in tables:   # traced with a dense V x d_ff gradient, the sparse one's upper bound (a fake tensor
        m.row_sparse = False   # cannot run the lookup's torch.unique: its output shape depends on the data)
    for name in plan.row_sharded + plan.host_tables:   # likewise (the bound), and updated as dense tables
        m = model.get_submodule(name)
        if isinstance(m, (RowShardedTable, HostTable)):   # (at world 1 a row-sharded table stays as it is)
            m.for_trace()
    return model, tables, host


def _peak_parts(peak: dict, tables, host, step_rows: int = 0) -> dict:
    """The tracker's peak snapshot as {category: bytes} (with ``Total``), corrected for what it does not see
    or what is not on the GPU (``step_rows``: host tables' step rows on the GPU, ``memory.host_device_bytes``)."""
    parts: dict = {}
    for snap in peak.values():   # one device
        for k, v in snap.items():
            name = getattr(k, "value", k)      # the tracker's category enums -> their names
            parts[name] = parts.get(name, 0) + v
    # the tracker does not see the gradient of a parameter outside FSDP (the replicated row-sparse tables):
    # added as a full fp32 replica, the upper bound of a gradient of at most V rows
    untracked = 4 * sum(p.numel() for m in tables for p in m.parameters())
    if untracked:
        parts["Replicated table grad"] = untracked
        parts["Total"] += untracked
    # host tables: the trace runs on one (CPU) device, where their weights, gradients and two moments (fp32) are
    # tracked like the rest; they are off the GPU
    off = 16 * sum(p.numel() for p in host)
    if off:
        parts["Host tables (off the GPU)"] = -off
        parts["Total"] -= off
    # their step's gradient rows, accumulated on the GPU (``StepRows``) and held from the first backward through the
    # update (the buffer is reused from step to step, so at every peak): the trace takes the dense-gradient bound
    # path (``HostTable.for_trace``: the rows' count is data), which puts nothing on the device
    if step_rows:
        parts["Host tables' step rows (on the GPU)"] = step_rows
        parts["Total"] += step_rows
    # the row-sharded tables (outside FSDP) it does see: their shards through the lookup's to_local() (as "Temp",
    # from their first forward on), their gradients (made in backward) and their moments (the optimizer's)
    return parts


def trace(spec: TrainSpec, plan: ParallelPlan, mixed_precision: bool = True) -> dict:
    """Rank 0's peak tensor memory over one training step (``stem.train.step.train_step``, as the loop runs
    it) of the job ``spec`` laid out as ``plan`` (``job``)."""
    cfg, tc = spec.model, spec.train
    n_micro = min(plan.accum // plan.world, 2)   # from the second micro-batch on, every one holds the same tensors
    device = torch.device("cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision else nullcontext()
    values = _fake_values()
    with fake_world(plan.world) as mesh, FakeTensorMode(), values:
        ctx = distributed.DistContext(0, plan.world, 0, 1, device, mesh)
        model, tables, host = _laid_out(cfg, plan, ctx, mixed_precision)
        opt = step.make_optimizer(model, spec, plan, fused=mixed_precision)
        x = torch.randint(0, cfg.vocab_size, (plan.micro_batch, plan.seq_len), device=device)
        y = torch.randint(0, cfg.vocab_size, (plan.micro_batch, plan.seq_len), device=device)
        for p in model.parameters():          # AdamW's state, as its first step creates it
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        fsdp = isinstance(model, FSDPModule)
        tracker = _peak_only(FSDPMemTracker)(model, opt) if fsdp else _peak_only(MemTracker)()
        if fsdp:
            tracker.track_inputs((x, y))
        else:
            tracker.track_external(model, opt, x, y)
        model.train()
        # the step's micro-batches of every rank: rank 0 runs n_micro of them (the same tensors), every target trained
        batches = [(x, y, None)] * (n_micro * plan.world)
        with tracker:                          # one step of the training loop, less its logging
            step.train_step(model, opt, batches, ctx, autocast, tc.lr, spec.optim.grad_clip,
                            counts=[x.numel()] * len(batches),
                            on_backward=tracker.reset_mod_stats)   # the tracker refuses a second root forward otherwise
        peak = tracker.get_tracker_snapshot("peak")
    parts = _peak_parts(peak, tables, host, memory.host_device_bytes(model, plan))
    return {"peak_gib": parts.pop("Total") / GIB, "parts_gib": {k: v / GIB for k, v in parts.items() if v},
            "world": plan.world, "strategy": plan.strategy, "micro_batch": plan.micro_batch, "seq_len": plan.seq_len,
            "micro_batches_traced": n_micro, "activation_checkpointing": model.activation_checkpointing}


# ----------------------------------------------------------------------------- the cache

def _module_file(name: str) -> Path | None:
    base = STEM_DIR.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None   # a name imported from a module (a function, a class), not a module


def _imported_sources(root: str = __name__) -> list[Path]:
    """The files of the stem modules ``root`` imports, directly or through others, at module level or inside
    a function, with the packages above each: read from their import statements (nothing is imported)."""
    seen: dict[str, Path | None] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = path = _module_file(name)
        if path is None:
            continue
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "stem"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: from the module's package
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] == "stem":
                    todo += [base] + [f"{base}.{a.name}" for a in node.names]
    return sorted(p for p in seen.values() if p is not None)


def _code_hash() -> str:
    h = hashlib.sha256()
    for path in _imported_sources():
        h.update(str(path.relative_to(STEM_DIR.parent)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _trace_key(spec: TrainSpec, plan: ParallelPlan, code: str) -> str:
    d = spec.to_dict()
    h = hashlib.sha256(json.dumps({
        "model": d["model"], "optim": d["optim"], "plugins": d.get("plugins", []), "plan": dataclasses.asdict(plan),
        "torch": version("torch"), "code": code}, sort_keys=True).encode())
    return h.hexdigest()[:20]


def _trace_job(args):
    try:
        return trace(*args)
    except Exception as e:  # torch's fake-tensor errors do not pickle back from a worker process
        spec = args[0]
        raise RuntimeError(f"memory trace of {spec.name} failed: {type(e).__name__}: {e}") from None


def traced(jobs: list[tuple[TrainSpec, ParallelPlan]], cache_dir, workers: int = 1) -> list[dict]:
    """``trace`` of each (spec, plan) (``job``), cached in ``cache_dir`` (see the module docstring), so a job
    is traced once; each in a fresh process, ``workers`` at once, or with ``workers=0`` in this one (jobs of
    one rank only: they join no process group)."""
    cache_dir, code = Path(cache_dir), _code_hash()
    paths = [cache_dir / f"{_trace_key(*j, code)}.json" for j in jobs]
    todo = sorted({str(p): j for p, j in zip(paths, jobs) if not p.is_file()}.items())
    if todo and workers == 0:
        if any(plan.world > 1 for _, (_, plan) in todo):
            raise ValueError("memory trace in this process (workers=0): jobs of one rank only")
        cache_dir.mkdir(parents=True, exist_ok=True)
        for path, j in todo:
            atomic_write_json(Path(path), _trace_job(j))
    elif todo:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # a fresh process per job: each trace joins (and leaves) its own fake process group
        with ProcessPoolExecutor(max(1, min(workers, len(todo))), mp_context=get_context("spawn"),
                                 max_tasks_per_child=1) as pool:
            for (path, _), result in zip(todo, pool.map(_trace_job, [j for _, j in todo])):
                atomic_write_json(Path(path), result)
    return [json.loads(p.read_text()) for p in paths]


# ----------------------------------------------------------------------------- jobs of an experiment

def experiment_steps(exp: Experiment, jobs, gpus: int | None = None, strategy: str | None = None,
                     tables: str | None = None, **link) -> list[dict]:
    """``comms.model_step`` of each training job (scale, variant, stage) of ``exp`` at its ``cluster.train`` layout
    (``gpus``: another world size; ``strategy``: another backbone strategy; ``tables``: another table layout,
    ``cluster.tables``), with the job's steps, its GPU-hours
    at the stated MFU (compute only, and with the communication not overlapped: an upper bound) and, for every
    job whose scale and stage have a dense job, the ratio of its communication and step time to dense's.
    ``link``: ``model_step``'s bandwidth / MFU / peak overrides."""
    strategy = strategy or exp.cluster.parallel
    if tables:   # the cluster section checked with them (host tables: jobs of one GPU), one line naming the key
        exp = dataclasses.replace(exp, cluster=node(Cluster, {**dataclass_mapping(exp.cluster), "tables": tables}, "cluster"))
    rows = []
    for scale, variant, stage in jobs:
        world, per_node = job_layout(exp, scale)
        world = gpus or world
        spec, plan = job(C.train_spec(exp, scale, variant, stage), world, strategy)
        model = build_model(spec.model, "meta")
        r = comms.model_step(model, plan, spec.train.seq_len, per_node or world, exp.device == Device.CUDA,
                       host_gbs=comms.host_bandwidth(exp.cluster, cluster_train(exp, scale)),
                       host_workers=spec.train.host_workers, **link)
        steps = spec.train.steps
        r.update(job=f"{scale}/{variant}/{stage}", scale=scale, variant=variant, stage=stage, steps=steps,
                 gpu_hours=steps * world * r["compute_s"] / 3600,
                 gpu_hours_no_overlap=steps * world * r["compute_s"] * r["step_vs_compute"] / 3600)
        rows.append(r)
    dense = {(r["scale"], r["stage"]): r for r in rows if r["variant"] == "dense"}
    for r in rows:
        d = dense.get((r["scale"], r["stage"]))
        if d is not None and d["total_bytes"]:
            r["comm_vs_dense"] = r["total_bytes"] / d["total_bytes"]
            r["step_vs_dense"] = r["compute_s"] * r["step_vs_compute"] / (d["compute_s"] * d["step_vs_compute"])
    return rows
