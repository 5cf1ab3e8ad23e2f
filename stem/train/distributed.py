"""Data-parallel training under torchrun: process group, FSDP2 wrapping, gradient clipping over shards,
resumable state that reshards across world sizes. What is sharded how is the job's ``ParallelPlan``
(``stem.train.plan``), decided once.

World size 1 (a plain ``python`` run, or torchrun with one process) uses none of this: ``setup`` returns a
context with ``world == 1`` and every helper below falls through to the single-process behaviour, so the
single-process loop is the same maths as before.

Data parallelism. Every rank reads the same deterministic micro-batch stream and keeps micro-batches
``rank, rank + W, rank + 2W, ...`` of each step's ``accum`` global micro-batches, so a step sees the same set
of sequences at any world size and the loader state is global (identical on every rank). The per-rank
micro-batch is ``min(micro_batch, batch_size // W)`` (the config's micro_batch is a per-GPU upper bound;
``stem.train.plan.local_micro_batch``).

Sharding (``parallelize``, as the plan says):
- the backbone: ``fully_shard`` per transformer block plus the root (FSDP2, ``strategy="fsdp"``; the token
  embedding and the LM head are the root's, so a tied pair, ``tie_embeddings``, is one unit), or
  replicated with one gradient all-reduce per step (``strategy="ddp"``, for small models);
- row-sparse tables (``optim.table_update: sparse``, the plan's ``row_sparse``; under ``train.tables: rows``
  they are row-sharded instead, below): replicated on every rank, outside FSDP (FSDP cannot carry sparse
  gradients); their (ids, rows) gradients are all-gathered instead;
- STEM tables and DSE tables (under ``train.tables: fsdp``, the default), Hash-MoE experts and the routed MoE's
  experts: each such module gets its own ``fully_shard`` unit on the
  world mesh *before* the backbone is wrapped, so they are sharded over all ranks (dim 0: table rows /
  experts) whatever the backbone strategy. FSDP reduce-scatters their gradients over the whole world,
  i.e. across every data-parallel replica on every node (the official code leaves replicas of its
  d_ff-sharded tables unsynchronised across nodes). Chosen over the official d_ff split with an
  all-gather of looked-up rows because it is exact, reuses FSDP's tested gradient path and needs no
  model change; the cost is that a table's forward all-gathers the whole table of one layer (prefetched
  one unit ahead) instead of only the looked-up rows.
- row-sharded tables (``train.tables: rows``, the plan's ``row_sharded``; ``stem.train.tables``): DTensors
  sharded by rows outside FSDP; a micro-batch moves only the rows it reads (all-to-all), and their gradients,
  their clipping, optimizer step and checkpoints are those of any other sharded parameter.
- gradients are reduce-scattered after every micro-batch, so they stay sharded (fp32, params / world).
  Skipping the reduction until a step's last micro-batch (``set_requires_gradient_sync(False)``) would
  save communication but hold every unit's *unsharded* fp32 gradients between micro-batches: for the
  1B STEM pretraining job at world 32 that is 24 GiB more per GPU (traced: 81.6 vs 57.6 GiB).
- mixed precision on CUDA: bf16 parameters for compute, fp32 gradient reduction, fp32 master weights
  and optimizer state (``MixedPrecisionPolicy``). On the CPU (gloo, tests) everything stays fp32.

Checkpoints (``save_state`` / ``load_state``): world size 1 keeps the single-process format of
``stem.checkpoint`` (safetensors + torch.save). World size > 1 writes ``torch.distributed.checkpoint``
(DCP: every rank writes its own shards, no gather) in ``step_N/dcp``; DCP reshards on load, so a state
saved at world size W resumes at any other world size, including 1 (DCP loads without a process group).
The final, declared checkpoint stays one safetensors file: its full state dict is gathered to rank 0
(CPU-offloaded), which is simple and what evaluation reads, at the cost of one full copy in rank 0's RAM.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from stem import checkpoint as ck
from stem.io import atomic_write_json, replace_dir
from stem.models.model import loaded_state
from stem.optim.adamw import row_sum_squares
from stem.train import tables
from stem.train.plan import ParallelPlan

# torch.distributed's FSDP, DTensor, DCP and device-mesh modules are imported where they are used: 1.5 s of
# imports that a single-process job (and every process importing the training step) would otherwise pay.


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    device: torch.device = torch.device("cpu")
    mesh: object = None
    owns_group: bool = False   # setup() created the process group (teardown() destroys only that)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ----------------------------------------------------------------------------- process group

def setup(device: torch.device) -> DistContext:
    """Join the torchrun process group (if WORLD_SIZE > 1); pins one GPU per local rank on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistContext(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()   # a caller (e.g. a test running several jobs) may have joined already
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=int(os.environ.get("STEM_DIST_TIMEOUT_MIN", "30"))))
    from torch.distributed.device_mesh import init_device_mesh   # multi-rank only (see the note above DistContext)
    mesh = init_device_mesh(device.type, (world,))
    return DistContext(rank, world, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device, mesh, owns)


