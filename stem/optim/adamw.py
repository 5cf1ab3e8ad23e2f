"""AdamW with named parameter groups owned by the model (matrix, norm, table, dse_table, and any group a
registered kind adds: ``stem.models.registry.OPTIM_GROUPS``), as ``stem.optim.OptimSpec.build`` makes it.

``optim.table_update`` chooses how the ``table`` group (STEM tables) is trained:

- ``dense`` (default, the paper): the lookup's gradient is a dense V x d_ff tensor and AdamW updates every
  row every step (rows the batch did not touch still move by their decaying moments and weight decay).
- ``sparse``: the lookup's gradient holds the batch's unique rows only (``stem.models.ffn.RowSparseLookup``)
  and ``RowSparseAdamW`` updates only those rows, so a step costs what the batch touches. Semantic
  difference from dense AdamW: an untouched row is left exactly as it is (its moments do not decay, no
  weight decay, no momentum step); the group's step count (bias correction) counts every optimizer step.
  A row touched at every step gets exactly dense AdamW's update; at the first step every row does.

Host tables (``train.tables: host``, ``stem.train.tables``) always have a row gradient: (unique ids, rows) as a
sparse COO gradient, never a dense table-sized one. A module announcing its reads (``register_read_hook``) says
how its rows are updated (``row_update``): ``sparse`` (``table_update: sparse``: the row-sparse update above) or
``lazy``: dense AdamW made lazy and exact (``LazyRows``): a row not read for k steps gets, when it is next read and
at every save (``settle``: the optimizer's ``state_dict`` and the module's), exactly the k zero-gradient AdamW
steps dense AdamW would have given it (decoupled weight decay, decayed moments, bias corrections, eps), so the
results are dense AdamW's at the cost of the rows a step touched plus their replays.

Every row update (row-sparse, a lazy table's touched rows and its replays, a row-sharded shard's rows) is fused
(``_adamw_rows``, ``_row_blocks``, ``_adamw_block``): the rows gathered a block at a time into a reused per-thread
workspace, updated there in one pass by torch's fused AdamW kernel (its unfused formula where this torch lacks the
kernel, or ``FUSED_ROWS`` is off), scattered once; a replay does all of a block's missed steps between its gather and
its scatter. A row's result does not depend on the blocks (docs/training.md, "Host tables' host side").

Which modules are trained row-sparse is explicit data: ``row_sparse_tables`` names them (the job's
``stem.train.plan.ParallelPlan`` carries the names to the sharding and the memory estimate), and
``use_row_sparse`` switches those modules' lookups before the model is wrapped.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from stem.models.registry import OPTIM_GROUPS, param_roles

# LR multiplier and weight decay per group unless the config overrides them (see the registry).
GROUP_DEFAULTS = OPTIM_GROUPS
SPARSE_GROUP = "table"     # the group optim.table_update: sparse trains row-sparse
SETTLE_ROWS = 4096         # rows of a lazy table brought current at once by a save (``RowSparseAdamW.settle``)
OVERLAP_ROWS = 1024        # rows of a host table's update a worker task carries (``RowSparseAdamW.overlap``)
ROW_BLOCK_BYTES = 1 << 20  # bytes of a tensor's rows a fused row update gathers at once on a CPU (``_row_blocks``)
FUSED_ROWS = True          # the row update through torch's fused AdamW kernel where this torch has it (``_adamw_block``)
NORM_BLOCK_BYTES = 1 << 26  # bytes of a device's rows a norm squares at once (``row_sum_squares``; a CPU's: ROW_BLOCK_BYTES)
FUSED_ALIGN = 64           # elements a CPU call of the fused kernel is a multiple of (its widest vector: no scalar tail)
_FUSED = getattr(torch, "_fused_adamw_", None)   # private in torch (2.x); without it the unfused formula
_local = threading.local()                       # each thread's row workspace (``_workspace``)

# ``optim`` below is a ``stem.optim.OptimSpec`` (not imported: that module imports this one to build).


def row_sparse_tables(model, optim) -> tuple[str, ...]:
    """Names of the modules holding a ``table``-group parameter, for ``table_update: sparse`` (each must support
    a row-sparse lookup: ``row_sparse``); empty for ``dense``. Changes nothing."""
    if not optim.sparse_tables:
        return ()
    roles = param_roles(model)
    names = []
    for name, m in model.named_modules():
        own = [n for n, p in m.named_parameters(recurse=False) if getattr(roles.get(id(p)), "group", None) == SPARSE_GROUP]
        if not own:
            continue
        if not hasattr(type(m), "row_sparse"):
            raise ValueError(f"optim.table_update: sparse: {type(m).__name__}.{own[0]} is in the "
                             f"'{SPARSE_GROUP}' group but its module has no row-sparse lookup (row_sparse)")
        names.append(name)
    return tuple(names)


def use_row_sparse(model, names) -> list:
    """Before the model is wrapped for data parallelism: the modules ``names`` (``row_sparse_tables``) switch to
    row-sparse gradients, coalesced after each micro-batch's backward. Returns those modules."""
    modules = [model.get_submodule(n) for n in names]
    for m in modules:
        m.row_sparse = True
        for p in m.parameters(recurse=False):
            p.register_post_accumulate_grad_hook(_coalesce_grad)
    return modules


