"""The communication of one training step, modelled from the job's ``ParallelPlan`` and checked by counting.

``collectives`` lists every collective one rank takes part in during one optimizer step
(``stem.train.step.train_step``) of a model laid out by ``stem.train.distributed.parallelize``: what it is
(``op``: all_gather, reduce_scatter, all_reduce), what it carries (``kind``, below), its payload (the bytes
of the whole tensor: the gathered output, the scattered input, the reduced tensor) and how often it runs.
Counted from the code, per FSDP2 unit:
- a unit's parameters travel as one flat buffer of the shards, dim 0 of each parameter padded to a multiple
  of the world size (``ceil(dim0 / W) x W`` rows); bf16 under mixed precision (CUDA), else fp32. Gradients
  are reduce-scattered in fp32 after every micro-batch (never accumulated unsharded).
- a unit is all-gathered twice a micro-batch (forward, then again in backward: ``reshard_after_forward``),
  except a root unit (the model under ``strategy: fsdp``; every table / expert unit under ``ddp``, where no
  wrapped module is above it), which stays gathered from its forward to its backward: once.
- ``strategy: ddp``: the replicated backbone's fp32 gradients, one flat all-reduce a step.
- row-sharded tables (``train.tables: rows``, ``stem.train.tables``): four all-to-alls per table a micro-batch
  (the counts asked of each owner, int64; the ids asked of this rank, int64; the rows this rank reads, bf16
  under mixed precision; the gradients of the rows asked of it, fp32); data-dependent (``lookups``: counted
  from the batch in tests, estimated for the paper's busiest rank, ``expected_lookups``); with activation
  checkpointing the forward's three run again when backward recomputes the block (an FSDP unit is not gathered
  again: counted).
- row-sparse tables (``optim.table_update: sparse``): three all-gathers per table a step (each rank's count
  of unique rows, int64; the ids, int64; the fp32 rows), padded to the rank with most unique rows
  (``unique_rows``; data-dependent: counted from the batch in tests, estimated for the paper, ``zipf_unique``).
- scalars: the step's loss mean (float64; one more for a model with auxiliary losses) and the gradient norm's
  sum over shards (fp32). The loop adds one stop-flag all-reduce a step (4 B), not modelled.
``count_collectives`` counts what really crosses a process group (a dispatch mode over the c10d ops); the
test (tests/test_comms.py) checks ``collectives`` against it, collective by collective, on gloo (an all-to-all's
payload: its output).

Bytes on the wire per GPU (``per_gpu``) are the ring algorithm's: an all-gather or reduce-scatter moves
(W-1)/W of its payload through every GPU, an all-reduce twice that. Time is those bytes over the slowest link
a ring crosses: the inter-node bandwidth when the job spans nodes, else the intra-node one (stated defaults
below, overridable); a host table's copies (``host_copy``: not a collective) cross PCIe at a stated bandwidth;
no overlap with compute is assumed in the ratio (it is comm time / compute time). Compute
is the step's FLOPs per GPU (``stem.models.accounting.flops_per_token``) at a stated MFU of a stated peak.
Host tables' host side (``host_update``: fetches, gradient accumulation, row update, a lazy table's replays) is
bytes of host memory traffic measured per parameter on a CPU (``HOST_BYTES_PER_PARAM``, ``python -m stem bench
host``) over the node's stated host memory bandwidth; ``step_vs_compute`` adds it and the communication to the
compute, none overlapped; ``host_path`` splits it into what the code puts on the step's critical path and what it
hides (``step_as_built``; ``step_vs_compute_overlapped``: the row update on ``train.host_workers``, the copies on the
compute stream; ``step_side_stream``: with them on CUDA's side stream, built and untested: no GPU in these sessions);
``fit_step_s`` ranks the layouts ``stem.train.memory.fit`` may choose by it (not by the untested side stream).
"""
from __future__ import annotations

import math
import multiprocessing
import os
import socket
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stem.config.experiment import Cluster, Experiment, dataclass_mapping, node
from stem.models.accounting import accounting, flops_per_token
from stem.models.registry import param_roles
from stem.specs import Layout
from stem.options import Device
from stem.train.plan import ParallelPlan
from stem.train.tables import owner_load

# Stated link bandwidths per GPU, GB/s (1e9 B/s), one direction: NVLink 4 (H100 SXM datasheet: 900 GB/s
# bidirectional per GPU) within a node; one 400 Gb/s NDR InfiniBand NIC per GPU between nodes (DGX H100).
INTRA_NODE_GBS = 450.0
INTER_NODE_GBS = 50.0
MFU = 0.40                 # the compute side of the ratio (the paper config's cost note uses the same)
PEAK_TFLOPS = 989.0        # H100 SXM dense bf16 (stem.train.throughput.PEAK_BF16_TFLOPS)

