"""Where a job keeps its lookup tables (``train.tables``, from ``cluster.tables``) when not as FSDP units: ``rows``
(each rank owns a contiguous block of rows of every lookup table and of its AdamW moments, and a micro-batch
moves only the rows it reads) or ``host`` (one rank: the tables, their gradients and moments in host memory,
``to_host`` below).

Which tables: every ``nn.Embedding`` whose weight has a ``lookup`` role (STEM's tables, DSE's hashed tables;
not the input embedding), except the row-sparse ones (``optim.table_update: sparse``, replicated).
``shard_rows`` replaces each such weight, before FSDP wraps the rest, by a DTensor sharded on dim 0 over the
world mesh (``Shard(0)``: rank r owns rows [r B, (r + 1) B), B = ceil(V / W), the last blocks shorter), so
gradient clipping (a DTensor: its local squares summed over ranks), the optimizer (local, on the shard: the
moments are DTensors too), DCP checkpoints (resharded at another world size) and the gathered final
checkpoint treat it like an FSDP shard, with no code of their own. The module keeps its class (its parameter
roles, hence its optimizer group) with this forward on top (``RowShardedLookup``):

- forward: the micro-batch's unique ids (sorted, so grouped by owner); an all-to-all of the counts per owner,
  one of the ids, each owner gathers the asked rows from its shard (bf16 under mixed precision, as FSDP's
  gathered parameters) and one all-to-all returns them; the output is those rows at the ids' positions.
- backward: the gradient of each unique row (summed over its positions) returns to its owner through one
  all-to-all (fp32) and is added into the shard's gradient, divided by the world size (FSDP's average: the
  loss is scaled by W for it, ``stem.train.step``).

Exact against the unsharded model (tests/test_tables.py: losses, gradient norms and parameters after 3 steps,
fp32, gloo). Traffic per micro-batch and table: 8 B a unique id + its row twice, instead of the whole table
gathered twice and its gradient reduce-scattered (``stem.train.comms``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from stem.models.registry import param_roles


def row_shardable(model, row_sparse=()) -> tuple[str, ...]:
    """Names of the lookup tables ``train.tables: rows`` shards by rows (module docstring), in module order."""
    roles = param_roles(model)
    return tuple(n for n, m in model.named_modules()
                 if isinstance(m, nn.Embedding) and n not in row_sparse
                 and getattr(roles.get(id(m.weight)), "count", None) == "lookup")


class RowShardedLookup(torch.autograd.Function):
    """``weight[ids]`` of a table whose rows are spread over the ranks in blocks of ``block``; ``local`` is this
    rank's block. Every rank calls it the same number of times in the same order (its all-to-alls pair up)."""

    @staticmethod
    def forward(ctx, local, ids, block: int, wire_dtype, bound: bool = False):
        world, rank = dist.get_world_size(), dist.get_rank()
        if bound:   # the memory trace's upper bound: every id distinct, as many asked of each owner
            uniq, n = ids.reshape(-1), ids.numel()
            inverse = torch.arange(n, device=ids.device)
            split = [n // world + (i < n % world) for i in range(world)]
            send = torch.tensor(split, device=ids.device)
        else:
            uniq, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
            send = torch.bincount(uniq // block, minlength=world)   # ids asked of each owner
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send, recv = (split, split) if bound else (send.tolist(), recv.tolist())
        asked = uniq.new_empty(sum(recv))
        dist.all_to_all_single(asked, uniq, recv, send)
        asked -= rank * block                                 # rows of this rank's block
        rows = local.new_empty(uniq.numel(), local.shape[1], dtype=wire_dtype)
        dist.all_to_all_single(rows, local.index_select(0, asked).to(wire_dtype), send, recv)
        ctx.save_for_backward(inverse, asked)
        ctx.splits, ctx.sizes = (send, recv), (uniq.numel(), local.shape[0])
        return rows.index_select(0, inverse).reshape(*ids.shape, local.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        inverse, asked = ctx.saved_tensors
        send, recv = ctx.splits
        (n_uniq, n_local), d = ctx.sizes, grad_out.shape[-1]
        rows = grad_out.new_zeros(n_uniq, d, dtype=torch.float32).index_add_(0, inverse, grad_out.reshape(-1, d).float())
        back = rows.new_empty(len(asked), d)
        dist.all_to_all_single(back, rows, recv, send)
        grad = rows.new_zeros(n_local, d).index_add_(0, asked, back)
        return grad.div_(dist.get_world_size()), None, None, None, None


class _RowSharded:
    """The forward put on top of a row-sharded table's own class (``shard_rows``). ``trace_bound``: the memory
    trace's fake tensors hold no ids, so it routes the upper bound (every id distinct, evenly owned)."""
    trace_bound = False

    def forward(self, ids):
        return RowShardedLookup.apply(self.weight.to_local(), ids, self.row_block, self.wire_dtype, self.trace_bound)


def shard_rows(model, names, mesh, mixed_precision: bool) -> list:
    """Shard the tables ``names`` (``row_shardable``) of ``model`` by rows over ``mesh`` (module docstring);
    returns their new weights (DTensors), which FSDP must leave alone (``ignored_params``)."""
    from torch.distributed.tensor import Shard, distribute_tensor   # multi-rank only (stem.train.distributed)
    out = []
    for name in names:
        m = model.get_submodule(name)
        cls = type(m)
        m.__class__ = type(f"RowSharded{cls.__name__}", (_RowSharded, cls), {})
        m.row_block = math.ceil(m.weight.shape[0] / mesh.size())
        m.wire_dtype = torch.bfloat16 if mixed_precision else m.weight.dtype
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        out.append(m.weight)
    return out


# ----------------------------------------------------------------------------- host tables

class HostLookup(torch.autograd.Function):
    """``weight[ids]`` of a table in host memory for ``ids`` on the device: the micro-batch's unique rows are copied
    to the device (from pinned memory on CUDA); backward adds each unique row's summed gradient, copied back,
    into the table's host gradient (made here: the dense gradient AdamW expects, never a V x d_ff one on the
    device), and gives autograd none."""

    @staticmethod
    def forward(ctx, weight, ids, bound: bool = False):
        if bound:   # the memory trace (as RowShardedLookup's): every id distinct
            uniq, inverse = ids.reshape(-1), torch.arange(ids.numel(), device=ids.device)
        else:
            uniq, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        host_ids = uniq.to(weight.device)
        rows = weight.index_select(0, host_ids)
        if ids.device.type == "cuda":
            rows = rows.pin_memory()
        ctx.save_for_backward(inverse, host_ids)
        ctx.weight, ctx.n_uniq = weight, uniq.numel()
        return rows.to(ids.device, non_blocking=True).index_select(0, inverse).reshape(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        inverse, host_ids = ctx.saved_tensors
        weight, d = ctx.weight, grad_out.shape[-1]
        rows = grad_out.new_zeros(ctx.n_uniq, d, dtype=weight.dtype).index_add_(0, inverse, grad_out.reshape(-1, d).to(weight.dtype))
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, host_ids, rows.to(weight.device))
        return None, None, None


class _Host:
    """The forward put on top of a host table's own class (``to_host``); ``trace_bound`` as ``_RowSharded``'s."""
    trace_bound = False

    def forward(self, ids):
        return HostLookup.apply(self.weight, ids, self.trace_bound)


def to_host(model, names) -> list:
    """Move the tables ``names`` (``row_shardable``) of ``model`` to host memory (pinned when CUDA is there) with
    the ``HostLookup`` forward; their AdamW moments follow their weights there. Returns their weights."""
    out = []
    for name in names:
        m = model.get_submodule(name)
        cls = type(m)
        m.__class__ = type(f"Host{cls.__name__}", (_Host, cls), {})
        w = m.weight.detach().cpu()
        m.weight = nn.Parameter(w.pin_memory() if torch.cuda.is_available() else w.clone())
        out.append(m.weight)
    return out
