"""Per-GPU peak memory of a training job: the closed form (``estimate``, the line every training job logs) and
the layouts a job may be fitted to (``candidates``, ``fit``). The trace itself, the source of truth, is
``stem.train.memtrace``; the workflow's pre-flight gate, every GPU training job's traced peak against
``cluster.gpu_mem_gib``, is ``stem.train.gate``.

``estimate`` is the closed form (FSDP with bf16 mixed precision), counted by hand from the code:
- model state, sharded over all ranks: fp32 master weights 4 B + fp32 gradients 4 B (reduce-scattered
  every micro-batch, so never unsharded between them) + two fp32 Adam moments 8 B = 16 B / parameter / W;
  the root's own parameters (embedding, final norm, LM head) stay gathered in bf16 for the whole
  forward/backward (``reshard_after_forward=False``): 2 B / parameter.
- activations, per token, bytes saved for backward, per block: each of its two RMSNorms 6 d (the fp32
  input autocast keeps, 4 d, + the bf16 output the projections save, 2 d); attention 14 d + 4 kv (RoPE's
  fp32 q and k, 4 d + 4 kv; the rotated bf16 q, 2 d; keys and values expanded to all heads for the
  kernel, 4 d; the kernel's output, 2 d, and its re-laid-out copy that wo saves, 2 d; the kernel's fp32
  log-sum-exp, 4 per head); the FFN what its kind declares with its facts (``FFNFacts.activations``,
  stem.models.registry: 8 d_ff for SwiGLU and STEM, the Hash-MoE's and the routed MoE's there; a kind that
  declares none is counted as SwiGLU). With activation checkpointing only each block's input (2 d) is kept, plus
  one block's set while it is recomputed.
- the loss: the peak is at the start of backward, when every activation is still alive and
  cross-entropy's backward holds the fp32 log-softmax output, its incoming gradient and its result:
  3 x 4 B x V per token (12 V), after the final norm's 6 d; with activation checkpointing the loss is
  computed and recomputed ``LOSS_CHUNK`` tokens at a time, so only one chunk's.
"""
from __future__ import annotations

from dataclasses import replace

from stem.models.spec import LOSS_CHUNK
from stem.models.registry import ffn_facts, swiglu_activations
from stem.options import TableLayout
from stem.train.plan import ParallelPlan, place

GIB = 1024 ** 3


def _block_bytes_per_token(cfg, layer: int) -> int:
    d = cfg.d_model
    kv = cfg.n_kv_heads * cfg.head_dim
    attn = 6 * d + 4 * d + 4 * kv + 2 * d + 4 * d + 2 * d + 2 * d + 4 * cfg.n_heads + 4
    body = (ffn_facts(cfg.ffn[layer]).activations or swiglu_activations)(cfg)   # the FFN's, declared with its kind
    return attn + 6 * d + body + 4


