"""Per-GPU peak memory of a training job: traced from the real training step, and a closed form beside it.

The source of truth is ``trace``: it runs one real training step of the job (this project's model, FSDP2
wrapping, AdamW groups, micro-batch accumulation, gradient clipping) for rank 0 of a *fake* process group
of the job's world size, under ``FakeTensorMode`` (no memory is allocated), and records the peak of live
tensor bytes with torch's ``FSDPMemTracker`` (``torch.distributed._tools``). It runs on the CPU (FSDP2
needs a real CUDA device): the CUDA run's mixed precision is applied there too (bf16 FSDP parameters,
fp32 reduction, bf16 autocast, fused AdamW); the CPU's attention kernel stands in for the CUDA one (it
saves grouped-query keys/values expanded to all heads, slightly more than a CUDA flash kernel), and the
extend stage's document mask (flex attention on CUDA, linear memory) is traced as plain causal attention.
Not counted: the CUDA context, NCCL buffers, allocator fragmentation (leave ~10 % headroom).

``estimate`` is the closed form (FSDP with bf16 mixed precision), counted by hand from the code:
- model state, sharded over all ranks: fp32 master weights 4 B + fp32 gradients 4 B (reduce-scattered
  every micro-batch, so never unsharded between them) + two fp32 Adam moments 8 B = 16 B / parameter / W;
  the root's own parameters (embedding, final norm, LM head) stay gathered in bf16 for the whole
  forward/backward (``reshard_after_forward=False``): 2 B / parameter.
- activations, per token, bytes saved for backward, per block: each of its two RMSNorms 6 d (the fp32
  input autocast keeps, 4 d, + the bf16 output the projections save, 2 d); attention 14 d + 4 kv (RoPE's
  fp32 q and k, 4 d + 4 kv; the rotated bf16 q, 2 d; keys and values expanded to all heads for the
  kernel, 4 d; the kernel's output, 2 d, and its re-laid-out copy that wo saves, 2 d; the kernel's fp32
  log-sum-exp, 4 per head); the FFN 8 d_ff (SwiGLU / STEM: gate, SiLU, up or table row, product: 2 d_ff
  each; Hash-MoE adds the gathered inputs, 2 d). The routed MoE (``moe``): 8 f_e per shared expert and per
  routed assignment (k a token), the router's fp32 input 4 d and scores 4 E, each assignment's gathered
  input and expert output 2 d + 2 d, and 26 per assignment (its expert index from top-k, the gather and
  inverse-permutation indices, int64, and its gate in bf16). With activation checkpointing only each block's input
  (2 d) is kept, plus one block's set while it is recomputed.
- the loss: the peak is at the start of backward, when every activation is still alive and
  cross-entropy's backward holds the fp32 log-softmax output, its incoming gradient and its result:
  3 x 4 B x V per token (12 V), after the final norm's 6 d.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

GIB = 1024 ** 3


def _block_bytes_per_token(cfg, layer: int) -> int:
    d, f = cfg.d_model, cfg.d_ff
    kv = cfg.n_kv_heads * cfg.head_dim
    attn = 6 * d + 4 * d + 4 * kv + 2 * d + 4 * d + 2 * d + 2 * d + 4 * cfg.n_heads + 4
    if cfg.ffn[layer] == "moe":
        fe, k, e = cfg.expert_d_ff, cfg.moe_top_k, cfg.moe_experts
        body = 8 * fe * (cfg.moe_shared + k) + 4 * d + 4 * k * d + 4 * e + 26 * k
    else:
        body = 8 * f + (2 * d if cfg.ffn[layer] == "hashmoe" else 0)
    return attn + 6 * d + body + 4


def estimate(model, micro_batch: int, seq_len: int, world: int = 1, strategy: str = "fsdp",
             act_ckpt: bool = False) -> dict:
    """The closed form above for FSDP (``strategy="ddp"``: replicated backbone state, no bf16 gathering)."""
    from stem.train.distributed import row_sparse_params, sharded_leaf_modules

    cfg, tokens = model.cfg, micro_batch * seq_len
    leaf = {id(p) for m in sharded_leaf_modules(model) for p in m.parameters()}
    # row-sparse tables (optim.table_update: sparse) are replicated on every rank; their gradient holds at most
    # V rows (all of them, at a large batch), counted here as a full replica too
    rep = {id(p) for p in row_sparse_params(model)}
    n_leaf = sum(p.numel() for p in model.parameters() if id(p) in leaf)
    n_rep = sum(p.numel() for p in model.parameters() if id(p) in rep)
    n_back = sum(p.numel() for p in model.parameters() if id(p) not in leaf and id(p) not in rep)
    params = n_leaf / world + n_back / (world if strategy == "fsdp" else 1) + n_rep
    n_root = sum(p.numel() for m in (model.tok_emb, model.norm, model.lm_head) for p in m.parameters())
    blocks = [_block_bytes_per_token(cfg, i) for i in range(cfg.n_layers)]
    head = 6 * cfg.d_model + 12 * cfg.vocab_size
    # checkpointing: the block inputs, then either the loss's backward or one block's recomputation on top
    acts = 2 * cfg.d_model * cfg.n_layers + max(0, max(blocks) - head) if act_ckpt else sum(blocks)
    out = {"params_gib": 4 * params / GIB, "grads_gib": 4 * params / GIB, "optimizer_gib": 8 * params / GIB,
           "gathered_bf16_gib": (2 * n_root if world > 1 and strategy == "fsdp" else 0) / GIB,
           "activations_gib": acts * tokens / GIB, "logits_gib": head * tokens / GIB,
           "world": world, "strategy": strategy, "micro_batch": micro_batch, "seq_len": seq_len,
           "activation_checkpointing": act_ckpt, "total_params": n_leaf + n_back + n_rep,
           "sharded_table_params": n_leaf, "replicated_table_params": n_rep}
    out["total_gib"] = sum(out[k] for k in ("params_gib", "grads_gib", "optimizer_gib", "gathered_bf16_gib",
                                            "activations_gib", "logits_gib"))
    return out


def describe(e: dict) -> str:
    return (f"per-GPU memory estimate at world {e['world']} ({e['strategy']}, micro-batch {e['micro_batch']} x "
            f"{e['seq_len']}{', act. ckpt' if e['activation_checkpointing'] else ''}): {e['total_gib']:.1f} GiB = "
            f"params {e['params_gib']:.2f} + grads {e['grads_gib']:.2f} + optimizer {e['optimizer_gib']:.2f} + "
            f"gathered bf16 {e['gathered_bf16_gib']:.2f} + activations {e['activations_gib']:.2f} + "
            f"loss {e['logits_gib']:.2f}")


# ----------------------------------------------------------------------------- trace

@contextmanager
def fake_world(world: int):
    """A fake process group of ``world`` ranks in this process (it is rank 0; collectives do nothing)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
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
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

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