def teardown(ctx: DistContext):
    if ctx.world > 1 and ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_mean(ctx: DistContext, value: float) -> float:
    """The mean of a per-rank float over ranks (the float itself at world size 1)."""
    if ctx.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.item() / ctx.world


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """True on every rank if it is true on any (so all ranks stop at the same step on SIGTERM)."""
    if ctx.world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(t)
    return t.item() > 0


# ----------------------------------------------------------------------------- wrapping

def parallelize(model, ctx: DistContext, plan: ParallelPlan, mixed_precision: bool | None = None):
    """Shard ``model`` in place over the world as ``plan`` says (no-op at world size 1); see the module
    docstring. ``mixed_precision`` (default: on CUDA) forces the bf16 policy, e.g. for the memory trace on the CPU."""
    if plan.world != ctx.world:
        raise ValueError(f"parallel plan for world size {plan.world}, but the process group has {ctx.world} ranks")
    if ctx.world == 1:
        return model
    # multi-rank only (see the note above DistContext)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if mixed_precision is None:
        mixed_precision = ctx.device.type == "cuda"
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision else MixedPrecisionPolicy())
    ignored = set(plan.row_sparse_params(model))   # replicated (row-sparse) or row-sharded tables: outside FSDP
    if plan.row_sharded:
        ignored |= set(tables.shard_rows(model, plan.row_sharded, ctx.mesh, mixed_precision, plan.sparse_rows))
    ignored = ignored or None
    units = plan.shard_units(model)
    if model.cfg.tie_embeddings and any(p is model.tok_emb.weight for m in units for p in m.parameters()):
        # torch >= 2.13 refuses a parameter shared by two fully_shard units: a tied embedding and head stay together
        raise ValueError("tie_embeddings: the tied embedding / LM head must stay in one FSDP unit (the root's), "
                         "not in a table shard unit")
    for m in units:
        fully_shard(m, mesh=ctx.mesh, mp_policy=mp, ignored_params=ignored)
    if plan.strategy == "fsdp":
        for block in model.layers:
            fully_shard(block, mesh=ctx.mesh, mp_policy=mp, ignored_params=ignored)
        fully_shard(model, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    return model


def sync_replicated_grads(model, ctx: DistContext):
    """Average over all ranks the gradients FSDP does not reduce: the row-sparse tables' (kept out of FSDP and
    replicated; their gradients are the sparse ones: ``all_gather_sparse_grad``, in module order, the same on
    every rank) and the other replicated (non-DTensor) parameters', the backbone's under strategy ddp (under
    fsdp every other parameter is a DTensor, sharded)."""
    if ctx.world == 1:
        return
    for p in model.parameters():
        if p.grad is not None and p.grad.is_sparse:
            p.grad = all_gather_sparse_grad(p.grad, ctx)
    from torch.distributed.tensor import DTensor   # multi-rank only (see the note above DistContext)
    grads = [p.grad for p in model.parameters() if p.grad is not None and not isinstance(p.grad, DTensor)
             and not p.grad.is_sparse]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= ctx.world
    for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(s)


def all_gather_sparse_grad(grad: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The mean over ranks of a sparse (COO) row gradient, identical on every rank: each rank's (unique ids,
    rows) are all-gathered (padded to the longest), concatenated in rank order and coalesced, then / W (the
    average FSDP's reduction takes). Traffic: uniq(rows) x (d_ff + 1) per rank, not V x d_ff."""
    g = grad.coalesce()
    ids, rows = g.indices()[0], g.values()
    n = torch.tensor([ids.numel()], device=ids.device)
    sizes = [torch.zeros_like(n) for _ in range(ctx.world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    pad = longest - ids.numel()
    ids = torch.cat([ids, ids.new_zeros(pad)])
    rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    all_ids = [torch.empty_like(ids) for _ in range(ctx.world)]
    all_rows = [torch.empty_like(rows) for _ in range(ctx.world)]
    dist.all_gather(all_ids, ids)
    dist.all_gather(all_rows, rows)
    ids = torch.cat([a[:k] for a, k in zip(all_ids, sizes)])
    rows = torch.cat([a[:k] for a, k in zip(all_rows, sizes)])
    out = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, grad.shape, check_invariants=False).coalesce()
    out.values().div_(ctx.world)
    return out


def _coalesce_sparse(params):
    """Sparse gradients coalesced in place (duplicate rows summed: the norm and the update need it)."""
    for p in params:
        if p.grad.is_sparse and not p.grad.is_coalesced():
            p.grad = p.grad.coalesce()


def _clip_with_sparse(params, max_norm: float, held: dict) -> torch.Tensor:
    """Single process, some gradients row-sparse: the L2 norm over the dense gradients and the sparse ones'
    rows (a row absent from a sparse gradient is zero), then torch's clipping coefficient on both. ``held``: host
    tables' rows held by id (``tables.held_rows``: each id once, not coalesced, on the lookup's device), their squares
    summed where they are, a block at a time (``row_sum_squares``: no tensor of the step's rows made); their scale is
    the update's, applied as it gathers them (``HostTable.scale_grad``: no pass of its own)."""
    dense = [p for p in params if not p.grad.is_sparse]
    sparse = [p.grad.values() for p in params if p.grad.is_sparse and p not in held]
    sq = torch.nn.utils.get_total_norm([p.grad for p in dense]).float().pow(2) if dense else torch.zeros(())
    sq = sq + sum(g.float().pow(2).sum() for g in sparse)
    total = (sq + sum(row_sum_squares(rows).to(sq.device) for _, rows, _ in held.values())).sqrt()
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in sparse:
        g.mul_(coef.to(g.device))
    for _, rows, table in held.values():
        table.scale_grad(coef.to(rows.device))
    return total


def clip_grad_norm_(model, max_norm: float, ctx: DistContext) -> torch.Tensor:
    """Global L2 gradient clipping over sharded (DTensor), replicated and row-sparse gradients; returns the norm.
    A host table's gradient held by id (one process: ``tables.held_rows``) is not coalesced: its ids are unique."""
    params = [p for p in model.parameters() if p.grad is not None]
    held = tables.held_rows(model) if ctx.world == 1 else {}
    _coalesce_sparse([p for p in params if p not in held])
    if ctx.world == 1:
        if any(p.grad.is_sparse for p in params):
            return _clip_with_sparse(params, max_norm, held)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    from torch.distributed.tensor import DTensor   # multi-rank only (see the note above DistContext)
    sharded = torch.zeros((), dtype=torch.float32, device=ctx.device)
    replicated = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for p in params:
        if isinstance(p.grad, DTensor):
            sharded += p.grad.to_local().float().pow(2).sum()
        elif p.grad.is_sparse:      # all-gathered: the same rows on every rank
            replicated += p.grad.values().float().pow(2).sum()
        else:
            replicated += p.grad.float().pow(2).sum()
    dist.all_reduce(sharded)           # each rank holds distinct shards: sum them
    total = (sharded + replicated).sqrt()  # replicated grads are identical on every rank after the sync
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad.values() if p.grad.is_sparse else p.grad
        g.mul_(coef)
    return total


def optimizer_for_dtensors(opt, plan: ParallelPlan):
    """Groups that mix DTensors and plain tensors (strategy ddp) cannot use the foreach/fused kernels."""
    if plan.world > 1 and plan.strategy == "ddp":
        for g in opt.param_groups:
            g["foreach"], g["fused"] = False, False
    return opt


# ----------------------------------------------------------------------------- checkpoints

def save_state(state_dir, step: int, model, opt, extra: dict, ctx: DistContext, keep: int = 2):
    """Resumable state: the single-process format at world size 1, DCP (sharded, reshardable) above."""
    state_dir = Path(state_dir)
    if ctx.world == 1:
        return ck.save_state(state_dir, step, model, opt, extra, keep=keep)
    import torch.distributed.checkpoint as dcp   # multi-rank only (see the note above DistContext)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    name = ck.state_name(step)
    tmp = state_dir / f".tmp_{name}"   # one name every rank knows (rank 0 makes it)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt)
    tables.logical_state(model, msd, osd)   # row-sharded tables in id order: the same state at any world size
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"))
    if ctx.is_main:
        atomic_write_json(tmp / "extra.json", {"step": step, "world_size": ctx.world, **extra})
        ck.write_manifest(tmp)   # after dcp.save returned: every rank's shards are written
        replace_dir(tmp, state_dir / name)
        ck.point_latest(state_dir, step, keep)
    dist.barrier()


def load_state(state_dir, model, opt, ctx: DistContext) -> dict | None:
    """Restore the latest complete state (either format, any world size it was saved at); returns its extra
    dict, or None if there is no state. A state that fails its manifest or its load is skipped with a
    one-line warning naming the bad file, falling back to the previous one; none complete: ValueError."""
    bad = []
    for folder in ck.state_candidates(state_dir):
        problem = ck.verify_state(folder)
        if problem is None:
            try:
                return _load_state_folder(folder, model, opt, ctx)
            except Exception as e:  # a state written before manifests, damaged in a way sizes do not show
                problem = f"{folder}: unreadable ({type(e).__name__}: {ck.first_line(e)})"
        bad.append(problem)
        if ctx.is_main:
            print(f"warning: {problem}; falling back to the previous state", file=sys.stderr)
    if bad:
        raise ValueError(f"{state_dir}: no complete state to resume from ({bad[0]}); "
                         "remove the folder to start the job over")
    return None


def _load_state_folder(folder: Path, model, opt, ctx: DistContext) -> dict:
    if ctx.world == 1 and not (folder / "dcp").is_dir():
        return ck.load_state(folder, model, opt)
    # multi-rank only (see the note above DistContext)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    if (folder / "dcp").is_dir():
        import torch.distributed.checkpoint as dcp   # multi-rank only (see the note above DistContext)
        msd, osd = get_state_dict(model, opt)
        tables.logical_state(model, msd, osd)   # what save_state wrote: row-sharded tables in id order
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        tables.logical_state(model, state["model"], state["optim"], inverse=True)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:  # a single-process state resumed on several ranks: full tensors, each rank keeps its shard
        full = loaded_state(load_file(str(folder / "model.safetensors")), model.cfg)
        osd = _fqn_optimizer_state(torch.load(folder / "optim.pt", weights_only=True, map_location="cpu"), model)
        tables.logical_full(model, full, osd, inverse=True)   # row-sharded tables: to their interleaved storage
        set_state_dict(model, opt, model_state_dict=full, optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True))
    return json.loads((folder / "extra.json").read_text())


def _fqn_optimizer_state(osd: dict, model) -> dict:
    """torch.optim's index-keyed state dict -> parameter-name keyed (the order build_optimizer used)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for ps in model.param_groups().values() for p in ps]
    return {"state": {order[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}


def full_model_view(model, ctx: DistContext):
    """Something with ``state_dict()`` giving full CPU tensors (gathered on rank 0 when sharded)."""
    if ctx.world == 1:
        return model
    # multi-rank only (see the note above DistContext)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tables.logical_full(model, full)   # row-sharded tables in id order

    class _Full:
        cfg = model.cfg

        @staticmethod
        def state_dict():
            return full
    return _Full()