def estimate(model, plan: ParallelPlan) -> dict:
    """The closed form above for FSDP (``plan.strategy == "ddp"``: replicated backbone state, no bf16 gathering)
    of ``model`` laid out as ``plan``."""
    cfg, tokens = model.cfg, plan.micro_batch * plan.seq_len
    world, strategy, act_ckpt = plan.world, plan.strategy, plan.activation_checkpointing
    # sharded over all ranks whatever the strategy: the shard units' parameters and the row-sharded tables
    leaf = {id(p) for m in plan.shard_units(model) for p in m.parameters()} | {id(p) for p in plan.row_sharded_params(model)}
    # row-sparse tables (optim.table_update: sparse) are replicated on every rank; their gradient holds at most
    # V rows (all of them, at a large batch), counted here as a full replica too
    rep = {id(p) for p in plan.row_sparse_params(model)}
    host = {id(p) for p in plan.host_params(model)}   # train.tables: host: weights, gradients, moments off the GPU
    n_leaf = sum(p.numel() for p in model.parameters() if id(p) in leaf)
    n_rep = sum(p.numel() for p in model.parameters() if id(p) in rep)
    n_back = sum(p.numel() for p in model.parameters() if id(p) not in leaf | rep | host)
    params = n_leaf / world + n_back / (world if strategy == "fsdp" else 1) + n_rep
    n_root = sum(p.numel() for p in {id(p): p for m in (model.tok_emb, model.norm, model.lm_head)
                                     for p in m.parameters()}.values())   # a tied embedding and head once
    blocks = [_block_bytes_per_token(cfg, i) for i in range(cfg.n_layers)]
    # the loss: checkpointed, one chunk of LOSS_CHUNK tokens at a time (stem.models.model._chunked_loss)
    head = (6 * cfg.d_model + 12 * cfg.vocab_size) * (min(tokens, LOSS_CHUNK) if act_ckpt else tokens)
    # checkpointing: the block inputs, then either the loss's backward or one block's recomputation on top
    acts = (2 * cfg.d_model * cfg.n_layers * tokens + max(0, max(blocks) * tokens - head) if act_ckpt
            else sum(blocks) * tokens)
    out = {"params_gib": 4 * params / GIB, "grads_gib": 4 * params / GIB, "optimizer_gib": 8 * params / GIB,
           "gathered_bf16_gib": (2 * n_root if world > 1 and strategy == "fsdp" else 0) / GIB,
           "activations_gib": acts / GIB, "logits_gib": head / GIB,
           "world": world, "strategy": strategy, "micro_batch": plan.micro_batch, "seq_len": plan.seq_len,
           "activation_checkpointing": act_ckpt, "total_params": sum(p.numel() for p in model.parameters()),
           "sharded_table_params": n_leaf, "replicated_table_params": n_rep, "host_table_params": sum(p.numel() for p in model.parameters() if id(p) in host)}
    out["host_rows_gib"] = host_device_bytes(model, plan) / GIB
    out["total_gib"] = sum(out[k] for k in ("params_gib", "grads_gib", "optimizer_gib", "gathered_bf16_gib",
                                            "activations_gib", "logits_gib", "host_rows_gib"))
    return out


def host_device_bytes(model, plan: ParallelPlan) -> int:
    """Device memory of host tables' step rows (``stem.train.tables.StepRows``: a step's gradient accumulated on the
    GPU): the step's unique rows x width x 4 B (its 1/16 spare not counted), their ids (8 B a row) and the slot map
    (8 B a table row); unique rows ``stem.train.comms.step_unique_rows``' Zipf estimate. 0 without host tables."""
    if not plan.host_tables:
        return 0
    from stem.train import comms   # imports torch; this module is imported by the DAG build (tests/test_dag_light.py)
    total = 0
    for name in plan.host_tables:
        d, u = comms.step_unique_rows(model, plan, name)
        total += u * (4 * d + 8) + 8 * model.get_submodule(name).weight.shape[0]
    return total


def host_estimate(model, plan: ParallelPlan, touched_params: int, fetched_params: int) -> dict:
    """Host memory of a job's host tables (``train.tables: host``), bytes: their weights and two AdamW moments (12 B
    a table parameter), the step's gradient rows on the host (``touched_params``: the step's unique rows x width, 4 B
    each, twice: the host copies ``StepRows.to_host`` makes from the GPU's, two while an overlapped update keeps one;
    on a CPU the accumulation's two buffers), the rows fetched for a micro-batch and for the next
    one (``fetched_params``: a step's, over its micro-batches), a lazy table's step of each row (8 B a row). The
    dense gradient the tables had before (4 B a table parameter) is no longer held: ``dense_grad``."""
    tables = [model.get_submodule(n).weight for n in plan.host_tables]
    n = sum(w.numel() for w in tables)
    lazy_rows = sum(w.shape[0] for name, w in zip(plan.host_tables, tables) if not plan.tables[name].sparse)
    out = {"tables": 12 * n, "gradient_rows": 8 * touched_params, "fetched_rows": 2 * 4 * fetched_params / plan.accum,
           "lazy_steps": 8 * lazy_rows}
    return {**out, "total": sum(out.values()), "dense_grad": 4 * n, "table_params": n}


def describe(e: dict) -> str:
    return (f"per-GPU memory estimate at world {e['world']} ({e['strategy']}, micro-batch {e['micro_batch']} x "
            f"{e['seq_len']}{', act. ckpt' if e['activation_checkpointing'] else ''}): {e['total_gib']:.1f} GiB = "
            f"params {e['params_gib']:.2f} + grads {e['grads_gib']:.2f} + optimizer {e['optimizer_gib']:.2f} + "
            f"gathered bf16 {e['gathered_bf16_gib']:.2f} + activations {e['activations_gib']:.2f} + "
            f"loss {e['logits_gib']:.2f}" + (f" + host tables' step rows {e['host_rows_gib']:.2f}"
                                              if e.get("host_rows_gib") else ""))