def _coalesce_grad(p):
    """After each micro-batch's backward: duplicate rows summed, so an accumulated sparse gradient never
    holds more than V rows (autograd's sum of sparse gradients concatenates them)."""
    if p.grad is not None and p.grad.is_sparse and not p.grad.is_coalesced():
        p.grad = p.grad.coalesce()


class LazyRows:
    """The bookkeeping of a ``lazy`` table (module docstring): ``last[i]``, the optimizer step row i is current
    at, and each step's (lr, weight decay, beta1, beta2, eps) since the oldest row not current (``hist``)."""

    def __init__(self, rows: int, device):
        self.last = torch.zeros(rows, dtype=torch.long, device=device)
        self.hist: dict[int, tuple] = {}

    def replay(self, p, state: dict, rows: torch.Tensor) -> int:
        """Bring ``rows`` (unique ids) of ``p`` current at the step ``state`` has counted: each row not current
        gets the zero-gradient AdamW steps it missed, in order (torch's AdamW formula with g = 0:
        p *= 1 - lr wd; m *= b1; v *= b2; p -= lr / (1 - b1^s) m / (sqrt(v) / sqrt(1 - b2^s) + eps); the fused
        kernel's ``_adamw_block``), a block of rows at a time (``_row_blocks``). Returns the row-steps replayed."""
        t = int(state["step"]) if state else 0
        last = self.last.index_select(0, rows)
        behind = last < t
        if not bool(behind.any()):
            return 0
        last, order = last[behind].sort()
        rows = rows[behind][order]                 # oldest first: the rows behind at step s are a prefix
        local = [p, state["exp_avg"], state["exp_avg_sq"]]
        n = block_rows(p)
        for k, ((w, m, v), rs, _) in enumerate(_row_blocks(local, rows)):
            self._replay_block(w, m, v, last[k * n:k * n + rs.numel()], t)
            for x, y in zip(local, (w, m, v)):
                x.index_copy_(0, rs, y)
        self.last.index_fill_(0, rows, t)
        return int((t - last).sum())

    def _replay_block(self, w, m, v, last: torch.Tensor, t: int):
        """Rows ``w`` (moments ``m``, ``v``), current at steps ``last`` (ascending), brought to step ``t``: for each
        missed step s, the rows behind at s (a prefix) get AdamW's step with a zero gradient, on the block while it
        sits in the workspace (one gather and one scatter for all its missed steps)."""
        first, zero = int(last[0]) + 1, _zeros(w, w.shape[0])
        ends = torch.searchsorted(last, torch.arange(first, t + 1, device=last.device)).tolist()
        for s, e in zip(range(first, t + 1), ends):   # e: rows current before step s
            lr, wd, b1, b2, eps = self.hist[s]
            _adamw_block(w[:e], zero[:e], m[:e], v[:e], s, lr, wd, b1, b2, eps)

    def forget_before(self, step: int):
        """Drop the steps no row still needs (every row current at ``step`` or later)."""
        self.hist = {s: h for s, h in self.hist.items() if s > step}


