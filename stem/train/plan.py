"""How one training job is laid out over its GPUs, decided once: ``ParallelPlan``.

A job computes its plan once (``ParallelPlan.of``: the spec's batch layout and strategy at the job's world
size, plus the tables its optimizer trains row-sparse) and hands the same object to the sharding
(``stem.train.distributed.parallelize``), the closed-form memory estimate (``stem.train.memory.estimate``)
and the memory trace (``stem.train.memtrace.trace``).

Torch-free, like ``job_layout`` (the world size a training job gets from ``cluster.train``): the workflow
calls it while it builds the DAG (``rules/common.smk``'s ``cluster_resources``).
"""
from __future__ import annotations

from dataclasses import dataclass

from stem.config.experiment import Experiment, TrainJob
from stem.options import Device, Strategy, values

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


@dataclass(frozen=True)
class ParallelPlan:
    """One training job's layout: ``world`` ranks, the backbone's ``strategy`` (fsdp | ddp), ``micro_batch``
    sequences of ``seq_len`` per rank per forward, ``accum`` global micro-batches per step (rank r runs r,
    r + world, ...), activation checkpointing, ``row_sparse``: the names of the table modules trained
    row-sparse (``optim.table_update: sparse``), replicated on every rank outside FSDP, ``row_sharded``: the
    lookup tables sharded by rows outside FSDP (``train.tables: rows``, ``stem.train.tables``; on several ranks
    the row-sparse ones too, named in ``sparse_rows`` and not in ``row_sparse``: sharded, not replicated), and
    ``host_tables``: those kept in host memory (``train.tables: host``, one rank only; the row-sparse ones too,
    named in ``sparse_rows``: their host update is row-sparse AdamW, the others' dense AdamW made lazy). Every other
    module declaring ``shard_unit`` (STEM/DSE tables, Hash-MoE FFNs, routed-MoE experts) with a parameter left
    is its own FSDP unit over all ranks whatever the strategy."""
    world: int
    strategy: str
    micro_batch: int
    accum: int
    seq_len: int
    activation_checkpointing: bool = False
    row_sparse: tuple[str, ...] = ()
    row_sharded: tuple[str, ...] = ()
    host_tables: tuple[str, ...] = ()
    sparse_rows: tuple[str, ...] = ()

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"parallel strategy {self.strategy!r}: expected one of {STRATEGIES}")

    @classmethod
    def of(cls, train, world: int, strategy: str | None = None, row_sparse: tuple[str, ...] = (),
           tables: tuple[str, ...] = ()) -> "ParallelPlan":
        """The plan of a job with ``train`` settings (a TrainSettings) at ``world`` ranks; ``strategy`` overrides
        the spec's ``train.parallel``; ``row_sparse``: ``OptimSpec.row_sparse_tables`` of the job's model;
        ``tables``: its lookup tables (``stem.train.tables.row_shardable``), row-sharded if ``train.tables`` is
        ``rows`` (the row-sparse ones too on several ranks), in host memory if it is ``host`` (the row-sparse ones
        too, updated row-sparse there: ``sparse_rows``)."""
        micro, accum = local_micro_batch(train.batch_size, train.micro_batch, world)
        if train.tables == "host" and world > 1:
            raise ValueError(f"train.tables: host keeps the whole tables in one host's memory, for a job of one GPU; "
                             f"this one has {world} (use rows)")
        sharded = train.tables == "rows" and world > 1
        outside = sharded or train.tables == "host"   # the row-sparse tables row-sharded or in host memory too
        sparse_rows = tuple(t for t in tables if t in row_sparse) if outside else ()
        tables = tuple(t for t in tables if outside or t not in row_sparse)
        return cls(world, strategy or train.parallel, micro, accum, train.seq_len, train.activation_checkpointing,
                   tuple(t for t in row_sparse if t not in sparse_rows), tables if train.tables == "rows" else (),
                   tables if train.tables == "host" else (), sparse_rows)

    def shard_units(self, model) -> list:
        """Modules sharded over all ranks independently of the backbone: those declaring ``shard_unit``, except
        the row-sparse tables and those with nothing left but row-sharded or host tables."""
        return [m for n, m in model.named_modules() if getattr(m, "shard_unit", False) and n not in self.row_sparse
                and any(not self.outside_fsdp(f"{n}.{p}") for p, _ in m.named_parameters())]

    def outside_fsdp(self, param_name: str) -> bool:
        """A parameter of a row-sharded or host table (outside FSDP either way)."""
        return param_name.rpartition(".")[0] in self.row_sharded + self.host_tables

    def host_params(self, model) -> list:
        """The host tables' weights, in module order."""
        return [model.get_submodule(n).weight for n in self.host_tables]

    def row_sharded_params(self, model) -> list:
        """The row-sharded tables' weights, in module order."""
        return [model.get_submodule(n).weight for n in self.row_sharded]

    def row_sparse_params(self, model) -> list:
        """Parameters of the row-sparse tables, in module order (the same on every rank)."""
        return [p for n in self.row_sparse for p in model.get_submodule(n).parameters()]