def trace(spec, world: int, strategy: str | None = None, mixed_precision: bool = True) -> dict:
    """Rank 0's peak tensor memory over one training step (``stem.train.step.train_step``, as the loop runs
    it) of the job ``spec`` (a TrainSpec or its JSON) at ``world`` ranks; ``strategy`` overrides the spec's."""
    import dataclasses

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from stem.models.model import build_model
    from stem.specs import TrainSpec
    from stem.train import distributed
    from stem.train.optim import configure_table_update
    from stem.train.step import make_optimizer, train_step

    spec = TrainSpec.coerce(spec)
    strategy = strategy or spec.train.parallel
    spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, parallel=strategy))
    cfg, tc = spec.model, spec.train
    micro, accum = distributed.local_micro_batch(tc.batch_size, tc.micro_batch, world)
    n_micro = min(accum // world, 2)   # from the second micro-batch on, every one holds the same tensors
    device = torch.device("cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision else nullcontext()
    values = _fake_values()
    with fake_world(world) as mesh, FakeTensorMode(), values:
        ctx = distributed.DistContext(0, world, 0, 1, device, mesh)
        model = build_model(cfg, device)       # as the loop does: build, then shard
        model.set_training_options(activation_checkpointing=tc.activation_checkpointing)
        tables = configure_table_update(model, spec.to_dict()["optim"])   # sparse: replicated, outside FSDP
        distributed.parallelize(model, ctx, strategy, mixed_precision=mixed_precision)
        for m in tables:   # traced with a dense V x d_ff gradient, the sparse one's upper bound (a fake tensor
            m.row_sparse = False   # cannot run the lookup's torch.unique: its output shape depends on the data)
        opt = make_optimizer(model, spec, ctx, fused=mixed_precision)
        x = torch.randint(0, cfg.vocab_size, (micro, tc.seq_len), device=device)
        y = torch.randint(0, cfg.vocab_size, (micro, tc.seq_len), device=device)
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
        batches = [(x, y, None)] * (n_micro * world)
        with tracker:                          # one step of the training loop, less its logging
            train_step(model, opt, batches, ctx, autocast, tc.lr, spec.optim.grad_clip,
                       counts=[x.numel()] * len(batches),
                       on_backward=tracker.reset_mod_stats)   # the tracker refuses a second root forward otherwise
        peak = tracker.get_tracker_snapshot("peak")
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
    return {"peak_gib": parts.pop("Total") / GIB, "parts_gib": {k: v / GIB for k, v in parts.items() if v},
            "world": world, "strategy": strategy, "micro_batch": micro, "seq_len": tc.seq_len,
            "micro_batches_traced": n_micro, "activation_checkpointing": model.activation_checkpointing}


# ----------------------------------------------------------------------------- jobs of an experiment

CODE = ("stem/models", "stem/train/distributed.py", "stem/train/memory.py", "stem/train/optim.py",
        "stem/train/step.py")


def job_layout(cfg: dict, scale: str) -> tuple[int, int]:
    """(world size, GPUs per node) of a training job at ``scale``, as rules/common.smk requests them."""
    t = ((cfg.get("cluster") or {}).get("train") or {}).get(scale)
    if t is None:
        return 1, 0 if cfg["device"] == "cpu" else 1
    return max(1, t["nodes"] * t["gpus_per_node"]), t["gpus_per_node"]


def gpu_jobs(cfg: dict, only=None) -> list[tuple[str, str, str]]:
    """The training jobs that run on GPUs (only those have GPU memory to check): ``only`` (a set of (scale,
    variant, stage), e.g. a DAG's, sweep points included), else the experiment's matrix."""
    from stem import config as C
    if cfg["device"] == "cpu":
        return []
    jobs = sorted(only) if only is not None else C.train_targets(cfg)
    return [j for j in jobs if job_layout(cfg, j[0])[1] > 0]


def _trace_key(spec: dict, world: int, strategy: str) -> str:
    import hashlib
    import json

    import torch

    from stem import config as C
    tc = spec["train"]
    h = hashlib.sha256(json.dumps({
        "model": spec["model"], "optim": spec["optim"], "world": world, "strategy": strategy,
        "train": {k: tc.get(k) for k in ("batch_size", "micro_batch", "seq_len", "activation_checkpointing")},
        "torch": torch.__version__}, sort_keys=True).encode())
    for part in CODE:
        for f in sorted((C.REPO / part).rglob("*.py")) if (C.REPO / part).is_dir() else [C.REPO / part]:
            h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _trace_job(args):
    try:
        return trace(*args)
    except Exception as e:  # torch's fake-tensor errors do not pickle back from a worker process
        spec = args[0]
        raise RuntimeError(f"memory trace of {spec['scale']}/{spec['variant']}/{spec['stage']} failed: "
                           f"{type(e).__name__}: {e}") from None


def traced(jobs: list[tuple[dict, int, str]], cache_dir, workers: int = 1) -> list[dict]:
    """``trace`` of each (spec, world, strategy), cached in ``cache_dir`` by everything that sets the peak
    (model, batch layout, optimizer, world, strategy, torch version and this code), so a job is traced once."""
    import json
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    from pathlib import Path

    from stem.io import atomic_write_json
    cache_dir = Path(cache_dir)
    paths = [cache_dir / f"{_trace_key(*job)}.json" for job in jobs]
    todo = sorted({str(p): job for p, job in zip(paths, jobs) if not p.is_file()}.items())
    if todo:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # a fresh process per job: each trace joins (and leaves) its own fake process group
        with ProcessPoolExecutor(max(1, min(workers, len(todo))), mp_context=get_context("spawn"),
                                 max_tasks_per_child=1) as pool:
            for (path, _), result in zip(todo, pool.map(_trace_job, [job for _, job in todo])):
                atomic_write_json(Path(path), result)
    return [json.loads(p.read_text()) for p in paths]


def check(cfg: dict, cache_dir, workers: int = 1, only=None) -> list[str]:
    """One line per GPU training job (of ``only``, a set of (scale, variant, stage), if given) whose traced
    peak exceeds ``cluster.gpu_mem_gib``; none if that is unset."""
    from stem import config as C
    cluster = cfg.get("cluster") or {}
    limit, jobs = cluster.get("gpu_mem_gib"), gpu_jobs(cfg, only)
    if limit is None or not jobs:
        return []
    strategy = cluster.get("strategy", "fsdp")
    specs = [(C.train_spec(cfg, *j), job_layout(cfg, j[0])[0], strategy) for j in jobs]
    return [f"training job {'/'.join(j)}: traced peak {r['peak_gib']:.1f} GiB per GPU exceeds "
            f"cluster.gpu_mem_gib = {limit} GiB (world {r['world']}, micro-batch {r['micro_batch']} x {r['seq_len']})"
            for j, r in zip(jobs, traced(specs, cache_dir, workers)) if r["peak_gib"] > limit]