PCIE_GBS = 50.0           # host <-> GPU, one direction: PCIe 5.0 x16 (64 GB/s nominal), what a copy achieves
# Host tables' host side (``host_update``): bytes of host memory traffic per table parameter, measured on a CPU by
# ``python -m stem bench host`` (stem.bench.host; the run is named in docs/training.md) as seconds x that CPU's
# measured bandwidth: a micro-batch's fetch and gradient accumulation per fetched parameter, the optimizer's row
# update and zeroing per touched parameter (the step's unique rows), a lazy table's replay per replayed
# parameter-step. A node's time is these bytes over its bandwidth (config ``cluster.host_mem_gbs``, at most
# ``cluster.train.<scale>.cpus`` x ``cluster.host_core_gbs``). Session 15's run: the gradient held by id, clipping's
# scale in the update's gather; the accumulation and clipping's norm (``clip``) measured on the CPU, on a GPU the
# device's (``host_update``'s ``device_seconds``, at ``DEVICE_MEM_GBS``).
DEVICE_MEM_GBS = 3350.0   # a GPU's memory bandwidth (H100 SXM datasheet, HBM3): host tables' rows accumulated and normed there
HOST_MEM_GBS = Layout.host_mem_gbs   # a node's host memory bandwidth: the config's default (cluster.host_mem_gbs)
HOST_BYTES_PER_PARAM = {"fetch": 15.4, "accumulate": 18.0, "clip": 10.6, "update": 102.4, "replay": 29.3}
KINDS = ("backbone_all_gather", "backbone_reduce_scatter", "table_all_gather", "table_reduce_scatter",
         "row_sharded_lookup", "row_sparse_gather", "dp_all_reduce", "host_copy", "scalars")


@dataclass(frozen=True)
class Collective:
    kind: str       # one of KINDS
    op: str         # all_gather | reduce_scatter | all_reduce
    payload: int    # bytes of the whole tensor
    count: int      # times per optimizer step on each rank

    def wire_bytes(self, world: int) -> float:
        """Bytes through each GPU per step (ring algorithm)."""
        share = (world - 1) / world * (2 if self.op == "all_reduce" else 1)   # all-to-all: the others' share
        return self.payload * share * self.count