class RowSparseAdamW(torch.optim.AdamW):
    """AdamW whose parameters with a sparse (COO) gradient get a row-wise update of the rows present in it.

    For a touched row i (g its coalesced gradient, t the parameter's step count, incremented every step):
        p_i *= 1 - lr wd;  m_i = b1 m_i + (1 - b1) g;  v_i = b2 v_i + (1 - b2) g^2
        p_i -= lr / (1 - b1^t) * m_i / (sqrt(v_i) / sqrt(1 - b2^t) + eps)
    (torch's AdamW formula); other rows and their moments are not touched. The state has AdamW's keys and
    shapes (step, exp_avg, exp_avg_sq), so checkpoints, DCP resharding and stage carry-over are unchanged.
    A row-sharded table (``stem.train.tables.RowShardedTable``, several ranks; ``track``) has a dense gradient on
    its shard and hands the rows its step asked of this rank (``take_touched``): those rows get the same update,
    on the shard.
    Other dense gradients go through torch's AdamW. A ``lazy`` table (``track``: a host table) is dense AdamW
    made lazy and exact (``LazyRows``): its step count and hyper-parameters are recorded every step, its
    touched rows updated, the others replayed when read (``catch_up``) or saved (``settle``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy: dict = {}            # parameter -> LazyRows
        self.tracked: set = set()       # the tables' parameters (``track``)
        self.touched: dict = {}         # a row-sharded table's parameter -> its module (``take_touched``)
        self.held: dict = {}            # a host table's parameter -> its module (``held_grad``: rows held by id)
        self.pool = None                # ``overlap``'s workers
        self.pending: dict = {}         # parameter -> its update (``PendingRows``)
        self.first: dict = {}           # parameter -> the ids the next step reads first (``read_first``), in that order

    def track(self, module):
        """A table module announcing its reads (``register_read_hook``, ``row_update``: sparse | lazy): its
        gradient comes as rows; before a read the rows wait for their update if it runs on a worker (``overlap``),
        and a lazy one's are brought current. A row-sharded one (``take_touched``) says which rows its step asked."""
        p = module.weight
        if hasattr(module, "take_touched"):
            self.touched[p] = module
            return
        self.tracked.add(p)
        if hasattr(module, "held_grad"):
            self.held[p] = module
        if module.row_update == "lazy":
            self.lazy[p] = LazyRows(p.shape[0], p.device)
        module.register_read_hook(lambda ids, p=p: self.catch_up(p, ids))
        module.register_state_dict_pre_hook(lambda *_: self.settle())   # every save sees every row current

    def overlap(self, workers: int = 1):
        """From now on the tracked tables' row updates run on ``workers`` threads, ``OVERLAP_ROWS`` rows a task, while
        the caller goes on (the next step's forward and backward); a read of rows waits for their own tasks only
        (``catch_up``), the next ``step`` and a save for all. The bookkeeping (step counts, a lazy table's history
        and rows' steps) stays in ``step``, so the results are the synchronous update's."""
        if workers < 1:
            raise ValueError(f"host update workers: {workers}; expected at least 1")
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="host-adamw")

    def read_first(self, reads: list):
        """The next step's first reads, ``[(table weight, host ids (unique))]`` in the order its forward reads them
        (``stem.train.tables.first_reads``): with ``overlap``, this step's update takes those rows first, table by
        table in that order (``PendingRows``' ``first``), then the others; the values do not depend on the order."""
        self.first = {p: ids for p, ids in reads if p in self.tracked}

    def drain(self):
        """Every pending row update done (its errors raised here)."""
        pending, self.pending = self.pending, {}
        for rows in pending.values():
            rows.wait()

    def _wait_rows(self, p, ids: torch.Tensor):
        """Rows ``ids`` of ``p`` current: those of a pending update not yet taken by a worker updated here, those a
        worker has taken waited for (``PendingRows.need``)."""
        if p in self.pending:
            self.pending[p].need(ids)

    @torch.no_grad()
    def catch_up(self, p, ids: torch.Tensor) -> int:
        """Before rows ``ids`` (unique) of a table are read: their pending update done (``overlap``), and a lazy
        table's missed steps replayed (``LazyRows.replay``)."""
        self._wait_rows(p, ids)
        return self.lazy[p].replay(p, self.state[p], ids) if p in self.lazy else 0

    @torch.no_grad()
    def settle(self):
        """Every row of every lazy table current (before a save), ``SETTLE_ROWS`` rows at a time: a replay works on
        copies of the rows it brings current, so a whole table at once would hold a second copy of it and its
        moments (rows are independent: the same result)."""
        self.drain()
        for p, lazy in self.lazy.items():
            if self.state[p]:
                for rows in torch.arange(p.shape[0], device=p.device).split(SETTLE_ROWS):
                    lazy.replay(p, self.state[p], rows)
                lazy.forget_before(int(self.state[p]["step"]))

    def state_dict(self):
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        self.drain()
        super().load_state_dict(state_dict)
        for p, lazy in self.lazy.items():   # a saved state is settled: every row current at its step
            lazy.last.fill_(int(self.state[p]["step"]) if self.state[p] else 0)
            lazy.hist = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.drain()                    # the previous step's host updates (``overlap``)
        sparse = [(g, p) for g in self.param_groups for p in g["params"]
                  if p in self.lazy or p.grad is not None and (p.grad.is_sparse or p in self.touched)]
        held = [(p, p.grad) for _, p in sparse]
        for p, _ in held:
            p.grad = None               # torch's AdamW skips them
        try:
            super().step()
        finally:
            for p, grad in held:
                p.grad = grad
        for group, p in sparse:
            self._row_step(group, p)
        first, self.first = self.first, {}
        if self.pending:   # the rows the next step reads first, in the order it reads them, then the others
            for p in first:
                if p in self.pending:
                    self.pending[p].submit(self.pool, 0)
            for rows in self.pending.values():
                rows.submit(self.pool, 1)
        return loss

    def _row_step(self, group: dict, p: torch.Tensor):
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("RowSparseAdamW: amsgrad / maximize are not supported for sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        local = [p, state["exp_avg"], state["exp_avg_sq"]]
        if p in self.touched:            # a row-sharded table: this rank's shard
            local = [x.to_local() for x in local]
        rows, g, perm, coef = self._grad_rows(p)
        lazy = self.lazy.get(p)
        if lazy is not None:             # its touched rows current before their update (read this step: they are)
            lazy.replay(p, state, rows)
        state["step"] += 1
        t = int(state["step"])
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        if lazy is not None:
            lazy.hist[t] = (lr, wd, b1, b2, eps)
            lazy.last.index_fill_(0, rows, t)
        if self.pool is None or p not in self.tracked:
            _adamw_rows(local, rows, g, t, lr, wd, b1, b2, eps, perm, coef)
            return
        self.pending[p] = PendingRows(local, rows, g, (t, lr, wd, b1, b2, eps), perm, coef, self.first.get(p))

    def _grad_rows(self, p) -> tuple:
        """(sorted row ids, gradient rows, None or the position in ``g`` of each id's row, None or clipping's coefficient
        for them) of ``p``'s step: a row-sharded table's rows asked of this rank (``take_touched``); a host table's rows
        held by id (``host_grad``: on the host, one copy a step from the lookup's device; unique ids in the order first
        seen, so only the ids are sorted and the update gathers each row from where it is and scales it there by
        clipping's coefficient, lent when the update outlives the step); else the coalesced sparse gradient's; none
        for a lazy table not read."""
        if p in self.touched:
            rows = self.touched[p].take_touched()
            return rows, p.grad.to_local().index_select(0, rows), None, None
        if p.grad is None:
            return torch.zeros(0, dtype=torch.long, device=p.device), p.new_zeros(0, p.shape[1]), None, None
        held = self.held[p].host_grad(lend=self.pool is not None) if p in self.held else None
        if held is not None:
            ids, g, coef = held
            rows, perm = ids.sort()
            return rows, g, perm, coef
        grad = p.grad.coalesce()
        return grad.indices()[0], grad.values(), None, None


class PendingRows:
    """One table's row update of a step off the critical path (``RowSparseAdamW.overlap``): its rows (sorted ids)
    in tasks of ``OVERLAP_ROWS``, each row updated once, by the worker that takes its task or by a read that needs
    it before (``need``); a row's update is ``_adamw_rows``' whoever runs it, so the results are the same, in any
    order. ``first``: ids the next step's first micro-batch reads (``RowSparseAdamW.read_first``): those of its rows
    make the first tasks (``parts``: the tasks of those, then the others'), so they are updated first."""

    def __init__(self, local: list, rows: torch.Tensor, g: torch.Tensor, hyper: tuple, perm=None, coef=None,
                 first: torch.Tensor | None = None):
        self.local, self.rows, self.g, self.hyper, self.perm, self.coef = local, rows, g, hyper, perm, coef
        self.todo = torch.ones(rows.numel(), dtype=torch.bool)   # not yet taken, by position
        self.lock = threading.Lock()
        head = self.positions(first) if first is not None else rows.new_zeros(0)
        rest = torch.ones(rows.numel(), dtype=torch.bool)
        rest[head] = False
        chunks = [list(head.split(OVERLAP_ROWS)), list(rest.nonzero().flatten().split(OVERLAP_ROWS))]
        self.tasks = chunks[0] + chunks[1]                   # positions, the first part's first
        self.task_of = torch.empty(rows.numel(), dtype=torch.long)   # position -> its task
        for k, pos in enumerate(self.tasks):
            self.task_of[pos] = k
        self.parts = (range(len(chunks[0])), range(len(chunks[0]), len(self.tasks)))
        self.done = [threading.Event() for _ in self.tasks]
        self.futures = []

    def submit(self, pool, part: int | None = None):
        """The tasks of ``parts[part]`` (None: all) to ``pool``'s workers, in their order."""
        for k in range(len(self.tasks)) if part is None else self.parts[part]:
            self.futures.append(pool.submit(self._task, k))

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """The positions in this update of those of ``ids`` (unique) it holds."""
        if not self.rows.numel():
            return self.rows.new_zeros(0)
        pos = torch.searchsorted(self.rows, ids).clamp_(max=self.rows.numel() - 1)
        return pos[self.rows[pos] == ids]

    def _take(self, pos: torch.Tensor) -> torch.Tensor:
        with self.lock:
            pos = pos[self.todo[pos]]
            self.todo[pos] = False
        return pos

    @torch.no_grad()   # grad mode is per thread: a worker's own
    def _update(self, pos: torch.Tensor):
        if pos.numel():   # the gradient rows by position, or (held by id) gathered through ``perm``
            g, perm = (self.g[pos], None) if self.perm is None else (self.g, self.perm[pos])
            _adamw_rows(self.local, self.rows[pos], g, *self.hyper, perm, self.coef)

    def _task(self, k: int):
        try:
            self._update(self._take(self.tasks[k]))
        finally:
            self.done[k].set()

    def need(self, ids: torch.Tensor):
        """Before ``ids`` (unique) are read: those of this update not yet taken updated here, ``OVERLAP_ROWS`` at a
        time (the workers meanwhile take the other tasks, or skip what this took), then the tasks that took the
        others waited for."""
        pos = self.positions(ids)
        theirs = torch.ones(pos.numel(), dtype=torch.bool)   # taken by a worker (not by this read)
        for lo in range(0, pos.numel(), OVERLAP_ROWS):
            mine = self._take(pos[lo:lo + OVERLAP_ROWS])
            self._update(mine)
            theirs[lo:lo + OVERLAP_ROWS] &= ~torch.isin(pos[lo:lo + OVERLAP_ROWS], mine)
        for k in self.task_of[pos[theirs]].unique().tolist():
            self.done[k].wait()

    def wait(self):
        for f in self.futures:
            f.result()


def _adamw_rows(local: list, rows, g, t: int, lr: float, wd: float, b1: float, b2: float, eps: float, perm=None,
                coef=None):
    """torch's AdamW step ``t`` on ``rows`` of (param, exp_avg, exp_avg_sq) with their gradient rows ``g`` (``perm``:
    row k's gradient is ``g[perm[k]]``, times clipping's ``coef`` if given), fused (``_row_blocks``): each block of
    rows gathered once into this thread's workspace, updated in one pass, scattered once."""
    for (w, m, v), rs, gs in _row_blocks(local, rows, g, perm, coef):
        _adamw_block(w, gs, m, v, t, lr, wd, b1, b2, eps)
        for x, y in zip(local, (w, m, v)):
            x.index_copy_(0, rs, y)


def _row_blocks(local: list, rows, g=None, perm=None, coef=None):
    """((param, exp_avg, exp_avg_sq) rows, their ids, their gradient rows) of ``rows`` of ``local`` in blocks of
    ``block_rows``, gathered into this thread's workspace (``_workspace``): reused, so no allocation (whose page
    faults cost more than the update on a CPU) and, on a CPU, small enough to stay in its cache between the gather,
    the update and the scatter. ``perm``: the gradient rows are ``g[perm]``, gathered with the block (a host table's
    rows held by id: ``RowSparseAdamW._grad_rows``) and multiplied there by clipping's ``coef`` if given (the product
    clipping's in-place scale made before: the same values, with no pass of its own over the rows)."""
    n = block_rows(local[0])
    for lo in range(0, rows.numel(), n):
        rs = rows[lo:lo + n]
        out = _workspace(local[0], rs.numel(), 3 if perm is None else 4)
        for x, y in zip(local, out):
            torch.index_select(x, 0, rs, out=y)
        if perm is not None:
            gs = torch.index_select(g, 0, perm[lo:lo + n], out=out[3])
            yield out[:3], rs, gs if coef is None else gs.mul_(coef)
        else:
            yield out, rs, None if g is None else g[lo:lo + n]


def row_sum_squares(rows: torch.Tensor) -> torch.Tensor:
    """The sum of the squares of ``rows`` (fp32, as a 0-dim fp32 tensor), a block of ``block_rows`` at a time: each
    block squared into this thread's workspace and summed, the blocks' sums added in fp64 (on a GPU, blocks of
    ``NORM_BLOCK_BYTES``). Gradient clipping's norm of a host table's rows where they are accumulated (the lookup's
    device; ``stem.train.distributed``) without a tensor of all of them (``pow(2)`` makes one: on a CPU
    its new pages cost ten times the sum) and as precise as torch's sum over them (a one-pass dot or
    ``vector_norm`` in fp32 was off by 3e-4 to 9e-4 at 12 million elements)."""
    total = torch.zeros((), dtype=torch.float64, device=rows.device)
    n = block_rows(rows) if rows.device.type == "cpu" else max(1, NORM_BLOCK_BYTES // max(1, rows.stride(0) * 4))
    for lo in range(0, rows.shape[0], n):
        x = rows[lo:lo + n]
        sq, = _workspace(rows, x.shape[0], 1, "squares")
        total += torch.mul(x, x, out=sq).sum()
    return total.float()


def block_rows(x: torch.Tensor) -> int:
    """Rows of ``x`` a fused row update takes at once: ``ROW_BLOCK_BYTES`` of them on a CPU, all on a GPU."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    return max(1, ROW_BLOCK_BYTES // max(1, x[0].numel() * x.element_size()))


def _workspace(like: torch.Tensor, n: int, k: int, use: str = "rows") -> list:
    """``k`` buffers of ``n`` rows shaped as ``like``'s: on a CPU this thread's own (a worker's of ``overlap`` too),
    reused; on a GPU new ones (its caching allocator reuses them, and no memory stays held between steps)."""
    if like.device.type != "cpu":
        return [like.new_empty(n, *like.shape[1:]) for _ in range(k)]
    bufs = _local.__dict__.setdefault("bufs", {})
    key = (like.shape[1:], like.dtype, k, use)
    have = bufs.get(key)
    if have is None or have[0].shape[0] < n:
        have = bufs[key] = [like.new_empty(max(n, block_rows(like)) if use == "rows" else n, *like.shape[1:]) for _ in range(k)]
    return [x[:n] for x in have]


def _zeros(like: torch.Tensor, n: int) -> torch.Tensor:
    """A zero gradient of ``n`` rows shaped as ``like``'s (a replay's), kept per thread on a CPU (nothing writes it)."""
    if like.device.type != "cpu":
        return like.new_zeros(n, *like.shape[1:])
    bufs = _local.__dict__.setdefault("zeros", {})
    key = (like.shape[1:], like.dtype)
    if key not in bufs or bufs[key].shape[0] < n:
        bufs[key] = like.new_zeros(max(n, block_rows(like)), *like.shape[1:])
    return bufs[key][:n]


def _adamw_block(w, g, m, v, t: int, lr: float, wd: float, b1: float, b2: float, eps: float):
    """torch's AdamW step ``t`` in place on rows ``w`` with gradient ``g`` and moments ``m``, ``v``: torch's fused
    kernel (``torch._fused_adamw_``: one pass; its step count is per tensor, here the group's ``t`` for every row,
    as the row-sparse semantics want) where this torch has it and ``FUSED_ROWS`` is on, else the same formula in
    torch's unfused ops (the two agree to a few ulps: ``tests/test_host_tables.py``). On a CPU the kernel's
    vectorised loop and its scalar tail round differently, so every call is given a multiple of ``FUSED_ALIGN``
    elements: whole blocks of rows, the rest through a zero-padded side buffer (``_aligned``); a row's result is
    then the same however its rows are split into calls (the overlap's tasks, a replay's prefixes)."""
    if not (FUSED_ROWS and _FUSED is not None):
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        w.mul_(1 - lr * wd)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        return
    step = torch.tensor(float(t), device=w.device)
    for pw, pg, pm, pv in _aligned(w, g, m, v):
        _FUSED([pw], [pg], [pm], [pv], [], [step], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
               amsgrad=False, maximize=False)


def _aligned(w, g, m, v):
    """(w, g, m, v) in parts of a multiple of ``FUSED_ALIGN`` elements each (``_adamw_block``): the leading whole
    rows, then the last few rows copied into a zero-padded side buffer (zero rows stay zero under AdamW), copied
    back once the caller has updated it. On a GPU: the tensors as they are."""
    n = w.shape[0]
    if w.device.type != "cpu" or not n:
        yield w, g, m, v
        return
    r0 = FUSED_ALIGN // math.gcd(FUSED_ALIGN, w[0].numel())   # rows holding a multiple of FUSED_ALIGN elements
    e0 = n // r0 * r0
    if e0:
        yield w[:e0], g[:e0], m[:e0], v[:e0]
    if e0 == n:
        return
    side = _workspace(w, r0, 4, "side")
    for y, x in zip(side, (w, g, m, v)):
        y[:n - e0].copy_(x[e0:])
        y[n - e0:].zero_()
    yield side
    for x, y in zip((w, m, v), (side[0], side[2], side[3])):
        x[e0:].copy_(y[:n - e0])


def build_optimizer(model, optim, lr: float, fused: bool = False) -> torch.optim.AdamW:
    """``OptimSpec.build``: AdamW over ``model.param_groups()`` with the registry's LR multipliers and weight
    decays under the spec's ``groups`` overrides."""
    groups = []
    for name, params in model.param_groups().items():
        lr_mult, wd = GROUP_DEFAULTS[name]
        o = optim.groups.get(name)   # a stem.optim.Group: the keys it sets over the registry's
        lr_mult = lr_mult if o is None or o.lr_mult is None else o.lr_mult
        wd = (optim.weight_decay if wd is None else wd) if o is None or o.weight_decay is None else o.weight_decay
        groups.append({"params": params, "name": name, "lr_mult": lr_mult, "weight_decay": wd, "lr": lr * lr_mult})
    tables = [m for m in model.modules() if getattr(m, "row_update", None) is not None]
    cls = RowSparseAdamW if optim.sparse_tables or tables else torch.optim.AdamW
    opt = cls(groups, lr=lr, betas=tuple(optim.betas), eps=optim.eps, fused=fused)
    for m in tables:   # host and row-sharded tables (stem.train.tables): their gradients come as rows
        opt.track(m)
    return opt


def set_lr(opt: torch.optim.Optimizer, lr: float):
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_mult"]
