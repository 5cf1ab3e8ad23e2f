"""How one training job is laid out over its GPUs, decided once: ``ParallelPlan``.

A job computes its plan once (``ParallelPlan.of``: the spec's batch layout and strategy at the job's world
size, plus the tables its optimizer trains row-sparse) and hands the same object to the sharding
(``stem.train.distributed.parallelize``), the closed-form memory estimate (``stem.train.memory.estimate``)
and the memory trace (``stem.train.memtrace.trace``).

Torch-free, like ``job_layout`` (the world size a training job gets from ``cluster.train``): the workflow
calls it while it builds the DAG (``rules/common.smk``'s ``cluster_resources``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from stem.config.experiment import Experiment, TrainJob
from stem.options import Device, Strategy, TableLayout, values

STRATEGIES = values(Strategy)


def cluster_train(exp: Experiment, scale: str) -> TrainJob:
    """``cluster.train.<scale>`` (nodes, gpus_per_node, runtime, ...), or one node for an hour with one GPU
    (none for ``device: cpu``) where the config sets none: what a training job at ``scale`` is given."""
    return exp.cluster.train.get(scale) or TrainJob(nodes=1, runtime=60,
                                                    gpus_per_node=0 if exp.device == Device.CPU else 1)


def job_layout(exp: Experiment, scale: str) -> tuple[int, int]:
    """(world size, GPUs per node) of a training job at ``scale`` (``cluster_train``)."""
    t = cluster_train(exp, scale)
    return max(1, t.gpus), t.gpus_per_node


def local_micro_batch(batch_size: int, micro_batch: int, world: int) -> tuple[int, int]:
    """(per-rank micro-batch, global micro-batches per step); raises if the batch does not split evenly."""
    micro = min(micro_batch, batch_size // world) if world > 1 else micro_batch
    if micro < 1 or batch_size % (micro * world):
        raise ValueError(f"batch_size {batch_size} cannot be split into micro-batches of {micro} "
                         f"over {world} ranks (batch_size must be a multiple of micro_batch x world size)")
    return micro, batch_size // micro


class Where(StrEnum):
    """Where a lookup table lives while a job trains (``Placement``)."""
    FSDP = "fsdp"               # on the device, sharded with its FSDP unit (STEM's own, DSE's memory; whole at world 1)
    REPLICATED = "replicated"   # on the device, whole on every rank, outside FSDP (optim.table_update: sparse)
    ROWS = "rows"               # on the device, rows interleaved over the ranks, outside FSDP (train.tables: rows)
    HOST = "host"               # in one rank's host memory (train.tables: host)


@dataclass(frozen=True)
class Placement:
    """One table's place (``where``) and how AdamW updates it: ``sparse``, the rows a step touched only (``optim.
    table_update: sparse``: a replicated table's sparse gradient, a row-sharded one's rows asked of this rank, a
    host one's row-sparse update), else dense AdamW (a host table's made lazy and exact, ``stem.optim.adamw``)."""
    where: Where
    sparse: bool = False


def place(layout: str, world: int, tables: tuple[str, ...] = (),
          row_sparse: tuple[str, ...] = ()) -> dict[str, Placement]:
    """Every table's ``Placement`` under ``train.tables: layout`` at ``world`` ranks: ``tables``, the lookup tables
    (``stem.train.tables.row_shardable``), in ``layout`` (row-sharded only on several ranks for the row-sparse
    ones), ``row_sparse`` (``OptimSpec.row_sparse_tables``) replicated where they are not row-sharded or in host
    memory; the others of ``tables`` as FSDP units. In ``tables``' order, then the row-sparse ones not in it."""
    outside = layout == TableLayout.HOST or layout == TableLayout.ROWS and world > 1
    where = {TableLayout.ROWS: Where.ROWS, TableLayout.HOST: Where.HOST}.get(TableLayout(layout), Where.FSDP)
    out = {}
    for t in tables + tuple(r for r in row_sparse if r not in tables):
        sparse = t in row_sparse
        out[t] = Placement(Where.REPLICATED if sparse and (t not in tables or not outside) else where, sparse)
    return out