# ----------------------------------------------------------------------------- fitting a job to its GPU

def candidates(plan: ParallelPlan, batch_size: int, tables: tuple[str, ...] = ()) -> list[ParallelPlan]:
    """The layouts a job may run with instead of ``plan`` without changing its maths (the same global batch of
    ``batch_size`` sequences an optimizer step, the loss the token mean over all of it), least change first:
    ``plan``, then smaller per-GPU micro-batches (more of them accumulated), then the same with activation
    checkpointing, then (one GPU, lookup ``tables`` resident) all of these with the tables in host memory."""
    micros = [m for m in range(plan.micro_batch, 0, -1) if batch_size % (m * plan.world) == 0]
    ckpts = (True,) if plan.activation_checkpointing else (False, True)
    hosts = [plan] + ([replace(plan, tables=place(TableLayout.HOST, 1, tables, plan.row_sparse))]
                      if plan.world == 1 and tables and not plan.host_tables else [])
    return [replace(p, micro_batch=m, accum=batch_size // m, activation_checkpointing=c)
            for p in hosts for c in ckpts for m in micros]


FIT_MARGIN = 1.1   # the closed form's tolerance against the trace (python -m stem memory keeps it within 10 %)


def fit(model, plan: ParallelPlan, batch_size: int, limit_gib: float, tables: tuple[str, ...] = (),
        step_s=None) -> ParallelPlan:
    """Of ``candidates`` whose closed-form peak (``estimate``) is within ``limit_gib`` (the spec's ``train.fit_gib``)
    less the closed form's tolerance, the first (least change), or with ``step_s`` (a layout's modelled step
    seconds, ``stem.train.comms.fit_step_s``) the fastest (the first of equals); if none is within, the leanest of
    all: the workflow's gate traces the one chosen against ``limit_gib`` and refuses the job if even that one does
    not fit."""
    peaks = [(estimate(model, p)["total_gib"], p) for p in candidates(plan, batch_size, tables)]
    fitting = [p for gib, p in peaks if gib * FIT_MARGIN <= limit_gib]
    if not fitting:
        return min(peaks, key=lambda t: t[0])[1]
    return fitting[0] if step_s is None else min(fitting, key=step_s)


def describe_fit(old: ParallelPlan, new: ParallelPlan, batch_size: int, step_s=None, first=None) -> str | None:
    """The log line of a layout ``fit`` changed (None if it did not); with ``step_s`` (``fit``'s) the modelled step
    seconds of the layout chosen and of ``first``, the least change that fits, when they differ."""
    if new == old:
        return None
    change = [f"micro-batch {old.micro_batch} -> {new.micro_batch} per GPU"] if new.micro_batch != old.micro_batch else []
    change += ["activation checkpointing on"] if new.activation_checkpointing != old.activation_checkpointing else []
    change += ["tables in host memory"] if new.host_tables != old.host_tables else []
    timed = "" if step_s is None else f"; modelled step {step_s(new):.3g} s" + (
        "" if first is None or first == new else f" (the least change that fits: {step_s(first):.3g} s)")
    return (f"memory fit (train.fit_gib): {', '.join(change)}; the same global batch of {batch_size} sequences an "
            f"optimizer step, its gradients accumulated over {new.accum} micro-batches instead of {old.accum} (the "
            f"loss is the token mean over the whole batch either way): the maths is unchanged{timed}")


def option(spec_plan: ParallelPlan, p: ParallelPlan, scale: str, stage: str) -> str:
    """How a config asks for layout ``p`` of a job planned as ``spec_plan`` (the refusal's advice)."""
    keys = [f"stages.{stage}.{scale}.micro_batch: {p.micro_batch}"] if p.micro_batch != spec_plan.micro_batch else []
    keys += [f"stages.{stage}.{scale}.activation_checkpointing: true"] if p.activation_checkpointing != spec_plan.activation_checkpointing else []
    keys += ["cluster.tables: host"] if p.host_tables != spec_plan.host_tables else []
    return " + ".join(keys) or "no change"
