"""Where a job keeps its lookup tables (``train.tables``, from ``cluster.tables``) when not as FSDP units: ``rows``
(each rank owns every W-th row of every lookup table and of its AdamW moments, and a micro-batch moves only the
rows it reads) or ``host`` (one rank: the tables, their gradients and moments in host memory, ``to_host``
below).

Which tables: every ``nn.Embedding`` whose weight has a ``lookup`` role (STEM's tables, DSE's hashed tables;
not the input embedding). Under ``optim.table_update: sparse`` the STEM tables are row-sharded too (the plan's
``sparse_rows``), not replicated: their owners apply the row-sparse update (``stem.optim.adamw``) to the rows a
step asked of them. Which table goes where is the job's plan (``stem.train.plan.ParallelPlan.tables``); the
modules are made from it: ``shard_rows`` puts a ``RowShardedTable`` in place of each row-sharded table, before
FSDP wraps the rest, ``to_host`` a ``HostTable`` in place of each host one (``model.set_submodule``: the state-dict
key ``<name>.weight`` stays, and the new module declares its weight's role, hence its optimizer group). A
``RowShardedTable``'s weight is a DTensor sharded on dim 0 over the world mesh whose rows are stored interleaved:
id i lives on rank i mod W, at local row i div W (``storage_ids``; B = ceil(V / W) local rows a rank, the last
ones of some ranks padding, never read, zero). A vocabulary's frequent (low) ids thus spread over every rank instead of all landing on rank 0 (the
imbalance ``owner_load`` measures). Gradient clipping (a DTensor: its local squares summed over ranks), the
optimizer (local, on the shard: the moments are DTensors too) treat the shard like an FSDP shard with no code
of their own; what leaves the job sees the tables in id order: ``logical_state`` (DCP states and the carried
optimizer state, resharded at another world size) and ``logical_full`` (the gathered final checkpoint). Its
forward (``RowShardedLookup``):

- forward: the micro-batch's unique ids as stored rows (sorted, so grouped by owner); an all-to-all of the
  counts per owner, one of the ids, each owner gathers the asked rows from its shard (bf16 under mixed
  precision, as FSDP's gathered parameters) and one all-to-all returns them; the output is those rows at the
  ids' positions.
- backward: the gradient of each unique row (summed over its positions) returns to its owner through one
  all-to-all (fp32) and is added into the shard's gradient, divided by the world size (FSDP's average: the
  loss is scaled by W for it, ``stem.train.step``); a row-sparse table's owner marks the rows asked of it
  (``RowShardedTable.take_touched`` hands them to the optimizer).

Exact against the unsharded model (tests/test_tables.py: losses, gradient norms and parameters after 3 steps,
fp32, gloo, 4 ranks). Traffic per micro-batch and table: 8 B a unique id + its row twice, instead of the whole
table gathered twice and its gradient reduce-scattered (``stem.train.comms``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from stem.models.registry import param_roles


def row_shardable(model) -> tuple[str, ...]:
    """Names of the lookup tables ``train.tables: rows`` shards by rows (module docstring), in module order."""
    roles = param_roles(model)
    return tuple(n for n, m in model.named_modules()
                 if isinstance(m, nn.Embedding) and getattr(roles.get(id(m.weight)), "count", None) == "lookup")


def storage_ids(ids: torch.Tensor, world: int, block: int) -> torch.Tensor:
    """The stored row of each id of a table interleaved over ``world`` ranks of ``block`` rows: rank id mod W,
    local row id div W (module docstring)."""
    return ids % world * block + ids // world


def owner_load(ids: torch.Tensor, rows: int, world: int, interleaved: bool = True) -> torch.Tensor:
    """How many of the unique ``ids`` (one micro-batch) each of ``world`` owners is asked for, under the
    interleaved map (``storage_ids``) or contiguous blocks of ceil(rows / W) ids."""
    uniq = ids.reshape(-1).unique()
    owner = uniq % world if interleaved else uniq // math.ceil(rows / world)
    return torch.bincount(owner, minlength=world)


class RowShardedLookup(torch.autograd.Function):
    """``weight[ids]`` of a table whose rows are interleaved over the ranks (``storage_ids``) in shards of ``block``
    rows; ``local`` is this rank's shard; ``touched`` (a row-sparse table's): this rank's rows asked, marked in
    backward. Every rank calls it the same number of times in the same order (its all-to-alls pair up)."""

    @staticmethod
    def forward(ctx, local, ids, block: int, wire_dtype, bound: bool = False, touched=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if bound:   # the memory trace's upper bound: every id distinct, as many asked of each owner
            uniq, n = ids.reshape(-1), ids.numel()
            inverse = torch.arange(n, device=ids.device)
            split = [n // world + (i < n % world) for i in range(world)]
            send = torch.tensor(split, device=ids.device)
        else:
            uniq, inverse = torch.unique(storage_ids(ids.reshape(-1), world, block), sorted=True, return_inverse=True)
            send = torch.bincount(uniq // block, minlength=world)   # ids asked of each owner
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send, recv = (split, split) if bound else (send.tolist(), recv.tolist())
        asked = uniq.new_empty(sum(recv))
        dist.all_to_all_single(asked, uniq, recv, send)
        asked -= rank * block                                 # rows of this rank's shard
        rows = local.new_empty(uniq.numel(), local.shape[1], dtype=wire_dtype)
        dist.all_to_all_single(rows, local.index_select(0, asked).to(wire_dtype), send, recv)
        ctx.save_for_backward(inverse, asked)
        ctx.splits, ctx.sizes, ctx.touched = (send, recv), (uniq.numel(), local.shape[0]), touched
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
        if ctx.touched is not None:
            ctx.touched[asked] = True
        return grad.div_(dist.get_world_size()), None, None, None, None, None


class RowShardedTable(nn.Module):
    """A lookup table whose rows are interleaved over the ranks (module docstring), made by ``shard_rows`` from the
    ``nn.Embedding`` it replaces (``<name>.weight`` and the weight's role kept): ``weight``, this rank's shard (a
    DTensor sharded on dim 0, ``row_block`` rows) of a ``table_rows`` x d table; the forward ``RowShardedLookup``,
    the rows on the wire in ``wire_dtype``. ``row_update``: ``sparse`` (the plan's ``sparse_rows``): the step's
    rows asked of this rank are marked, for the optimizer (``take_touched``, ``stem.optim.adamw``), or None (a
    dense update of the shard; the memory trace's). ``trace_bound``: the memory trace's fake tensors hold no ids,
    so it routes the upper bound (every id distinct, evenly owned; ``for_trace``)."""
    trace_bound = False

    def __init__(self, table: nn.Embedding, mesh, mixed_precision: bool, sparse: bool = False, role=None):
        from torch.distributed.tensor import DTensor, Shard   # multi-rank only (stem.train.distributed)
        super().__init__()
        world, rank = mesh.size(), mesh.get_local_rank()
        (rows, d), w = table.weight.shape, table.weight.detach()
        self.row_block, self.table_rows = math.ceil(rows / world), rows
        self.wire_dtype = torch.bfloat16 if mixed_precision else table.weight.dtype
        self.param_roles = {"weight": role} if role is not None else {}
        local = w.new_zeros(self.row_block, d)
        mine = w[rank::world]
        local[:mine.shape[0]] = mine
        self.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        self.row_update = "sparse" if sparse else None
        self.touched = torch.zeros(self.row_block, dtype=torch.bool, device=local.device) if sparse else None

    def for_trace(self):
        """As the memory trace runs it: the lookup's upper bound (every id distinct, evenly owned) and every row of
        the shard updated, as a dense table's (no rows marked)."""
        self.trace_bound, self.row_update, self.touched = True, None, None

    def take_touched(self) -> torch.Tensor:
        """The shard's rows the step asked of this rank (local rows, sorted), cleared for the next step."""
        rows = self.touched.nonzero().squeeze(1)
        self.touched.zero_()
        return rows

    def forward(self, ids):
        return RowShardedLookup.apply(self.weight.to_local(), ids, self.row_block, self.wire_dtype, self.trace_bound,
                                      self.touched)


def _with_roles(model, names) -> list:
    """(name, module, its weight's role) of each table ``names`` of ``model``: the role (``param_roles``, declared by
    the table or by its parent) the module put in its place declares for its own weight (the same optimizer group
    and accounting)."""
    roles = param_roles(model)
    return [(n, m, roles.get(id(m.weight))) for n, m in ((n, model.get_submodule(n)) for n in names)]


def shard_rows(model, names, mesh, mixed_precision: bool, sparse=()) -> list:
    """Put a ``RowShardedTable`` in place of each table ``names`` (``row_shardable``) of ``model``, sharded by rows
    over ``mesh``, interleaved (module docstring); those in ``sparse`` (the plan's ``sparse_rows``) mark the rows a
    step asks of this rank (``RowShardedTable.take_touched``, read by ``stem.optim.adamw.RowSparseAdamW``). Returns
    their weights (DTensors), which FSDP must leave alone (``ignored_params``)."""
    out = []
    for name, m, role in _with_roles(model, names):
        table = RowShardedTable(m, mesh, mixed_precision, name in sparse, role)
        model.set_submodule(name, table)
        out.append(table.weight)
    return out


# ----------------------------------------------------------------------------- the tables in id order

def _sharded_tables(model) -> dict:
    """State-dict key -> module of every row-sharded table of ``model``."""
    return {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, RowShardedTable)}


def _to_blocks(x, m, inverse: bool):
    """One row-sharded tensor (a table or a moment of it) from its interleaved storage to id order sharded in
    contiguous blocks of B ids (a DTensor of V rows: what DCP saves and reshards), or back (``inverse``)."""
    from torch.distributed.tensor import DTensor, Shard   # multi-rank only (stem.train.distributed)
    world, rank, block, rows = dist.get_world_size(), dist.get_rank(), m.row_block, m.table_rows
    local = x.to_local()
    mine = torch.arange(rank, rows, world, device=local.device)             # ids stored here, in local order
    lo = rank * block
    theirs = torch.arange(lo, min(lo + block, rows), device=local.device)   # ids of this rank's block
    theirs = torch.cat([theirs[theirs % world == r] for r in range(world)])  # as they arrive, by sender
    send = torch.bincount(mine // block, minlength=world).tolist()
    recv = torch.bincount(theirs % world, minlength=world).tolist()
    if inverse:   # id order -> interleaved
        out = local.new_zeros(block, local.shape[1])
        got = local.new_empty(len(mine), local.shape[1])
        dist.all_to_all_single(got, local.index_select(0, theirs - lo).contiguous(), send, recv)
        out[:len(mine)] = got
        return DTensor.from_local(out, x.device_mesh, [Shard(0)], run_check=False)
    got = local.new_empty(len(theirs), local.shape[1])
    dist.all_to_all_single(got, local[:len(mine)].contiguous(), recv, send)
    out = torch.empty_like(got).index_copy_(0, theirs - lo, got)
    return DTensor.from_local(out, x.device_mesh, [Shard(0)], run_check=False, shape=(rows, local.shape[1]),
                              stride=(local.shape[1], 1))


def _tensors(model, msd: dict | None, osd: dict | None):
    """(dict, key, module) of every row-sharded table in a model state dict ``msd`` and of its two moments in an
    optimizer state dict ``osd`` (``get_state_dict``'s, keyed by name)."""
    for key, m in _sharded_tables(model).items():
        if msd is not None and key in msd:
            yield msd, key, m
        if key in ((osd or {}).get("state") or {}):   # a copy: get_state_dict's inner dicts are the optimizer's own
            state = osd["state"][key] = dict(osd["state"][key])
            yield from ((state, k, m) for k in ("exp_avg", "exp_avg_sq") if k in state)


def logical_state(model, msd: dict | None = None, osd: dict | None = None, inverse: bool = False):
    """In place: the row-sharded tables of a sharded model state dict ``msd`` and their moments in ``osd`` from
    interleaved storage to id order (DCP states are thus the same at any world size), or back (``inverse``).
    Collective (every rank)."""
    for d, k, m in list(_tensors(model, msd, osd)):
        d[k] = _to_blocks(d[k], m, inverse)


def logical_full(model, msd: dict | None = None, osd: dict | None = None, inverse: bool = False):
    """``logical_state`` of full state dicts (whole tensors, e.g. gathered to rank 0): interleaved storage (W B
    rows) to id order (V rows), or back (``inverse``: full tensors to load). Local."""
    for d, k, m in list(_tensors(model, msd, osd)):
        x, ids = d[k], storage_ids(torch.arange(m.table_rows), dist.get_world_size(), m.row_block).to(d[k].device)
        d[k] = (x.new_zeros(dist.get_world_size() * m.row_block, x.shape[1]).index_copy_(0, ids, x) if inverse
                else x.index_select(0, ids))


# ----------------------------------------------------------------------------- host tables

def _fetch(m, ids, bound: bool = False, slot: str = "direct", stream=None) -> tuple:
    """(inverse, host ids, rows on ``ids``' device) of host table ``m``'s lookup of ``ids``: the unique ids' rows,
    brought current first (``m.before_read``: a lazy table's missed steps), gathered on the host and copied to the
    device (pinned, non-blocking on CUDA: queued on the current stream, so the host's gather of the next
    micro-batch overlaps the device's work on this one). The gather goes into a reused buffer per ``slot``
    (``HostTable.fetch_buffer``: ``ahead`` for ``prefetch``, ``direct`` for a forward's own fetch, so a recomputed forward
    does not overwrite the rows fetched ahead); a forward reads its rows before the same slot is fetched again (on
    a CPU they are the buffer itself; on CUDA ``pin_memory`` copies them out first). ``stream``: CUDA, the copy on
    that side stream instead (``prefetch``; untested here: no GPU in these sessions)."""
    if bound:   # the memory trace (as RowShardedLookup's): every id distinct
        uniq, inverse = ids.reshape(-1), torch.arange(ids.numel(), device=ids.device)
    else:
        uniq, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
    host_ids = uniq.to(m.weight.device)
    m.before_read(host_ids)
    w = m.weight.detach()
    if bound or w.device.type != "cpu":   # the memory trace's fake tensors: a buffer of their own
        rows = w.index_select(0, host_ids)
    else:
        rows = torch.index_select(w, 0, host_ids, out=m.fetch_buffer(slot, host_ids.numel()))
    if ids.device.type == "cuda":
        rows = rows.pin_memory()
    if stream is None:
        return inverse, host_ids, rows.to(ids.device, non_blocking=True)
    with torch.cuda.stream(stream):
        return inverse, host_ids, rows.to(ids.device, non_blocking=True)


_SIDE: dict = {}   # device -> its side stream for host tables' copies (``side_stream``)


def side_stream(device: torch.device):
    """CUDA only (untested here: no GPU in these sessions): the device's side stream for host tables' copies, the next
    micro-batch's rows in (``prefetch``) and the step's rows out (``StepRows.send``), off the compute stream; None
    elsewhere (a CPU: the copies are no copies)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _ready(stream, rows):
    """CUDA: ``rows`` copied on side ``stream`` are used on the compute stream (their memory kept for it) once the
    event returned has passed; None without a side stream."""
    if stream is None:
        return None
    rows.record_stream(torch.cuda.current_stream(rows.device))
    done = torch.cuda.Event()
    done.record(stream)
    return done


class HostLookup(torch.autograd.Function):
    """``weight[ids]`` of a table in host memory for ``ids`` on the device: the micro-batch's unique rows are copied
    to the device (``_fetch``; ``fetched``: already, one micro-batch ahead, ``prefetch``); backward adds each unique
    row's summed gradient into the step's, accumulated by id on the device (``table``: the ``HostTable``,
    ``StepRows``: each id once, never coalesced, no copy back per micro-batch; the step's last backward sends them to
    the host, ``send_rows``), never a dense table-sized one (``table`` None: the memory trace's upper bound, a dense
    host gradient, copied back); autograd gets none."""

    @staticmethod
    def forward(ctx, weight, ids, fetched, table=None):
        inverse, host_ids, got = fetched
        ctx.save_for_backward(inverse, host_ids)
        ctx.weight, ctx.n_uniq, ctx.table = weight, host_ids.numel(), table
        return got.index_select(0, inverse).reshape(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out):
        inverse, host_ids = ctx.saved_tensors
        weight, d = ctx.weight, grad_out.shape[-1]
        rows = grad_out.new_zeros(ctx.n_uniq, d, dtype=weight.dtype).index_add_(0, inverse, grad_out.reshape(-1, d).to(weight.dtype))
        if ctx.table is None:
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, host_ids, rows.to(weight.device))
            return None, None, None, None
        # accumulated where the rows are (the lookup's device): no copy back per micro-batch (``StepRows``)
        acc = ctx.table.step_rows(rows.device)
        acc.accumulate(weight, host_ids.to(rows.device, non_blocking=True), rows)
        if ctx.table.send_next:   # the step's last micro-batch: this table's rows are final (``send_rows``)
            ctx.table.send_next = False
            acc.send()
        return None, None, None, None


class StepRows:
    """A host table's gradient over one step's micro-batches, accumulated by id on the lookup's device (``device``: where
    the rows' gradients are, the GPU; the host itself on a CPU): each id's slot in a buffer of the step's rows
    (``slot``: -1 for an id not yet seen), a new id's slot zeroed, each micro-batch's rows added into their slots by
    one ``index_add_`` (no copy back to the host per micro-batch, no host pass: issue 42). Clipping's norm reads
    them where they are (``held``) and leaves its scale for the update (``scale``: applied in the update's gather,
    ``stem.optim.adamw``); the optimizer takes the step's (ids, rows) on the host once a step (``to_host``: one copy
    when the device is not the host, none when it is). The gradient handed out is a sparse COO tensor over the buffer
    (on the host: ``apart`` False), ids in the order first seen, each once, marked not coalesced and never coalesced;
    with the buffer on another device (``apart``) the weight's gradient is an empty sparse tensor that marks the step
    (a host weight cannot hold a device gradient) and the rows are read through ``held``. The buffer is reused from
    step to step (a new step: the weight's gradient None); rows lent to an update that outlives the step (``lend``:
    ``RowSparseAdamW.overlap``'s) are kept for it and the next step's go elsewhere (the two alternate). Each row's sum
    is the micro-batches' in their order, as the sparse sums' were: the same values, bit for bit
    (``tests/test_host_tables.py``)."""

    def __init__(self, weight, device=None, apart: bool | None = None):
        device = weight.device if device is None else torch.device(device)
        self.shape, self.grad, self.n, self.coef, self.host = weight.shape, None, 0, None, weight.device
        self.apart = device != weight.device if apart is None else apart
        self.slot = torch.full((weight.shape[0],), -1, dtype=torch.long, device=device)
        self.ids = torch.empty(0, dtype=torch.long, device=device)
        self.buf = weight.new_empty(0, weight.shape[1], device=device)
        self.spare = weight.new_empty(0, weight.shape[1], device=device)   # the other buffer (``lend``, not apart)
        self.copies, self.turn = [None, None], 0   # ``apart``: host copies of a step's (ids, rows), alternating when lent
        self.lent, self.sent = False, None          # ``sent``: their copy begun (``send``): True, or CUDA's event

    def held(self, grad) -> tuple | None:
        """(ids, rows) of ``grad`` if it is this step's gradient: its unique ids in the order first seen and their rows,
        the buffer itself on the device (no copy); else None (a gradient made otherwise)."""
        if grad is None or grad is not self.grad:
            return None
        return self.ids[:self.n], self.buf[:self.n]

    def scale(self, coef: torch.Tensor):
        """Clipping's coefficient for this step's rows, applied by the update as it gathers them (no pass of its own)."""
        self.coef = coef if self.coef is None else self.coef * coef

    def lend(self):
        """This step's rows outlive it (an update still reading them while the next step accumulates): the next step
        takes the other buffer (``add``). The update that borrowed them is done before the step after next
        (``RowSparseAdamW.step`` drains it first), so two buffers suffice."""
        self.lent = True

    def to_host(self, lend: bool = False) -> tuple:
        """(ids, rows, clipping's coefficient or None) of this step on the host, for the update: the buffer itself when
        the device is the host, else one copy a step (``send``: begun by the table's last backward, or now) into
        reused host buffers (pinned where CUDA is), waited for here; the two alternate when ``lend`` (the update
        outlives the step)."""
        ids, rows = self.ids[:self.n], self.buf[:self.n]
        coef = None if self.coef is None else self.coef.to(self.host)
        if not self.apart:
            if lend:
                self.lend()
            return ids, rows, coef
        if self.sent is None:
            self.send()
        if self.sent is not True:   # CUDA: the side stream's copy (untested here)
            self.sent.synchronize()
        self.sent = None
        hi, hr = (x[:self.n] for x in self.copies[self.turn])
        self.turn ^= int(lend)   # a lent copy is kept: the next step's goes to the other one
        return hi, hr, coef

    def send(self):
        """The step's rows are final: their copy to the host (apart from it only) begins, into this turn's host
        buffers: on CUDA on the side stream (``side_stream``) after what the compute stream has queued, so the
        device goes on with the other tables' backward (untested here: no GPU); elsewhere (the CPU tests of this
        path) a plain copy. ``to_host`` waits for it."""
        if not self.apart:
            return
        got = self.copies[self.turn]
        if got is None or got[0].shape[0] < self.n:
            pin = torch.cuda.is_available()
            got = self.copies[self.turn] = (torch.empty(self.buf.shape[0], dtype=torch.long, pin_memory=pin),
                                            torch.empty(self.buf.shape[0], self.shape[1], dtype=self.buf.dtype,
                                                        pin_memory=pin))
        hi, hr = got[0][:self.n], got[1][:self.n]
        stream = side_stream(self.buf.device)
        if stream is None:
            hi.copy_(self.ids[:self.n])
            hr.copy_(self.buf[:self.n])
            self.sent = True
            return
        stream.wait_stream(torch.cuda.current_stream(self.buf.device))
        with torch.cuda.stream(stream):
            hi.copy_(self.ids[:self.n], non_blocking=True)
            hr.copy_(self.buf[:self.n], non_blocking=True)
        self.sent = torch.cuda.Event()
        self.sent.record(stream)

    def _unsend(self):
        """Rows about to change after a copy was begun (a gradient added after ``send``, or a step that never reached
        ``to_host``): the compute stream waits for the copy (CUDA), which no longer counts (``to_host`` copies again)."""
        if self.sent is not None and self.sent is not True:
            torch.cuda.current_stream(self.buf.device).wait_event(self.sent)
        self.sent = None

    def accumulate(self, weight, ids, rows):
        """Add a micro-batch's gradient ``rows`` of the unique ``ids`` (sorted; on the buffer's device) into ``weight``'s
        gradient (``HostLookup.backward``), once per row and micro-batch, without coalescing; a gradient that is not
        the step's own (none other is made here) is summed with it on the host and coalesced, as before."""
        if weight.grad is not None and weight.grad is not self.grad:
            g = torch.sparse_coo_tensor(ids.to(self.host).unsqueeze(0), rows.to(self.host), weight.shape,
                                        is_coalesced=True, check_invariants=False)
            weight.grad = (weight.grad + g).coalesce()
            return
        weight.grad = self.grad = self.add(ids, rows, fresh=weight.grad is None)

    def add(self, ids, rows, fresh: bool) -> torch.Tensor:
        self._unsend()
        if fresh:   # a new step: the previous one's slots freed
            self.slot.index_fill_(0, self.ids[:self.n], -1)
            self.n, self.coef = 0, None
            if self.lent and not self.apart:   # its rows still read by an update (``lend``)
                self.buf, self.spare, self.lent = self.spare, self.buf, False
        new = ids[self.slot.index_select(0, ids) < 0]
        n, k = self.n, new.numel()
        self._grow(n + k)
        self.ids[n:n + k] = new
        self.slot[new] = torch.arange(n, n + k, device=new.device)
        self.buf[n:n + k].zero_()
        self.n = n + k
        self.buf.index_add_(0, self.slot.index_select(0, ids), rows)
        if self.apart:   # the step's marker (the rows are read through ``held``)
            return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long), torch.empty(0, self.shape[1], dtype=self.buf.dtype),
                                           self.shape, is_coalesced=False, check_invariants=False)
        return torch.sparse_coo_tensor(self.ids[:self.n].unsqueeze(0), self.buf[:self.n], self.shape,
                                       is_coalesced=False, check_invariants=False)

    def _grow(self, need: int):
        """The buffer and the ids room for ``need`` rows (grown with 1/16 spare, kept for the next steps: ~ the largest
        step's rows)."""
        n, cap = self.n, min(self.shape[0], need * 17 // 16)
        if need > self.buf.shape[0]:
            buf = self.buf.new_empty(cap, self.shape[1])
            buf[:n] = self.buf[:n]
            self.buf = buf
        if need > self.ids.shape[0]:   # shared by both buffers (``lend``)
            ids = self.ids.new_empty(cap)
            ids[:n] = self.ids[:n]
            self.ids = ids


class HostTable(nn.Module):
    """A lookup table in host memory (pinned when CUDA is there), made by ``to_host`` from the ``nn.Embedding`` it
    replaces (``<name>.weight`` and the weight's role kept), with the ``HostLookup`` forward. ``token_ids``: looked up
    by token id (STEM's; a DSE table's ids are hashed in the forward); ``trace_bound`` as ``RowShardedTable``'s;
    ``ahead``: (ids, fetched) from ``prefetch``, used by the forward whose ids are those very ids (a recomputed
    forward, under activation checkpointing, fetches its own); ``prefetched``: how many forwards used one.
    ``row_update`` (``stem.optim.adamw``): how the optimizer updates its rows, ``lazy`` (dense AdamW, exact) or
    ``sparse`` (row-sparse AdamW), or None (the memory trace: a dense gradient, plain AdamW); the optimizer
    registers ``register_read_hook`` to bring rows current before they are read."""
    trace_bound = False
    ahead = None
    prefetched = 0
    send_next = False   # the rows go to the host after the next backward (``send_rows``)

    def __init__(self, table: nn.Embedding, sparse: bool = False, role=None):
        super().__init__()
        self.param_roles = {"weight": role} if role is not None else {}
        self.token_ids = getattr(role, "group", None) != "dse_table"
        self.row_update = "sparse" if sparse else "lazy"
        self.read_hooks: list = []
        self.fetched: dict = {}    # slot -> its reused buffer of gathered rows (``fetch_buffer``)
        self.grad_rows = None      # the step's gradient rows (``step_rows``), made at the first backward
        w = table.weight.detach().cpu()
        self.weight = nn.Parameter(w.pin_memory() if torch.cuda.is_available() else w.clone())

    def for_trace(self):
        """As the memory trace runs it: the lookup's upper bound (every id distinct) and a dense host gradient with
        plain AdamW (off the GPU either way)."""
        self.trace_bound, self.row_update = True, None

    def fetch_buffer(self, slot: str, n: int) -> torch.Tensor:
        """``n`` rows of the reused fetch buffer ``slot`` (grown with 1/16 spare): a fresh tensor of a step's rows is
        new pages every time (above glibc's mmap threshold), which cost a CPU more than the gather itself."""
        buf = self.fetched.get(slot)
        if buf is None or buf.shape[0] < n:
            w = self.weight.detach()
            buf = self.fetched[slot] = w.new_empty(min(w.shape[0], n * 17 // 16 + 1), w.shape[1])
        return buf[:n]

    def step_rows(self, device=None) -> "StepRows":
        """The table's gradient accumulated by id over a step (``StepRows``) on ``device`` (the lookup's; default where
        it already is, else the host), made at its first use there."""
        rows = self.grad_rows
        if rows is None or device is not None and rows.buf.device != torch.device(device):
            rows = self.grad_rows = StepRows(self.weight, device)
        return rows

    def held_grad(self, lend: bool = False) -> tuple | None:
        """(unique ids, rows) of the weight's gradient if it is the step's accumulation by id (``StepRows.held``: no
        coalesce needed, nothing copied; on the lookup's device), else None; ``lend``: the rows outlive the step
        (``StepRows.lend``)."""
        got = None if self.grad_rows is None else self.grad_rows.held(self.weight.grad)
        if got is not None and lend:
            self.grad_rows.lend()
        return got

    def host_grad(self, lend: bool = False) -> tuple | None:
        """(unique ids, rows, clipping's coefficient or None) of the step's accumulation by id on the host, for the
        update (``StepRows.to_host``: one copy a step when the rows are on another device), else None (as
        ``held_grad``); ``lend``: the rows outlive the step (the update on workers)."""
        if self.held_grad() is None:
            return None
        return self.grad_rows.to_host(lend)

    def scale_grad(self, coef: torch.Tensor):
        """Clipping's coefficient for the step's held rows, applied by the update's gather (``StepRows.scale``)."""
        self.grad_rows.scale(coef)

    def register_read_hook(self, fn):
        """``fn(host ids)`` runs before those rows of the table are read (``stem.optim.adamw``)."""
        self.read_hooks.append(fn)

    def before_read(self, ids):
        for fn in self.read_hooks:
            fn(ids)

    def forward(self, ids):
        fetched = None
        if self.ahead is not None and self.ahead[0] is ids:
            (_, fetched, ready), self.ahead = self.ahead, None
            self.prefetched += 1
            if ready is not None:   # CUDA: copied on the side stream (``prefetch``)
                torch.cuda.current_stream(ids.device).wait_event(ready)
        return HostLookup.apply(self.weight, ids, fetched or _fetch(self, ids, self.trace_bound),
                                self if self.row_update is not None else None)


def held_rows(model) -> dict:
    """Weight -> (unique ids, rows, its ``HostTable``) of each host table of ``model`` whose gradient is its step's
    accumulation by id (``HostTable.held_grad``, on the lookup's device): gradient clipping's norm takes them as they
    are, with no coalesce, and leaves its scale to the update (``HostTable.scale_grad``)."""
    out = {}
    for m in model.modules():
        if isinstance(m, HostTable) and (got := m.held_grad()) is not None:
            out[m.weight] = (*got, m)
    return out


def prefetch(model, ids: torch.Tensor):
    """Fetch ahead, for the micro-batch of token ids ``ids`` (on the device), the rows of the host tables looked up
    by token id (STEM's; a DSE table's ids are hashed in the forward): called between one micro-batch's forward
    and its backward (``stem.train.step``), so the host gathers the next one's rows while the device computes.
    The weights do not change within a step, so the rows are those its forward would fetch. The memory trace
    (``trace_bound``) holds the bound's rows ahead likewise."""
    side = side_stream(ids.device)
    for m in model.modules():
        if isinstance(m, HostTable) and m.token_ids:
            fetched = _fetch(m, ids, m.trace_bound, "ahead", side)
            m.ahead = (ids, fetched, _ready(side, fetched[2]))


def first_reads(model, ids: torch.Tensor) -> list:
    """[(weight, host ids)] of the host tables looked up by token id that a forward over token ids ``ids`` reads, in
    the order it reads them (the modules' order: the blocks'), each table's unique ids as its fetch takes them
    (``_fetch``): the next step's first micro-batch's, for ``RowSparseAdamW.read_first``."""
    uniq = None
    out = []
    for m in model.modules():
        if isinstance(m, HostTable) and m.token_ids:
            uniq = torch.unique(ids.reshape(-1), sorted=True) if uniq is None else uniq
            out.append((m.weight, uniq.to(m.weight.device)))
    return out


def send_rows(model):
    """Before a step's last micro-batch's backward (``stem.train.step``): each host table looked up by token id (one
    lookup, hence one backward, a micro-batch) sends its step's rows to the host as soon as its backward has added
    them (``StepRows.send``: on CUDA on the side stream, during the other tables' backward), instead of all at the
    update (``StepRows.to_host``, which otherwise copies them)."""
    for m in model.modules():
        if isinstance(m, HostTable) and m.token_ids and m.row_update is not None:
            m.send_next = True


def to_host(model, names, sparse=()) -> list:
    """Put a ``HostTable`` in place of each table ``names`` (``row_shardable``) of ``model``: in host memory with the
    ``HostLookup`` forward; their AdamW moments follow their weights there. Those in ``sparse`` (the plan's
    ``sparse_rows``: ``optim.table_update: sparse``) get the row-sparse update, the others dense AdamW's, lazy
    and exact (``stem.optim.adamw``). Returns their weights."""
    out = []
    for name, m, role in _with_roles(model, names):
        table = HostTable(m, name in sparse, role)
        model.set_submodule(name, table)
        out.append(table.weight)
    return out