@dataclass(frozen=True)
class ParallelPlan:
    """One training job's layout: ``world`` ranks, the backbone's ``strategy`` (fsdp | ddp), ``micro_batch``
    sequences of ``seq_len`` per rank per forward, ``accum`` global micro-batches per step (rank r runs r,
    r + world, ...), activation checkpointing, and ``tables``: every lookup table's ``Placement`` (``place``;
    the sharding, the memory estimate and trace, the traffic model and the optimizer read it, none re-derives
    it). Views of it by name: ``row_sparse`` (replicated on every rank outside FSDP), ``row_sharded`` (sharded
    by rows outside FSDP, ``stem.train.tables``), ``host_tables`` (in host memory, one rank only) and
    ``sparse_rows`` (the row-sharded or host ones updated row-sparse). Every other module declaring
    ``shard_unit`` (STEM/DSE tables, Hash-MoE FFNs, routed-MoE experts) with a parameter left is its own FSDP unit
    over all ranks whatever the strategy."""
    world: int
    strategy: str
    micro_batch: int
    accum: int
    seq_len: int
    activation_checkpointing: bool = False
    tables: dict[str, Placement] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"parallel strategy {self.strategy!r}: expected one of {STRATEGIES}")

    @classmethod
    def of(cls, train, world: int, strategy: str | None = None, row_sparse: tuple[str, ...] = (),
           tables: tuple[str, ...] = ()) -> "ParallelPlan":
        """The plan of a job with ``train`` settings (a TrainSettings) at ``world`` ranks; ``strategy`` overrides
        the spec's ``train.parallel``; ``row_sparse``: ``OptimSpec.row_sparse_tables`` of the job's model;
        ``tables``: its lookup tables (``stem.train.tables.row_shardable``), placed by ``place`` under the spec's
        ``train.tables``."""
        micro, accum = local_micro_batch(train.batch_size, train.micro_batch, world)
        if train.tables == TableLayout.HOST and world > 1:
            raise ValueError(f"train.tables: host keeps the whole tables in one host's memory, for a job of one GPU; "
                             f"this one has {world} (use rows)")
        return cls(world, strategy or train.parallel, micro, accum, train.seq_len, train.activation_checkpointing,
                   place(train.tables, world, tables, row_sparse))

    def names(self, where: Where, sparse: bool | None = None) -> tuple[str, ...]:
        """The tables placed ``where`` (updated row-sparse or not: ``sparse``, either if None), in plan order."""
        return tuple(n for n, p in self.tables.items() if p.where == where and sparse in (None, p.sparse))

    @property
    def row_sparse(self) -> tuple[str, ...]:
        return self.names(Where.REPLICATED)

    @property
    def row_sharded(self) -> tuple[str, ...]:
        return self.names(Where.ROWS)

    @property
    def host_tables(self) -> tuple[str, ...]:
        return self.names(Where.HOST)

    @property
    def sparse_rows(self) -> tuple[str, ...]:
        return tuple(n for n, p in self.tables.items() if p.sparse and p.where in (Where.ROWS, Where.HOST))

    def shard_units(self, model) -> list:
        """Modules sharded over all ranks independently of the backbone: those declaring ``shard_unit``, except
        the row-sparse tables and those with nothing left but row-sharded or host tables."""
        return [m for n, m in model.named_modules() if getattr(m, "shard_unit", False) and n not in self.row_sparse
                and any(not self.outside_fsdp(f"{n}.{p}") for p, _ in m.named_parameters())]

    def outside_fsdp(self, param_name: str) -> bool:
        """A parameter of a row-sharded or host table (outside FSDP either way)."""
        p = self.tables.get(param_name.rpartition(".")[0])
        return p is not None and p.where in (Where.ROWS, Where.HOST)

    def host_params(self, model) -> list:
        """The host tables' weights, in module order."""
        return [model.get_submodule(n).weight for n in self.host_tables]

    def row_sharded_params(self, model) -> list:
        """The row-sharded tables' weights, in module order."""
        return [model.get_submodule(n).weight for n in self.row_sharded]

    def row_sparse_params(self, model) -> list:
        """Parameters of the row-sparse tables, in module order (the same on every rank)."""
        return [p for n in self.row_sparse for p in model.get_submodule(n).parameters()]