def _padded(params, world: int) -> int:
    """Elements of FSDP2's flat buffer of ``params`` gathered over ``world`` ranks (dim 0 padded)."""
    return sum(math.ceil(p.shape[0] / world) * world * (p.numel() // max(p.shape[0], 1)) for p in params)


def units(model, plan: ParallelPlan) -> list[tuple[str, list, bool]]:
    """The FSDP2 units ``parallelize`` makes, in its order: (kind, parameters, is a root unit), kind ``table``
    for the ``shard_unit`` modules (tables, experts) and ``backbone`` for the blocks and the model's own."""
    out, taken = [], {id(p) for p in plan.row_sharded_params(model)}   # row-sharded tables: outside FSDP
    for m in plan.shard_units(model):
        ps = [p for p in m.parameters() if id(p) not in taken]
        taken |= {id(p) for p in ps}
        out.append(("table", ps, plan.strategy == "ddp"))
    if plan.strategy == "fsdp":
        taken |= {id(p) for p in plan.row_sparse_params(model)}
        for block in model.layers:
            ps = [p for p in block.parameters() if id(p) not in taken]
            taken |= {id(p) for p in ps}
            out.append(("backbone", ps, False))
        out.append(("backbone", [p for p in model.parameters() if id(p) not in taken], True))
    return out


def collectives(model, plan: ParallelPlan, mixed_precision: bool, unique_rows: int = 0,
                lookups: list[tuple[int, int, int]] | None = None) -> list[Collective]:
    """Every collective of one optimizer step on one rank (module docstring); ``model`` may be on the meta
    device; ``unique_rows``: the most unique ids a rank's step reads (row-sparse tables only); ``lookups``: one
    (table width, unique ids read, ids asked of this rank) per micro-batch and row-sharded table (default:
    estimated, ``expected_lookups``)."""
    w = plan.world
    if w == 1:
        return []
    micro = plan.accum // w      # micro-batches per rank per step
    gather_b = 2 if mixed_precision else 4
    out = []
    for kind, ps, root in units(model, plan):
        if not ps:
            continue
        n = _padded(ps, w)
        out.append(Collective(f"{kind}_all_gather", "all_gather", n * gather_b, micro * (1 if root else 2)))
        out.append(Collective(f"{kind}_reduce_scatter", "reduce_scatter", n * 4, micro))
    if plan.strategy == "ddp":
        sharded = {id(p) for _, ps, _ in units(model, plan) for p in ps}
        sharded |= {id(p) for p in plan.row_sparse_params(model) + plan.row_sharded_params(model)}
        rest = sum(p.numel() for p in model.parameters() if id(p) not in sharded)
        if rest:
            out.append(Collective("dp_all_reduce", "all_reduce", 4 * rest, 1))
    if plan.row_sharded:
        wire = 2 if mixed_precision else 4
        fwd = 2 if plan.activation_checkpointing else 1   # a checkpointed block's forward runs again in backward
        for d, uniq, asked in (expected_lookups(model, plan) if lookups is None else lookups):
            out += [Collective("row_sharded_lookup", "all_to_all", 8 * w, fwd),        # ids asked of each owner
                    Collective("row_sharded_lookup", "all_to_all", 8 * asked, fwd),     # the ids asked of this rank
                    Collective("row_sharded_lookup", "all_to_all", wire * uniq * d, fwd),   # the rows it reads
                    Collective("row_sharded_lookup", "all_to_all", 4 * asked * d, 1)]     # its rows' gradients
    for p in plan.row_sparse_params(model):
        out += [Collective("row_sparse_gather", "all_gather", 8 * w, 1),
                Collective("row_sparse_gather", "all_gather", 8 * w * unique_rows, 1),
                Collective("row_sparse_gather", "all_gather", 4 * w * unique_rows * p.shape[1], 1)]
    out.append(Collective("scalars", "all_reduce", 8, 1 + bool(getattr(model, "aux_modules", None))))
    out.append(Collective("scalars", "all_reduce", 4, 1))
    return out


def as_counter(cs: list[Collective]) -> Counter:
    """(op, payload) -> times a step, the form ``count_collectives`` records."""
    c = Counter()
    for x in cs:
        c[(x.op, x.payload)] += x.count
    return c


def expected_lookups(model, plan: ParallelPlan, names: tuple[str, ...] | None = None) -> list[tuple[int, int, int]]:
    """(width, unique ids, ids asked of this rank) of each row-sharded lookup of a step on the busiest rank,
    estimated: a micro-batch's unique ids of a token-indexed table (STEM) by ``zipf_seen``, of a hashed one (DSE)
    as uniform draws over its rows; the ids asked of the busiest owner (``stem.train.tables``: ids interleaved
    over the ranks, so a vocabulary ordered by frequency spreads its frequent ids over all of them) the world's
    micro-batches' unique ids it owns (rank 0's, with the most frequent id; ``owner_imbalance`` measures it).
    ``names``: other tables than the row-sharded ones (the host tables: ``host_copy_bytes``)."""
    roles, n, w = param_roles(model), plan.micro_batch * plan.seq_len, plan.world
    out = []
    for name in plan.row_sharded if names is None else names:
        weight = model.get_submodule(name).weight
        rows, d = weight.shape
        if getattr(roles.get(id(weight)), "group", None) == "dse_table":
            u = round(rows * -math.expm1(n * math.log1p(-1 / rows)))
            asked = u
        else:
            seen = zipf_seen(n, rows)
            u = int(round(float(seen.sum())))
            asked = int(round(w * float(seen[::w].sum())))
        out += [(d, u, asked)] * (plan.accum // plan.world)
    return out


@lru_cache(maxsize=64)
def zipf_seen(tokens: int, vocab: int) -> torch.Tensor:
    """The probability that each of ``vocab`` ids occurs among ``tokens`` draws of a Zipf(1) law (natural text's
    rank-frequency law, id i the (i+1)-th most frequent): 1 - (1 - p_i)^tokens. An estimate, used where no
    batch is at hand. Cached (the fit weighs every layout by it): read it, do not write it."""
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    p /= p.sum()
    return 1 - (1 - p) ** tokens


def zipf_unique(tokens: int, vocab: int) -> int:
    """Expected distinct ids among ``tokens`` draws of a Zipf(1) law over ``vocab`` ids (``zipf_seen``)."""
    return int(round(float(zipf_seen(tokens, vocab).sum())))


def owner_imbalance(tokens, rows: int, world: int, micro_tokens: int) -> dict:
    """Measured on a token stream (1-D): the rows the busiest owner of a row-sharded token-indexed table of
    ``rows`` ids is asked for in a step, over the mean owner's, for contiguous blocks of ids and for the
    interleaved map (``stem.train.tables``). A step: ``world`` consecutive micro-batches of ``micro_tokens``, one
    a rank; an owner is asked, summed over the ranks, each micro-batch's unique ids it owns. Mean over the
    stream's whole steps (``steps``)."""
    t = torch.as_tensor(tokens).long()
    steps = len(t) // (micro_tokens * world)
    if steps == 0:
        raise ValueError(f"owner_imbalance: {len(t)} tokens hold no step of {world} x {micro_tokens}")
    out = {"steps": steps}
    for name, interleaved in (("blocks", False), ("interleaved", True)):
        ratios = []
        for s in range(steps):
            load = sum(owner_load(t[(s * world + r) * micro_tokens:(s * world + r + 1) * micro_tokens], rows, world,
                                  interleaved) for r in range(world))
            ratios.append(float(load.max() / load.double().mean()))
        out[name] = sum(ratios) / steps
    return out


def host_copy_bytes(model, plan: ParallelPlan) -> float:
    """Bytes a step of host tables (``train.tables: host``, ``stem.train.tables``) moves over PCIe (``host_copies``'
    two directions)."""
    return float(sum(host_copies(model, plan).values()))


def step_unique_rows(model, plan: ParallelPlan, name: str) -> tuple[int, int]:
    """(width, unique rows) of host table ``name`` over a whole step's tokens (``expected_lookups``' estimate)."""
    step_plan = replace(plan, micro_batch=plan.micro_batch * plan.accum, accum=1)   # the step's tokens as one draw
    (d, u, _), = expected_lookups(model, step_plan, (name,))
    return d, u


def host_copies(model, plan: ParallelPlan) -> dict:
    """Bytes of a step of host tables over PCIe, by direction: ``in``, each micro-batch's unique rows of every host
    table to the GPU (fp32, as the host keeps them; again when a checkpointed block recomputes its forward); ``out``,
    the step's gradient rows back once a step (fp32, and their ids, 8 B a row: ``StepRows.to_host``; they are
    accumulated on the GPU, not copied back per micro-batch). Unique rows estimated as ``expected_lookups``'s. The
    prefetch (one micro-batch ahead) hides the copies' latency, not their bytes."""
    fwd = 2 if plan.activation_checkpointing else 1
    rows_in = sum(4 * uniq * d * fwd for d, uniq, _ in expected_lookups(model, plan, plan.host_tables))
    rows_out = sum(u * (4 * d + 8) for d, u in (step_unique_rows(model, plan, n) for n in plan.host_tables))
    return {"in": float(rows_in), "out": float(rows_out)}


def host_update(model, plan: ParallelPlan, gbs: float, bytes_per_param: dict | None = None,
                device_gbs: float = DEVICE_MEM_GBS) -> dict:
    """The host side of a step of host tables (``train.tables: host``) at ``gbs`` GB/s of host memory bandwidth
    (``HOST_BYTES_PER_PARAM``): the micro-batches' fetches (fetched parameters: each micro-batch's unique rows, again
    when a checkpointed block recomputes its forward), the row update with clipping's scale in its gather and the
    zeroing (touched parameters: the step's unique rows; ``expected_lookups``' estimate, over the step's tokens), and
    for a lazy table (``table_update: dense``) the replays: each of the V - u rows the step did not touch misses one
    step, which its next read (or a save) replays, so in the steady state V - u row-steps a step. The gradient's
    accumulation (per fetched parameter) and clipping's norm of the rows (per touched one) are the device's
    (``StepRows`` on the lookup's device): ``device_seconds`` at ``device_gbs`` of device memory bandwidth, at the
    factors measured on the CPU (an upper bound: a GPU's index_add and sum stream closer to their floor)."""
    b = bytes_per_param or HOST_BYTES_PER_PARAM
    fwd = 2 if plan.activation_checkpointing else 1
    fetched = touched = replayed = 0
    for name in plan.host_tables:
        d, u_step = step_unique_rows(model, plan, name)
        fetched += fwd * sum(u * d for d, u, _ in expected_lookups(model, plan, (name,)))
        touched += u_step * d
        if not plan.tables[name].sparse:   # a lazy table
            replayed += (model.get_submodule(name).weight.shape[0] - u_step) * d
    traffic = {"fetch": fetched * b["fetch"], "update": touched * b["update"], "replay": replayed * b["replay"]}
    device = {"accumulate": fetched * b["accumulate"], "norm": touched * b["clip"]}
    seconds = {k: v / (gbs * 1e9) for k, v in traffic.items()}
    device_s = {k: v / (device_gbs * 1e9) for k, v in device.items()}
    return {"gbs": gbs, "fetched_params": fetched, "touched_params": touched, "replayed_param_steps": replayed,
            "bytes": traffic, "seconds": seconds, "total_s": sum(seconds.values()), "device_gbs": device_gbs,
            "device_bytes": device, "device_seconds": device_s, "device_s": sum(device_s.values())}


def model_step(model, plan: ParallelPlan, seq_len: int, gpus_per_node: int, mixed_precision: bool = True,
               unique_rows: int | None = None, intra_gbs: float = INTRA_NODE_GBS, inter_gbs: float = INTER_NODE_GBS,
               mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS, acct: dict | None = None,
               pcie_gbs: float = PCIE_GBS, host_gbs: float = HOST_MEM_GBS, host_workers: int | None = None,
               core_gbs: float = Layout.host_core_gbs) -> dict:
    """One step of ``model`` laid out as ``plan``: bytes per GPU by kind, the comm time at the link bandwidth the
    job's ring crosses (the host tables' copies at ``pcie_gbs``), the compute time at ``mfu`` of
    ``peak_tflops``, and their ratio; host tables' host side (``host_update``) at ``host_gbs`` of host memory
    bandwidth and the device's part of it (accumulation, norm), and the step (compute + comm + host side, none
    overlapped) over the compute; ``host_path``'s steps over the compute: the copies on the compute stream
    (``step_as_built``), with the row update on ``host_workers`` threads (``step_vs_compute_overlapped``, the figure
    the fit weighs when ``train.host_workers`` is set) and with the copies on CUDA's side stream too
    (``step_side_stream``: what a GPU job with host workers runs; untested, no GPU in these sessions); with host workers
    the next step's first micro-batch waits for the update of its rows (``first_read_wait``: the update ordered as
    built, its rows first; ``step_workers_unordered``: session 15's order, for comparison) at ``core_gbs`` a thread.
    ``unique_rows`` (row-sparse tables): default ``zipf_unique`` of a rank's tokens a step; ``acct``: the model's
    accounting, if already at hand."""
    w = plan.world
    if unique_rows is None and plan.row_sparse:
        unique_rows = zipf_unique(plan.accum // w * plan.micro_batch * seq_len, model.cfg.vocab_size)
    cs = collectives(model, plan, mixed_precision, unique_rows or 0)
    by_kind = {k: 0.0 for k in KINDS}
    for c in cs:
        by_kind[c.kind] += c.wire_bytes(w)
    by_kind["host_copy"] = host_copy_bytes(model, plan)
    nodes = max(1, math.ceil(w / max(gpus_per_node, 1)))
    gbs = inter_gbs if nodes > 1 else intra_gbs
    total = sum(by_kind.values())
    tokens_per_gpu = plan.accum * plan.micro_batch * seq_len / w
    compute_s = flops_per_token(acct or accounting(model), model.cfg, seq_len) * tokens_per_gpu / (mfu * peak_tflops * 1e12)
    comm_s = (total - by_kind["host_copy"]) / (gbs * 1e9) + by_kind["host_copy"] / (pcie_gbs * 1e9)
    host = host_update(model, plan, host_gbs) if plan.host_tables else None
    paths = dict.fromkeys(("step_as_built", "step_vs_compute_overlapped", "step_side_stream", "step_workers_unordered"))
    if host:
        host["workers"] = host_workers
        copies = {k: v / (pcie_gbs * 1e9) for k, v in host_copies(model, plan).items()}
        args = (host, compute_s, copies, plan.accum, plan.activation_checkpointing)
        reads = host["reads"] = next_reads(model, plan, host_gbs, core_gbs, host_workers)
        n = len(plan.host_tables)
        paths = host["paths"] = {"step_as_built": host_path(*args, tables=n),
                                 "step_vs_compute_overlapped": host_path(*args, True, tables=n, reads=reads),
                                 "step_side_stream": host_path(*args, True, True, n, reads=reads),
                                 "step_workers_unordered": host_path(*args, True, tables=n,
                                                                     reads={**reads, "first": False})}
    return {"world": w, "nodes": nodes, "strategy": plan.strategy, "bytes_per_gpu": by_kind, "total_bytes": total,
            "table_bytes": sum(by_kind[k] for k in ("table_all_gather", "table_reduce_scatter", "row_sharded_lookup",
                                                    "row_sparse_gather")),
            "unique_rows": unique_rows if plan.row_sparse else None, "link_gbs": gbs if w > 1 else None,
            "comm_s": comm_s, "compute_s": compute_s, "mfu": mfu, "peak_tflops": peak_tflops,
            "intra_gbs": intra_gbs, "inter_gbs": inter_gbs, "pcie_gbs": pcie_gbs,
            "comm_compute_ratio": comm_s / compute_s, "host": host, "core_gbs": core_gbs,
            "step_vs_compute": (compute_s + comm_s + (host["total_s"] + host["device_s"] if host else 0.0)) / compute_s,
            **{k: (v["step_s"] if v else compute_s + comm_s) / compute_s for k, v in paths.items()}}


def host_path(host: dict, compute_s: float, copies: dict, micro: int, recompute: bool, workers: bool = False,
              side_stream: bool = False, tables: int = 1, reads: dict | None = None) -> dict:
    """Which of a host-table step's host seconds (``host_update``), device seconds and copies (``copies``: seconds
    ``in`` and ``out``) are on its critical path, as ``stem.train.step`` runs it on a GPU (docs/training.md, "The
    critical path"), over ``micro`` micro-batches of ``tables`` host tables:
    - micro-batch 0's fetch (and a lazy table's replays of its rows): in its forward, the device waiting for them;
    - the other micro-batches' fetches (``prefetch``): on the host while the device runs the previous micro-batch's
      forward (a third of its compute), critical for what exceeds it; a checkpointed block's recomputed forward
      fetches its rows again, in backward: critical;
    - the gradient's accumulation and clipping's norm of the rows: the device's (``StepRows`` on the GPU), on its
      compute stream: critical (device seconds); clipping's scale is in the update's gather (no pass of its own);
    - the row update: critical, unless ``workers`` (``train.host_workers``: during the next step); then the next
      step's first micro-batch waits for the update of the rows it reads (``reads``: ``first_read_wait``);
    - the copies: queued on the compute stream, critical: every micro-batch's rows in and the step's rows out, once
      (``side_stream``: CUDA only, untested: micro-batch 0's rows in, a recomputed forward's, and the last table's
      rows out: each table's rows go out as its last backward ends, during the others').
    The host's memory bandwidth bounds the step too: all its host seconds fit in it. Returns the critical seconds by
    part and ``step_s`` = max(compute + critical, host seconds)."""
    s, fwd = host["seconds"], 2 if recompute else 1
    read = s["fetch"] + s["replay"]
    first = read / fwd / micro
    window = compute_s / 3 * (micro - 1) / micro
    rows_in = copies["in"] * (1 / (fwd * micro) + (fwd - 1) / fwd) if side_stream else copies["in"]
    crit = {"fetch_first": first, "fetch_recompute": read * (fwd - 1) / fwd,
            "fetch_ahead": max(0.0, read / fwd - first - window), "device": host["device_s"],
            "update": 0.0 if workers else s["update"],
            "update_wait": first_read_wait(s["update"], first, compute_s / micro / 3, reads) if workers and reads else 0.0,
            "copies": rows_in + (copies["out"] / max(tables, 1) if side_stream else copies["out"])}
    return {"critical": crit, "critical_s": sum(crit.values()),
            "step_s": max(compute_s + sum(crit.values()), host["total_s"])}


def next_reads(model, plan: ParallelPlan, host_gbs: float, core_gbs: float, workers: int | None) -> dict:
    """What the next step's first micro-batch reads of a step's host-table update (``first_read_wait``): ``share``, the
    step's touched rows it reads (Zipf: sum over ids of P(in its micro-batch) x P(in the step), over the step's
    unique ids); ``layers``, each host table's place in the forward (its block's index over the blocks, in the
    forward's order); ``threads``, the update's workers (``train.host_workers``; not set: enough that they and the
    reading thread fill the node's bandwidth); ``thread_share``, one thread's part of that bandwidth (``core_gbs`` over
    ``host_gbs``); ``first``: the update takes those rows first (as built), else table by table in id order."""
    vocab, n = model.cfg.vocab_size, plan.micro_batch * plan.seq_len
    seen_mb, seen_step = zipf_seen(n, vocab), zipf_seen(n * plan.accum, vocab)
    share = float((seen_mb * seen_step).sum() / seen_step.sum())
    blocks = {id(m): i for i, b in enumerate(model.layers) for m in b.modules()}
    layers = sorted(blocks.get(id(model.get_submodule(t)), 0) / len(model.layers) for t in plan.host_tables)
    threads = workers or max(1, math.ceil(host_gbs / core_gbs) - 1)
    return {"share": share, "layers": layers, "threads": threads, "thread_share": min(1.0, core_gbs / host_gbs),
            "first": True}


def first_read_wait(update_s: float, fetch_s: float, forward_s: float, reads: dict) -> float:
    """Seconds the next step's first micro-batch's reads stall the device beyond its own fetch (``fetch_s``, counted
    apart) while the row update of this step (``update_s`` at the node's bandwidth, tables of equal size) runs on
    host workers (``PendingRows``). Its forward reads table k after ``layers[k]`` of its forward (``forward_s``) on
    the device; the host reaches each read at once (it only queues the device's work) and waits there for the
    update of that table's rows it reads (``reads['share']`` of the table's update), then fetches (``fetch_s`` over
    the tables). As built (``first``): the workers and the reading thread update those rows first, table by table
    in the forward's order, at min(node, (threads + 1) x one thread's bandwidth); session 15's order: the workers
    sweep the tables in order, their rows in id order (those read spread over it), at min(node, threads x one
    thread's, less the reading thread's share), and a read updates on its own thread those of its rows not yet swept.
    The update does not progress while the host fetches (the same bandwidth). The device runs its forward up to
    each read, then waits for the rows."""
    tables, share, one = len(reads["layers"]), reads["share"], reads["thread_share"]
    per_table, need, fetch = update_s / tables, share * update_s / tables, fetch_s / tables
    sweep, together = min(1.0, reads["threads"] * one), min(1.0, (reads["threads"] + 1) * one)
    host = device = fetched = last = 0.0   # fetched: the host's seconds of fetching so far (no update meanwhile)
    for k, at in enumerate(reads["layers"]):
        if reads["first"]:
            host = max(host, fetched + need * (k + 1) / together)
        else:   # the workers' sweep shares the bandwidth with the reading thread
            swept = min(1.0, max(0.0, ((host - fetched) * min(sweep, 1 - one) - k * per_table) / per_table))
            host += need * (1 - swept) / one
        host, fetched = host + fetch, fetched + fetch
        device = max(device + (at - last) * forward_s, host)
        last = at
    return max(0.0, device - last * forward_s - fetch_s)


CKPT_RECOMPUTE = 1 / 3   # activation checkpointing's recomputed forward, of a step's compute (forward 1 of 3)


def fit_step_s(model, seq_len: int, gpus_per_node: int, mixed_precision: bool, host_workers: int | None = None,
               host_gbs: float = HOST_MEM_GBS):
    """A layout's modelled step seconds, for ``stem.train.memory.fit`` to weigh the layouts that fit: ``model_step``'s
    compute (+ ``CKPT_RECOMPUTE`` of it under activation checkpointing), communication at the stated link
    bandwidths and host side at ``host_gbs`` (the row update hidden if ``host_workers``)."""
    acct = accounting(model)

    def step_s(plan: ParallelPlan) -> float:
        r = model_step(model, plan, seq_len, gpus_per_node, mixed_precision, acct=acct, host_workers=host_workers,
                       host_gbs=host_gbs)
        ratio = r["step_vs_compute_overlapped"] if host_workers else r["step_vs_compute"]
        return r["compute_s"] * (ratio + (CKPT_RECOMPUTE if plan.activation_checkpointing else 0.0))
    return step_s


def describe(r: dict) -> str:
    """One line: the step's bytes per GPU by kind, times and ratio."""
    if r["world"] == 1:
        host = r["bytes_per_gpu"]["host_copy"]
        copies = (f"host tables' copies {host / 1e9:.3g} GB = {r['comm_s']:.3g} s at {r['pcie_gbs']:g} GB/s (PCIe)"
                  if host else "none")
        h = r.get("host")
        host_side = "" if not h else (
            f"; host side {h['total_s']:.3g} s at {h['gbs']:g} GB/s ("
            + ", ".join(f"{k} {v:.3g}" for k, v in h["seconds"].items())
            + f"), on the device {h['device_s']:.3g} s at {h['device_gbs']:g} GB/s ("
            + ", ".join(f"{k} {v:.3g}" for k, v in h["device_seconds"].items())
            + f"): step / compute {r['step_vs_compute']:.2f} not overlapped, {r['step_as_built']:.2f} as built "
            f"(the prefetch), {r['step_vs_compute_overlapped']:.2f} with the row update on host workers "
            f"(train.host_workers: {h['workers'] or 'not set'}), {r['step_side_stream']:.2f} with host workers and the copies on "
            f"CUDA's side stream (built, untested: no GPU in these sessions)")
        return (f"communication per step: {copies} (world 1); compute {r['compute_s']:.3g} s at {r['mfu']:.0%} MFU: "
                f"comm/compute {r['comm_compute_ratio']:.2f}{host_side}")
    kinds = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in r["bytes_per_gpu"].items() if v)
    return (f"communication per GPU per step at world {r['world']} ({r['nodes']} node(s), {r['strategy']}): "
            f"{r['total_bytes'] / 1e9:.3g} GB ({kinds} GB) = {r['comm_s']:.3g} s at {r['link_gbs']:g} GB/s vs "
            f"compute {r['compute_s']:.3g} s at {r['mfu']:.0%} MFU of {r['peak_tflops']:g} TFLOPS: "
            f"comm/compute {r['comm_compute_ratio']:.2f}")


# ----------------------------------------------------------------------------- counting

_OPS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "reduce_scatter_": "reduce_scatter", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
        "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "broadcast_": "broadcast"}


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_bytes(y) for y in x) if isinstance(x, (list, tuple)) else 0


class _Counter(TorchDispatchMode):
    """Records (op, payload bytes) of every c10d collective dispatched: the gathered output of an all-gather,
    the input of a reduce-scatter, the tensor(s) of an all-reduce, the output of an all-to-all."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if func.namespace == "c10d" else None
        if name in _OPS:
            op = _OPS[name]
            tensor = args[1] if op == "reduce_scatter" else args[0]   # the scattered input; else the whole tensor
            self.seen[(op, _bytes(tensor))] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_collectives():
    """``with count_collectives() as seen:`` ``seen`` (a Counter of (op, payload bytes)) receives every
    collective this process runs in the block."""
    mode = _Counter()
    with mode:
        yield mode.seen


def host_bandwidth(layout: Layout, job=None, cores: int | None = None) -> float:
    """A training job's host memory bandwidth, GB/s: ``host_mem_gbs``, at most its cores x ``host_core_gbs``
    (``layout``: the config's ``cluster`` or a job spec's ``train``, both a ``stem.specs.Layout``). Its cores: its
    ``cluster.train.<scale>`` (``job``: ``cpus`` or ``cpus_per_gpu`` x GPUs) when planned, or ``cores`` (the job's
    own, at run time)."""
    if job is not None:
        cores = job.cpus or (job.cpus_per_gpu or 0) * max(job.gpus, 1)
    return min(layout.host_mem_gbs, cores * layout.host_core_gbs) if cores else layout.host_mem_gbs


def _step_cell(r: dict) -> str:
    """The step/compute cell: not overlapped; for host tables also as built (the prefetch), with the row update on
    host workers with the copies on the compute stream and with them on CUDA's side stream (the code on a GPU,
    untested: no GPU in these sessions): ``model_step``, ``host_path``."""
    h = r.get("host")
    if not h:
        return f"{r['step_vs_compute']:.2f}"
    return (f"{r['step_vs_compute']:.2f} ({r['step_as_built']:.2f} as built, {r['step_vs_compute_overlapped']:.2f} "
            f"host workers, {r['step_side_stream']:.2f} side stream)")


def render(rows: list[dict], title: str) -> str:
    """The experiment's table (GB per GPU per step by kind; seconds), then the whole DAG's GPU-hours."""
    head = ("job", "world", "backbone AG", "backbone RS", "table AG", "table RS", "row lookups", "row-sparse", "DP AR",
            "host copy", "total GB",
            "comm s", "host side s", "compute s", "comm/compute", "step/compute", "comm vs dense", "step vs dense")
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = r["bytes_per_gpu"]
        cells = [r["job"], f"{r['world']} ({r['nodes']} node{'s' if r['nodes'] > 1 else ''})"]
        cells += [f"{b[k] / 1e9:.3g}" for k in KINDS[:-1]]
        cells += [f"{r['total_bytes'] / 1e9:.3g}", f"{r['comm_s']:.3g}",
                  f"{r['host']['total_s']:.3g}" if r["host"] else "-", f"{r['compute_s']:.3g}",
                  f"{r['comm_compute_ratio']:.2f}", _step_cell(r)]
        cells += [f"{r[k]:.2f}x" if k in r else "-" for k in ("comm_vs_dense", "step_vs_dense")]
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        r = rows[0]
        gh, gn = sum(r["gpu_hours"] for r in rows), sum(r["gpu_hours_no_overlap"] for r in rows)
        lines += ["", f"GPU-hours of these {len(rows)} training jobs at {r['mfu']:.0%} MFU of {r['peak_tflops']:g} "
                      f"TFLOPS: {gh:,.0f} (compute only), {gn:,.0f} with the communication not overlapped "
                      f"(links: {r['intra_gbs']:g} GB/s within a node, {r['inter_gbs']:g} GB/s between nodes)"]
    return "\n".join(lines)


def fork_ranks(target, world: int, *args, timeout: float = 300) -> list[int]:
    """Run ``target(*args)`` in ``world`` processes forked from this one (torch already imported: no torchrun start-
    up), each rank of one local gloo group (``stem.train.distributed.setup`` reads the environment set here);
    returns their exit codes. For tests and benchmarks on the CPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def rank(r):
        os.environ.update(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
        torch.set_num_threads(1)
        target(*args)

    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=rank, args=(r,)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    return [p.exitcode for p in procs]
